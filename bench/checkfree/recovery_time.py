#!/usr/bin/env python3
"""How long a lost pipeline stage takes to come back on real processes (issue 14;
../../docs/BENCHMARKS.md "CheckFree on real processes").

Each round runs `weightlift launch -n S --restart-failed K -- weightlift train --preset small
--pp S --recovery STRATEGY` with three stages lost by the command's own drill (--kill: the
stage's process SIGKILLs itself as an iteration starts): a middle stage, the stage holding the
embedding and the one holding the head (CheckFree+ brings the ends back; under checkfree they
fall back to the newest checkpoint). From each run's summary.json: the kill to the first
survivor noticing (detection_ms) and from there to the rebuilt stage's first step
(recovery_ms), the issue's bar being under 2 s for `small`.

In the same rounds, interleaved, the same training without losses, with --recovery and
without it (parallel/'s pipeline, GPipe): what surviving a loss costs when nothing is lost,
as the ratio of their step times, pair by pair. Prints every figure, then min / median / max.

Usage: recovery_time.py --weightlift build/release/apps/weightlift [--rounds 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare_rl import cpu  # noqa: E402  the CPU model and its ISA, as every bench prints


def train(args, out, extra, restarts=0):
    cmd = [args.weightlift, "launch", "-n", str(args.stages), "--restart-failed", str(restarts),
           "--", args.weightlift, "--threads", "1", "train", "--preset", args.preset,
           "--pp", str(args.stages), "--micro-batches", str(args.micro_batches),
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--eval-every", "0", "--eval-windows", "0", "--out", out, "--timeout", "60",
           "--quiet"] + extra
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}\nexit {r.returncode}\n{r.stdout}{r.stderr}")
    steps = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    # Step time from the records' clock: the steps after the first (start-up excluded).
    step_s = (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / max(len(steps) - 1, 1)
    return seconds, step_s


def spread(xs, fmt="8.1f"):
    return (f"min {min(xs):{fmt}}  median {statistics.median(xs):{fmt}}  "
            f"max {max(xs):{fmt}}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weightlift", required=True)
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--strategy", default="checkfree+")
    args = p.parse_args()
    if args.rounds < 1 or args.stages < 4 or args.steps < 12:
        sys.exit("--rounds from 1, --stages from 4, --steps from 12")
    s = args.stages
    kills = ["--kill", "3:2", "--kill", "6:0", "--kill", "9:" + str(s - 1)]
    names = {2: "middle stage 2", 0: "stage 0 (embedding)", s - 1: f"stage {s - 1} (head)"}
    model, isa, _ = cpu()
    print(f"# {args.preset}, {s} stages x 1 thread, batch {args.batch} x {args.seq}, "
          f"{args.micro_batches} micro-batches, {args.strategy}; {model}, {os.cpu_count()} "
          f"cores, ISA {isa}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    detection, recovery = {k: [] for k in names}, {k: [] for k in names}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="wl-recovery-") as d:
        for r in range(args.rounds):
            lost = os.path.join(d, f"lost{r}")
            train(args, lost, ["--recovery", args.strategy, "--checkpoint-every", "4"] + kills,
                  restarts=3)
            summary = json.load(open(os.path.join(lost, "summary.json")))
            line = []
            for rec in summary["recoveries"]:
                st = rec["stages"][0]["stage"]
                detection[st].append(rec.get("detection_ms", float("nan")))
                recovery[st].append(rec["recovery_ms"])
                how = rec["stages"][0]["how"] + (" (fallback)" if "fallback" in rec else "")
                line.append(f"{names[st]}: {rec.get('detection_ms', float('nan')):.0f} + "
                            f"{rec['recovery_ms']:.0f} ms, {how}")
            _, resilient = train(args, os.path.join(d, f"resilient{r}"),
                                 ["--recovery", args.strategy])
            _, plain = train(args, os.path.join(d, f"plain{r}"), ["--pp-schedule", "gpipe"])
            ratios.append(resilient / plain)
            print(f"round {r + 1}: " + "; ".join(line) +
                  f"; step {resilient * 1e3:.0f} ms with --recovery, {plain * 1e3:.0f} ms "
                  f"without ({resilient / plain:.3f}x)")
            sys.stdout.flush()
    print("# kill -> detection (ms), detection -> the rebuilt stage's first step (ms)")
    for st, name in names.items():
        print(f"{name:24s} detection {spread(detection[st])}")
        print(f"{'':24s} recovery  {spread(recovery[st])}")
    worst = max(max(v) for v in recovery.values())
    print(f"# bar: recovery under 2000 ms for every loss of every round: "
          f"{'met' if worst < 2000 else 'NOT met'} (worst {worst:.0f} ms)")
    print(f"# step with --recovery / without, no losses: {spread(ratios, '.3f')}")


if __name__ == "__main__":
    main()
