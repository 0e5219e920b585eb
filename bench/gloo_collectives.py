#!/usr/bin/python3
"""The torch.distributed (gloo) peer of `weightlift bench collectives`.

Runs the same sweep as `weightlift bench collectives` (apps/weightlift/bench/collectives.h) through gloo and prints the same JSON rows
(impl "gloo"): f32 sum, `size` as nccl-tests counts it, warmup untimed, each call timed on its
own and its time the slowest rank's, rank r pinned to core r % cores, 20..20000 iterations (about 1 GiB of data per size;
weightlift goes up to 1000000, but a gloo call from Python takes tens of microseconds, so 20000 already span a second) unless
--iters is given, busbw with nccl-tests' factors. gloo's allreduce and broadcast work in place;
its all_gather writes a list of tensors (views into one output here). torch 1.13's gloo has no
reduce_scatter, so that op is skipped with a note on stderr.

    /usr/bin/python3 bench/gloo_collectives.py --nprocs 2 --ops allreduce --max-bytes 256M

Starts its own ranks (torch.multiprocessing) on a free loopback port; under a launcher that
sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT it joins that job instead (--nprocs 0).
"""
import argparse
import json
import os
import socket
import sys
import time


def parse_bytes(text):
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def bus_factor(op, p):
    if op == "allreduce":
        return 2.0 * (p - 1) / p
    if op in ("allgather", "reduce_scatter"):
        return (p - 1) / p
    return 1.0


def sizes(lo, hi, factor):
    s = lo
    while s <= hi:
        yield s
        if s > hi // factor:
            break
        s *= factor


def run(rank, world, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Rank r on core r % cores, as mpirun and `weightlift bench collectives` bind their ranks.
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    p = world
    for op in args.ops.split(","):
        if op == "reduce_scatter":
            if rank == 0:
                print("gloo (torch %s) has no reduce_scatter; skipped" % torch.__version__,
                      file=sys.stderr)
            continue
        for want in sizes(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.factor):
            per_rank = op == "allgather"
            count = want // 4 // p if per_rank else want // 4
            if count == 0:
                continue
            nbytes = count * 4 * p if per_rank else count * 4
            x = torch.ones(count, dtype=torch.float32)
            if op == "allgather":
                out = torch.empty(count * p, dtype=torch.float32)
                views = list(out.view(p, count).unbind(0))
                call = lambda: dist.all_gather(views, x)
            elif op == "allreduce":
                call = lambda: dist.all_reduce(x)
            else:
                call = lambda: dist.broadcast(x, 0)
            iters = args.iters or max(20, min(20000, (1 << 30) // nbytes))
            for _ in range(args.warmup):
                call()
            t = torch.empty(iters, dtype=torch.float64)
            for i in range(iters):
                t0 = time.perf_counter()
                call()
                t[i] = time.perf_counter() - t0
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rank == 0:
                us = sorted(float(v) * 1e6 for v in t)
                mean = sum(us) / len(us)
                pct = lambda q: us[min(len(us) - 1, int(q * (len(us) - 1) + 0.5))]
                algbw = nbytes / (mean * 1e3)
                print(json.dumps({"impl": "gloo", "op": op, "bytes": nbytes, "count": count,
                                  "dtype": "F32", "ranks": p, "time_us": round(mean, 3),
                                  "p50_us": round(pct(0.5), 3), "p99_us": round(pct(0.99), 3),
                                  "algbw_gbps": round(algbw, 4),
                                  "busbw_gbps": round(algbw * bus_factor(op, p), 4)}),
                      flush=True)
    dist.destroy_process_group()


def spawned(rank, world, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    run(rank, world, args)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2, help="ranks to start; 0: join the launcher's job")
    ap.add_argument("--ops", default="allreduce,allgather,reduce_scatter,broadcast")
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    if args.nprocs == 0:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(spawned, args=(args.nprocs, port, args), nprocs=args.nprocs, join=True)


if __name__ == "__main__":
    main()
