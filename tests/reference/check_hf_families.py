#!/usr/bin/python3
"""Hugging Face checkpoints through the real command, against PyTorch in float64.

For each family weightlift reads, random checkpoints are written as Hugging Face lays them out
(config.json, BF16 tensors in two shards with model.safetensors.index.json, norms that are not
ones, a head_dim other than hidden_size / heads, grouped KV heads, tied embeddings in some
cases), then `weightlift grad --model-dir` gives ce, logits and grad.<Hugging Face name> for
every tensor, and this file's own float64 implementation, written from each family's published
semantics (transformers' modeling code, eager attention), gives the same. The families:

  mixtral    MixtralForCausalLM (modeling_mixtral): RMSNorm, rotate-half RoPE, repeat_kv, every
             layer a block_sparse_moe whose softmax router's top-k weights are renormalised,
             experts w2(silu(w1 x) * w3 x).
  qwen3_moe  Qwen3MoeForCausalLM (modeling_qwen3_moe): attention with q_norm / k_norm, RMSNorms
             over head_dim applied per head before RoPE; layer l is sparse iff l is not in
             mlp_only_layers, num_experts > 0 and (l + 1) % decoder_sparse_step == 0, else a
             dense SwiGLU of intermediate_size; sparse layers route softmax -> top-k, divided by
             the top-k sum only when norm_topk_prob; experts are SwiGLUs of moe_intermediate_size.
  qwen3      Qwen3ForCausalLM (modeling_qwen3): the same attention, every layer a dense SwiGLU.
  llama      LlamaForCausalLM (modeling_llama): no q/k norms, every layer a dense SwiGLU,
             head_dim defaulting to hidden_size // num_attention_heads when absent, rope_scaling
             null, "linear" (inv_freq / factor) or "llama3" (transformers'
             _compute_llama3_parameters: low frequencies / factor, high ones unchanged, a smooth
             blend between).

router_aux_loss_coef is 0 here: weightlift's load-balancing loss is DESIGN.md's, computed per
layer, not transformers' over all layers at once, so the gradients compared are the
cross-entropy's. MoE weights are drawn again until no token's top-k is decided by a near-tie.
Tolerance 1e-4 relative (max |a - b| / max |b| per tensor): f32 against float64 over a few
layers leaves about 1e-6.

Before the binary is run, each case checks the reference itself: forward() against
naive_logits(), a second reading of the same semantics written differently (one token at a time
with a KV cache, RoPE as a complex rotation, scalar frequencies and routing), autograd against
central finite differences of ce, and each rope_scaling / norm_topk_prob case against the same
weights without it, so that the comparison with weightlift can tell them apart.

Then a run's export: `weightlift train` on `tiny` writes <out>/hf/, which loads back through
--model-dir to logits bit for bit equal to the run's own model.safetensors; and refusals: what
weightlift does not implement, or a damaged checkpoint, is one error line naming the key or
tensor and exit code 1.

    /usr/bin/python3 tests/reference/check_hf_families.py build/release/apps/weightlift [FILTER...]
    /usr/bin/python3 tests/reference/check_hf_families.py --self-check [FAMILY...]

FILTER is a family (mixtral, qwen3_moe, qwen3, llama: its cases and its refusals) or export;
without one, everything runs. --self-check runs only the reference's own checks, no binary.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_moe import read_safetensors, write_safetensors  # noqa: E402  (file I/O only)

torch.set_default_dtype(torch.float64)
TOL = 1e-4
FAMILIES = ("mixtral", "qwen3_moe", "qwen3", "llama")
DENSE = ("gate_proj", "up_proj", "down_proj")  # (gate, up, down) of a SwiGLU, by name

# ----------------------------------------------------------------------------- configurations

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 96,
           "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "sliding_window": None, "router_aux_loss_coef": 0.0, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96,
         "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 128, "rope_theta": 1000000.0, "rope_scaling": None,
         "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
         "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
         "max_window_layers": 2, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
QWEN3_MOE = dict(QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                 num_hidden_layers=3, max_window_layers=3, moe_intermediate_size=24,
                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.0,
                 output_router_logits=False, tie_word_embeddings=False)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96,
         "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 128, "rope_theta": 10000.0, "rope_scaling": None,
         "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
         "attention_dropout": 0.0, "pretraining_tp": 1, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16"}
# Keys real configs carry that change nothing weightlift computes; the loader must accept them.
HOUSEKEEPING = {"bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
                "use_cache": True, "transformers_version": "4.51.3"}
# head_dim 16, rope_theta 1e4: wavelengths 6.3, 20, 63, 199, ... against 64 / 4 and 64 / 1, so
# one frequency is kept, two are blended and five are divided by the factor.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def without(c, key):
    return {k: v for k, v in c.items() if k != key}


def cases():
    """(family, case name, config.json)."""
    return [
        ("mixtral", "mixtral", MIXTRAL),
        ("mixtral", "mixtral-tied-mqa", dict(MIXTRAL, tie_word_embeddings=True,
                                             num_key_value_heads=1)),
        ("qwen3_moe", "qwen3_moe", dict(QWEN3_MOE, **HOUSEKEEPING)),
        ("qwen3_moe", "qwen3_moe-step2-unnormalised-tied",
         dict(QWEN3_MOE, num_hidden_layers=4, max_window_layers=4, decoder_sparse_step=2,
              mlp_only_layers=[], norm_topk_prob=False, tie_word_embeddings=True)),
        ("qwen3", "qwen3-tied", dict(QWEN3, **HOUSEKEEPING)),
        ("qwen3", "qwen3-mqa", dict(QWEN3, num_key_value_heads=1, head_dim=8,
                                    tie_word_embeddings=False)),
        ("llama", "llama", dict(LLAMA, **HOUSEKEEPING)),
        ("llama", "llama-llama3-rope", dict(LLAMA, rope_scaling=LLAMA3_ROPE,
                                            max_position_embeddings=512)),
        ("llama", "llama-linear-rope-no-head-dim-tied",
         dict(without(LLAMA, "head_dim"), rope_scaling={"rope_type": "linear", "factor": 2.0},
              tie_word_embeddings=True)),
    ]


def spec(c):
    """What transformers' modeling code builds from config c, as far as this file needs it."""
    n, family = c["num_hidden_layers"], c["model_type"]
    s = SimpleNamespace(head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
                        qk_norm=family in ("qwen3", "qwen3_moe"),
                        tied=c.get("tie_word_embeddings", False), sparse=[False] * n,
                        moe="mlp", expert_mlp=DENSE, experts=0, expert_width=0, norm_topk=True)
    if family == "mixtral":
        s.sparse, s.moe, s.expert_mlp = [True] * n, "block_sparse_moe", ("w1", "w3", "w2")
        s.experts, s.expert_width = c["num_local_experts"], c["intermediate_size"]
    elif family == "qwen3_moe":  # Qwen3MoeDecoderLayer.__init__
        s.sparse = [l not in c["mlp_only_layers"] and c["num_experts"] > 0 and
                    (l + 1) % c["decoder_sparse_step"] == 0 for l in range(n)]
        s.experts, s.expert_width = c["num_experts"], c["moe_intermediate_size"]
        s.norm_topk = c["norm_topk_prob"]
    s.top_k = c.get("num_experts_per_tok", 0)
    return s


def swiglu_shapes(prefix, names, width, d):
    gate, up, down = names
    return {f"{prefix}{gate}.weight": (width, d), f"{prefix}{up}.weight": (width, d),
            f"{prefix}{down}.weight": (d, width)}


def hf_tensors(c):
    """Every tensor of the checkpoint, by Hugging Face name, and its shape."""
    s, d, V = spec(c), c["hidden_size"], c["vocab_size"]
    hd, H, KV = s.head_dim, c["num_attention_heads"], c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,)}
    if not s.tied:
        shapes["lm_head.weight"] = (V, d)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (H * hd, d),
                       p + "self_attn.k_proj.weight": (KV * hd, d),
                       p + "self_attn.v_proj.weight": (KV * hd, d),
                       p + "self_attn.o_proj.weight": (d, H * hd)})
        if s.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,),
                           p + "self_attn.k_norm.weight": (hd,)})
        if s.sparse[l]:
            shapes[f"{p}{s.moe}.gate.weight"] = (s.experts, d)
            for e in range(s.experts):
                shapes.update(swiglu_shapes(f"{p}{s.moe}.experts.{e}.", s.expert_mlp,
                                            s.expert_width, d))
        else:
            shapes.update(swiglu_shapes(p + "mlp.", DENSE, c["intermediate_size"], d))
    return shapes

# ----------------------------------------------------------------------------- the reference


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_kind(c):
    rs = c.get("rope_scaling") or {}
    return rs.get("rope_type", rs.get("type", "default"))


def rope_inv_freq(c, hd):
    """transformers' ROPE_INIT_FUNCTIONS for "default", "linear" (inv_freq / factor) and
    "llama3" (_compute_llama3_parameters); all three leave attention_factor at 1."""
    inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    kind, rs = rope_kind(c), c.get("rope_scaling")
    if kind == "linear":
        return inv_freq / rs["factor"]
    if kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    assert kind == "default", kind
    return inv_freq


def llama3_regions(c, hd):
    """How many frequencies the llama3 rule keeps, blends and divides by the factor."""
    rs = c["rope_scaling"]
    wavelen = 2 * math.pi * (c["rope_theta"] ** (torch.arange(0, hd, 2) / hd))
    old = rs["original_max_position_embeddings"]
    high = int((wavelen < old / rs["high_freq_factor"]).sum())
    low = int((wavelen > old / rs["low_freq_factor"]).sum())
    return high, len(wavelen) - high - low, low


def attention(x, w, p, c, s, cos, sin):
    """Eager self-attention of modeling_llama / _mixtral / _qwen3(_moe): q/k_norm (Qwen3 only)
    per head before rotate-half RoPE, repeat_kv, causal softmax scaled by head_dim ** -0.5."""
    B, T, _ = x.shape
    H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], s.head_dim
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(B, T, H, hd)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(B, T, KV, hd)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
    if s.qk_norm:
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], c["rms_norm_eps"])
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], c["rms_norm_eps"])
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    mask = torch.full((T, T), float("-inf")).triu(1)
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1) @ v
    return att.transpose(1, 2).reshape(B, T, H * hd) @ w[p + "self_attn.o_proj.weight"].T


def swiglu(h, w, prefix, names):
    """down(silu(gate(h)) * up(h)): MixtralBlockSparseTop2MLP, LlamaMLP, Qwen3(Moe)MLP."""
    gate, up, down = names
    return (F.silu(h @ w[f"{prefix}{gate}.weight"].T) * (h @ w[f"{prefix}{up}.weight"].T)) @ \
        w[f"{prefix}{down}.weight"].T


def sparse_moe(h, w, prefix, s):
    """MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock on rows h [N, d]: softmax over all experts,
    top-k, divided by the top-k sum when norm_topk_prob (always for Mixtral). Also returns the
    router logits."""
    logits = h @ w[prefix + "gate.weight"].T
    top_w, top_i = torch.topk(torch.softmax(logits, dim=-1), s.top_k, dim=-1)
    if s.norm_topk:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in range(s.experts):
        rows, slot = (top_i == e).nonzero(as_tuple=True)
        if rows.numel():
            y = swiglu(h[rows], w, f"{prefix}experts.{e}.", s.expert_mlp)
            out.index_add_(0, rows, y * top_w[rows, slot].unsqueeze(-1))
    return out, logits


def forward(w, tokens, c):
    """The family's *ForCausalLM, eager, float64: logits and every sparse layer's router logits."""
    s, (B, T), d, eps = spec(c), tokens.shape, c["hidden_size"], c["rms_norm_eps"]
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), rope_inv_freq(c, s.head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    x = w["model.embed_tokens.weight"][tokens]
    router_logits = []
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        x = x + attention(rms_norm(x, w[p + "input_layernorm.weight"], eps), w, p, c, s, cos, sin)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps).reshape(B * T, d)
        if s.sparse[l]:
            y, logits = sparse_moe(h, w, f"{p}{s.moe}.", s)
            router_logits.append(logits)
        else:
            y = swiglu(h, w, p + "mlp.", DENSE)
        x = x + y.view(B, T, d)
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if s.tied else w["lm_head.weight"]
    return x @ head.T, router_logits


def reference(w64, tokens, targets, c):
    """ce, logits and the gradient of ce for every tensor, by autograd through forward()."""
    params = {k: v.clone().requires_grad_(True) for k, v in w64.items()}
    logits, _ = forward(params, tokens, c)
    ce = F.cross_entropy(logits.reshape(-1, c["vocab_size"]), targets.reshape(-1),
                         ignore_index=-100)
    ce.backward()
    # An expert no token chose takes no part in the graph: its gradient is zero, not None.
    grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in params.items()}
    return ce.detach(), logits.detach(), grads

# ----------------------------------------------------------------- a second, independent reading


def naive_inv_freq(c, hd):
    """The rotary frequencies one at a time, from the rules as stated rather than torch.where."""
    rs, out = c.get("rope_scaling") or {}, []
    for i in range(hd // 2):
        f = c["rope_theta"] ** (-2.0 * i / hd)
        if rope_kind(c) == "linear":
            f /= rs["factor"]
        elif rope_kind(c) == "llama3":
            old, lo, hi = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                           rs["high_freq_factor"])
            wavelen = 2 * math.pi / f
            if wavelen > old / lo:
                f /= rs["factor"]
            elif wavelen >= old / hi:
                smooth = (old / wavelen - lo) / (hi - lo)
                f = (1 - smooth) * f / rs["factor"] + smooth * f
        out.append(f)
    return torch.tensor(out)


def naive_rms(x, g, eps):
    rows = x.view(-1, x.shape[-1])
    out = [r / math.sqrt(float(r @ r) / r.numel() + eps) * g for r in rows]
    return torch.stack(out).view(x.shape)


def naive_rotate(x, pos, inv_freq):
    """RoPE as complex multiplication: pair (x_i, x_{i + hd/2}) times exp(i pos f_i)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[:, :half], x[:, half:]) * torch.polar(torch.ones(half), pos * inv_freq)
    return torch.cat((z.real, z.imag), dim=-1)


def naive_swiglu(h, w, prefix, names):
    gate, up, down = (w[f"{prefix}{n}.weight"] for n in names)
    a = gate @ h
    return down @ (a / (1 + torch.exp(-a)) * (up @ h))


def naive_moe(h, w, prefix, s):
    logits = [float(r @ h) for r in w[prefix + "gate.weight"]]
    ex = [math.exp(a - max(logits)) for a in logits]
    probs = [a / sum(ex) for a in ex]
    chosen = sorted(range(s.experts), key=lambda e: -probs[e])[:s.top_k]
    weights = [probs[e] for e in chosen]
    if s.norm_topk:
        weights = [a / sum(weights) for a in weights]
    return sum(a * naive_swiglu(h, w, f"{prefix}experts.{e}.", s.expert_mlp)
               for a, e in zip(weights, chosen))


def naive_attention(h, w, p, c, s, pos, inv_freq, cache):
    """One new token's attention over a KV cache of the positions before it and itself."""
    H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], s.head_dim
    eps = c["rms_norm_eps"]
    q = (w[p + "self_attn.q_proj.weight"] @ h).view(H, hd)
    k = (w[p + "self_attn.k_proj.weight"] @ h).view(KV, hd)
    v = (w[p + "self_attn.v_proj.weight"] @ h).view(KV, hd)
    if s.qk_norm:
        q = naive_rms(q, w[p + "self_attn.q_norm.weight"], eps)
        k = naive_rms(k, w[p + "self_attn.k_norm.weight"], eps)
    cache[0].append(naive_rotate(k, pos, inv_freq))
    cache[1].append(v)
    q, heads = naive_rotate(q, pos, inv_freq), []
    for i in range(H):
        j = i * KV // H  # the KV head query head i shares
        scores = [float(q[i] @ kk[j]) / math.sqrt(hd) for kk in cache[0]]
        ex = [math.exp(a - max(scores)) for a in scores]
        heads.append(sum(a / sum(ex) * vv[j] for a, vv in zip(ex, cache[1])))
    return w[p + "self_attn.o_proj.weight"] @ torch.cat(heads)


def naive_logits(w, tokens, c):
    """The same model decoded one token at a time with a KV cache per layer."""
    s, eps = spec(c), c["rms_norm_eps"]
    inv_freq = naive_inv_freq(c, s.head_dim)
    head = w["model.embed_tokens.weight"] if s.tied else w["lm_head.weight"]
    out = torch.zeros(*tokens.shape, c["vocab_size"])
    for b in range(tokens.shape[0]):
        caches = [([], []) for _ in range(c["num_hidden_layers"])]
        for t in range(tokens.shape[1]):
            x = w["model.embed_tokens.weight"][tokens[b, t]]
            for l, cache in enumerate(caches):
                p = f"model.layers.{l}."
                x = x + naive_attention(naive_rms(x, w[p + "input_layernorm.weight"], eps), w, p,
                                        c, s, t, inv_freq, cache)
                h = naive_rms(x, w[p + "post_attention_layernorm.weight"], eps)
                x = x + (naive_moe(h, w, f"{p}{s.moe}.", s) if s.sparse[l] else
                         naive_swiglu(h, w, p + "mlp.", DENSE))
            out[b, t] = head @ naive_rms(x, w["model.norm.weight"], eps)
    return out

# ----------------------------------------------------------------------------- checkpoints


def routing_margin(router_logits, k):
    gaps = [l.sort(-1, descending=True).values for l in router_logits]
    return min((g[:, k - 1] - g[:, k]).min().item() for g in gaps) if gaps else math.inf


def make_weights(c, seed, tokens):
    """BF16 weights (what the checkpoint holds) whose routing, if any, has a clear top-k margin."""
    for attempt in range(50):
        g = torch.Generator().manual_seed(seed + attempt)
        w = {}
        for name, shape in hf_tensors(c).items():
            if len(shape) == 1:  # norms around 1, not ones
                t = 1.0 + 0.5 * (torch.rand(shape, generator=g) - 0.5)
            else:
                t = torch.randn(shape, generator=g) * (0.5 / math.sqrt(shape[1]))
            w[name] = t.to(torch.bfloat16)
        w64 = {k: v.double() for k, v in w.items()}
        _, router = forward(w64, tokens, c)
        if routing_margin(router, c.get("num_experts_per_tok", 0)) > 1e-3:
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


def make_batch(c):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, c["vocab_size"], (2, 12), generator=g)
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -100
    targets[0, 3] = -100
    return tokens, targets

# ----------------------------------------------------------------------------- checks


class CommandFailed(Exception):
    pass


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip() or r.stdout.strip() or "(no output)").splitlines()[-1]
        command = next(a for a in cmd[1:] if a.isalpha())  # grad, train
        raise CommandFailed(f"`weightlift {command}` exited {r.returncode}: {last[:300]}")
    return r


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def report(name, problems, summary, failures):
    """One line per check, PASS or FAIL; the failures are listed again at the end."""
    failures += [f"{name}: {p}" for p in problems]
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    print(f"PASS {name}: {summary}" if not problems else f"FAIL {name}: {problems[0]}{more}",
          flush=True)


def finite_differences(w64, tokens, targets, c, grads):
    """Central differences of ce at a few elements (q/k norms, a router, an embedding row that
    is used) against autograd: worst |fd - grad| / max(|grad|, 1e-3)."""
    names = [n for n in w64 if n.endswith(("q_norm.weight", "k_norm.weight"))][:2] or \
        ["model.layers.0.self_attn.q_proj.weight"]
    names += [n for n in w64 if n.endswith(".gate.weight")][-1:] or \
        [f"model.layers.{c['num_hidden_layers'] - 1}.mlp.down_proj.weight"]
    names += ["model.embed_tokens.weight", "model.norm.weight"]
    g, worst, h = torch.Generator().manual_seed(1), 0.0, 1e-5
    for name in names:
        flat = int(tokens[0, 0]) * c["hidden_size"] if name == "model.embed_tokens.weight" else \
            int(torch.randint(0, w64[name].numel(), (1,), generator=g))
        ce = []
        for sign in (1, -1):
            w = dict(w64, **{name: w64[name].clone()})
            w[name].view(-1)[flat] += sign * h
            logits, _ = forward(w, tokens, c)
            ce.append(F.cross_entropy(logits.reshape(-1, c["vocab_size"]), targets.reshape(-1),
                                      ignore_index=-100).item())
        fd, exact = (ce[0] - ce[1]) / (2 * h), grads[name].view(-1)[flat].item()
        worst = max(worst, abs(fd - exact) / max(abs(exact), 1e-3))
    return worst, len(names)


def contrasts(c):
    """The same weights under what a loader that ignored a key would compute instead."""
    out = []
    if rope_kind(c) != "default":
        out.append(("without rope_scaling", dict(c, rope_scaling=None)))
    if rope_kind(c) == "llama3":
        out.append(("with linear rope_scaling of the same factor",
                    dict(c, rope_scaling={"rope_type": "linear",
                                          "factor": c["rope_scaling"]["factor"]})))
    if c.get("norm_topk_prob") is False:
        out.append(("with norm_topk_prob true", dict(c, norm_topk_prob=True)))
    return out


def self_check(name, c, w64, tokens, targets, ref, failures):
    """The reference against itself: naive_logits, finite differences, and contrasts."""
    _, logits, grads = ref
    s, problems, notes = spec(c), [], []
    naive = rel_err(naive_logits(w64, tokens, c), logits)
    if naive > 1e-10:
        problems.append(f"forward() and naive_logits() differ by {naive:.1e}")
    fd, n = finite_differences(w64, tokens, targets, c, grads)
    if fd > 1e-6:
        problems.append(f"autograd and finite differences differ by {fd:.1e}")
    for label, other in contrasts(c):
        change = rel_err(forward(w64, tokens, other)[0], logits)
        notes.append(f"{label} logits move {change:.1e}")
        if change < 100 * TOL:
            problems.append(f"{label}, logits move only {change:.1e}: the case cannot tell")
    if rope_kind(c) == "llama3":
        notes.append("llama3 frequencies kept/blended/divided: %d/%d/%d"
                     % llama3_regions(c, s.head_dim))
        if 0 in llama3_regions(c, s.head_dim):
            problems.append("a region of the llama3 rule is not exercised")
    layers = "".join("S" if x else "D" for x in s.sparse)
    report(name + " (reference)", problems,
           f"layers {layers}, naive forward {naive:.0e}, {n} finite differences {fd:.0e}"
           + "".join("; " + x for x in notes), failures)


def check_case(exe, tmp, name, c, failures):
    """One checkpoint: the reference's self-check, then `weightlift grad --model-dir` against it."""
    tokens, targets = make_batch(c)
    w, w64 = make_weights(c, 11, tokens)
    ref = reference(w64, tokens, targets, c)
    self_check(name, c, w64, tokens, targets, ref, failures)
    if exe is None:
        return
    d = os.path.join(tmp, name)
    write_checkpoint(d, c, w)
    batch = os.path.join(tmp, name + "-batch.safetensors")
    out = os.path.join(tmp, name + "-grad.safetensors")
    write_safetensors(batch, {"tokens": tokens, "targets": targets})
    try:
        run([exe, "--threads", "1", "grad", "--model-dir", d, "--tokens", batch, "--out", out])
    except CommandFailed as e:
        return report(name, [str(e)], "", failures)
    ours, (ce, logits, grads) = read_safetensors(out), ref
    checks = [("ce", ours["ce"].reshape(()), ce), ("logits", ours["logits"], logits)]
    problems = [f"no grad.{k} in the output" for k in grads if "grad." + k not in ours]
    checks += [("grad." + k, ours["grad." + k], g) for k, g in grads.items() if "grad." + k in ours]
    extra = [k for k in ours if k.startswith("grad.") and k[5:] not in grads]
    if extra:
        problems.append(f"gradients of tensors the checkpoint lacks: {extra[:3]}")
    for label, a, b in checks:
        if a.shape != b.shape or rel_err(a, b) > TOL:
            problems.append(f"{label}: rel err {rel_err(a, b):.2e} (shapes {tuple(a.shape)}, "
                            f"{tuple(b.shape)})")
    worst = max(checks, key=lambda x: rel_err(x[1], x[2]) if x[1].shape == x[2].shape else 1)
    report(name, problems, f"ce, logits and {len(checks) - 2} gradients within {TOL:g} "
           f"(worst {worst[0]}: {rel_err(worst[1], worst[2]):.1e})", failures)


def check_export(exe, tmp, failures):
    out = os.path.join(tmp, "run")
    brown = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "data", "brown")
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 320, (2, 16), generator=g)
    batch = os.path.join(tmp, "export-batch.safetensors")
    write_safetensors(batch, {"tokens": tokens, "targets": torch.roll(tokens, -1, dims=1)})
    try:
        run([exe, "--threads", "1", "train", "--preset", "tiny", "--steps", "3", "--batch", "2",
             "--seq", "32", "--corpus", brown, "--out", out])
        run([exe, "grad", "--config", os.path.join(out, "config.json"), "--weights",
             os.path.join(out, "model.safetensors"), "--tokens", batch, "--out",
             os.path.join(tmp, "ours.safetensors")])
        run([exe, "grad", "--model-dir", os.path.join(out, "hf"), "--tokens", batch, "--out",
             os.path.join(tmp, "hf.safetensors")])
    except CommandFailed as e:
        return report("export", [str(e)], "", failures)
    a = read_safetensors(os.path.join(tmp, "ours.safetensors"))
    b = read_safetensors(os.path.join(tmp, "hf.safetensors"))
    with open(os.path.join(out, "hf", "config.json")) as f:
        arch = json.load(f)["architectures"]
    same = torch.equal(a["logits"], b["logits"]) and torch.equal(a["ce"], b["ce"])
    report("export", [] if same else ["the hf/ checkpoint's logits differ from the run's own"],
           f"train's hf/ ({arch[0]}) reloads to logits and ce bit for bit", failures)

def check_family_export(exe, tmp, name, c, failures):
    """`train --model-dir` from a family's checkpoint, two steps on a fixed batch: its hf/ is
    the same family, carries the source's tokenizer and generation files byte for byte, and
    reloads to the run's own logits bit for bit."""
    src = os.path.join(tmp, name)
    side = {"tokenizer_config.json": '{"model_max_length": 64}\n',
            "generation_config.json": '{"bos_token_id": 1, "eos_token_id": 2}\n'}
    for f, text in side.items():
        with open(os.path.join(src, f), "w") as fh:
            fh.write(text)
    out = os.path.join(tmp, name + "-run")
    tokens, targets = make_batch(c)
    batch = os.path.join(tmp, name + "-export-batch.safetensors")
    write_safetensors(batch, {"tokens": tokens, "targets": targets})
    label = "export " + name
    try:
        run([exe, "--threads", "1", "train", "--model-dir", src, "--batch-file", batch,
             "--steps", "2", "--out", out])
        run([exe, "grad", "--config", os.path.join(out, "config.json"), "--weights",
             os.path.join(out, "model.safetensors"), "--tokens", batch, "--out",
             os.path.join(tmp, name + "-ours.safetensors")])
        run([exe, "grad", "--model-dir", os.path.join(out, "hf"), "--tokens", batch, "--out",
             os.path.join(tmp, name + "-hf.safetensors")])
    except CommandFailed as e:
        return report(label, [str(e)], "", failures)
    a = read_safetensors(os.path.join(tmp, name + "-ours.safetensors"))
    b = read_safetensors(os.path.join(tmp, name + "-hf.safetensors"))
    problems = []
    if not (torch.equal(a["logits"], b["logits"]) and torch.equal(a["ce"], b["ce"])):
        problems.append("the hf/ checkpoint's logits differ from the run's own")
    with open(os.path.join(out, "hf", "config.json")) as f:
        arch = json.load(f)["architectures"]
    if arch != c["architectures"]:
        problems.append(f"exported as {arch}, not {c['architectures']}")
    for f, text in side.items():
        path = os.path.join(out, "hf", f)
        if not os.path.exists(path) or open(path).read() != text:
            problems.append(f"{f} not carried over from the source checkpoint")
    report(label, problems, f"train --model-dir's hf/ ({arch[0]}) reloads bit for bit, "
           "tokenizer files carried", failures)


# ----------------------------------------------------------------------------- refusals


def with_config(**changes):
    """An edit of config.json; a value "<drop>" removes the key."""
    def edit(d, cfg):
        cfg.update(changes)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({k: v for k, v in cfg.items() if v != "<drop>"}, f)
    return edit


def with_tensor(name, change):
    """An edit of one tensor in whichever shard holds it; change returning None removes it from
    the shard and from the index, as if the checkpoint had never had it."""
    def edit(d, cfg):
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            index = json.load(f)
        path = os.path.join(d, index["weight_map"][name])
        t = read_safetensors(path)
        t[name] = change(t[name])
        if t[name] is None:
            del t[name], index["weight_map"][name]
            with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f)
        write_safetensors(path, t)
    return edit


def drop_shard(d, cfg):
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))


def refusals(family, c):
    """(label, edit, needle in the one line of stderr) for what the family's loader must refuse."""
    hd = spec(c).head_dim
    if family == "mixtral":
        return [
            ("another family", with_config(architectures=["DeepseekV3ForCausalLM"]),
             "architectures [\"DeepseekV3ForCausalLM\"] is not a family"),
            ("sliding window", with_config(sliding_window=4096),
             "sliding_window 4096 is not supported"),
            ("rope scaling", with_config(rope_scaling={"type": "yarn", "factor": 4.0}),
             "rope_scaling"),
            ("an unknown key", with_config(n_shared_experts=1), "key 'n_shared_experts'"),
            ("a missing shard", drop_shard,
             "model-00002-of-00002.safetensors: a shard of the checkpoint is missing"),
            ("a wrong shape", with_tensor("model.embed_tokens.weight", lambda t: t[:-1]),
             "model.embed_tokens.weight"),
            ("a wrong dtype", with_tensor("model.embed_tokens.weight", lambda t: t.to(torch.int32)),
             "dtype I32, expected a float type")]
    if family == "qwen3_moe":
        q_norm = "model.layers.0.self_attn.q_norm.weight"
        dense = "model.layers.1.mlp.down_proj.weight"  # layer 1 is in mlp_only_layers
        return [
            ("qwen3_moe sliding window", with_config(use_sliding_window=True),
             "use_sliding_window"),
            ("qwen3_moe attention bias", with_config(attention_bias=True), "attention_bias"),
            ("qwen3_moe shared expert", with_config(shared_expert_intermediate_size=32),
             "shared_expert_intermediate_size"),
            ("qwen3_moe q_norm of the wrong shape",
             with_tensor(q_norm, lambda t: t.repeat(c["num_attention_heads"])), q_norm),
            ("qwen3_moe a dense layer's tensor missing", with_tensor(dense, lambda t: None), dense)]
    if family == "qwen3":
        k_norm = "model.layers.1.self_attn.k_norm.weight"
        return [("qwen3 attention bias", with_config(attention_bias=True), "attention_bias"),
                ("qwen3 k_norm missing", with_tensor(k_norm, lambda t: None), k_norm),
                ("qwen3 q_norm of the wrong shape",
                 with_tensor("model.layers.0.self_attn.q_norm.weight", lambda t: t[: hd // 2]),
                 "model.layers.0.self_attn.q_norm.weight")]
    dense = "model.layers.1.mlp.up_proj.weight"
    return [
        ("llama yarn rope scaling",
         with_config(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 32}), "rope_scaling"),
        ("llama mlp bias", with_config(mlp_bias=True), "mlp_bias"),
        ("llama a dense layer's tensor missing", with_tensor(dense, lambda t: None), dense)]


def check_refusals(exe, tmp, family, base, failures):
    """What weightlift does not implement, and a damaged checkpoint: one clear error naming the
    file and the key or tensor, exit code 1, never a model that computes something else."""
    tokens = torch.zeros((1, 4), dtype=torch.int64)
    batch = os.path.join(tmp, "refusal-batch.safetensors")
    write_safetensors(batch, {"tokens": tokens, "targets": tokens})
    w, _ = make_weights(base, 5, tokens)
    for label, edit, needle in refusals(family, base):
        d = os.path.join(tmp, "refusal-" + label.replace(" ", "-").replace("'", ""))
        cfg = json.loads(json.dumps(base))
        write_checkpoint(d, cfg, w)
        edit(d, cfg)
        r = subprocess.run([exe, "grad", "--model-dir", d, "--tokens", batch, "--out",
                            os.path.join(d, "g.safetensors")], capture_output=True, text=True)
        # 2: what was given is wrong (InvalidArgument); 1 for any other error (docs/errors.md).
        expected = 2 if ": InvalidArgument: " in r.stderr else 1
        ok = (r.returncode == expected and needle in r.stderr and
              len(r.stderr.strip().splitlines()) == 1)
        report("refused: " + label,
               [] if ok else [f"exit {r.returncode}, stderr {r.stderr.strip()[-300:]!r}, "
                              f"expected {needle!r}"], r.stderr.strip()[:150], failures)


REFUSAL_BASES = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE, "qwen3": QWEN3, "llama": LLAMA}


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    exe = None if args[0] == "--self-check" else args[0]
    wanted = set(args[1:]) or set(FAMILIES) | {"export"}
    unknown = wanted - set(FAMILIES) - {"export"}
    if unknown:
        sys.exit(f"unknown filter {sorted(unknown)}: one of {', '.join(FAMILIES)}, export")
    failures, count = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        exported = set()
        for family, name, c in cases():
            if family in wanted:
                check_case(exe, tmp, name, c, failures)
                count += 1
                if exe is not None and family != "mixtral" and family not in exported:
                    check_family_export(exe, tmp, name, c, failures)
                    exported.add(family)
        if exe is not None and "export" in wanted:
            check_export(exe, tmp, failures)
        for family in FAMILIES:
            if exe is not None and family in wanted:
                check_refusals(exe, tmp, family, REFUSAL_BASES[family], failures)
    print(f"{count} cases; {len(failures)} failure(s)")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
