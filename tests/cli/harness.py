"""What every bad invocation of the real `weightlift` must do, checked in one place.

A careless user or a hostile peer gets exit code 2 for what was given wrong (InvalidArgument)
and 1 for any other error (never a signal: 134 is an abort, 139 a segfault), exactly one line
on stderr that contains what the case says it must name (the flag, the file, the range), within a time bound (a hang is a failure, reported as such), and
nothing on disk changes: every file, directory and device the case names or that lives in the
scratch directory is hashed before and after, so a destroyed input, a half-written output or
a temporary file left behind all fail the case.

The suites (bad_flags.py, outputs.py, ...) build their inputs with tests/reference/torch_moe.py,
which shares no code with weightlift, and report each case on one line.
"""
import hashlib
import json
import os
import re
import resource
import stat
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 1, "head_dim": 16,
        "num_experts": 4, "top_k": 2, "ffn_dim": 128, "vocab_size": 320, "max_seq_len": 128}


def expected_exit_code(stderr):
    """weightlift's exit code for the error it printed (docs/errors.md): 2 for InvalidArgument
    (what was given is wrong, and no retry changes it), 1 for every other error."""
    return 2 if ": InvalidArgument: " in stderr else 1


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def snapshot(paths):
    """Everything about `paths` a command could destroy: per entry, its type and content hash
    (regular files), target (links), device number (devices), recursing into directories."""
    state = {}

    def visit(p):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            state[p] = "absent"
            return
        if stat.S_ISREG(st.st_mode):
            state[p] = ("file", st.st_size, _digest(p))
        elif stat.S_ISLNK(st.st_mode):
            state[p] = ("link", os.readlink(p))
        elif stat.S_ISDIR(st.st_mode):
            state[p] = ("dir",)
            for name in sorted(os.listdir(p)):
                visit(os.path.join(p, name))
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            state[p] = ("device", stat.S_IFMT(st.st_mode), st.st_rdev)
        else:
            state[p] = ("other", stat.S_IFMT(st.st_mode))

    for p in paths:
        visit(p)
    return state


def _changes(before, after):
    out = []
    for p in sorted(set(before) | set(after)):
        if before.get(p) != after.get(p):
            what = ("appeared" if before.get(p) in (None, "absent") else
                    "vanished" if after.get(p) in (None, "absent") else "changed")
            out.append(f"{p} {what}")
    return out


class Suite:
    def __init__(self, exe, scratch):
        self.exe = exe
        self.scratch = scratch
        self.failures = 0
        self.cases = 0

    def run(self, cmd, timeout=60, env=None, memory_limit=None, stdin=subprocess.DEVNULL):
        def limit():
            if memory_limit:
                resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))

        full_env = dict(os.environ, **(env or {}))
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                               timeout=timeout, preexec_fn=limit, env=full_env, stdin=stdin)
            return r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else ""
            return None, "", err

    def expect_error(self, label, cmd, *needles, unchanged=None, keep_scratch=True, timeout=60,
                     env=None, memory_limit=None, forbidden=()):
        """`cmd` (after the binary) must fail cleanly. `unchanged`: paths that must be exactly
        as before (default: the scratch directory and every existing path on the command
        line); `keep_scratch=False` leaves the scratch directory out of that default."""
        argv = [self.exe] + [str(c) for c in cmd]
        if unchanged is None:
            unchanged = [self.scratch] if keep_scratch else []
            unchanged += [a for a in argv[1:] if os.path.isabs(a) and os.path.lexists(a) and
                          not a.startswith(self.scratch + os.sep)]
        before = snapshot(unchanged)
        code, _, stderr = self.run(argv, timeout=timeout, env=env, memory_limit=memory_limit)
        after = snapshot(unchanged)
        self.check(label, code, stderr, needles, _changes(before, after), timeout, forbidden)

    def check(self, label, code, stderr, needles, changes=(), timeout=60, forbidden=()):
        lines = [l for l in stderr.splitlines() if l.strip()]
        problems = []
        if code is None:
            problems.append(f"still running after {timeout} s (a hang)")
        elif code != expected_exit_code(stderr):
            problems.append(f"exit code {code}, expected {expected_exit_code(stderr)}" +
                            (" (a signal)" if code < 0 or code > 128 else ""))
        if len(lines) != 1:
            problems.append(f"{len(lines)} lines on stderr, expected 1")
        for n in needles:
            if n not in stderr:
                problems.append(f"stderr does not mention {n!r}")
        for n in forbidden:
            if n in stderr:
                problems.append(f"stderr mentions {n!r}")
        if re.search(r"\d{25,}", stderr):
            problems.append("stderr holds a number of 25 digits or more")
        if re.search(r"[\x00-\x08\x0b-\x1f\x7f]", stderr):
            problems.append("stderr holds a raw control character")
        problems += [f"{c} (must stay unchanged)" for c in changes]
        self.report(label, lines[0] if lines else "(no stderr)", problems)

    def report(self, label, shown, problems):
        self.cases += 1
        print(f"{'ok  ' if not problems else 'FAIL'} {label}: {shown[:300]}")
        for p in problems:
            print(f"       {p}")
        sys.stdout.flush()
        self.failures += bool(problems)

    def finish(self):
        print(f"{self.failures} of {self.cases} failed" if self.failures else
              f"all {self.cases} bad invocations gave one clear error line")
        sys.exit(1 if self.failures else 0)


def write_tiny_model(d, config=TINY, seed=0, name="w.safetensors"):
    """config.json, weights and a one-row token batch for `config` in directory d."""
    import torch
    import torch_moe as ref

    cfg = os.path.join(d, "config.json")
    with open(cfg, "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(seed)
    w = {k: 0.02 * torch.randn(s, generator=g) for k, s in ref.param_shapes(config).items()}
    weights = os.path.join(d, name)
    ref.write_safetensors(weights, w)
    batch = os.path.join(d, "batch.safetensors")
    ref.write_safetensors(batch, {"tokens": torch.zeros(1, 8, dtype=torch.int64),
                                  "targets": torch.zeros(1, 8, dtype=torch.int64)})
    return cfg, weights, batch
