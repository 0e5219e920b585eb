#!/usr/bin/env python3
"""weightlift vs PyTorch eager on the `small` preset (batch 8 x 256, 2 threads), f32 and bf16.

The two run alternately, `--rounds` times each, and the ratio is taken between medians of the
same run: these machines are shared, and a neighbour's load moves absolute times by 2x or more
within minutes, but it hits interleaved runs alike.

PyTorch runs in two configurations each round, and the ratio is taken against the faster: one
intra-op thread (Debian's build defaults to it, OpenBLAS then uses both cores inside each
matmul) and `torch.set_num_threads(2)` (which oversubscribes the cores with OpenMP and
OpenBLAS threads and is 2-3x slower here when the machine is idle, but is what many scripts
set). Comparing with the slower one alone would flatter us. Also prints our achieved GFLOP/s against
the GEMM peak of the run's dtype that `weightlift bench train` measures in the same process.

`--contended` measures each round twice, once idle and once while a busy neighbour (a third
process spinning on the CPU, as another user's job would) holds one of the cores, and reports
both ratios: users share machines, and a trainer whose step collapses when a neighbour wakes
up is slow in practice whatever its idle figure.
Usage: bench/compare_train.py [--weightlift build/release/apps/weightlift] [--rounds 3]
                              [--dtypes f32,bf16] [--contended]"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def busy_neighbour(on):
    """A process that keeps one core busy for as long as the block runs (nothing when off)."""
    if not on:
        yield
        return
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        p.kill()
        p.wait()


TORCH_THREADS = (1, 2)


def one_pair(a, dtype, contended):
    """Our step and PyTorch's in each thread configuration, under the same load."""
    with busy_neighbour(contended):
        ours = run_json([a.weightlift, "--threads", "2", "bench", "train", "--preset", "small",
                         "--batch", "8", "--seq", "256", "--precision", dtype, "--steps", "5",
                         "--json"])
        theirs = {t: run_json(["/usr/bin/python3", os.path.join(HERE, "torch_train_small.py"),
                               "--threads", str(t), "--dtype", dtype, "--steps", "2"])
                  for t in TORCH_THREADS}
    best = min(theirs.values(), key=lambda x: x["step_ms_median"])
    return ours, {**best, "by_threads": {t: x["step_ms_median"] for t, x in theirs.items()}}


def summarize(dtype, load, ours, theirs):
    o = statistics.median(x["step_ms_median"] for x in ours)
    t = statistics.median(x["step_ms_median"] for x in theirs)
    gf = statistics.median(x["gflops"] for x in ours)
    peak = statistics.median(x["gemm_peak_gflops"] for x in ours)
    # The GEMM the step runs on: bf16 only where this CPU multiplies bf16 natively.
    peak_dtype = ours[0].get("gemm_peak_dtype", dtype).lower()
    ratios = [b["step_ms_median"] / x["step_ms_median"] for x, b in zip(ours, theirs)]
    by_threads = {n: statistics.median(x["by_threads"][n] for x in theirs) for n in TORCH_THREADS}
    configs = ", ".join(f"{n} thread{'s' if n > 1 else ''} {ms:.0f}" for n, ms in by_threads.items())
    print(f"{dtype:>5} {load:>9}: weightlift {o:7.0f} ms/step ({2048 / o * 1e3:6.0f} tok/s, "
          f"{gf:5.1f} GFLOP/s = {100 * gf / peak:3.0f}% of the {peak:.0f} GFLOP/s {peak_dtype} GEMM "
          f"peak) | PyTorch {theirs[0]['torch']} eager, faster of its configurations, {t:7.0f} "
          f"ms/step ({configs}) | speedup {t / o:.2f}x (rounds {min(ratios):.2f}-"
          f"{max(ratios):.2f}x)")
    return {"dtype": dtype, "load": load, "weightlift_step_ms": o, "pytorch_step_ms": t,
            "pytorch_step_ms_by_threads": by_threads, "speedup": t / o, "speedup_rounds": ratios,
            "weightlift_gflops": gf, "gemm_peak_gflops": peak, "torch": theirs[0]["torch"],
            "cpu": ours[0]["cpu"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weightlift", default=os.path.join(HERE, "..", "build", "release", "apps",
                                                         "weightlift"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--contended", action="store_true",
                    help="also run every round with a busy neighbour on one core")
    a = ap.parse_args()
    loads = ["idle", "contended"] if a.contended else ["idle"]
    results = []
    for dtype in a.dtypes.split(","):
        runs = {load: ([], []) for load in loads}
        for r in range(a.rounds):
            for load in loads:
                ours, theirs = one_pair(a, dtype, load == "contended")
                runs[load][0].append(ours)
                runs[load][1].append(theirs)
                print(f"  {dtype} round {r + 1} {load}: weightlift "
                      f"{ours['step_ms_median']:.0f} ms, PyTorch {theirs['by_threads']} ms",
                      file=sys.stderr)
        rows = {load: summarize(dtype, load, *runs[load]) for load in loads}
        results.extend(rows.values())
        if a.contended:
            kept = rows["contended"]["speedup"] / rows["idle"]["speedup"]
            print(f"{dtype:>5}: the contended speedup is {100 * kept:.0f}% of the idle one")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
