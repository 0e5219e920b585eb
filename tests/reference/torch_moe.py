"""An independent PyTorch implementation of weightlift's MoE transformer (DESIGN.md, "The
model, exactly"), written from the specification and sharing no code with the C++ one.

Used as the numerical reference by check_numerics.py and as the eager baseline by
bench/torch_train_small.py. Also reads and writes safetensors with nothing but struct and json,
so the reference does not depend on the safetensors package either.
"""
import json
import math
import struct

import torch
import torch.nn.functional as F

_DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16,
           "F16": torch.float16, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
_NAMES = {v: k for k, v in _DTYPES.items()}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        buf = bytearray(data[base + b:base + e])
        t = torch.frombuffer(buf, dtype=_DTYPES[info["dtype"]]) if e > b else \
            torch.empty(0, dtype=_DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]).clone()
    return out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.numpy().tobytes() if t.dtype != torch.bfloat16 else \
            t.view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def param_shapes(c):
    d, dh, f = c["hidden_size"], c["head_dim"], c["ffn_dim"]
    shapes = {"embed.weight": (c["vocab_size"], d)}
    for l in range(c["num_layers"]):
        p = f"layers.{l}."
        shapes[p + "attn_norm.weight"] = (d,)
        shapes[p + "attn.q_proj.weight"] = (c["num_heads"] * dh, d)
        shapes[p + "attn.k_proj.weight"] = (c["num_kv_heads"] * dh, d)
        shapes[p + "attn.v_proj.weight"] = (c["num_kv_heads"] * dh, d)
        shapes[p + "attn.o_proj.weight"] = (d, c["num_heads"] * dh)
        shapes[p + "moe_norm.weight"] = (d,)
        shapes[p + "moe.router.weight"] = (c["num_experts"], d)
        for e in range(c["num_experts"]):
            q = p + f"moe.experts.{e}."
            shapes[q + "gate_proj.weight"] = (f, d)
            shapes[q + "up_proj.weight"] = (f, d)
            shapes[q + "down_proj.weight"] = (d, f)
    shapes["norm.weight"] = (d,)
    if not c.get("tie_embeddings", False):
        shapes["lm_head.weight"] = (c["vocab_size"], d)
    return shapes


def rmsnorm(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def rope(x, pos0, c):
    """x: [B, T, h, Dh]; rotate-half convention with NTK-aware base."""
    dh = x.shape[-1]
    base = c.get("rope_theta", 10000.0) * c.get("rope_ntk_alpha", 1.0) ** (dh / (dh - 2))
    inv_freq = base ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    pos = torch.arange(pos0, pos0 + x.shape[1], dtype=torch.float64)
    ang = pos[:, None] * inv_freq[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., :dh // 2], x[..., dh // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(x, w, p, c):
    B, T, _ = x.shape
    H, Hkv, Dh = c["num_heads"], c["num_kv_heads"], c["head_dim"]
    q = (x @ w[p + "attn.q_proj.weight"].T).view(B, T, H, Dh)
    k = (x @ w[p + "attn.k_proj.weight"].T).view(B, T, Hkv, Dh)
    v = (x @ w[p + "attn.v_proj.weight"].T).view(B, T, Hkv, Dh)
    q, k = rope(q, 0, c), rope(k, 0, c)
    rep = H // Hkv
    k = k.repeat_interleave(rep, dim=2)  # head h reads kv head h // rep, as HF's repeat_kv
    v = v.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, Dh]
    s = q @ k.transpose(-1, -2) / math.sqrt(Dh)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.softmax(s, -1) @ v
    o = o.transpose(1, 2).reshape(B, T, H * Dh)
    return o @ w[p + "attn.o_proj.weight"].T


def kept_slots(topi, E, capacity_factor):
    """[n, K] bool: the routing slots an expert has room for. GShard's rule: each expert takes
    ceil(capacity_factor * n * K / E) slots, every token's first choice (in token order) before
    any second choice; None keeps them all."""
    n, K = topi.shape
    if capacity_factor is None:
        return torch.ones(n, K, dtype=torch.bool)
    capacity = math.ceil(capacity_factor * (n * K) / E)
    onehot = F.one_hot(topi.t().reshape(-1), E)          # slots in priority order, [K n, E]
    position = (onehot.cumsum(0) * onehot).sum(-1)        # 1-based place at its expert
    return (position <= capacity).reshape(K, n).t()


def moe(x, w, p, c, stats=None):
    """Returns output [B, T, d], aux_l and z_l (unweighted). A dropped slot (capacity_factor)
    adds nothing; the gate weights are those of the router's top-k either way, and f counts
    the router's choices. stats, when given, gains "slots" and "dropped"."""
    B, T, d = x.shape
    E, K = c["num_experts"], c["top_k"]
    xs = x.reshape(-1, d)
    logits = xs @ w[p + "moe.router.weight"].T
    probs = torch.softmax(logits, -1)
    topv, topi = probs.topk(K, dim=-1)
    if c.get("norm_topk", True):
        topv = topv / topv.sum(-1, keepdim=True)
    kept = kept_slots(topi, E, c.get("capacity_factor"))
    if stats is not None:
        stats["slots"] = stats.get("slots", 0) + kept.numel()
        stats["dropped"] = stats.get("dropped", 0) + int((~kept).sum())
    out = torch.zeros_like(xs)
    for e in range(E):
        tok, slot = ((topi == e) & kept).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        q = p + f"moe.experts.{e}."
        xe = xs[tok]
        ye = (F.silu(xe @ w[q + "gate_proj.weight"].T) * (xe @ w[q + "up_proj.weight"].T)) \
            @ w[q + "down_proj.weight"].T
        out = out.index_add(0, tok, (topv[tok, slot, None] * ye).to(out.dtype))
    n = xs.shape[0]
    f = torch.bincount(topi.flatten(), minlength=E).to(x.dtype) / (n * K)  # no gradient
    P = probs.mean(0)
    aux = E * (f * P).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    return out.view(B, T, d), aux, z


def forward(w, tokens, targets, c, stats=None):
    """Returns logits, loss, ce, aux, z (stats: moe()'s, over the layers)."""
    eps = c.get("rms_eps", 1e-5)
    x = w["embed.weight"][tokens]
    L = c["num_layers"]
    aux_sum, z_sum = 0.0, 0.0
    for l in range(L):
        p = f"layers.{l}."
        h = x + attention(rmsnorm(x, w[p + "attn_norm.weight"], eps), w, p, c)
        m, aux, z = moe(rmsnorm(h, w[p + "moe_norm.weight"], eps), w, p, c, stats)
        x = h + m
        aux_sum, z_sum = aux_sum + aux, z_sum + z
    x = rmsnorm(x, w["norm.weight"], eps)
    head = w["embed.weight"] if c.get("tie_embeddings", False) else w["lm_head.weight"]
    logits = x @ head.T
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                         ignore_index=-100)
    aux = c.get("aux_loss_alpha", 0.01) * aux_sum / L
    z = c.get("z_loss_beta", 0.0) * z_sum / L
    return logits, ce + aux + z, ce, aux, z


def lr_at(step, base_lr, warmup, total, min_lr):
    """weightlift's schedule (train/schedule.h) for the 0-based update `step`."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    progress = min(progress, 1.0)
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))
