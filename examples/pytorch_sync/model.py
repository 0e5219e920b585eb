"""A small Llama written in plain PyTorch, named as Hugging Face names Llama's tensors, and the
two things weightlift needs to know about it: how an inference engine fuses its tensors (the
layout spec) and how to rebuild the model from what arrives.

Nothing here is weightlift's model: the trainer is any nn.Module, and the layout spec is the
only place the transfer learns its shapes and fusions."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping

import torch
from torch import nn

import weightlift as wl


@dataclass
class Config:
    vocab: int = 64
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim of [batch, heads, time, head_dim]."""
    t, d = x.shape[-2], x.shape[-1]
    freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = torch.arange(t, dtype=torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + half * sin


class Attention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = rotate(q), rotate(k)
        repeat = c.heads // c.kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down_proj = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)


class Llama(nn.Module):
    """model.embed_tokens, model.layers.{l}.{input_layernorm, self_attn.{q,k,v,o}_proj,
    post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm, lm_head."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        self.model = Body(c)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def generate(self, prompt: list, n: int) -> list:
        """Greedy continuation of `prompt` by `n` tokens."""
        tokens = list(prompt)
        for _ in range(n):
            logits = self(torch.tensor([tokens]))
            tokens.append(int(logits[0, -1].argmax()))
        return tokens[len(prompt):]


# ---- what weightlift needs -------------------------------------------------------------------

def layout_spec(c: Config) -> wl.LayoutSpec:
    """The engine's tensors, as vLLM holds a Llama: q, k and v fused into qkv_proj (split by
    heads under tensor parallelism), gate and up into gate_up_proj; the four matrices in fp8
    when a receiver asks for fp8, everything else bf16."""
    spec = wl.LayoutSpec("pytorch-sync-llama").params_from(Llama(c).state_dict())
    spec.tensor("model.embed_tokens.weight")
    for l in range(c.layers):
        p = f"model.layers.{l}."
        spec.tensor(p + "input_layernorm.weight")
        spec.tensor(p + "self_attn.qkv_proj.weight",
                    [p + f"self_attn.{w}_proj.weight" for w in "qkv"], split="heads",
                    head_dim=c.head_dim, dtype="fp8")
        spec.tensor(p + "self_attn.o_proj.weight", split="row", dtype="fp8")
        spec.tensor(p + "post_attention_layernorm.weight")
        spec.tensor(p + "mlp.gate_up_proj.weight", [p + "mlp.gate_proj.weight",
                                                    p + "mlp.up_proj.weight"],
                    split="column", dtype="fp8")
        spec.tensor(p + "mlp.down_proj.weight", split="row", dtype="fp8")
    spec.tensor("model.norm.weight")
    spec.tensor("lm_head.weight")
    return spec


def sources(name: str) -> list:
    """The trainer tensors a receiver tensor is made of (the fusions of layout_spec)."""
    for fused, parts in (("self_attn.qkv_proj.weight", ["self_attn.q_proj.weight",
                                                        "self_attn.k_proj.weight",
                                                        "self_attn.v_proj.weight"]),
                         ("mlp.gate_up_proj.weight", ["mlp.gate_proj.weight",
                                                      "mlp.up_proj.weight"])):
        if name.endswith(fused):
            return [name[: -len(fused)] + p for p in parts]
    return [name]


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 codes (torch.uint8; torch 1.13 has no fp8 dtype) as float32: sign, 4 exponent
    bits (bias 7), 3 mantissa bits, subnormals at exponent 0."""
    q = q.to(torch.int32)
    sign = torch.where(q >= 128, -1.0, 1.0)
    e, m = (q >> 3) & 15, (q & 7).to(torch.float32)
    normal = (1 + m / 8) * torch.pow(2.0, (e - 7).to(torch.float32))
    return sign * torch.where(e == 0, m / 8 * 2.0 ** -6, normal)


def block_scales(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Each element's scale of fp8 tensor `name`: one per 128 x 128 block, in `<name>.scale`."""
    rows, cols = weights[name].shape
    scale = weights[name + ".scale"]
    return scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def dequantized(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Receiver tensor `name` in float32: bf16 widened, or fp8 codes times their scales."""
    t = weights[name]
    if name + ".scale" not in weights.keys():
        return t.float()
    return e4m3_to_float(t) * block_scales(weights, name)


def rebuilt(c: Config, weights: Mapping[str, torch.Tensor]) -> Llama:
    """A Llama whose parameters are what a receiver holds: the fused tensors split back."""
    model = Llama(c)
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    sd: Dict[str, torch.Tensor] = {}
    for name in weights.keys():
        if name.endswith(".scale"):
            continue
        parts = sources(name)
        pieces = dequantized(weights, name).split([shapes[p][0] for p in parts])
        for p, piece in zip(parts, pieces):
            sd[p] = piece.reshape(shapes[p]).clone()
    model.load_state_dict(sd)
    return model
