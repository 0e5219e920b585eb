#!/usr/bin/env python3
"""The `small` preset trained with PyTorch DistributedDataParallel over gloo: the peer of
`weightlift launch -n N -- weightlift bench train --dp-mode ddp` (bench/compare_ddp.py).

The same model as bench/torch_train_small.py (tests/reference/torch_moe.py, written from
DESIGN.md), each of N processes taking global_batch / N rows, AdamW, clipping at 1.0.
DistributedDataParallel needs find_unused_parameters=True: an MoE step leaves the experts no
token chose without a gradient. `--dtype bf16` runs the forward under CPU autocast to bf16,
the peer of `--precision bf16`. Rank 0 prints one JSON object.

    /usr/bin/python3 bench/torch_ddp_small.py --nprocs 2 --threads 1 --batch 8 --seq 256
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))
import torch_moe as ref  # noqa: E402
from torch_train_small import SMALL  # noqa: E402


class Model(torch.nn.Module):
    """The reference model's parameters as a Module, so DDP can hook their gradients."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.names = []
        self.params = torch.nn.ParameterList()
        for name, shape in ref.param_shapes(config).items():
            t = torch.ones(shape) if len(shape) == 1 else 0.02 * torch.randn(shape)
            self.names.append(name)
            self.params.append(torch.nn.Parameter(t))

    def forward(self, tokens, targets):
        w = dict(zip(self.names, self.params))
        _, loss, _, _, _ = ref.forward(w, tokens, targets, self.config)
        return loss


def run(rank, world, a):
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts them)
    model = torch.nn.parallel.DistributedDataParallel(Model(SMALL), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 320, (a.batch, a.seq), generator=gen)
    targets = torch.randint(0, 320, (a.batch, a.seq), generator=gen)
    rows = a.batch // world
    mine = slice(rank * rows, (rank + 1) * rows)
    times = []
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = model(tokens[mine], targets[mine])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    # The slowest rank's step is the job's.
    med = torch.tensor([statistics.median(times)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        ms = float(med[0])
        print(json.dumps({"impl": "pytorch-ddp-gloo", "torch": torch.__version__, "ranks": world,
                          "threads": a.threads, "batch": a.batch, "seq": a.seq, "dtype": a.dtype,
                          "step_ms_median": ms, "tokens_per_s": a.batch * a.seq / ms * 1e3}),
              flush=True)
    dist.destroy_process_group()


def spawned(rank, world, port, a):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    run(rank, world, a)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    ap.add_argument("--batch", type=int, default=8, help="global batch, rows")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()
    if a.batch % a.nprocs:
        sys.exit("--batch must be a multiple of --nprocs")
    # Each process's BLAS gets its thread count too; left alone, OpenBLAS starts a thread per
    # core in every process and two processes oversubscribe the machine.
    os.environ["OPENBLAS_NUM_THREADS"] = str(a.threads)
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(spawned, args=(a.nprocs, port, a), nprocs=a.nprocs, join=True)


if __name__ == "__main__":
    main()
