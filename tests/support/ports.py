"""A port that is free now, for a job whose store a test starts on a port it names.

Drawn at random below the kernel's ephemeral range (ip_local_port_range), never from it: a
port the kernel handed out once is handed out again to any process's connect() or bind(0),
and under `ctest -j` another test's socket can take it between this call and the job's bind.
tests/support/child_process.h draws the C++ tests' ports the same way."""
import random
import socket


def free_port():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = 10000, max(11000, ephemeral_low)
    for _ in range(1000):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in [{low}, {high})")
