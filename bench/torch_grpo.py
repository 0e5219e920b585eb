#!/usr/bin/env python3
"""A synchronous GRPO loop in PyTorch eager: what a user would run instead of `weightlift rl`
(bench/compare_rl.py times the two in turn). One process does everything, step after step:

  generate   draw `prompts` problems of the task (rl/tasks.cc's prompt format, distribution and
             held-out split), repeat each G times, and sample all prompts * G rows together with
             a KV cache: left-padded prefill, then one token per row per step, temperature 1, no
             top-k/top-p, until every row has produced the end token or the answer's length + 1
             tokens (rl/trainer.cc's generation options); the sampled token's log-probability kept. Score by the
             task's rules, GRPO advantages per group (mean, unbiased std + 1e-6; a flat group 0).
  train      rows prompt + completion right-padded with the end token to
             1 + max prompt + max answer + 1 positions (rl/policy_step.cc), one forward and
             backward of the decoupled clipped loss (rl/policy_loss.h: ratio exp(logp - logp_old)
             with logp_old = logp detached, so exactly 1 on this single pass; clip 0.2/0.28;
             truncated importance weight min(exp(logp_old - logp_mu), 2); summed over completion
             tokens and divided by their global count) plus the router's aux and z losses as in
             pretraining, global-norm clipping at 1, one AdamW step (betas 0.9/0.95, eps 1e-8,
             weight decay 0.1 on matrices only: train/adamw.h's defaults), f32.

The model is tests/reference/torch_moe.py (DESIGN.md's model written independently in PyTorch),
imported; only the cached, left-padded attention for generation is written here, from the same
formulas. Weights are drawn as model/params.cc draws them (normal 0.02, o_proj and down_proj
scaled by 1/sqrt(2 layers), norm gains 1), from torch's generator.

Prints one JSON object: per-step generate_s and train_s, tokens generated per step, the CPU ISA.
Usage: bench/torch_grpo.py --preset tiny --steps 6 --threads 1 [--weightlift PATH] [--check]
"""
import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "reference"))
import torch_moe as ref  # noqa: E402

# model/config.cc's presets (the keys DESIGN.md's config.json has); checked against
# `weightlift model-info` when --weightlift is given, so a preset that changes is noticed.
_COMMON = {"rope_theta": 10000.0, "rope_ntk_alpha": 1.0, "rms_eps": 1e-5, "norm_topk": True,
           "aux_loss_alpha": 0.01, "z_loss_beta": 0.0, "tie_embeddings": False}
PRESETS = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 1,
             "head_dim": 16, "num_experts": 4, "top_k": 2, "ffn_dim": 128, "vocab_size": 320,
             "max_seq_len": 128, **_COMMON},
    "small": {"hidden_size": 256, "num_layers": 6, "num_heads": 8, "num_kv_heads": 1,
              "head_dim": 32, "num_experts": 8, "top_k": 2, "ffn_dim": 512, "vocab_size": 320,
              "max_seq_len": 256, **_COMMON},
}

BOS, EOS, IGNORE = 256, 257, -100  # train/tokenizer.h, kernels::kIgnoreIndex


def check_preset(weightlift, name, c):
    """Our binary's description of the preset must match the dictionary above."""
    out = subprocess.run([weightlift, "model-info", "--preset", name], check=True,
                         capture_output=True, text=True).stdout
    m = re.search(r"d (\d+), (\d+) layers, (\d+) heads \((\d+) kv\) x (\d+), (\d+) experts "
                  r"top-(\d+) of ffn (\d+), vocab (\d+)", out)
    if not m:
        sys.exit(f"torch_grpo: cannot read `weightlift model-info --preset {name}`:\n{out}")
    keys = ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
            "top_k", "ffn_dim", "vocab_size"]
    theirs = dict(zip(keys, map(int, m.groups())))
    ours = {k: c[k] for k in keys}
    if theirs != ours:
        sys.exit(f"torch_grpo: preset {name} differs from weightlift's: {ours} vs {theirs}")


# ---- the task (rl/tasks.cc) -------------------------------------------------------------

def fnv1a(s):
    h = 0xcbf29ce484222325
    for ch in s.encode():
        h = ((h ^ ch) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


class Task:
    """add, sort, reverse: prompt format, distribution, held-out split and reward of tasks.cc."""

    def __init__(self, kind, difficulty, format_reward):
        self.kind, self.d, self.format_reward = kind, difficulty, format_reward

    def _number(self, rng):
        n = 1 + rng.randrange(self.d)
        return "".join(str(1 + rng.randrange(9) if i == 0 and n > 1 else rng.randrange(10))
                       for i in range(n))

    def _draw(self, rng):
        if self.kind == "add":
            a, b = self._number(rng), self._number(rng)
            return a + "+" + b + "=", str(int(a) + int(b))
        n = 1 + rng.randrange(self.d)
        if self.kind == "sort":
            digits = "".join(str(rng.randrange(10)) for _ in range(n))
            return "sort " + digits + "=", "".join(sorted(digits))
        word = "".join(chr(ord("a") + rng.randrange(26)) for _ in range(n))
        return "rev " + word + "=", word[::-1]

    def sample(self, rng):
        while True:  # the held-out split (hash % 8 == 0) is never trained on
            p = self._draw(rng)
            if fnv1a(p[0]) % 8 != 0:
                return p

    def max_prompt_bytes(self):
        return {"add": 2 * self.d + 2, "sort": self.d + 6, "reverse": self.d + 5}[self.kind]

    def max_answer_bytes(self):
        return self.d + 1 if self.kind == "add" else self.d

    def _alphabet(self, ch):
        return "a" <= ch <= "z" if self.kind == "reverse" else "0" <= ch <= "9"

    def reward(self, answer, completion):
        """completion: the sampled token ids (the end token last when produced)."""
        ended = bool(completion) and completion[-1] == EOS
        body = completion[:-1] if ended else completion
        if any(t < 0 or t > 255 for t in body):  # a special token inside: not text
            return 0.0
        text = bytes(body).decode("latin-1")
        if ended and text == answer:
            return 1.0
        well_formed = ended and text != "" and all(self._alphabet(ch) for ch in text)
        return self.format_reward if well_formed else 0.0


def encode(text):
    return [BOS] + list(text.encode())


def group_advantages(rewards, eps=1e-6):
    g = len(rewards)
    if g < 2 or all(r == rewards[0] for r in rewards):
        return [0.0] * g
    mean = sum(rewards) / g
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (g - 1))
    return [(r - mean) / (std + eps) for r in rewards]


# ---- the model's weights and its cached forward for generation ---------------------------

def init_params(c, gen):
    residual = 1.0 / math.sqrt(2.0 * c["num_layers"])
    params = {}
    for name, shape in ref.param_shapes(c).items():
        if len(shape) == 1:
            t = torch.ones(shape)
        else:
            std = 0.02 * (residual if name.endswith(("o_proj.weight", "down_proj.weight")) else 1)
            t = std * torch.randn(shape, generator=gen)
        params[name] = t.requires_grad_(True)
    return params


def rope_table(c):
    """cos, sin [max_seq_len, head_dim] with torch_moe.rope's base and rotate-half layout."""
    dh = c["head_dim"]
    base = c["rope_theta"] * c["rope_ntk_alpha"] ** (dh / (dh - 2))
    inv_freq = base ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    ang = torch.arange(c["max_seq_len"], dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (torch.cat([ang.cos(), ang.cos()], -1).float(),
            torch.cat([ang.sin(), ang.sin()], -1).float())


def rope_at(x, cos, sin):
    """x [B, T, h, Dh]; cos, sin [B, T, Dh] gathered at each row's own positions."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, :, None, :] + rot * sin[:, :, None, :]


class KvCache:
    def __init__(self, c, rows, length):
        shape = (rows, c["num_kv_heads"], length, c["head_dim"])
        self.k = [torch.zeros(shape) for _ in range(c["num_layers"])]
        self.v = [torch.zeros(shape) for _ in range(c["num_layers"])]
        self.used = 0


def cached_attention(x, w, p, c, cache, layer, cos, sin, key_ok):
    """x [B, T, d] new tokens at positions given by cos/sin; appends their k, v to the cache
    and attends causally over everything cached; key_ok [B, used + T] masks the left padding."""
    B, T, _ = x.shape
    H, Hkv, Dh = c["num_heads"], c["num_kv_heads"], c["head_dim"]
    q = (x @ w[p + "attn.q_proj.weight"].T).view(B, T, H, Dh)
    k = (x @ w[p + "attn.k_proj.weight"].T).view(B, T, Hkv, Dh)
    v = (x @ w[p + "attn.v_proj.weight"].T).view(B, T, Hkv, Dh)
    q, k = rope_at(q, cos, sin), rope_at(k, cos, sin)
    a, b = cache.used, cache.used + T
    cache.k[layer][:, :, a:b] = k.transpose(1, 2)
    cache.v[layer][:, :, a:b] = v.transpose(1, 2)
    rep = H // Hkv  # query head h reads kv head h // rep
    kk = cache.k[layer][:, :, :b].repeat_interleave(rep, dim=1)  # [B, H, b, Dh]
    vv = cache.v[layer][:, :, :b].repeat_interleave(rep, dim=1)
    s = q.transpose(1, 2) @ kk.transpose(-1, -2) / math.sqrt(Dh)  # [B, H, T, b]
    causal = torch.ones(T, b, dtype=torch.bool).tril(diagonal=a)
    # Every query also sees itself, so a padding position's softmax is not over nothing (NaN
    # there would reach the real rows through 0 * NaN in the value product).
    itself = torch.zeros(T, b, dtype=torch.bool)
    itself[torch.arange(T), a + torch.arange(T)] = True
    allowed = (causal[None, None] & key_ok[:, None, None, :b]) | itself[None, None]
    s = s.masked_fill(~allowed, float("-inf"))
    o = (torch.softmax(s, -1) @ vv).transpose(1, 2).reshape(B, T, H * Dh)
    return o @ w[p + "attn.o_proj.weight"].T


def cached_forward(w, c, cache, tokens, positions, key_ok, table):
    """Logits [B, V] of each row's last new token."""
    eps = c["rms_eps"]
    cos, sin = table[0][positions], table[1][positions]
    x = w["embed.weight"][tokens]
    for l in range(c["num_layers"]):
        p = f"layers.{l}."
        h = x + cached_attention(ref.rmsnorm(x, w[p + "attn_norm.weight"], eps), w, p, c, cache,
                                 l, cos, sin, key_ok)
        m, _, _ = ref.moe(ref.rmsnorm(h, w[p + "moe_norm.weight"], eps), w, p, c)
        x = h + m
    cache.used += tokens.shape[1]
    x = ref.rmsnorm(x[:, -1], w["norm.weight"], eps)
    return x @ w["lm_head.weight"].T


@torch.no_grad()
def generate(w, c, prompts, max_new, table, gen):
    """Samples every row at temperature 1 until the end token or max_new tokens; returns the
    completions (the end token kept) and each token's log-probability."""
    B = len(prompts)
    L = max(len(p) for p in prompts)
    tokens = torch.full((B, L), EOS, dtype=torch.long)
    key_ok = torch.zeros(B, L + max_new, dtype=torch.bool)
    for r, p in enumerate(prompts):
        tokens[r, L - len(p):] = torch.tensor(p)
        key_ok[r, L - len(p):] = True
    positions = (key_ok[:, :L].long().cumsum(1) - 1).clamp(min=0)
    cache = KvCache(c, B, L + max_new)
    logits = cached_forward(w, c, cache, tokens, positions, key_ok, table)
    next_pos = positions[:, -1:] + 1
    out = torch.empty(B, max_new, dtype=torch.long)
    logp = torch.empty(B, max_new)
    done = torch.zeros(B, dtype=torch.bool)
    steps = 0
    for t in range(max_new):
        lp = torch.log_softmax(logits, -1)
        tok = torch.multinomial(lp.exp(), 1, generator=gen)  # [B, 1]
        out[:, t] = tok[:, 0]
        logp[:, t] = lp.gather(1, tok)[:, 0]
        steps = t + 1
        done |= tok[:, 0] == EOS
        if bool(done.all()) or t + 1 == max_new:
            break
        key_ok[:, L + t] = True
        logits = cached_forward(w, c, cache, tok, next_pos, key_ok, table)
        next_pos = next_pos + 1
    completions, logprobs = [], []
    out, logp = out[:, :steps].tolist(), logp[:, :steps].tolist()
    for r in range(B):
        n = out[r].index(EOS) + 1 if EOS in out[r] else steps
        completions.append(out[r][:n])
        logprobs.append(logp[r][:n])
    return completions, logprobs


# ---- the policy step ---------------------------------------------------------------------

def train_forward(w, c, tokens):
    """Logits [B, T, V] and the router's aux + z losses, torch_moe.forward without its CE."""
    eps, L = c["rms_eps"], c["num_layers"]
    x = w["embed.weight"][tokens]
    aux_sum, z_sum = 0.0, 0.0
    for l in range(L):
        p = f"layers.{l}."
        h = x + ref.attention(ref.rmsnorm(x, w[p + "attn_norm.weight"], eps), w, p, c)
        m, aux, z = ref.moe(ref.rmsnorm(h, w[p + "moe_norm.weight"], eps), w, p, c)
        x = h + m
        aux_sum, z_sum = aux_sum + aux, z_sum + z
    x = ref.rmsnorm(x, w["norm.weight"], eps)
    router = c["aux_loss_alpha"] * aux_sum / L + c["z_loss_beta"] * z_sum / L
    return x @ w["lm_head.weight"].T, router


def policy_step(w, c, opt, samples, seq, a):
    """samples: (prompt ids, completion ids, logprobs, advantage). Returns the loss."""
    B = len(samples)
    tokens = torch.full((B, seq), EOS, dtype=torch.long)
    targets = torch.full((B, seq), IGNORE, dtype=torch.long)
    logp_mu = torch.zeros(B, seq)
    adv = torch.zeros(B, seq)
    for i, (prompt, comp, lps, advantage) in enumerate(samples):
        p, n = len(prompt), len(comp)
        row = prompt + comp[:-1]
        tokens[i, :len(row)] = torch.tensor(row)
        targets[i, p - 1:p - 1 + n] = torch.tensor(comp)
        logp_mu[i, p - 1:p - 1 + n] = torch.tensor(lps)
        adv[i, p - 1:p - 1 + n] = advantage
    mask = targets != IGNORE
    count = max(int(mask.sum()), 1)
    opt.zero_grad(set_to_none=True)
    logits, router = train_forward(w, c, tokens)
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    old = logp.detach()
    ratio = torch.exp(logp - old)
    weight = torch.exp(old - logp_mu).clamp(max=a.tis_cap) if a.tis_cap > 0 else 1.0
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - a.clip_low, 1 + a.clip_high) * adv
    objective = torch.minimum(unclipped, clipped)
    loss = -(weight * objective * mask).sum() / count + router
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(w.values()), 1.0)
    opt.step()
    return float(loss)


def check(c, table, gen):
    """Verification, separate from timing: the cached, left-padded forward equals
    torch_moe.forward on each unpadded row, and the reward and advantage rules give tasks.cc's
    and policy_loss.cc's values on hand-made cases. Exits non-zero on a mismatch."""
    w = {k: v.detach() for k, v in init_params(c, gen).items()}
    prompts = [encode("sort 5=")[:n] for n in (3, 8)] + [encode("sort 9130=")]
    feed = [[5, 9, EOS], [48, 49, 50], [257, 100, 1]]  # a token per step per row
    B, L = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((B, L), EOS, dtype=torch.long)
    key_ok = torch.zeros(B, L + len(feed[0]), dtype=torch.bool)
    for r, p in enumerate(prompts):
        tokens[r, L - len(p):] = torch.tensor(p)
        key_ok[r, L - len(p):] = True
    pos = (key_ok[:, :L].long().cumsum(1) - 1).clamp(min=0)
    cache = KvCache(c, B, L + len(feed[0]))
    worst = 0.0
    with torch.no_grad():
        logits = cached_forward(w, c, cache, tokens, pos, key_ok, table)
        for t in range(len(feed[0]) + 1):
            for r in range(B):
                row = torch.tensor([prompts[r] + feed[r][:t]])
                full = ref.forward(w, row, torch.zeros_like(row), c)[0][0, -1]
                worst = max(worst, float((full - logits[r]).abs().max()))
            if t == len(feed[0]):
                break
            key_ok[:, L + t] = True
            pos = pos[:, -1:] + 1
            logits = cached_forward(w, c, cache, torch.tensor([[f[t]] for f in feed]), pos,
                                    key_ok, table)
    # f32 logits of order 1 through a few layers in another association order: 1e-4 is
    # hundreds of ulps, while a wrong position or mask moves them by 1e-2 or more.
    ok = worst < 1e-4
    task = Task("sort", 3, 0.1)
    cases = [("123", [49, 50, 51, EOS], 1.0), ("123", [49, 51, 50, EOS], 0.1),
             ("123", [49, 50, 51], 0.0), ("123", [EOS], 0.0), ("123", [49, 256, EOS], 0.0),
             ("123", [97, EOS], 0.0)]
    for answer, completion, want in cases:
        got = task.reward(answer, completion)
        if got != want:
            print(f"torch_grpo --check: reward({answer!r}, {completion}) = {got}, want {want}")
            ok = False
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])  # mean 0.25, unbiased std 0.5
    if max(abs(x - y) for x, y in zip(adv, [0.75 / (0.5 + 1e-6)] + [-0.25 / (0.5 + 1e-6)] * 3)) \
            > 1e-12 or group_advantages([0.1, 0.1]) != [0.0, 0.0]:
        print(f"torch_grpo --check: advantages {adv}")
        ok = False
    print(json.dumps({"check": "ok" if ok else "FAILED", "cached_vs_full_max_abs": worst}))
    sys.exit(0 if ok else 1)


def cpu_isa():
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    for isa in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
        if isa in flags:
            return isa
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--task", choices=["add", "sort", "reverse"], default="sort")
    ap.add_argument("--difficulty", type=int, default=3)
    ap.add_argument("--format-reward", type=float, default=0.1)
    ap.add_argument("--prompts", type=int, default=8, help="groups per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--clip-low", type=float, default=0.2)
    ap.add_argument("--clip-high", type=float, default=0.28)
    ap.add_argument("--tis-cap", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--weightlift", help="check the preset against this binary's model-info")
    ap.add_argument("--check", action="store_true",
                    help="verify the cached generation and the reward rules, then exit")
    a = ap.parse_args()
    c = PRESETS[a.preset]
    if a.weightlift:
        check_preset(a.weightlift, a.preset, c)
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(a.seed)
    rng = random.Random(a.seed)
    task = Task(a.task, a.difficulty, a.format_reward)
    seq = 1 + task.max_prompt_bytes() + task.max_answer_bytes() + 1
    max_new = task.max_answer_bytes() + 1
    w = init_params(c, gen)
    decay = [t for t in w.values() if t.dim() >= 2]
    no_decay = [t for t in w.values() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    table = rope_table(c)
    if a.check:
        check(c, table, gen)
    steps = []
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        problems = [task.sample(rng) for _ in range(a.prompts)]
        prompts = [encode(p) for p, _ in problems for _ in range(a.group)]
        completions, logprobs = generate(w, c, prompts, max_new, table, gen)
        samples, rewards = [], []
        for i, (_, answer) in enumerate(problems):
            rows = range(i * a.group, (i + 1) * a.group)
            r = [task.reward(answer, completions[k]) for k in rows]
            rewards += r
            for k, advantage in zip(rows, group_advantages(r)):
                samples.append((prompts[k], completions[k], logprobs[k], advantage))
        t1 = time.perf_counter()
        loss = policy_step(w, c, opt, samples, seq, a)
        t2 = time.perf_counter()
        steps.append({"step": step, "generate_s": t1 - t0, "train_s": t2 - t1,
                      "tokens": sum(len(x) for x in completions),
                      "reward_mean": sum(rewards) / len(rewards), "loss": loss})
    print(json.dumps({"impl": "pytorch-eager", "torch": torch.__version__, "preset": a.preset,
                      "task": a.task, "difficulty": a.difficulty, "prompts": a.prompts,
                      "group": a.group, "max_new_tokens": max_new, "seq": seq,
                      "threads": torch.get_num_threads(), "isa": cpu_isa(), "steps": steps}))


if __name__ == "__main__":
    main()
