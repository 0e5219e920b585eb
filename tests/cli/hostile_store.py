#!/usr/bin/env python3
"""A hostile peer on a real job's MASTER_PORT. Two real rank processes (tests/comm/
comm_test_rank, `hold` mode) join through rank 0's rendezvous store while this test, knowing
only the port, attacks it:
  during the rendezvous   2,000 idle connections and 40 forged headers that declare a 64 MiB
                          value under a wrong token (rank 1 is started only after them);
  while the job holds     2,000 more idle connections, 40 more forged headers, and 40 that
                          declare a 1 KiB token and never send it.
The job must complete (both ranks set and read store keys and run collectives, exit 0), a
legitimate client (this test, with the token) must be served in the middle of the flood, and
rank 0, which runs the store, must stay bounded: at most MAX_THREADS threads, at most
MAX_RSS_MB resident, and at most MAX_GROWTH_MB more resident memory under the second attack
than before it. Before the store
became an event loop that authenticates before allocating, the same attack made one thread per
connection (2,004 threads for 2,000 connections) and took 64 MiB per forged header (84 MB to
2.7 GB).

Usage: hostile_store.py COMM_TEST_RANK"""
import os
import random
import resource
import socket
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))
from ports import free_port  # noqa: E402

# The figures; the environment may lower them (a tree that allocates what a forged
# header declares takes 64 MiB per header from a shared machine).
IDLE = int(os.environ.get("WL_HOSTILE_IDLE", 2000))
FORGED = int(os.environ.get("WL_HOSTILE_FORGED", 40))
MAX_THREADS = 64      # rank 0's threads at any point: UCX's, the compute pool's, the store's
MAX_GROWTH_MB = 64    # rank 0's resident memory under the second attack, over the first
MAX_RSS_MB = 256      # rank 0's resident memory at any point (about 12 MB when it holds)
JOB_TIMEOUT_MS = 60000


def request(op, token, key, value=b"", wait_ms=0):
    """docs/formats.md, "Rendezvous store wire format": a 32-byte header, token, key, value."""
    return struct.pack("<4sBBHIIQII", b"WLKV", 1, op, 0, len(token), len(key), len(value),
                       wait_ms, 0) + token + key + value


def read_response(sock):
    head = b""
    while len(head) < 16:
        chunk = sock.recv(16 - len(head))
        if not chunk:
            raise ConnectionError("the store closed the connection")
        head += chunk
    magic, _version, code, _, length = struct.unpack("<4sBBHQ", head)
    payload = b""
    while len(payload) < length:
        payload += sock.recv(length - len(payload))
    return code, payload


def status_of(pid):
    """Threads and resident MB of a process, from /proc."""
    fields = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) // 1024


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def attack(port, sockets):
    """Idle connections, forged oversized declarations, and declarations that never finish."""
    for _ in range(IDLE):
        try:
            sockets.append(connect(port))
        except OSError:
            pass  # the store may refuse or reset a flood past its bound: that is its right
    for i in range(FORGED):
        try:
            s = connect(port)
            fake = bytes(random.getrandbits(8) for _ in range(1024))
            s.sendall(struct.pack("<4sBBHIIQII", b"WLKV", 1, 1, 0, 1024, 4096, 64 << 20, 0, 0)
                      + fake)
            sockets.append(s)
            s2 = connect(port)
            s2.sendall(struct.pack("<4sBBHIIQII", b"WLKV", 1, 1, 0, 1024, 4096, 64 << 20, 0, 0))
            sockets.append(s2)
        except OSError:
            pass


def probe(port, token, problems):
    """The job's own kind of client, in the middle of the flood: set a key, read it back.
    Its reply also means the store has taken the connections that came before it."""
    try:
        s = connect(port)
        s.sendall(request(1, token.encode(), b"hostile/probe", b"still here"))
        set_code, _ = read_response(s)
        s.sendall(request(2, token.encode(), b"hostile/probe", wait_ms=1000))
        get_code, value = read_response(s)
        s.close()
        if (set_code, get_code, value) != (0, 0, b"still here"):
            problems.append(f"a client with the token got codes {set_code}, {get_code}")
    except OSError as e:
        problems.append(f"a client with the token was not served: {e}")


def wait_for_line(proc, prefix, limit_s):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            return None
        if line.startswith(prefix):
            return line
    return None


def main():
    rank_binary = sys.argv[1]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 2 * IDLE + 4 * FORGED + 64:
        # Counted as skipped, never as passed (CTest's SKIP_RETURN_CODE, tests/CMakeLists.txt).
        print(f"skip: RLIMIT_NOFILE {hard} is too low for the flood")
        return 77
    port = free_port()
    token = "%032x" % random.getrandbits(128)
    problems, sockets, procs = [], [], []

    def start(rank):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WEIGHTLIFT_JOB_TOKEN=token)
        p = subprocess.Popen([rank_binary, "hold", str(JOB_TIMEOUT_MS)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    try:
        rank0 = start(0)
        for _ in range(2000):  # until rank 0's store accepts connections
            try:
                connect(port).close()
                break
            except OSError:
                time.sleep(0.01)
        attack(port, sockets)  # during the rendezvous
        rank1 = start(1)
        for rank, p in ((0, rank0), (1, rank1)):
            if not wait_for_line(p, "ready", 60):
                problems.append(f"rank {rank} never joined the job under the flood")
        probe(port, token, problems)
        threads_a, rss_a = status_of(rank0.pid)
        print(f"rank 0 after the rendezvous under attack: {threads_a} threads, {rss_a} MB; "
              f"{len(sockets)} attacking connections open")
        attack(port, sockets)  # while the job holds
        probe(port, token, problems)
        threads_b, rss_b = status_of(rank0.pid)
        print(f"rank 0 under the second attack: {threads_b} threads, {rss_b} MB; "
              f"{len(sockets)} attacking connections open")
        if max(threads_a, threads_b) > MAX_THREADS:
            problems.append(f"rank 0 ran {max(threads_a, threads_b)} threads (at most "
                            f"{MAX_THREADS} allowed)")
        if max(rss_a, rss_b) > MAX_RSS_MB:
            problems.append(f"rank 0 held {max(rss_a, rss_b)} MB resident (at most "
                            f"{MAX_RSS_MB} MB allowed)")
        if rss_b - rss_a > MAX_GROWTH_MB:
            problems.append(f"rank 0 grew by {rss_b - rss_a} MB under the second attack (at most "
                            f"{MAX_GROWTH_MB} MB allowed)")
        for p in procs:
            p.stdin.close()  # let the job finish
        for rank, p in enumerate(procs):
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                problems.append(f"rank {rank} did not finish within 90 s")
            out = p.stdout.read()
            if p.returncode != 0:
                problems.append(f"rank {rank} exited {p.returncode}: {out.strip()[-300:]}")
    finally:
        for s in sockets:
            s.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p in problems:
        print(f"FAIL {p}")
    print("the job completed and rank 0 stayed bounded" if not problems else
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
