#!/usr/bin/python3
"""One allreduce size, many runs in a row: weightlift against OpenMPI, a ratio per run.

A figure met in one run of five is not met; this is the check for the large-message allreduce
(issue 16), which used to fall to a third of its speed in some runs. Each run is a fresh pair
of processes for each implementation, one after the other:
  weightlift  `weightlift launch -n N -- weightlift bench collectives --pin --ops allreduce`
  openmpi     `mpirun --allow-run-as-root --oversubscribe -np N mpi_collectives --ops allreduce`
and the line printed per run is both busbw figures and their ratio; the summary gives the
smallest, the median and how many runs reached --bar.

    /usr/bin/python3 bench/allreduce_every_run.py --build build/release --runs 10 --bytes 64M
"""
import argparse
import os
import shutil
import statistics
import sys

from compare_collectives import mpirun, rows_from


def busbw(rows, impl):
    got = [r["busbw_gbps"] for r in rows if r.get("impl") == impl and r.get("op") == "allreduce"]
    return got[0] if got else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build/release", help="CMake build directory")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--bytes", default="64M", help="allreduce size (K/M/G suffixes)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--bar", type=float, default=2.0, help="ratio each run should reach")
    ap.add_argument("--mpi-keep-heap", action="store_true",
                    help="OpenMPI with glibc keeping its large freed blocks "
                         "(compare_collectives.KEEP_HEAP)")
    args = ap.parse_args()
    if args.runs < 1:
        sys.exit("--runs %d: expected 1 or more" % args.runs)
    wl = os.path.join(args.build, "apps", "weightlift")
    mpi = os.path.join(args.build, "bench", "mpi_collectives")
    if not (os.path.exists(wl) and os.path.exists(mpi) and shutil.which("mpirun")):
        sys.exit("needs %s, %s and mpirun (scripts/setup.sh, scripts/build.sh)" % (wl, mpi))
    size = ["--ops", "allreduce", "--min-bytes", args.bytes, "--max-bytes", args.bytes]
    peer = ", OpenMPI keeping its heap" if args.mpi_keep_heap else ""
    print("%d ranks, f32 sum, %s, busbw GB/s%s" % (args.nprocs, args.bytes, peer))
    print("%4s %11s %9s %7s" % ("run", "weightlift", "openmpi", "ratio"))
    ratios = []
    for run in range(1, args.runs + 1):
        ours = busbw(rows_from([wl, "launch", "-n", str(args.nprocs), "--", wl, "bench",
                                "collectives", "--json", "--pin"] + size), "weightlift")
        theirs = busbw(rows_from(mpirun(args.nprocs, args.mpi_keep_heap) + [mpi] + size),
                       "openmpi")
        if ours is None or theirs is None or theirs <= 0:
            sys.exit("run %d: no figure from %s" % (run, "weightlift" if ours is None else "OpenMPI"))
        ratios.append(ours / theirs)
        print("%4d %11.2f %9.2f %7.2f" % (run, ours, theirs, ratios[-1]), flush=True)
    met = sum(r >= args.bar for r in ratios)
    print("ratio: min %.2f, median %.2f, max %.2f; %d of %d runs at %.1fx or more"
          % (min(ratios), statistics.median(ratios), max(ratios), met, len(ratios), args.bar))


if __name__ == "__main__":
    main()
