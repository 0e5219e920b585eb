#!/usr/bin/env python3
"""Memory before allocation, through the real command: a config, a plan or a sweep whose
size would exceed the machine's memory (or --max-memory) is refused with the estimate in the
message before anything is allocated, never an uncaught bad_alloc, an OOM kill or minutes of
growing.

Every case runs under an 8 GiB address-space limit, so that a tree which allocates first
fails fast instead of taking the shared machine's memory; the refusal must name the estimate
("needs at least") either way.

Run by CTest with the path of the weightlift binary (tests/cli/harness.py has the rules)."""
import json
import os
import re
import shutil
import sys
import tempfile

from harness import TINY, Suite, write_tiny_model
from outputs import TRAIN

LIMIT = 8 << 30


def huge_configs(s, d, cfg, w, batch):
    for key, value in (("hidden_size", 1000000000), ("num_experts", 100000000),
                       ("vocab_size", 2000000000)):
        path = os.path.join(d, f"huge_{key}.json")
        json.dump(dict(TINY, **{key: value}), open(path, "w"))
        s.expect_error(f"generate with {key} {value}",
                       ["generate", "--config", path, "--weights", w], "needs at least",
                       path, memory_limit=LIMIT)
        s.expect_error(f"grad with {key} {value}",
                       ["grad", "--config", path, "--weights", w, "--tokens", batch, "--out",
                        os.path.join(d, "g.safetensors")], "needs at least", memory_limit=LIMIT)
        s.expect_error(f"train with {key} {value}",
                       ["train"] + TRAIN + ["--config", path, "--steps", "1", "--batch-file",
                                            batch, "--out", os.path.join(d, "run")],
                       "needs at least", memory_limit=LIMIT)
    # The estimate says what the memory is for: here the rotary tables and the KV cache, not
    # the 259k parameters.
    path = os.path.join(d, "huge_max_seq_len.json")
    json.dump(dict(TINY, max_seq_len=10**12), open(path, "w"))
    s.expect_error("generate with max_seq_len 1e12", ["generate", "--config", path, "--weights",
                   w], "for the rotary tables of 1000000000000 positions", "KV cache",
                   memory_limit=LIMIT)
    # model-info only counts: it must answer, not build a billion-expert parameter table.
    path = os.path.join(d, "huge_num_experts.json")
    code, out, err = s.run([s.exe, "model-info", "--config", path], memory_limit=LIMIT)
    s.report("model-info of a 100M-expert config answers", out.splitlines()[0] if out else err,
             [] if code == 0 and "total parameters" in out else [f"exit {code}: {err.strip()}"])
    # Its per-rank table lays out every tensor: refused before, with the count.
    s.expect_error("model-info's per-rank table of a 100M-expert config",
                   ["model-info", "--config", path, "--dp", "2"], "laying out the parameter tensors",
                   "600000014 tensors", memory_limit=LIMIT)


def budgets(s, d, cfg, w, batch):
    s.expect_error("train tiny under --max-memory 1M",
                   ["--max-memory", "1M", "train"] + TRAIN +
                   ["--steps", "1", "--batch-file", batch, "--out", os.path.join(d, "run")],
                   "needs at least", "--max-memory", memory_limit=LIMIT)
    s.expect_error("train --max-memory after the subcommand",
                   ["train", "--max-memory", "1M"] + TRAIN +
                   ["--steps", "1", "--batch-file", batch, "--out", os.path.join(d, "run")],
                   "needs at least", "--max-memory", memory_limit=LIMIT)
    s.expect_error("generate under --max-memory 1M",
                   ["--max-memory", "1M", "generate", "--config", cfg, "--weights", w],
                   "needs at least", memory_limit=LIMIT)
    s.expect_error("bench train medium with a million rows",
                   ["bench", "train", "--preset", "medium", "--batch", "1000000", "--seq", "512"],
                   "needs at least", memory_limit=LIMIT)
    s.expect_error("--max-memory 0", ["--max-memory", "0", "model-info"], "--max-memory")
    # Every size an rl option sets counts, on every process, before it connects: the warm
    # start's batch (its logits and its tokens) and the held-out set a lone worker generates.
    rl = ["rl", "--preset", "tiny", "--task", "sort", "--difficulty", "3",
          "--out", os.path.join(d, "rl")]
    s.expect_error("rl --sft-batch 16384 under --max-memory 256M",
                   ["--max-memory", "256M"] + rl + ["--sft-batch", "16384"], "needs at least",
                   "a batch of 16384 rows", memory_limit=LIMIT)
    s.expect_error("rl --sft-batch 1048576", rl + ["--sft-batch", "1048576"], "needs at least",
                   "the activations and logits of 1048576 x", memory_limit=LIMIT)
    s.expect_error("rl --eval-problems 100000 under --max-memory 64M",
                   ["--max-memory", "64M"] + rl + ["--eval-problems", "100000"], "needs at least",
                   "KV cache", memory_limit=LIMIT)


def plans_and_sweeps(s, d, cfg, w, batch):
    s.expect_error("transfer plan for a million receivers",
                   ["transfer", "plan", "--preset", "medium", "--trainers", "2", "--receivers",
                    "1048576", "--tp", "2"], "needs at least", "receivers",
                   memory_limit=LIMIT)
    s.expect_error("transfer plan for a million trainers",
                   ["transfer", "plan", "--preset", "medium", "--trainers", "1048576",
                    "--receivers", "2"], "needs at least", memory_limit=LIMIT)
    s.expect_error("transfer simulate of a million GPUs under --max-memory 64M",
                   ["--max-memory", "64M", "transfer", "simulate", "--trainers", "1048576",
                    "--receivers", "1048576", "--no-sensitivity"], "needs at least",
                   "per-rank schedule state", memory_limit=LIMIT)
    s.expect_error("transfer simulate of a million GPUs without --max-memory",
                   ["transfer", "simulate", "--trainers", "1048576", "--receivers", "1048576",
                    "--no-sensitivity"], "needs at least", "per-rank schedule state",
                   memory_limit=LIMIT)
    s.expect_error("fault simulate of a model too large for the machine",
                   ["fault", "simulate", "--preset", "seed-6.9b", "--out",
                    os.path.join(d, "fault_run")], "needs at least", memory_limit=LIMIT)
    s.expect_error("bench collectives up to 1 TiB",
                   ["bench", "collectives", "--ops", "allreduce", "--max-bytes", "1T"],
                   "needs at least", "--max-bytes", memory_limit=LIMIT)


def activation_plans(s, d, cfg, w, batch):
    """model-info's activations per rank: GPipe keeps every micro-batch in flight on every
    stage, 1F1B p - s on stage s, ZB p - s + 1, and checkpointing holds less per micro-batch."""
    def table(*extra):
        code, out, err = s.run([s.exe, "model-info", "--preset", "small", "--pp", "4", "--batch",
                                "8", "--micro-batches", "8"] + list(extra))
        rows = out.split("activations per rank:")[-1].splitlines()
        stages = [r.split() for r in rows if r.strip()[:1].isdigit()]
        unit = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
        return code, err, [(float(r[1]) * unit[r[2]], int(r[3])) for r in stages]

    for schedule, want in (("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1]), ("zb", [5, 4, 3, 2])):
        code, err, stages = table("--pp-schedule", schedule)
        got = [flight for _, flight in stages]
        s.report(f"model-info --pp 4 --micro-batches 8 --pp-schedule {schedule}: in flight",
                 str(got), [] if code == 0 and got == want else [f"exit {code} {err} {got}"])
    _, _, plain = table()
    code, err, kept = table("--checkpointing")
    less = len(plain) == 4 and len(kept) == 4 and all(k[0] < p[0] for k, p in zip(kept, plain))
    s.report("model-info --checkpointing holds less per micro-batch on every stage",
             f"{[p[0] / 1e6 for p in plain]} -> {[k[0] / 1e6 for k in kept]} MB",
             [] if code == 0 and less else [f"exit {code} {err}"])


def expert_plans(s, d, cfg, w, batch):
    """model-info --ep: a rank holds its own experts only, so DDP x EP 4 keeps less than DDP
    on 4 ranks; FSDP already cuts every expert, so EP does not change its total."""
    def total(*extra):
        code, out, err = s.run([s.exe, "model-info", "--preset", "small", "--dp", "4"] +
                               list(extra))
        rows = [r for r in out.splitlines() if r.strip()[:1].isdigit()]
        unit = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
        # stage, units, then weights, gradients, AdamW m+v, total and largest unit in bytes
        sizes = re.findall(r"([0-9.]+) (B|kB|MB|GB|TB)\b", rows[0]) if rows else []
        return code, err, float(sizes[3][0]) * unit[sizes[3][1]] if len(sizes) == 5 else 0.0
    code, err, ddp = total()
    code_ep, err_ep, ddp_ep = total("--ep", "4")
    s.report("model-info --dp 4 --ep 4 holds less than --dp 4 (ddp)",
             f"{ddp / 1e6:.0f} MB -> {ddp_ep / 1e6:.0f} MB",
             [] if code == 0 and code_ep == 0 and 0 < ddp_ep < ddp / 3 else
             [f"exit {code} {err} / {code_ep} {err_ep}"])
    _, _, fsdp = total("--dp-mode", "fsdp")
    code, err, fsdp_ep = total("--dp-mode", "fsdp", "--ep", "4")
    s.report("model-info --dp-mode fsdp --ep 4 holds what fsdp does",
             f"{fsdp / 1e6:.1f} MB, {fsdp_ep / 1e6:.1f} MB",
             [] if code == 0 and fsdp > 0 and abs(fsdp_ep - fsdp) < 0.01 * fsdp else
             [f"exit {code} {err}"])


def tensor_plans(s, d, cfg, w, batch):
    """model-info --tp: a rank holds its heads' and ffn rows' slices, so TP 2 keeps about half
    of one rank's model and TP 4 about a quarter (the embedding, head, norms and routers stay
    whole on every rank); its activations shrink too."""
    def total(*extra):
        code, out, err = s.run([s.exe, "model-info", "--preset", "small"] + list(extra))
        rows = [r for r in out.splitlines() if r.strip()[:1].isdigit()]
        unit = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
        sizes = re.findall(r"([0-9.]+) (B|kB|MB|GB|TB)\b", rows[0]) if rows else []
        return code, err, float(sizes[3][0]) * unit[sizes[3][1]] if len(sizes) == 5 else 0.0
    code, err, one = total("--dp", "1")
    code2, err2, tp2 = total("--tp", "2")
    code4, err4, tp4 = total("--tp", "4")
    s.report("model-info --tp 2 and --tp 4 hold about 1/2 and 1/4 of one rank's state",
             f"{one / 1e6:.0f} MB -> {tp2 / 1e6:.0f} MB -> {tp4 / 1e6:.0f} MB",
             [] if code == code2 == code4 == 0 and one / 2 <= tp2 < 0.52 * one and
             one / 4 <= tp4 < 0.27 * one else [f"exit {code} {err} / {code2} {err2} / {code4} {err4}"])


def main():
    s = Suite(sys.argv[1], tempfile.mkdtemp(prefix="wl-memory-"))
    try:
        for group in (huge_configs, budgets, plans_and_sweeps, activation_plans, expert_plans,
                      tensor_plans):
            d = tempfile.mkdtemp(dir=s.scratch)
            cfg, w, batch = write_tiny_model(d)
            group(s, d, cfg, w, batch)
    finally:
        shutil.rmtree(s.scratch, ignore_errors=True)
    s.finish()


if __name__ == "__main__":
    main()
