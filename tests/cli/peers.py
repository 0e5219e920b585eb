#!/usr/bin/env python3
"""Peers that never come, through the real command: a rank whose peer never joins, or whose
store never starts, ends with DeadlineExceeded (a timeout, not "refused") at the --timeout it
was given, not at a default of its own and never as a hang.

Run by CTest with the path of the weightlift binary (tests/cli/harness.py has the rules)."""
import os
import socket
import sys
import tempfile
import time

from harness import Suite


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def main():
    s = Suite(sys.argv[1], tempfile.mkdtemp(prefix="wl-peers-"))
    alone(s, 0, 3)  # the store is up; rank 1's address never comes
    alone(s, 1, 3)  # nothing listens on MASTER_PORT: the store never starts
    os.rmdir(s.scratch)
    s.finish()


if __name__ == "__main__":
    main()
