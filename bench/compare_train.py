#!/usr/bin/env python3
"""weightlift vs PyTorch eager on the `small` preset (batch 8 x 256, 2 threads), f32 and bf16.

The two run alternately, `--rounds` times each, and the ratio is taken between medians of the
same run: these machines are shared, and a neighbour's load moves absolute times by 2x or more
within minutes, but it hits interleaved runs alike. Also prints our achieved GFLOP/s against
the f32 GEMM peak that `weightlift bench train` measures in the same process.
Usage: bench/compare_train.py [--weightlift build/release/apps/weightlift] [--rounds 3]"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weightlift", default=os.path.join(HERE, "..", "build", "release", "apps",
                                                         "weightlift"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="f32,bf16")
    a = ap.parse_args()
    results = []
    for dtype in a.dtypes.split(","):
        ours, theirs = [], []
        for r in range(a.rounds):
            ours.append(run_json([a.weightlift, "--threads", "2", "bench", "train", "--preset",
                                  "small", "--batch", "8", "--seq", "256", "--precision", dtype,
                                  "--steps", "5", "--json"]))
            theirs.append(run_json(["/usr/bin/python3", os.path.join(HERE, "torch_train_small.py"),
                                    "--threads", "2", "--dtype", dtype, "--steps", "2"]))
            print(f"  {dtype} round {r + 1}: weightlift {ours[-1]['step_ms_median']:.0f} ms, "
                  f"PyTorch {theirs[-1]['step_ms_median']:.0f} ms", file=sys.stderr)
        o = statistics.median(x["step_ms_median"] for x in ours)
        t = statistics.median(x["step_ms_median"] for x in theirs)
        gf = statistics.median(x["gflops"] for x in ours)
        peak = statistics.median(x["gemm_peak_gflops"] for x in ours)
        row = {"dtype": dtype, "weightlift_step_ms": o, "pytorch_step_ms": t, "speedup": t / o,
               "weightlift_gflops": gf, "gemm_peak_gflops": peak, "torch": theirs[0]["torch"]}
        results.append(row)
        print(f"{dtype:>5}: weightlift {o:7.0f} ms/step ({2048 / o * 1e3:6.0f} tok/s, "
              f"{gf:5.1f} GFLOP/s = {100 * gf / peak:3.0f}% of the {peak:.0f} GFLOP/s f32 GEMM "
              f"peak) | PyTorch {theirs[0]['torch']} eager {t:7.0f} ms/step | "
              f"speedup {t / o:.2f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
