#!/usr/bin/python3
"""A PyTorch trainer's state dict to rollout processes through weightlift's Python API: the
figure issue 15 compares with torch.distributed's gloo broadcast
(bench/torch_broadcast_baseline.py). Run under the launcher, rank 0 the trainer and every other
rank a rollout process holding the bf16 inference layout (tp 1):

    weightlift launch -n 3 -- /usr/bin/python3 bench/python_sync.py --preset medium --updates 5

Each update is what a trainer does after an optimizer step: `refresh` (the state dict into the
server's bf16 shards) and `update` (p2p one-sided writes into every receiver, returning once
all of them hold it). Prints one JSON line (rank 0) with both parts per update and the receivers'
check that the last version arrived exactly (bf16)."""
import argparse
import json
import statistics
import time

import torch

import weightlift as wl


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--mode", default="p2p", choices=["p2p", "broadcast"])
    a = ap.parse_args()
    job = wl.init(timeout=300)
    g = torch.Generator().manual_seed(7)
    sd = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in wl.parameters(a.preset)}
    if job.rank == 0:
        server = wl.ParameterServer(job, mode=a.mode, shard_dtype="BF16", timeout=300)
        server.register_checkpoint("policy", a.preset, named_tensors=sd)
        server.wait_for_receivers(job.size - 1)
        server.update("policy")  # the first update plans; not timed
        refresh_ms, update_ms = [], []
        for _ in range(a.updates):
            t0 = time.perf_counter()
            server.refresh("policy", sd)
            t1 = time.perf_counter()
            u = server.update("policy")
            t2 = time.perf_counter()
            refresh_ms.append((t1 - t0) * 1e3)
            update_ms.append((t2 - t1) * 1e3)
        job.barrier("checked", timeout=300)
        total = [r + u for r, u in zip(refresh_ms, update_ms)]
        print(json.dumps({"impl": "weightlift-python", "mode": a.mode, "preset": a.preset,
                          "receivers": job.size - 1, "refresh_ms": refresh_ms,
                          "update_ms": update_ms, "total_ms": total,
                          "total_ms_p50": statistics.median(total),
                          "update_ms_p50": statistics.median(update_ms),
                          "bytes_per_receiver": u["bytes"] // max(1, job.size - 1)}), flush=True)
    else:
        receiver = wl.Receiver(job, id=job.rank - 1, model=a.preset, timeout=300)
        receiver.wait_for_version(a.updates + 1, timeout=600)
        with receiver.acquire() as w:
            q = w["layers.0.attn.qkv_proj.weight"]
            want = torch.cat([sd["layers.0.attn.%s_proj.weight" % p] for p in "qkv"])
            assert torch.equal(q, want), "received weights differ from what the trainer sent"
        job.barrier("checked", timeout=300)
    job.close(timeout=300)


if __name__ == "__main__":
    main()
