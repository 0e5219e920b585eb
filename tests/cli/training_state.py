#!/usr/bin/env python3
"""Training state you can trust, through the real command: a run whose loss or weights go
non-finite stops with an error naming the step and keeps its last good checkpoint (an f16 run
may skip updates, but not many in a row); a resume verifies every checksum, refuses a state
outside the schedule or with moments that are not finite or a negative v, refuses changed
hyperparameters unless told (naming them), and refuses a checkpoint format it cannot verify.

Tampered checkpoints are made here with their checksums recomputed (XXH3-64 through
libxxhash's C API by ctypes, the canonicalisation written from docs/formats.md), so the case
reaches the check it is about rather than the checksum.

Run by CTest with the path of the weightlift binary (tests/cli/harness.py has the rules)."""
import ctypes
import json
import os
import shutil
import struct
import sys
import tempfile

import torch

from harness import TINY, Suite, write_tiny_model
from outputs import TRAIN, make_run

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
import torch_moe as ref  # noqa: E402

_xxh = ctypes.CDLL("libxxhash.so.0")
_xxh.XXH3_64bits.restype = ctypes.c_uint64
_xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def xxh3(data):
    return _xxh.XXH3_64bits(data, len(data))


def seal_state(path, state):
    """Writes state.json as the format says: 2-space JSON, then state_checksum over the text
    with its 16 digits as zeros."""
    state["state_checksum"] = "0" * 16
    text = json.dumps(state, indent=1) + "\n"
    text = text.replace('"state_checksum": "' + "0" * 16,
                        '"state_checksum": "' + "%016x" % xxh3(text.encode()))
    open(path, "w").write(text)


def set_first_element(path, name, value):
    """Writes `value` over the first f32 of tensor `name` in a checkpoint's tensor file, and
    its checksum into the file's metadata (same length, so the header keeps its size);
    returns the file's digest as state.json records it (docs/formats.md)."""
    data = bytearray(open(path, "rb").read())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    begin, end = header[name]["data_offsets"]
    at = 8 + n + begin
    data[at:at + 4] = struct.pack("<f", value)
    meta = header["__metadata__"]
    old = meta["xxh3." + name]
    new = "%016x" % xxh3(bytes(data[8 + n + begin:8 + n + end]))
    meta["xxh3." + name] = new
    text = data[8:8 + n].decode()
    data[8:8 + n] = text.replace(f'"xxh3.{name}":"{old}"', f'"xxh3.{name}":"{new}"').encode()
    open(path, "wb").write(data)
    lines = "".join(f"{k[5:]} {v}\n" for k, v in sorted(meta.items()) if k.startswith("xxh3."))
    return "%016x" % xxh3(lines.encode())


def run_dirs(s, d, batch):
    run = os.path.join(d, "run")
    make_run(s, batch, run)
    return run, os.path.join(run, "checkpoint-4")


def copy_of(d, run, name):
    other = os.path.join(d, name)
    shutil.copytree(run, other)
    return other, os.path.join(other, "checkpoint-4")


def diverging(s, d, cfg, w, batch):
    train = ["train"] + TRAIN + ["--batch-file", batch]
    out = os.path.join(d, "diverges")
    s.expect_error("train --lr 1e30 diverges: stops naming the step",
                   train + ["--steps", "6", "--lr", "1e30", "--warmup-steps", "0",
                            "--checkpoint-every", "1", "--out", out],
                   "step 2", "checkpoint-1", unchanged=[cfg, w, batch])
    kept = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) if \
        os.path.isdir(out) else []
    s.report("a diverged run keeps only its good checkpoints", str(kept),
             [] if kept == ["checkpoint-1"] else [f"checkpoints left: {kept}"])

    g = torch.Generator().manual_seed(0)
    nan_w = {k: 0.02 * torch.randn(sh, generator=g) for k, sh in ref.param_shapes(TINY).items()}
    nan_w["layers.0.attn.q_proj.weight"][3, 5] = float("nan")
    nan_path = os.path.join(d, "nan.safetensors")
    ref.write_safetensors(nan_path, nan_w)
    s.expect_error("train --init-weights with a NaN", train + [
        "--config", cfg, "--steps", "3", "--init-weights", nan_path, "--out",
        os.path.join(d, "nan_run")], "step 1", "not finite", unchanged=[nan_path, batch])

    huge = {k: v * 1e4 for k, v in ref.read_safetensors(w).items()}
    huge_path = os.path.join(d, "huge.safetensors")
    ref.write_safetensors(huge_path, huge)
    s.expect_error("f16 that overflows on every update", train + [
        "--config", cfg, "--steps", "40", "--precision", "f16", "--init-weights", huge_path,
        "--out", os.path.join(d, "f16_run")], "in a row", unchanged=[huge_path, batch])


def resumes(s, d, cfg, w, batch):
    run, ck4 = run_dirs(s, d, batch)
    train = ["train", "--preset", "tiny", "--seq", "8", "--eval-every", "0", "--quiet",
             "--batch-file", batch, "--out", run, "--resume", ck4]
    for flag, value, shown in (("--steps", "8", "--steps 6 -> 8"),
                               ("--batch", "2", "--batch 1 -> 2"),
                               ("--seed", "7", "--seed 1234 -> 7"),
                               ("--precision", "bf16", "--precision f32 -> bf16"),
                               ("--lr", "0.001", "--lr 0.003 -> 0.001"),
                               ("--capacity-factor", "1.5",
                                "--capacity-factor (not recorded) -> 1.5")):
        base = {"--steps": "6", "--batch": "1"}
        base[flag] = value
        s.expect_error(f"resume with {flag} {value}",
                       train + [x for kv in base.items() for x in kv], shown, "--allow-changes")
    code, _, err = s.run([s.exe, "--threads", "1"] + train +
                         ["--batch", "1", "--steps", "8", "--allow-changes"], timeout=120)
    s.report("resume with --steps 8 --allow-changes goes ahead", f"exit {code}",
             [] if code == 0 else [f"exit {code}: {err.strip()}"])
    # A capacity factor from the config is the run's as much as one from the flag: resuming
    # with the same config goes ahead, and another factor on the command line is a change.
    with open(cfg) as f:
        dropping = json.load(f)
    dropping["capacity_factor"] = 1.25
    cfg_cf = os.path.join(d, "dropping.json")
    with open(cfg_cf, "w") as f:
        json.dump(dropping, f)
    run_cf = os.path.join(d, "run_cf")
    make_run(s, batch, run_cf, "--config", cfg_cf)
    again = ["train", "--config", cfg_cf, "--seq", "8", "--eval-every", "0", "--quiet",
             "--batch-file", batch, "--out", run_cf, "--resume",
             os.path.join(run_cf, "checkpoint-4"), "--steps", "6", "--batch", "1"]
    s.expect_error("resume a config's capacity factor 1.25 with --capacity-factor 2",
                   again + ["--capacity-factor", "2"], "--capacity-factor 1.25 -> 2",
                   "--allow-changes")
    code, _, err = s.run([s.exe, "--threads", "1"] + again, timeout=120)
    s.report("resume with the config's own capacity factor goes ahead", f"exit {code}",
             [] if code == 0 else [f"exit {code}: {err.strip()}"])


def tampered(s, d, cfg, w, batch):
    run, _ = run_dirs(s, d, batch)
    train = ["train"] + TRAIN + ["--batch-file", batch, "--steps", "6"]

    r, ck = copy_of(d, run, "flipped_weight")
    path = os.path.join(ck, "rank-00000-of-00001.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x40  # a bit of the last tensor's last element
    open(path, "wb").write(data)
    s.expect_error("resume from a checkpoint with a flipped bit in its weights",
                   train + ["--resume", ck, "--out", r], "rank-00000-of-00001.safetensors",
                   "checksum")

    r, ck = copy_of(d, run, "edited_state")
    path = os.path.join(ck, "state.json")
    text = open(path).read().replace('"step": 4', '"step": 5')
    open(path, "w").write(text)
    s.expect_error("resume from a hand-edited state.json", train + ["--resume", ck, "--out", r],
                   "state.json", "checksum")

    r, ck = copy_of(d, run, "far_future")
    path = os.path.join(ck, "state.json")
    state = json.load(open(path))
    state["step"] = state["adamw_steps"] = 1000000000
    seal_state(path, state)
    s.expect_error("resume from a state at step 1e9 (checksums valid)",
                   train + ["--resume", ck, "--out", r], "1000000000", "schedule")

    r, ck = copy_of(d, run, "negative_v")
    name = "v.layers.0.attn.q_proj.weight"
    digest = set_first_element(os.path.join(ck, "rank-00000-of-00001.safetensors"), name, -1.0)
    path = os.path.join(ck, "state.json")
    state = json.load(open(path))
    state["files"]["rank-00000-of-00001.safetensors"] = digest
    seal_state(path, state)
    s.expect_error("resume with a negative second moment (checksums valid)",
                   train + ["--resume", ck, "--out", r], name, "-1")

    r, ck = copy_of(d, run, "version_one")
    path = os.path.join(ck, "state.json")
    state = json.load(open(path))
    del state["format_version"], state["files"], state["state_checksum"]
    state["version"] = 1
    open(path, "w").write(json.dumps(state, indent=2))
    s.expect_error("resume from a version-1 checkpoint (no checksums)",
                   train + ["--resume", ck, "--out", r], "format version 1", "version 4")


def main():
    s = Suite(sys.argv[1], tempfile.mkdtemp(prefix="wl-state-"))
    try:
        for group in (diverging, resumes, tampered):
            d = tempfile.mkdtemp(dir=s.scratch)
            cfg, w, batch = write_tiny_model(d)
            group(s, d, cfg, w, batch)
    finally:
        shutil.rmtree(s.scratch, ignore_errors=True)
    s.finish()


if __name__ == "__main__":
    main()
