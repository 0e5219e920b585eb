#!/usr/bin/python3
"""The hierarchical allreduce against the flat ones, with several ranks per testbed host.

  sudo bench/testbed_hierarchical.py --weightlift build/release/apps/weightlift \\
      [--hosts 2,4] [--ranks-per-host 2] [--rates 1gbit,100mbit] [--max-bytes 2M] \\
      [--rounds 2] [--out runs/testbed-hierarchical]

For each NIC rate and host count (scripts/testbed.sh, --ranks-per-host ranks on each host:
shared memory inside a host, TCP between) it times the allreduce over sizes 8 B .. --max-bytes
(x4) with the hierarchical algorithm (allreduce_hierarchical.cc) and with each flat one (the
ring, the double binary tree, recursive doubling), every algorithm on a fresh testbed, the
algorithms in turn within a round. It prints, per size, the hierarchical median, the best flat
one's and which it was, and the ratio per round (best flat / hierarchical: above 1, the
hierarchical one is faster), and at the largest size the fraction of the NIC-limited bound the
hierarchical one reaches (each host's NIC carries 2 (H - 1) / H of the buffer each way).
A plot per configuration goes to --out.
"""
import argparse
import json
import os
import statistics
import sys

from testbed_runs import (ALGORITHM_COLORS, human_bytes, parse_bytes, rate_bytes_per_s,
                         run_on_testbed, time_plot)

FLAT = ("ring", "tree", "recursive_doubling")
ALGORITHMS = ("hierarchical",) + FLAT


def measure(exe, hosts, ranks_per_host, rate, algorithm, max_bytes, iters):
    """p50 microseconds by size, rank 0's rows of one sweep on a fresh testbed."""
    cmd = [exe, "--threads", "1", "bench", "collectives", "--ops", "allreduce", "--algorithm",
           algorithm, "--min-bytes", "8", "--max-bytes", str(max_bytes), "--factor", "4",
           "--iters", str(iters), "--warmup", "2", "--timeout", "120", "--json"]
    code, lines, output = run_on_testbed(exe, hosts, rate, cmd, ranks_per_host=ranks_per_host)
    rows = [json.loads(text) for host, text in lines if host == 0 and text.startswith("{")]
    if code != 0 or not rows:
        raise SystemExit(f"{' '.join(cmd)} on {hosts} hosts: exit {code}\n{output}")
    for row in rows:
        if row["algorithm"] != algorithm or row["wrong"] != 0:
            raise SystemExit(f"asked for {algorithm}: ran {row['algorithm']}, "
                             f"{row['wrong']} wrong")
    return {row["bytes"]: row["p50_us"] for row in rows}


def plot(path, title, medians):
    time_plot(path, title,
              [(alg, medians[alg], "o-" if alg == "hierarchical" else "o--", ALGORITHM_COLORS[alg])
               for alg in ALGORITHMS], ylabel="time per call (ms, median of rounds)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weightlift", required=True)
    ap.add_argument("--hosts", default="2,4")
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--rates", default="1gbit,100mbit")
    ap.add_argument("--max-bytes", default="2M")
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="runs/testbed-hierarchical")
    a = ap.parse_args()
    exe = os.path.abspath(a.weightlift)
    os.makedirs(a.out, exist_ok=True)
    hi = parse_bytes(a.max_bytes)
    results = []
    for rate in a.rates.split(","):
        for hosts in [int(h) for h in a.hosts.split(",")]:
            rounds = []
            for _ in range(a.rounds):
                rounds.append({alg: measure(exe, hosts, a.ranks_per_host, rate, alg, hi, a.iters)
                               for alg in ALGORITHMS})
            sizes = sorted(rounds[0]["hierarchical"])
            medians = {alg: {n: statistics.median(r[alg][n] for r in rounds) for n in sizes}
                       for alg in ALGORITHMS}
            print(f"\n{hosts} hosts x {a.ranks_per_host} ranks, NICs at {rate} "
                  f"({a.rounds} rounds, p50 of {a.iters} calls each)")
            print("| size | hierarchical us | best flat us (which) | best flat / hierarchical "
                  "(rounds) |")
            print("|---|---|---|---|")
            for n in sizes:
                best = min(FLAT, key=lambda alg: medians[alg][n])
                ratios = [min(r[alg][n] for alg in FLAT) / r["hierarchical"][n] for r in rounds]
                print(f"| {human_bytes(n)} | {medians['hierarchical'][n]:.0f} | "
                      f"{medians[best][n]:.0f} ({best}) | "
                      f"{statistics.median(ratios):.2f} ("
                      + ", ".join(f"{x:.2f}" for x in ratios) + ") |")
            n = sizes[-1]
            bound_us = 2 * (hosts - 1) / hosts * n / rate_bytes_per_s(rate) * 1e6
            print(f"at {human_bytes(n)}: the hierarchical allreduce at "
                  f"{bound_us / medians['hierarchical'][n]:.0%} of the NIC-limited bound "
                  f"({bound_us:.0f} us: 2 (H-1)/H of it through each host's NIC at {rate})",
                  flush=True)
            name = f"hierarchical_{rate}_{hosts}x{a.ranks_per_host}"
            plot(os.path.join(a.out, name + ".svg"),
                 f"allreduce, {hosts} hosts x {a.ranks_per_host} ranks, {rate} NICs", medians)
            results.append({"rate": rate, "hosts": hosts, "ranks_per_host": a.ranks_per_host,
                            "rounds": rounds})
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"# plots and results.json in {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
