#!/usr/bin/python3
"""The allreduce's algorithms across hosts, measured on the testbed and held to the cost model.

  sudo bench/testbed_collectives.py --weightlift build/release/apps/weightlift \\
      [--hosts 2,4,8] [--rates 100mbit,1gbit] [--max-bytes 4M] [--out runs/testbed-collectives]

For each NIC rate and host count (one rank per host, scripts/testbed.sh) it times the ring, the
double binary tree and recursive doubling over sizes 8 B .. --max-bytes (x4), and asks
`weightlift bench collectives --model` for each one's predicted time with:
  - alpha, the time of one message step, measured on the spot on the same hosts: the 8-byte
    allreduce by recursive doubling, median of its calls, over its log2(hosts) exchanges (on
    this 2-core machine a step between 8 processes costs several times one between 2, which a
    2-host alpha would miss: both are printed);
  - the link, the NIC's rate as set (bytes/s = rate / 8): not fitted to any result here.
It prints, per configuration, where the ring starts beating the tree (measured: the smallest
size from which the ring is at least as fast at every larger size of the grid; predicted: the
same on the model's times at the same sizes), how many x4 size steps apart they are, and the
model's error per algorithm (median and worst of |predicted - measured| / measured); a
measured/predicted plot per configuration goes to --out.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys

from testbed_runs import (ALGORITHM_COLORS, human_bytes, parse_bytes, rate_bytes_per_s,
                         run_on_testbed, time_plot)

ALGORITHMS = ("ring", "tree", "recursive_doubling")


def measure(exe, hosts, rate, algorithm, min_bytes, max_bytes, iters):
    """Rank 0's rows of one sweep on a fresh testbed."""
    cmd = [exe, "--threads", "1", "bench", "collectives", "--ops", "allreduce", "--algorithm",
           algorithm, "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes), "--factor",
           "4", "--iters", str(iters), "--warmup", "2", "--timeout", "120", "--json"]
    code, lines, output = run_on_testbed(exe, hosts, rate, cmd)
    rows = [json.loads(text) for host, text in lines if host == 0 and text.startswith("{")]
    if code != 0 or not rows:
        raise SystemExit(f"{' '.join(cmd)} on {hosts} hosts: exit {code}\n{output}")
    for row in rows:
        if row["algorithm"] != algorithm:
            raise SystemExit(f"asked for {algorithm}, ran {row['algorithm']}")
    return {row["bytes"]: row["p50_us"] for row in rows}


def model(exe, hosts, alpha_us, link_gbps, min_bytes, max_bytes):
    cmd = [exe, "bench", "collectives", "--model", "--model-ranks", str(hosts),
           "--model-alpha-us", "%.3f" % alpha_us, "--model-link-gbps", "%.6f" % link_gbps,
           "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes), "--factor", "4",
           "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    times = {a: {row["bytes"]: row[a + "_us"] for row in rows if "bytes" in row}
             for a in ALGORITHMS}
    fine = [row["ring_beats_tree_from"] for row in rows if "ring_beats_tree_from" in row][0]
    return times, fine


def crossover(ring, tree):
    """The smallest size of the grid from which the ring is at least as fast everywhere above;
    None if the tree wins at the largest size."""
    sizes = sorted(ring)
    at = None
    for n in reversed(sizes):
        if ring[n] <= tree[n]:
            at = n
        else:
            break
    return at


def human(n):
    return "never" if n is None else human_bytes(n)


def steps_apart(a, b):
    if a is None or b is None:
        return "-" if a == b else "n/a"
    return "%d" % round(abs(math.log(a / b, 4)))


def plot(path, title, measured, predicted):
    curves = []
    for a in ALGORITHMS:
        curves.append((f"{a} measured", measured[a], "o-", ALGORITHM_COLORS[a]))
        curves.append((f"{a} model", predicted[a], "--", ALGORITHM_COLORS[a]))
    time_plot(path, title, curves)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weightlift", required=True)
    ap.add_argument("--hosts", default="2,4,8")
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--max-bytes", default="4M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="runs/testbed-collectives")
    a = ap.parse_args()
    exe = os.path.abspath(a.weightlift)
    os.makedirs(a.out, exist_ok=True)
    lo, hi = parse_bytes(a.min_bytes), parse_bytes(a.max_bytes)
    results = []
    print("| NIC | hosts | alpha (us): 2 hosts, these | ring beats tree from: measured | "
          "predicted (grid) | "
          "predicted (fine) | x4 steps apart | model error, median / worst: ring | tree | "
          "rec. doubling |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rate in a.rates.split(","):
        alpha2 = measure(exe, 2, rate, "recursive_doubling", 8, 8, 50)[8]
        link_gbps = rate_bytes_per_s(rate) / 1e9
        for hosts in [int(h) for h in a.hosts.split(",")]:
            # The model's count (allreduce.cc): floor(log2 P) exchanges, 2 more off a power of 2.
            steps = math.floor(math.log2(hosts)) + (0 if hosts & (hosts - 1) == 0 else 2)
            alpha = alpha2 if hosts == 2 else \
                measure(exe, hosts, rate, "recursive_doubling", 8, 8, 50)[8] / steps
            measured = {alg: measure(exe, hosts, rate, alg, lo, hi, a.iters) for alg in ALGORITHMS}
            predicted, fine = model(exe, hosts, alpha, link_gbps, lo, hi)
            got = crossover(measured["ring"], measured["tree"])
            want = crossover(predicted["ring"], predicted["tree"])
            errors = []
            for alg in ALGORITHMS:
                e = [abs(predicted[alg][n] - t) / t for n, t in measured[alg].items()]
                errors.append("%.0f%% / %.0f%%" % (100 * statistics.median(e), 100 * max(e)))
            print(f"| {rate} | {hosts} | {alpha2:.0f}, {alpha:.0f} | {human(got)} | {human(want)} | "
                  f"{'always' if fine == 0 else human(fine)} | {steps_apart(got, want)} | "
                  + " | ".join(errors) + " |", flush=True)
            name = f"allreduce_{rate}_{hosts}hosts"
            plot(os.path.join(a.out, name + ".svg"),
                 f"allreduce, {hosts} hosts on {rate} NICs (alpha {alpha:.0f} us)", measured,
                 predicted)
            results.append({"rate": rate, "hosts": hosts, "alpha_us": alpha, "alpha2_us": alpha2,
                            "link_gbps": link_gbps, "measured_us": measured,
                            "predicted_us": predicted, "crossover_measured": got,
                            "crossover_predicted": want})
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"# plots and results.json in {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
