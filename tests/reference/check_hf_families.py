#!/usr/bin/python3
"""Hugging Face checkpoints through the real command, against PyTorch in float64.

For each family weightlift reads (Mixtral so far), a random checkpoint is written as Hugging
Face lays it out (config.json, BF16 tensors in two shards with model.safetensors.index.json,
norms that are not ones, a head_dim other than hidden_size / heads, grouped KV heads, tied
embeddings in one case), then `weightlift grad --model-dir` gives ce, logits and
grad.<Hugging Face name> for every tensor, and this file's own float64 implementation of the
family, written from its published semantics (transformers' modeling_mixtral: RMSNorm, rotate-half
RoPE, repeat_kv, a softmax router whose top-k weights are renormalised, w2(silu(w1 x) * w3 x)),
gives the same. router_aux_loss_coef is 0 here: weightlift's load-balancing loss is DESIGN.md's,
computed per layer, not transformers' over all layers at once, so the gradients compared are
the cross-entropy's. Tolerance 1e-4 relative (max |a - b| / max |b| per tensor): f32 against
float64 over a few layers leaves about 1e-6.

Then a run's export: `weightlift train` on `tiny` writes <out>/hf/, which loads back through
--model-dir to logits bit for bit equal to the run's own model.safetensors.

    /usr/bin/python3 tests/reference/check_hf_families.py build/release/apps/weightlift
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_moe import read_safetensors, write_safetensors  # noqa: E402  (file I/O only)

torch.set_default_dtype(torch.float64)
TOL = 1e-4


def mixtral_tensors(c, tied):
    d, hd, f = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    H, KV, E = c["num_attention_heads"], c["num_key_value_heads"], c["num_local_experts"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,)}
    if not tied:
        shapes["lm_head.weight"] = (c["vocab_size"], d)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (H * hd, d),
                       p + "self_attn.k_proj.weight": (KV * hd, d),
                       p + "self_attn.v_proj.weight": (KV * hd, d),
                       p + "self_attn.o_proj.weight": (d, H * hd),
                       p + "block_sparse_moe.gate.weight": (E, d)})
        for e in range(E):
            q = p + f"block_sparse_moe.experts.{e}."
            shapes.update({q + "w1.weight": (f, d), q + "w3.weight": (f, d), q + "w2.weight": (d, f)})
    return shapes


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def mixtral_forward(w, tokens, c, tied):
    """transformers' MixtralForCausalLM, eager, float64: logits and every layer's router logits."""
    B, T = tokens.shape
    d, hd = c["hidden_size"], c["head_dim"]
    H, KV, E, K = (c["num_attention_heads"], c["num_key_value_heads"], c["num_local_experts"],
                   c["num_experts_per_tok"])
    eps = c["rms_norm_eps"]
    inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = w["model.embed_tokens.weight"][tokens]
    router_logits = []
    mask = torch.full((T, T), float("-inf")).triu(1)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(B, T, H, hd).transpose(1, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1) @ v
        x = x + att.transpose(1, 2).reshape(B, T, H * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps).reshape(B * T, d)
        logits = h @ w[p + "block_sparse_moe.gate.weight"].T
        router_logits.append(logits)
        probs = torch.softmax(logits, dim=-1)
        top_w, top_i = torch.topk(probs, K, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in range(E):
            q_ = p + f"block_sparse_moe.experts.{e}."
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = (F.silu(h[rows] @ w[q_ + "w1.weight"].T) * (h[rows] @ w[q_ + "w3.weight"].T)) @ \
                w[q_ + "w2.weight"].T
            out.index_add_(0, rows, y * top_w[rows, slot].unsqueeze(-1))
        x = x + out.view(B, T, d)
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
    return x @ head.T, router_logits


def routing_margin(router_logits, k):
    return min((l.sort(-1, descending=True).values[:, k - 1] -
                l.sort(-1, descending=True).values[:, k]).min().item() for l in router_logits)


def make_mixtral(c, tied, seed, tokens):
    """BF16 weights (what the checkpoint holds) whose routing has a clear top-k margin."""
    for attempt in range(50):
        g = torch.Generator().manual_seed(seed + attempt)
        w = {}
        for name, shape in mixtral_tensors(c, tied).items():
            if len(shape) == 1:  # norms around 1, not ones
                t = 1.0 + 0.5 * (torch.rand(shape, generator=g) - 0.5)
            else:
                t = torch.randn(shape, generator=g) * (0.5 / math.sqrt(shape[1]))
            w[name] = t.to(torch.bfloat16)
        w64 = {k: v.double() for k, v in w.items()}
        _, router = mixtral_forward(w64, tokens, c, tied)
        if routing_margin(router, c["num_experts_per_tok"]) > 1e-3:
            return w, w64
    raise RuntimeError("no weights with a clear routing margin")


def write_checkpoint(d, c, w):
    """Two shards and their index, as a Hugging Face save_pretrained lays them out."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    names = list(w)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, part in shards.items():
        write_safetensors(os.path.join(d, file), {n: w[n] for n in part})
        weight_map.update({n: file for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
    return r


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def check_mixtral(exe, tmp, name, c, tied, failures):
    B, T = 2, 12
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, c["vocab_size"], (B, T), generator=g)
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -100
    targets[0, 3] = -100
    w, w64 = make_mixtral(c, tied, 11, tokens)
    d = os.path.join(tmp, name)
    write_checkpoint(d, c, w)
    write_safetensors(os.path.join(tmp, name + "-batch.safetensors"),
                      {"tokens": tokens, "targets": targets})
    out = os.path.join(tmp, name + "-grad.safetensors")
    run([exe, "--threads", "1", "grad", "--model-dir", d, "--tokens",
         os.path.join(tmp, name + "-batch.safetensors"), "--out", out])
    ours = read_safetensors(out)
    params = {k: v.clone().requires_grad_(True) for k, v in w64.items()}
    logits, _ = mixtral_forward(params, tokens, c, tied)
    ce = F.cross_entropy(logits.reshape(-1, c["vocab_size"]), targets.reshape(-1), ignore_index=-100)
    ce.backward()
    checks = [("ce", ours["ce"].reshape(()), ce.detach()), ("logits", ours["logits"], logits.detach())]
    checks += [("grad." + k, ours["grad." + k], p.grad) for k, p in params.items()]
    missing = [k for k in ours if k.startswith("grad.") and k[5:] not in params]
    if missing:
        failures.append(f"{name}: gradients of tensors the checkpoint lacks: {missing[:3]}")
    worst = max(checks, key=lambda x: rel_err(x[1], x[2]))
    for label, a, b in checks:
        if a.shape != b.shape or rel_err(a, b) > TOL:
            failures.append(f"{name}: {label}: rel err {rel_err(a, b):.2e} (shapes {tuple(a.shape)}, "
                            f"{tuple(b.shape)})")
    print(f"{name}: ce, logits and {len(checks) - 2} gradients within {TOL:g} "
          f"(worst {worst[0]}: {rel_err(worst[1], worst[2]):.1e})")


def check_export(exe, tmp, failures):
    out = os.path.join(tmp, "run")
    brown = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "data", "brown")
    run([exe, "--threads", "1", "train", "--preset", "tiny", "--steps", "3", "--batch", "2",
         "--seq", "32", "--corpus", brown, "--out", out])
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 320, (2, 16), generator=g)
    batch = os.path.join(tmp, "export-batch.safetensors")
    write_safetensors(batch, {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1)})
    run([exe, "grad", "--config", os.path.join(out, "config.json"), "--weights",
         os.path.join(out, "model.safetensors"), "--tokens", batch, "--out",
         os.path.join(tmp, "ours.safetensors")])
    run([exe, "grad", "--model-dir", os.path.join(out, "hf"), "--tokens", batch, "--out",
         os.path.join(tmp, "hf.safetensors")])
    a = read_safetensors(os.path.join(tmp, "ours.safetensors"))
    b = read_safetensors(os.path.join(tmp, "hf.safetensors"))
    if not torch.equal(a["logits"], b["logits"]) or not torch.equal(a["ce"], b["ce"]):
        failures.append("export: the hf/ checkpoint's logits differ from the run's own weights'")
    with open(os.path.join(out, "hf", "config.json")) as f:
        arch = json.load(f)["architectures"]
    print(f"export: train's hf/ ({arch[0]}) reloads to logits and ce bit for bit")


def check_refusals(exe, tmp, base, failures):
    """What weightlift does not implement, and a damaged checkpoint: one clear error naming the
    file and the key or tensor, exit code 1, never a model that computes something else."""
    tokens = torch.zeros((1, 4), dtype=torch.int64)
    batch = os.path.join(tmp, "refusal-batch.safetensors")
    write_safetensors(batch, {"tokens": tokens, "targets": tokens})
    w, _ = make_mixtral(base, False, 5, tokens)

    def expect(label, edit, needle):
        d = os.path.join(tmp, "refusal-" + label.replace(" ", "-"))
        cfg = json.loads(json.dumps(base))
        write_checkpoint(d, cfg, w)
        edit(d, cfg)
        r = subprocess.run([exe, "grad", "--model-dir", d, "--tokens", batch, "--out",
                            os.path.join(d, "g.safetensors")], capture_output=True, text=True)
        ok = r.returncode == 1 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
        if not ok:
            failures.append(f"refusal {label}: exit {r.returncode}, stderr {r.stderr.strip()!r}, "
                            f"expected {needle!r}")
        else:
            print(f"refused: {label}: {r.stderr.strip()[:150]}")

    def with_config(**changes):
        def edit(d, cfg):
            cfg.update(changes)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump({k: v for k, v in cfg.items() if v != "<drop>"}, f)
        return edit

    def drop_shard(d, cfg):
        os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))

    def wrong_shape(d, cfg):
        path = os.path.join(d, "model-00001-of-00002.safetensors")
        t = read_safetensors(path)
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:-1]
        write_safetensors(path, t)

    def wrong_dtype(d, cfg):
        path = os.path.join(d, "model-00001-of-00002.safetensors")
        t = read_safetensors(path)
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].to(torch.int32)
        write_safetensors(path, t)

    expect("another family", with_config(architectures=["DeepseekV3ForCausalLM"]),
           "architectures [\"DeepseekV3ForCausalLM\"] is not a family")
    expect("sliding window", with_config(sliding_window=4096), "sliding_window 4096 is not supported")
    expect("rope scaling", with_config(rope_scaling={"type": "yarn", "factor": 4.0}),
           "rope_scaling")
    expect("an unknown key", with_config(n_shared_experts=1), "key 'n_shared_experts'")
    expect("a missing shard", drop_shard, "model-00002-of-00002.safetensors: a shard of the "
           "checkpoint is missing")
    expect("a wrong shape", wrong_shape, "model.embed_tokens.weight")
    expect("a wrong dtype", wrong_dtype, "dtype I32, expected a float type")


def main():
    exe = sys.argv[1]
    failures = []
    base = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 96,
            "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "sliding_window": None, "router_aux_loss_coef": 0.0, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}
    with tempfile.TemporaryDirectory() as tmp:
        check_mixtral(exe, tmp, "mixtral", base, False, failures)
        check_mixtral(exe, tmp, "mixtral-tied-mqa",
                      dict(base, tie_word_embeddings=True, num_key_value_heads=1), True, failures)
        check_export(exe, tmp, failures)
        check_refusals(exe, tmp, base, failures)
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
