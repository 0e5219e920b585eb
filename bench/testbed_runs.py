"""What bench/testbed_*.py share: a command run on a fresh scripts/testbed.sh testbed, its ranks'
lines, and the NIC rates tc takes."""
import os
import re
import subprocess

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TESTBED = os.path.join(ROOT, "scripts", "testbed.sh")


def rate_bytes_per_s(rate):
    """tc's rate words -> bytes/s ("100mbit" -> 12.5e6)."""
    for unit, bits in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * bits / 8
    raise SystemExit(f"'{rate}' is not a rate in bit/s (200mbit, 1gbit)")


def run_on_testbed(weightlift, hosts, rate, command, loss="0", ranks_per_host=1):
    """`command` as `ranks_per_host` ranks per host (one by default) on a fresh testbed of
    `hosts` hosts at `rate`, each NIC dropping `loss` percent of its packets each way: the exit
    code, each rank's lines as (host, text) in order, and the whole output for errors."""
    r = subprocess.run(["bash", TESTBED, "run", "--hosts", str(hosts), "--ranks-per-host",
                        str(ranks_per_host), "--rate", rate, "--loss", str(loss), "--bin",
                        weightlift, "--"] + list(command),
                       capture_output=True, text=True, timeout=3600)
    lines = []
    for line in r.stdout.splitlines():
        m = re.match(r"\[host (\d+)\] \[rank \d+\] (.*)$", line)
        if m:
            lines.append((int(m.group(1)), m.group(2)))
    return r.returncode, lines, r.stdout[-2000:] + r.stderr[-2000:]
