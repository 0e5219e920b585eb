#!/usr/bin/python3
"""What checkpoint-engine's broadcast mode does, in torch.distributed over gloo: the baseline
`weightlift bench transfer` is compared with (bench/compare_transfer.py).

Processes: `--trainers` trainer ranks holding every parameter of the preset as bf16 dim-0
shards (FSDP style, torch.chunk rows), then `--receivers` receiver ranks, inference engines of
`--tp`, each holding its bf16 inference layout (DESIGN.md: fused qkv and gate_up, column- and
row-parallel TP slices, the rest replicated) in preallocated tensors. One update:
  1. parameters grouped as the receivers read them (q/k/v together, gate/up together) and
     packed into fixed-size buckets of whole tensors (`--bucket-mb`), bucket b owned by
     trainer b % trainers;
  2. per bucket, every trainer all_gathers the shards of its parameters (full_tensor), the
     owner copies them into its bucket buffer and broadcasts it over a group of itself and
     every receiver;
  3. receivers double-buffer: bucket b arrives in buffer b % 2 while a thread copies bucket
     b - 1's slices into the engine tensors (slice, fuse, copy_: the conversion and load).
An update's time runs from a world barrier to the next one, after the last receiver loaded.
bf16 only: torch 1.13 has no float8 dtype. gloo moves the bf16 bytes as float16 views (it
has no bf16 or int16 collectives; copies keep the bytes). Prints one JSON line (rank 0):
  {"impl": "torch-gloo", "mode": "broadcast", "preset": .., "update_ms": [..],
   "update_ms_p50": .., "update_ms_p99": .., "bytes_broadcast": ..}

    /usr/bin/python3 bench/torch_broadcast_baseline.py --preset medium --trainers 2 \
        --receivers 2 --tp 2 --updates 3
    sudo scripts/testbed.sh run --hosts 4 --rate 1gbit -- env GLOO_SOCKET_IFNAME=eth0 \
        /usr/bin/python3 $PWD/bench/torch_broadcast_baseline.py --as-rank --preset small
"""
import argparse
import dataclasses
import json
import math
import os
import socket
import statistics
import threading
import time


def percentile(samples, q):
    """Nearest-rank q-quantile, as weightlift's reports compute it (core/timing.h)."""
    s = sorted(samples)
    return s[max(1, math.ceil(q * len(s))) - 1]

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRESETS = {  # DESIGN.md, "The model, exactly"
    "tiny": dict(d=64, layers=2, heads=4, kv=1, hd=16, experts=4, ffn=128, vocab=320),
    "small": dict(d=256, layers=6, heads=8, kv=1, hd=32, experts=8, ffn=512, vocab=320),
    "medium": dict(d=1024, layers=8, heads=16, kv=1, hd=64, experts=8, ffn=2048, vocab=320),
}


def params(p):
    """[(name, shape)] in model order, grouped as receivers read them."""
    d, hd = p["d"], p["hd"]
    groups = [[("embed.weight", (p["vocab"], d))]]
    for l in range(p["layers"]):
        a = "layers.%d." % l
        groups.append([(a + "attn_norm.weight", (d,))])
        groups.append([(a + "attn.q_proj.weight", (p["heads"] * hd, d)),
                       (a + "attn.k_proj.weight", (p["kv"] * hd, d)),
                       (a + "attn.v_proj.weight", (p["kv"] * hd, d))])
        groups.append([(a + "attn.o_proj.weight", (d, p["heads"] * hd))])
        groups.append([(a + "moe_norm.weight", (d,))])
        groups.append([(a + "moe.router.weight", (p["experts"], d))])
        for e in range(p["experts"]):
            x = a + "moe.experts.%d." % e
            groups.append([(x + "gate_proj.weight", (p["ffn"], d)),
                           (x + "up_proj.weight", (p["ffn"], d))])
            groups.append([(x + "down_proj.weight", (d, p["ffn"]))])
    groups.append([("norm.weight", (d,))])
    groups.append([("lm_head.weight", (p["vocab"], d))])
    return groups


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def buckets_of(groups, bucket_elems):
    out = []  # [[(name, shape, offset)]], offsets in elements
    size = 0
    for g in groups:
        n = sum(numel(s) for _, s in g)
        if not out or size + n > bucket_elems:
            out.append([])
            size = 0
        for name, shape in g:
            out[-1].append((name, shape, size))
            size += numel(shape)
    return out


def engine_layout(p, tp, r):
    """{engine tensor: (shape, [(param, row slice, col slice, dst row)])} for TP rank r."""
    d, hd, H, K, F = p["d"], p["hd"], p["heads"], p["kv"], p["ffn"]
    hq, f = H // tp, F // tp
    kvh = (r // (tp // K)) if K < tp else None
    kv_rows = (slice(kvh * hd, (kvh + 1) * hd) if K < tp
               else slice(r * (K // tp) * hd, (r + 1) * (K // tp) * hd))
    nkv = kv_rows.stop - kv_rows.start
    lay = {"embed.weight": ((p["vocab"], d), [("embed.weight", slice(None), slice(None), 0)]),
           "norm.weight": ((d,), [("norm.weight", slice(None), slice(None), 0)]),
           "lm_head.weight": ((p["vocab"], d), [("lm_head.weight", slice(None), slice(None), 0)])}
    for l in range(p["layers"]):
        a = "layers.%d." % l
        for n in ("attn_norm.weight", "moe_norm.weight"):
            lay[a + n] = ((d,), [(a + n, slice(None), slice(None), 0)])
        lay[a + "attn.qkv_proj.weight"] = ((hq * hd + 2 * nkv, d), [
            (a + "attn.q_proj.weight", slice(r * hq * hd, (r + 1) * hq * hd), slice(None), 0),
            (a + "attn.k_proj.weight", kv_rows, slice(None), hq * hd),
            (a + "attn.v_proj.weight", kv_rows, slice(None), hq * hd + nkv)])
        lay[a + "attn.o_proj.weight"] = ((d, hq * hd), [
            (a + "attn.o_proj.weight", slice(None), slice(r * hq * hd, (r + 1) * hq * hd), 0)])
        lay[a + "moe.router.weight"] = ((p["experts"], d), [
            (a + "moe.router.weight", slice(None), slice(None), 0)])
        for e in range(p["experts"]):
            x = a + "moe.experts.%d." % e
            lay[x + "gate_up_proj.weight"] = ((2 * f, d), [
                (x + "gate_proj.weight", slice(r * f, (r + 1) * f), slice(None), 0),
                (x + "up_proj.weight", slice(r * f, (r + 1) * f), slice(None), f)])
            lay[x + "down_proj.weight"] = ((d, f), [
                (x + "down_proj.weight", slice(None), slice(r * f, (r + 1) * f), 0)])
    return lay


@dataclasses.dataclass
class Setup:
    """What every rank builds before the first update, identical on all ranks."""
    preset: dict           # PRESETS entry
    shapes: dict           # {param: full shape}, in model order
    buckets: list          # [[(name, shape, offset)]], offsets in elements (step 1)
    largest: int           # elements, bf16, of the largest bucket
    trainer_group: object  # every trainer: the all_gathers
    owner_groups: list     # [trainer t and every receiver]: t's broadcasts


def set_up(rank, a, port, addr="127.0.0.1"):
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    world = a.trainers + a.receivers
    dist.init_process_group("gloo", rank=rank, world_size=world)
    p = PRESETS[a.preset]
    groups = params(p)
    shapes = {n: s for g in groups for n, s in g}
    buckets = buckets_of(groups, a.bucket_mb * (1 << 20) // 2)
    trainers = list(range(a.trainers))
    receivers = list(range(a.trainers, world))
    # new_group is collective: every rank creates the same groups in the same order.
    trainer_group = dist.new_group(trainers)
    owner_groups = [dist.new_group([t] + receivers) for t in trainers]
    largest = max(sum(numel(s) for _, s, _ in b) for b in buckets)
    return Setup(preset=p, shapes=shapes, buckets=buckets, largest=largest,
                 trainer_group=trainer_group, owner_groups=owner_groups)


def run_trainer(rank, a, setup):
    """Step 2 for `--updates` + 1 updates; returns each one's seconds."""
    times = []
    g = torch.Generator().manual_seed(rank)
    shards = {}
    for n, s in setup.shapes.items():
        rows = s[0]
        assert rows % a.trainers == 0, "%s: rows %d not divisible by trainers" % (n, rows)
        shards[n] = (torch.rand((rows // a.trainers,) + s[1:], generator=g) - 0.5).bfloat16()
    buf = torch.empty(setup.largest, dtype=torch.bfloat16)
    for u in range(a.updates + 1):
        dist.barrier()
        t = time.perf_counter()
        for b, bucket in enumerate(setup.buckets):
            owner = b % a.trainers
            for name, shape, off in bucket:
                full = buf[off:off + numel(shape)].view(shape)
                if a.trainers == 1:
                    full.copy_(shards[name])
                else:
                    dist.all_gather(list(full.view(torch.float16).chunk(a.trainers)),
                                    shards[name].view(torch.float16), group=setup.trainer_group)
            if owner == rank:
                n = sum(numel(s) for _, s, _ in bucket)
                dist.broadcast(buf[:n].view(torch.float16), src=owner,
                               group=setup.owner_groups[owner])
        dist.barrier()
        times.append(time.perf_counter() - t)
    return times


def run_receiver(rank, a, setup):
    """Step 3 for `--updates` + 1 updates; returns each one's seconds."""
    times = []
    r = (rank - a.trainers) % a.tp
    lay = engine_layout(setup.preset, a.tp, r)
    engine = {n: torch.zeros(s, dtype=torch.bfloat16) for n, (s, _) in lay.items()}
    by_param = {}
    for n, (_, pieces) in lay.items():
        for param, rows, cols, dst in pieces:
            by_param.setdefault(param, []).append((n, rows, cols, dst))
    bufs = [torch.empty(setup.largest, dtype=torch.bfloat16) for _ in range(2)]

    def load(bucket, buf):
        for name, shape, off in bucket:
            full = buf[off:off + numel(shape)].view(shape)
            for n, rows, cols, dst in by_param.get(name, []):
                src = full[rows] if len(shape) == 1 else full[rows, cols]
                engine[n][dst:dst + src.shape[0]].copy_(src)

    for u in range(a.updates + 1):
        dist.barrier()
        t = time.perf_counter()
        loader = None
        for b, bucket in enumerate(setup.buckets):
            n = sum(numel(s) for _, s, _ in bucket)
            # Buffer b % 2 is free: bucket b - 2's loader was joined before b - 1's began.
            dist.broadcast(bufs[b % 2][:n].view(torch.float16), src=b % a.trainers,
                           group=setup.owner_groups[b % a.trainers])
            if loader is not None:
                loader.join()  # bucket b - 1 loaded: its buffer is free for bucket b + 1
            loader = threading.Thread(target=load, args=(bucket, bufs[b % 2]))
            loader.start()
        loader.join()
        dist.barrier()
        times.append(time.perf_counter() - t)
    return times


def report(rank, a, setup, times):
    """Rank 0 prints the JSON line: per update, the slowest rank's time, the first (warm-up)
    update left out."""
    world = a.trainers + a.receivers
    timed = [1e3 * x for x in times[1:]]
    out = [None] * world if rank == 0 else None
    dist.gather_object(timed, out, dst=0)
    if rank == 0:
        per_update = [max(col) for col in zip(*out)]
        print(json.dumps({
            "impl": "torch-gloo", "mode": "broadcast", "preset": a.preset,
            "trainers": a.trainers, "receivers": a.receivers, "tp": a.tp, "dtype": "bf16",
            "bucket_mb": a.bucket_mb, "updates": a.updates, "update_ms": per_update,
            "update_ms_p50": percentile(per_update, 0.50),
            "update_ms_p99": percentile(per_update, 0.99),
            "bytes_broadcast": 2 * sum(numel(s) for s in setup.shapes.values()),
            "torch": torch.__version__}), flush=True)


def run(rank, a, port, addr="127.0.0.1"):
    setup = set_up(rank, a, port, addr)
    if rank < a.trainers:
        times = run_trainer(rank, a, setup)
    else:
        times = run_receiver(rank, a, setup)
    report(rank, a, setup, times)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="medium")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--as-rank", action="store_true",
                    help="be one rank of a job another launcher started (weightlift launch, "
                    "torchrun, scripts/testbed.sh): RANK and WORLD_SIZE from the environment, "
                    "gloo's store on MASTER_ADDR at MASTER_PORT + 1 (the launcher's own store "
                    "may hold MASTER_PORT)")
    a = ap.parse_args()
    if a.receivers % a.tp:
        ap.error("--tp must divide --receivers")
    if a.as_rank:
        world = int(os.environ["WORLD_SIZE"])
        if world != a.trainers + a.receivers:
            ap.error("WORLD_SIZE %d is not --trainers + --receivers" % world)
        run(int(os.environ["RANK"]), a, int(os.environ["MASTER_PORT"]) + 1,
            os.environ["MASTER_ADDR"])
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(a, port), nprocs=a.trainers + a.receivers, join=True)


if __name__ == "__main__":
    main()
