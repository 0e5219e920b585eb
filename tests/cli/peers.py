#!/usr/bin/env python3
"""Peers that never come, through the real command: a rank whose peer never joins, or whose
store never starts, ends with DeadlineExceeded (a timeout, not "refused") at the --timeout it
was given, not at a default of its own and never as a hang. And the driver of
`bench collectives --turns` (apps/weightlift/bench/turns.h): the benchmark runs only in the
turns it is given, exactly as many as its sizes and blocks make, and a driver that goes away
ends it with an error naming the FIFO, not a hang.

Run by CTest with the path of the weightlift binary (tests/cli/harness.py has the rules)."""
import errno
import os
import select
import subprocess
import sys
import tempfile
import time

from harness import Suite
from ports import free_port


def alone(s, rank, timeout_s):
    """Rank `rank` of a 2-rank job whose other rank never starts."""
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WEIGHTLIFT_JOB_TOKEN": "peers-test"}
    cmd = [s.exe, "bench", "collectives", "--ops", "allreduce", "--max-bytes", "1K",
           "--iters", "1", "--warmup", "0", "--timeout", str(timeout_s)]
    start = time.monotonic()
    code, _, err = s.run(cmd, env=env, timeout=timeout_s + 30)
    took = time.monotonic() - start
    label = f"rank {rank} of 2 alone, --timeout {timeout_s}"
    problems = []
    if code is not None and not (timeout_s - 0.5 <= took <= timeout_s + 10):
        problems.append(f"gave up after {took:.1f} s, not at --timeout {timeout_s} s")
    # The old wording of a key nobody set was "store ... refused 'wl/addr/1'"; the socket's own
    # "Connection refused" of a store that never started may stay in the message.
    s.check(label, code, err, ["DeadlineExceeded", "within"],
            timeout=timeout_s + 30, forbidden=["refused '"])
    if problems:
        s.report(label + ": at its deadline", f"{took:.1f} s", problems)


class TurnDriver:
    """The driver's side of the turns protocol for one rank of `impl`, as
    bench/compare_collectives.py plays it, started beside `cmd` (a single-rank run)."""

    def __init__(self, s, folder, cmd):
        self.base = os.path.join(folder, "weightlift.0")
        os.mkfifo(self.base + ".go")
        os.mkfifo(self.base + ".done")
        self.done = os.open(self.base + ".done", os.O_RDONLY | os.O_NONBLOCK)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        self.proc = subprocess.Popen([s.exe] + cmd + ["--turns", folder], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.go = None
        deadline = time.monotonic() + 30
        while self.go is None and time.monotonic() < deadline and self.proc.poll() is None:
            try:
                self.go = os.open(self.base + ".go", os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                time.sleep(0.01)

    def answered(self, timeout):
        """The rank's answer to a turn: b"d", b"" once it exited, None if it said nothing."""
        ready, _, _ = select.select([self.done], [], [], timeout)
        return os.read(self.done, 1) if ready else None

    def finish(self, timeout=30):
        if self.go is not None:
            os.close(self.go)
        os.close(self.done)
        try:
            out, err = self.proc.communicate(timeout=timeout)
            return self.proc.returncode, out, err
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return None, "", ""


def turns(s):
    # 4 sizes (8..64 B) of 4 calls in 2 blocks each, after the turn that measures the copy rate.
    cmd = ["bench", "collectives", "--ops", "allreduce", "--min-bytes", "8", "--max-bytes", "64",
           "--iters", "4", "--warmup", "1", "--json", "--turn-blocks", "2", "--timeout", "20"]
    label = "bench collectives --turns: 1 + 4 sizes x 2 blocks turns, none taken unasked"
    with tempfile.TemporaryDirectory(dir=s.scratch) as folder:
        d = TurnDriver(s, folder, cmd)
        problems, given = [], 0
        if d.go is None:
            problems.append("the benchmark never opened its go FIFO")
        else:
            if d.answered(0.5) is not None:
                problems.append("it ran before its first turn")
            while given < 20:
                try:
                    os.write(d.go, b"g")
                except BrokenPipeError:  # it has exited
                    break
                answer = d.answered(20)
                if answer != b"d":
                    if answer is None:
                        problems.append(f"no answer to turn {given + 1} within 20 s")
                    break
                given += 1
                after = d.answered(0.05)
                if after == b"d":
                    problems.append(f"it went on after turn {given} without being asked")
                if after is not None:  # b"": it has exited
                    break
        code, out, err = d.finish()
        rows = [line for line in out.splitlines() if line.startswith("{")]
        if given != 9:
            problems.append(f"it took {given} turns, expected 9")
        if code != 0 or len(rows) != 4:
            problems.append(f"exit code {code} with {len(rows)} rows, expected 0 with 4: "
                            f"{err.strip()[:200]}")
        s.report(label, f"{given} turns, {len(rows)} rows", problems)

    # The driver goes away after two turns: the benchmark, asleep in poll(), must notice.
    with tempfile.TemporaryDirectory(dir=s.scratch) as folder:
        d = TurnDriver(s, folder, cmd)
        for _ in range(2):
            if d.go is not None:
                os.write(d.go, b"g")
                d.answered(20)
        start = time.monotonic()
        code, _, err = d.finish(timeout=30)
        s.check("bench collectives --turns, the driver gone after 2 turns", code, err,
                ["closed", "weightlift.0.go"], timeout=30)
        if code is not None and time.monotonic() - start > 5:
            s.report("bench collectives --turns, the driver gone: noticed at once",
                     f"{time.monotonic() - start:.1f} s", ["took more than 5 s"])
    s.expect_error("bench collectives --turns a missing directory",
                   ["bench", "collectives", "--ops", "allreduce", "--max-bytes", "64",
                    "--turns", os.path.join(s.scratch, "no-such-dir")],
                   "--turns", "no-such-dir/weightlift.0.go")


def main():
    s = Suite(sys.argv[1], tempfile.mkdtemp(prefix="wl-peers-"))
    alone(s, 0, 3)  # the store is up; rank 1's address never comes
    alone(s, 1, 3)  # nothing listens on MASTER_PORT: the store never starts
    turns(s)
    os.rmdir(s.scratch)
    s.finish()


if __name__ == "__main__":
    main()
