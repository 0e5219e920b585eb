#!/usr/bin/env python3
"""Outputs never destroy anything, through the real command: a target that is not a regular
file (a device node as root, a FIFO, a directory, a symbolic link) is refused, so is an output
that is one of the command's inputs (however its path is spelt), writing into the checkpoint a
run resumes from, and a run directory that holds another run's results (unless --overwrite,
or the run resumes that directory). Two processes writing one output leave one of their files,
whole. And what `generate` prints ends before its first stop string.

Run by CTest with the path of the weightlift binary (tests/cli/harness.py has the rules)."""
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile

from harness import Suite, write_tiny_model

TRAIN = ["--preset", "tiny", "--batch", "1", "--seq", "8", "--eval-every", "0", "--quiet"]


def make_run(s, batch, out, *extra):
    """A real run to resume from: steps 6, stopped at 4, checkpoints at 2 and 4."""
    code, _, err = s.run([s.exe, "--threads", "1", "train"] + TRAIN +
                         ["--batch-file", batch, "--steps", "6", "--stop-after", "4",
                          "--checkpoint-every", "2", "--out", out] + list(extra), timeout=120)
    if code != 0:
        sys.exit(f"setup: training {out} failed ({code}): {err}")


def grad_targets(s, d, cfg, w, batch):
    grad = ["grad", "--config", cfg, "--weights", w, "--tokens", batch, "--out"]
    if os.geteuid() == 0:
        # /dev/null's own major and minor, in the scratch directory: what `--out /dev/null`
        # meets as root, without risking the machine's /dev/null on a tree that replaces it.
        null = os.path.join(d, "null")
        os.mknod(null, 0o666 | 0o020000, os.makedev(1, 3))
        s.expect_error("grad --out a character device (as root)", grad + [null], null,
                       "character device")
    fifo = os.path.join(d, "fifo")
    os.mkfifo(fifo)
    s.expect_error("grad --out a FIFO", grad + [fifo], fifo, "FIFO")
    directory = os.path.join(d, "a_directory")
    os.mkdir(directory)
    s.expect_error("grad --out a directory", grad + [directory], directory, "directory")
    victim = os.path.join(d, "victim.txt")
    open(victim, "w").write("precious\n")
    link = os.path.join(d, "link.safetensors")
    os.symlink(victim, link)
    s.expect_error("grad --out a symbolic link", grad + [link], link, "symbolic link")


def grad_inputs(s, d, cfg, w, batch):
    def grad(out, weights=w, config=cfg):
        return ["grad", "--config", config, "--weights", weights, "--tokens", batch,
                "--out", out]

    s.expect_error("grad --out the --weights file", grad(w), "--out", "--weights")
    s.expect_error("grad --out the --config file", grad(cfg), "--out", "--config")
    s.expect_error("grad --out the --tokens file", grad(batch), "--out", "--tokens")
    hard = os.path.join(d, "hardlink.safetensors")
    os.link(w, hard)
    s.expect_error("grad --out a hard link of --weights", grad(hard), "--weights")
    s.expect_error("grad --out ''", grad(""), "--out", "empty path")
    s.expect_error("grad --out in a directory that does not exist",
                   grad(os.path.join(d, "no_such_dir", "g.safetensors")), "--out",
                   "does not exist")
    s.expect_error("grad --out --weights spelt another way",
                   grad(os.path.join(d, ".", "w.safetensors")), "--weights")


def train_outputs(s, d, w, batch):
    run = os.path.join(d, "run")
    make_run(s, batch, run)
    ck4 = os.path.join(run, "checkpoint-4")
    train = ["train"] + TRAIN + ["--batch-file", batch, "--steps", "6"]
    s.expect_error("train --resume R/checkpoint-4 --out R/checkpoint-4",
                   train + ["--resume", ck4, "--out", ck4], "--out", "--resume")
    s.expect_error("train --resume R/checkpoint-4 --out R --stop-after 4 (rewrites it)",
                   train + ["--resume", ck4, "--out", run, "--stop-after", "4"], "--stop-after")
    s.expect_error("train --out-weights inside the resumed checkpoint",
                   train + ["--resume", ck4, "--out", run, "--out-weights",
                            os.path.join(ck4, "extra.safetensors")], "--out-weights")
    s.expect_error("train --out-weights into another checkpoint of the resumed run",
                   train + ["--resume", ck4, "--out", run, "--out-weights",
                            os.path.join(run, "checkpoint-2", "rank-00000-of-00001.safetensors")],
                   "--out-weights", "checkpoint-2", "state.json")
    s.expect_error("train --resume with --init-weights",
                   train + ["--resume", ck4, "--init-weights", w, "--out", run],
                   "--init-weights", "--resume")
    s.expect_error("train into a directory holding another run",
                   train + ["--out", run], "--overwrite", "checkpoint-2")
    s.expect_error("train --out one of another run's checkpoints",
                   train + ["--out", os.path.join(run, "checkpoint-2")], "--overwrite",
                   "state.json")
    mine = os.path.join(d, "my_configs")
    os.mkdir(mine)
    with open(os.path.join(mine, "config.json"), "w") as f:
        f.write('{"the user\'s": "own file"}')
    s.expect_error("train --out a directory holding a config.json of the user's",
                   train + ["--out", mine], "--overwrite", "config.json")
    busy = os.path.join(d, "busy_run")
    os.mkdir(busy)
    with open(os.path.join(busy, ".weightlift.lock"), "w") as held:
        # What a run writing there holds for its whole length (core/file_io.h, DirectoryLock).
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        s.expect_error("train --out a directory another run is writing",
                       train + ["--out", busy], "--out", "another weightlift run", "pid 4242")
    s.expect_error("train --out-weights the --init-weights file",
                   train + ["--init-weights", w, "--out-weights", w, "--out",
                            os.path.join(d, "fresh")], "--out-weights", "--init-weights")
    empty = os.path.join(d, "empty_run")
    os.mkdir(empty)
    victim = os.path.join(d, "victim.txt")
    os.symlink(victim, os.path.join(empty, "metrics.jsonl"))
    s.expect_error("train --out whose metrics.jsonl is a symbolic link",
                   train + ["--out", empty], "metrics.jsonl", "symbolic link")
    not_dir = os.path.join(d, "plain_file")
    open(not_dir, "w").write("x")
    s.expect_error("train --stop-after past --steps", train + ["--stop-after", "9", "--out",
                   os.path.join(d, "past")], "--stop-after 9", "--steps 6")
    s.expect_error("train --out-weights in a directory that does not exist",
                   train + ["--out", os.path.join(d, "fresh2"), "--out-weights",
                            os.path.join(d, "no_such_dir", "w.safetensors")], "--out-weights",
                   "does not exist")
    s.expect_error("train --out ''", train + ["--out", ""], "--out", "empty path")
    s.expect_error("train --out a regular file", train + ["--out", not_dir], "--out",
                   "not a directory")

    # What stays allowed: resuming into the run's own directory, and --overwrite.
    code, _, err = s.run([s.exe, "--threads", "1"] + train + ["--resume", ck4, "--out", run],
                         timeout=120)
    s.report("train --resume R/checkpoint-4 --out R goes ahead", f"exit {code}",
             [] if code == 0 else [f"exit {code}: {err.strip()}"])
    code, _, err = s.run([s.exe, "--threads", "1"] + train + ["--out", run, "--overwrite"],
                         timeout=120)
    s.report("train --overwrite replaces another run", f"exit {code}",
             [] if code == 0 else [f"exit {code}: {err.strip()}"])


def concurrent_writers(s, d, cfg, batch):
    """Two processes write one output at once, again and again: each must succeed and the
    file must be one of theirs, whole."""
    _, w1, _ = write_tiny_model(d, seed=1, name="w1.safetensors")
    _, w2, _ = write_tiny_model(d, seed=2, name="w2.safetensors")

    def grad(weights, out):
        return [s.exe, "--threads", "1", "grad", "--config", cfg, "--weights", weights,
                "--tokens", batch, "--out", out]

    refs = []
    for i, weights in enumerate((w1, w2)):
        ref = os.path.join(d, f"ref{i}.safetensors")
        subprocess.run(grad(weights, ref), check=True, capture_output=True, timeout=60)
        refs.append(open(ref, "rb").read())
    out = os.path.join(d, "shared.safetensors")
    problems = []
    for round_ in range(8):
        procs = [subprocess.Popen(grad(weights, out), stderr=subprocess.PIPE, text=True)
                 for weights in (w1, w2)]
        for p in procs:
            _, err = p.communicate(timeout=60)
            if p.returncode != 0:
                problems.append(f"round {round_}: a writer failed: {err.strip()}")
        if open(out, "rb").read() not in refs:
            problems.append(f"round {round_}: the output is neither writer's file")
    leftovers = [n for n in os.listdir(d) if ".tmp" in n]
    if leftovers:
        problems.append(f"temporary files left: {leftovers}")
    s.report("two processes writing one output, 8 rounds", "", sorted(set(problems)))


def generated_text(s, cmd):
    """The completion `generate` printed for its one prompt ("The "), the number of tokens it
    generated, and why not when it failed."""
    code, out, err = s.run([s.exe] + cmd, timeout=60)
    head, tail = "--- prompt 0 ---\nThe ", "\n--- 1 rows, "
    if code != 0 or head not in out or tail not in out:
        return None, 0, f"exit {code}: {err.strip()[-300:]} {out[-300:]!r}"
    tokens = int(out[out.index(tail) + len(tail):].split(" new tokens")[0])
    return out[out.index(head) + len(head):out.index(tail)], tokens, ""


def generate_stops(s, cfg, w):
    """Stop strings end a row where it first produces one (it generates no further), and are
    left out of what is printed; the text before is what the same seeded run without them
    produced. The prompt's own text does not count."""
    gen = ["generate", "--config", cfg, "--weights", w, "--prompt", "The ", "--max-new-tokens",
           "24", "--temperature", "0.9", "--seed", "5"]
    free, free_tokens, why = generated_text(s, gen)
    if free is None:
        s.report("generate --stop", "the run without stops failed", [why])
        return
    letters = [i for i, ch in enumerate(free) if i >= 1 and ch.isascii() and ch.isalpha()]
    if not letters:
        s.report("generate --stop", f"no letter in {free!r} to stop at", ["pick another seed"])
        return
    stop = free[letters[0]]
    cut, cut_tokens, why = generated_text(s, gen + ["--stop", "never printed", "--stop", stop])
    want = free[:free.index(stop)]
    problems = [why] if cut is None else [] if cut == want else [f"expected {want!r}"]
    if cut is not None and not cut_tokens < free_tokens:
        problems.append(f"{cut_tokens} tokens generated, as many as without the stop string")
    s.report(f"generate --stop {stop!r}", f"{free!r} -> {cut!r}", problems)
    # "Th" is in the prompt "The ": only the completion's text is looked at.
    in_prompt, _, why = generated_text(s, gen + ["--stop", "Th"])
    want = free[:free.index("Th")] if "Th" in free else free
    s.report("generate --stop in the prompt", f"{in_prompt!r}",
             [why] if in_prompt is None else [] if in_prompt == want else [f"expected {want!r}"])


def main():
    s = Suite(sys.argv[1], tempfile.mkdtemp(prefix="wl-outputs-"))
    try:
        for group in (grad_targets, grad_inputs):
            d = tempfile.mkdtemp(dir=s.scratch)
            cfg, w, batch = write_tiny_model(d)
            group(s, d, cfg, w, batch)
        d = tempfile.mkdtemp(dir=s.scratch)
        cfg, w, batch = write_tiny_model(d)
        train_outputs(s, d, w, batch)
        d = tempfile.mkdtemp(dir=s.scratch)
        cfg, w, batch = write_tiny_model(d)
        concurrent_writers(s, d, cfg, batch)
        d = tempfile.mkdtemp(dir=s.scratch)
        cfg, w, batch = write_tiny_model(d, seed=3)
        generate_stops(s, cfg, w)
    finally:
        shutil.rmtree(s.scratch, ignore_errors=True)
    s.finish()


if __name__ == "__main__":
    main()
