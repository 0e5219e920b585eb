"""What bench/testbed_*.py share: a command run on a fresh scripts/testbed.sh testbed, its ranks'
lines, the NIC rates tc takes, byte sizes, and the plot of an allreduce's time against size."""
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


def parse_bytes(text):
    """"4M" -> 4194304 (K, M, G: powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TiB"


ALGORITHM_COLORS = {"hierarchical": "#9467bd", "ring": "#1f77b4", "tree": "#2ca02c",
                    "recursive_doubling": "#d62728"}


def time_plot(path, title, curves, ylabel="time per call (ms, median)"):
    """An allreduce's time against its size, log-log, into `path` (svg): `curves` is a list of
    (label, {bytes: microseconds}, matplotlib style, color)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, times, style, color in curves:
        sizes = sorted(times)
        ax.plot(sizes, [times[n] / 1e3 for n in sizes], style, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("allreduce size (bytes)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(curves) > 4 else 1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
