#!/usr/bin/env python3
"""Inputs that are not regular files are refused before anything blocks on them, and every
file read has a size bound, through the real command: a FIFO given as weights, tokens, a
config, a batch file, a checkpoint's state.json, a run's metrics.jsonl or an hwloc XML would
block a reader forever; a device or a huge file would be read without limit.

Run by CTest with the path of the weightlift binary (tests/cli/harness.py has the rules)."""
import os
import shutil
import sys
import tempfile

from harness import Suite, write_tiny_model
from outputs import TRAIN, make_run

# A hang shows up as this timeout; nothing here needs more than a few seconds.
HANG = 20


def fifo_inputs(s, d, cfg, w, batch):
    fifo = os.path.join(d, "fifo")
    os.mkfifo(fifo)
    out = os.path.join(d, "g.safetensors")

    def grad(config=cfg, weights=w, tokens=batch):
        return ["grad", "--config", config, "--weights", weights, "--tokens", tokens, "--out",
                out]

    s.expect_error("grad --weights a FIFO", grad(weights=fifo), fifo, "FIFO", timeout=HANG)
    s.expect_error("grad --config a FIFO", grad(config=fifo), fifo, "FIFO", timeout=HANG)
    s.expect_error("grad --tokens a FIFO", grad(tokens=fifo), fifo, "FIFO", timeout=HANG)
    s.expect_error("generate --weights a FIFO", ["generate", "--config", cfg, "--weights", fifo],
                   fifo, "FIFO", timeout=HANG)
    s.expect_error("train --batch-file a FIFO",
                   ["train"] + TRAIN + ["--steps", "1", "--batch-file", fifo, "--out",
                                        os.path.join(d, "run")], fifo, "FIFO", timeout=HANG)
    s.expect_error("train --init-weights a FIFO",
                   ["train"] + TRAIN + ["--steps", "1", "--batch-file", batch, "--init-weights",
                                        fifo, "--out", os.path.join(d, "run")], fifo, "FIFO",
                   timeout=HANG)
    s.expect_error("topo --xml a FIFO", ["topo", "--xml", fifo], fifo, "FIFO", timeout=HANG)
    # Skipped, a FIFO named as a corpus file would move every later file across the train /
    # validation split.
    corpus = os.path.join(d, "corpus_with_fifo")
    os.mkdir(corpus)
    os.mkfifo(os.path.join(corpus, "ca01"))
    s.expect_error("train --corpus holding a FIFO",
                   ["train"] + TRAIN + ["--steps", "1", "--corpus", corpus, "--out",
                                        os.path.join(d, "run")], "ca01", "not a regular file",
                   timeout=HANG)
    s.expect_error("model-info --config a directory", ["model-info", "--config", d], d,
                   "directory", timeout=HANG)
    s.expect_error("generate --config /dev/zero", ["generate", "--config", "/dev/zero",
                                                   "--weights", w], "/dev/zero",
                   "character device", timeout=HANG)
    broken = os.path.join(d, "broken.json")
    with open(broken, "w") as f:
        f.write('{"hidden_size": 64,,}')
    s.expect_error("model-info --config with a JSON syntax error", ["model-info", "--config",
                   broken], broken, "not valid JSON", "line 1, column",
                   forbidden=("json.exception",))


def checkpoint_inputs(s, d, cfg, w, batch):
    run = os.path.join(d, "run")
    make_run(s, batch, run)
    train = ["train"] + TRAIN + ["--batch-file", batch, "--steps", "6"]

    def copy_of_run(name):
        other = os.path.join(d, name)
        shutil.copytree(run, other)
        return other

    r = copy_of_run("fifo_state")
    os.unlink(os.path.join(r, "checkpoint-4", "state.json"))
    os.mkfifo(os.path.join(r, "checkpoint-4", "state.json"))
    s.expect_error("train --resume whose state.json is a FIFO",
                   train + ["--resume", os.path.join(r, "checkpoint-4"), "--out", r],
                   "state.json", "FIFO", timeout=HANG)

    r = copy_of_run("huge_state")
    with open(os.path.join(r, "checkpoint-4", "state.json"), "r+b") as f:
        f.truncate(80 << 20)  # sparse: 80 MiB that cost no disk
    s.expect_error("train --resume whose state.json is 80 MiB",
                   train + ["--resume", os.path.join(r, "checkpoint-4"), "--out", r],
                   "state.json", "more than", timeout=HANG, memory_limit=4 << 30)

    r = copy_of_run("fifo_model")
    tensors = os.path.join(r, "checkpoint-4", "rank-00000-of-00001.safetensors")
    os.unlink(tensors)
    os.mkfifo(tensors)
    s.expect_error("train --resume whose tensor file is a FIFO",
                   train + ["--resume", os.path.join(r, "checkpoint-4"), "--out", r],
                   "rank-00000-of-00001.safetensors", "FIFO", timeout=HANG)

    r = copy_of_run("fifo_metrics")
    os.unlink(os.path.join(r, "metrics.jsonl"))
    os.mkfifo(os.path.join(r, "metrics.jsonl"))
    s.expect_error("train --resume into a run whose metrics.jsonl is a FIFO",
                   train + ["--resume", os.path.join(r, "checkpoint-4"), "--out", r],
                   "metrics.jsonl", "FIFO", timeout=HANG)


def main():
    s = Suite(sys.argv[1], tempfile.mkdtemp(prefix="wl-inputs-"))
    try:
        for group in (fifo_inputs, checkpoint_inputs):
            d = tempfile.mkdtemp(dir=s.scratch)
            cfg, w, batch = write_tiny_model(d)
            group(s, d, cfg, w, batch)
    finally:
        shutil.rmtree(s.scratch, ignore_errors=True)
    s.finish()


if __name__ == "__main__":
    main()
