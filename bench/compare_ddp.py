#!/usr/bin/env python3
"""Data-parallel training side by side: weightlift's layouts and PyTorch DDP (gloo), one run.

Each round runs, one after the other on the same machine, the `small` preset's step with a
global batch of 8 x 256:
  weightlift DDP       weightlift launch -n 2 -- weightlift --threads 1 bench train --dp-mode ddp
  weightlift FSDP      the same with --dp-mode fsdp
  weightlift 1 x 2     one process with 2 threads (the scaling yardstick)
  PyTorch DDP          bench/torch_ddp_small.py --nprocs 2 --threads 1 (gloo, find_unused_parameters)
and reports the medians over the rounds, the ratios taken round by round, the exposed
communication weightlift measured and each layout's peak model state per rank. With
`--precision bf16` both sides run bf16 mixed precision (weightlift's GEMMs on bf16 operands,
PyTorch's forward under CPU autocast).

    /usr/bin/python3 bench/compare_ddp.py --rounds 3 [--precision bf16]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def last_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    for line in reversed(out.splitlines()):
        at = line.find("{")
        if at >= 0:
            return json.loads(line[at:])
    raise RuntimeError("no JSON from " + " ".join(cmd))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weightlift", default=os.path.join(HERE, "..", "build", "release", "apps",
                                                         "weightlift"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()
    wl = os.path.abspath(a.weightlift)
    step = ["bench", "train", "--preset", "small", "--batch", str(a.batch), "--seq", str(a.seq),
            "--steps", "5", "--json", "--precision", a.precision]
    runs = {
        "weightlift ddp 2x1": [wl, "launch", "-n", "2", "--", wl, "--threads", "1"] + step +
                              ["--dp-mode", "ddp"],
        "weightlift fsdp 2x1": [wl, "launch", "-n", "2", "--", wl, "--threads", "1"] + step +
                               ["--dp-mode", "fsdp"],
        "weightlift 1x2": [wl, "--threads", "2"] + step,
        "pytorch ddp 2x1": ["/usr/bin/python3", os.path.join(HERE, "torch_ddp_small.py"),
                            "--nprocs", "2", "--threads", "1", "--batch", str(a.batch),
                            "--seq", str(a.seq), "--steps", "3", "--dtype", a.precision],
    }
    results = {name: [] for name in runs}
    for r in range(a.rounds):
        for name, cmd in runs.items():
            results[name].append(last_json(cmd))
            print(f"  round {r + 1} {name}: {results[name][-1]['step_ms_median']:.0f} ms",
                  file=sys.stderr, flush=True)
    med = {n: statistics.median(x["step_ms_median"] for x in v) for n, v in results.items()}
    def ratio(a_name, b_name):
        rs = [y["step_ms_median"] / x["step_ms_median"]
              for x, y in zip(results[a_name], results[b_name])]
        return statistics.median(rs), min(rs), max(rs)
    print(f"cpu: {results['weightlift 1x2'][0]['cpu']}, precision {a.precision}")
    for n in runs:
        extra = ""
        if n.startswith("weightlift"):
            x = results[n][0]
            extra = (f"  exposed comm {statistics.median(y['exposed_comm_ms'] for y in results[n]):.1f}"
                     f" ms, peak state {x['peak_bytes_per_rank'] / 1e6:.1f} MB per rank")
        print(f"{n:>22}: {med[n]:7.0f} ms/step  {a.batch * a.seq / med[n] * 1e3:6.0f} tok/s{extra}")
    m, lo, hi = ratio("weightlift ddp 2x1", "pytorch ddp 2x1")
    print(f"weightlift DDP vs PyTorch DDP: {m:.2f}x faster (rounds {lo:.2f}-{hi:.2f})")
    m, lo, hi = ratio("weightlift ddp 2x1", "weightlift 1x2")
    print(f"DDP 2x1 tokens/s as a share of one process x 2 threads: {100 / m:.0f}% "
          f"(rounds {100 / hi:.0f}-{100 / lo:.0f}%)")
    m, lo, hi = ratio("weightlift fsdp 2x1", "weightlift ddp 2x1")
    print(f"FSDP 2 step time over DDP 2: {1 / m:.2f}x (rounds {1 / hi:.2f}-{1 / lo:.2f})")
    print(json.dumps({n: v for n, v in results.items()}))


if __name__ == "__main__":
    main()
