#!/usr/bin/env python3
"""The `small` preset trained in PyTorch eager mode: the baseline `weightlift bench train` is
compared with (bench/compare_train.sh). Same model (tests/reference/torch_moe.py, written from
DESIGN.md), same batch shape, AdamW, f32 or bf16 autocast. Prints one JSON object."""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "reference"))
import torch_moe as ref  # noqa: E402

SMALL = {"hidden_size": 256, "num_layers": 6, "num_heads": 8, "num_kv_heads": 1, "head_dim": 32,
         "num_experts": 8, "top_k": 2, "ffn_dim": 512, "vocab_size": 320, "max_seq_len": 256,
         "rope_theta": 10000.0, "rope_ntk_alpha": 1.0, "rms_eps": 1e-5, "norm_topk": True,
         "aux_loss_alpha": 0.01, "z_loss_beta": 0.0, "tie_embeddings": False}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    params = {}
    for name, shape in ref.param_shapes(SMALL).items():
        t = torch.ones(shape) if len(shape) == 1 else 0.02 * torch.randn(shape)
        params[name] = t.requires_grad_(True)
    opt = torch.optim.AdamW(params.values(), lr=1e-4)
    tokens = torch.randint(0, 320, (a.batch, a.seq))
    targets = torch.randint(0, 320, (a.batch, a.seq))
    times = []
    for step in range(a.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            _, loss, _, _, _ = ref.forward(params, tokens, targets, SMALL)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        if step > 0:  # the first step pays one-time allocation
            times.append((time.perf_counter() - t0) * 1e3)
    med = statistics.median(times)
    print(json.dumps({"impl": "pytorch-eager", "torch": torch.__version__, "dtype": a.dtype,
                      "batch": a.batch, "seq": a.seq, "threads": a.threads,
                      "step_ms_median": med, "tokens_per_s": a.batch * a.seq / med * 1e3}))


if __name__ == "__main__":
    main()
