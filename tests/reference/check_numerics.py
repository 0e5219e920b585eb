#!/usr/bin/env python3
"""weightlift's numerics against PyTorch (run with Debian's /usr/bin/python3 and python3-torch).

For each case: write a config, random weights and a token batch as files; run
`weightlift grad` (or `weightlift train` on a fixed batch) on them; compute the same in PyTorch
in float64 (torch_moe.py, written from DESIGN.md); compare. Exits non-zero on any mismatch.

Tolerances. Our side computes in f32 (unit roundoff 6e-8). Each value is a sum of at most a few
thousand products (d <= 256, tokens <= 512) passed through ~2 * num_layers + 2 such stages,
so the expected norm-wise relative error is around 1e-6 to 1e-5. We require 1e-4 for logits,
losses and gradients (the figure issue 2 asks for), a 10x margin over what we expect.
For bf16 mixed precision GEMM operands are rounded to 8 significant bits (relative 2^-9 = 2e-3
each); the loss is an average over many tokens, so its error stays near that: we require 2e-2
relative on the loss (10x margin).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch

import torch_moe as ref

TOL_F32 = 1e-4
TOL_BF16_LOSS = 2e-2


def rel_err(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def make_case(cfg, batch, seq, seed):
    """Random weights with well-separated router choices (so f32 and f64 route alike)."""
    g = torch.Generator().manual_seed(seed)
    for attempt in range(20):
        w = {}
        for name, shape in ref.param_shapes(cfg).items():
            if len(shape) == 1:
                w[name] = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
            elif "router" in name:
                w[name] = 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
            else:
                w[name] = 0.08 * torch.randn(shape, generator=g, dtype=torch.float64)
        w = {k: v.float().double() for k, v in w.items()}  # exactly representable in f32
        tokens = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=g)
        targets = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=g)
        targets[0, :3] = -100
        if routing_margin(w, tokens, cfg) > 1e-3:
            return w, tokens, targets
    raise RuntimeError("could not find weights with a clear routing margin")


def routing_margin(w, tokens, cfg):
    """Smallest gap between the k-th and (k+1)-th router logit over all layers: f32 puts
    about 1e-6 of error on logits of size ~1-10, so a gap above 1e-3 routes alike."""
    margins = []
    eps = cfg.get("rms_eps", 1e-5)
    x = w["embed.weight"][tokens]
    K, E = cfg["top_k"], cfg["num_experts"]
    for l in range(cfg["num_layers"]):
        p = f"layers.{l}."
        h = x + ref.attention(ref.rmsnorm(x, w[p + "attn_norm.weight"], eps), w, p, cfg)
        xn = ref.rmsnorm(h, w[p + "moe_norm.weight"], eps)
        logits = xn.reshape(-1, xn.shape[-1]) @ w[p + "moe.router.weight"].T
        if K < E:
            s = logits.sort(-1, descending=True).values
            margins.append((s[:, K - 1] - s[:, K]).min().item())
        m, _, _ = ref.moe(xn, w, p, cfg)
        x = h + m
    return min(margins) if margins else 1.0


def write_inputs(d, cfg, w, tokens, targets):
    paths = {k: os.path.join(d, k) for k in ("config.json", "weights.safetensors",
                                             "batch.safetensors", "out.safetensors")}
    with open(paths["config.json"], "w") as f:
        json.dump(cfg, f, indent=2)
    ref.write_safetensors(paths["weights.safetensors"], {k: v.float() for k, v in w.items()})
    ref.write_safetensors(paths["batch.safetensors"], {"tokens": tokens, "targets": targets})
    return paths


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(" ".join(cmd), "\n", r.stdout, r.stderr, file=sys.stderr)
        raise SystemExit(f"command failed with exit code {r.returncode}")


class Checker:
    def __init__(self):
        self.failures = 0

    def expect(self, label, err, tol):
        ok = err <= tol and not math.isnan(err)
        self.failures += 0 if ok else 1
        print(f"  {'ok  ' if ok else 'FAIL'} {label:<48} rel err {err:.2e} (tol {tol:.0e})")


def check_grad_case(ck, exe, name, cfg, batch, seq, seed, precision="f32"):
    print(f"case {name}: {precision}, batch {batch} x seq {seq}")
    w, tokens, targets = make_case(cfg, batch, seq, seed)
    with tempfile.TemporaryDirectory() as d:
        p = write_inputs(d, cfg, w, tokens, targets)
        run([exe, "grad", "--config", p["config.json"], "--weights", p["weights.safetensors"],
             "--tokens", p["batch.safetensors"], "--out", p["out.safetensors"],
             "--precision", precision])
        ours = ref.read_safetensors(p["out.safetensors"])
    params = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    stats = {}
    logits, loss, ce, aux, z = ref.forward(params, tokens, targets, cfg, stats)
    loss.backward()
    if cfg.get("capacity_factor") is not None:
        # A case that drops nothing would not test dropping.
        print(f"  capacity factor {cfg['capacity_factor']}: {stats['dropped']} of "
              f"{stats['slots']} slots dropped")
        ck.expect("some slots dropped", 0.0 if stats["dropped"] > 0 else 1.0, 0.0)
        ck.expect("the same slots dropped (count)",
                  abs(int(ours["dropped_slots"].item()) - stats["dropped"]), 0.0)
    if precision != "f32":
        ck.expect("loss (bf16 vs f64 reference)", rel_err(ours["loss"], loss.detach()),
                  TOL_BF16_LOSS)
        return
    ck.expect("logits", rel_err(ours["logits"], logits.detach()), TOL_F32)
    for label, val in (("loss", loss), ("ce", ce), ("aux", aux), ("z", z)):
        val = torch.as_tensor(val, dtype=torch.float64).detach()
        if val.abs().item() == 0:
            ck.expect(label + " (reference is 0)", ours[label].abs().item(), 1e-12)
        else:
            ck.expect(label, rel_err(ours[label], val), TOL_F32)
    worst = (0.0, "")
    for k, v in params.items():
        e = rel_err(ours["grad." + k], v.grad)
        worst = max(worst, (e, k))
        if e > TOL_F32:
            ck.expect("grad." + k, e, TOL_F32)
    ck.expect(f"all {len(params)} gradients (worst {worst[1]})", worst[0], TOL_F32)


def check_adamw_case(ck, exe, cfg, seed):
    steps, base_lr, warmup, min_lr, clip, wd = 3, 1e-2, 2, 1e-3, 0.5, 0.1
    betas, eps = (0.9, 0.95), 1e-8
    print(f"case adamw: {steps} steps, lr {base_lr} warmup {warmup}, clip {clip}, wd {wd}")
    w, tokens, targets = make_case(cfg, 2, 16, seed)
    with tempfile.TemporaryDirectory() as d:
        p = write_inputs(d, cfg, w, tokens, targets)
        run([exe, "train", "--config", p["config.json"], "--init-weights", p["weights.safetensors"],
             "--batch-file", p["batch.safetensors"], "--steps", str(steps), "--lr", str(base_lr),
             "--min-lr", str(min_lr), "--warmup-steps", str(warmup), "--grad-clip", str(clip),
             "--weight-decay", str(wd), "--beta1", str(betas[0]), "--beta2", str(betas[1]),
             "--adam-eps", str(eps), "--out-weights", p["out.safetensors"], "--quiet",
             "--out", os.path.join(d, "run")])
        ours = ref.read_safetensors(p["out.safetensors"])
    params = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    decay = [v for k, v in params.items() if v.dim() > 1]
    no_decay = [v for k, v in params.items() if v.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=base_lr, betas=betas, eps=eps)
    for s in range(steps):
        for group in opt.param_groups:
            group["lr"] = ref.lr_at(s, base_lr, warmup, steps, min_lr)
        opt.zero_grad()
        _, loss, _, _, _ = ref.forward(params, tokens, targets, cfg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
    # Adam divides each gradient by its own running RMS, so a gradient component near zero
    # turns its small absolute error into a large relative one in the update; the updates
    # therefore get 10x the gradient tolerance.
    worst = (0.0, "")
    for k, v in params.items():
        # Compare the update (final - initial) so the tolerance is relative to what moved.
        e = rel_err(ours[k].double() - w[k], v.detach() - w[k])
        worst = max(worst, (e, k))
    ck.expect(f"parameter updates after {steps} steps (worst {worst[1]})", worst[0], TOL_F32 * 10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weightlift", required=True, help="path to the weightlift binary")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = {"rope_theta": 10000.0, "rope_ntk_alpha": 1.0, "rms_eps": 1e-5, "norm_topk": True,
            "aux_loss_alpha": 0.01, "z_loss_beta": 0.0, "tie_embeddings": False,
            "capacity_factor": None}
    tiny = dict(base, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16,
                num_experts=4, top_k=2, ffn_dim=128, vocab_size=320, max_seq_len=128)
    small2 = dict(base, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=1, head_dim=32,
                  num_experts=8, top_k=2, ffn_dim=512, vocab_size=320, max_seq_len=256)
    variant = dict(tiny, norm_topk=False, z_loss_beta=1e-3, tie_embeddings=True,
                   rope_ntk_alpha=4.0, num_kv_heads=2, top_k=3)
    ck = Checker()
    check_grad_case(ck, args.weightlift, "tiny", tiny, 2, 24, 1)
    check_grad_case(ck, args.weightlift, "small, 2 layers", small2, 2, 64, 2)
    check_grad_case(ck, args.weightlift, "tiny: norm_topk off, z-loss, tied, NTK 4, GQA 2",
                    variant, 2, 24, 3)
    check_grad_case(ck, args.weightlift, "tiny: capacity factor 1 (GShard dropping)",
                    dict(tiny, capacity_factor=1.0), 2, 24, 6)
    check_grad_case(ck, args.weightlift, "small, 2 layers: capacity factor 0.75",
                    dict(small2, capacity_factor=0.75), 2, 64, 7)
    check_adamw_case(ck, args.weightlift, tiny, 4)
    check_grad_case(ck, args.weightlift, "small, 2 layers", small2, 2, 64, 5, precision="bf16")
    print(f"{ck.failures} failed" if ck.failures else "all numerics agree with PyTorch")
    sys.exit(1 if ck.failures else 0)


if __name__ == "__main__":
    main()
