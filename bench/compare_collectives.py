#!/usr/bin/python3
"""Collectives side by side: weightlift vs OpenMPI vs torch.distributed (gloo), in one run.

For each op it runs the same sweep three times, one implementation after the other:
  weightlift  `weightlift launch -n N -- weightlift bench collectives --json`   (apps/weightlift/bench/collectives.h)
  openmpi     `mpirun --allow-run-as-root --oversubscribe -np N mpi_collectives`
  gloo        `/usr/bin/python3 bench/gloo_collectives.py --nprocs N`
then prints busbw per size with the ratios (and time ratios, which matter for small sizes),
writes an SVG plot of busbw against size per op, and optionally all rows as JSON lines.
With --interleave it runs one size at a time, every implementation in turn: the machine's
state changes within seconds (docs/algorithms.md, "Where the slow runs came from"), and a
whole sweep of one implementation after the other's may compare two different machines.

With --turns weightlift and OpenMPI run at the same time and take turns, in blocks of a few
hundred microseconds to a few hundred milliseconds per size (apps/weightlift/bench/turns.h):
each size's calls of both are spread over the same stretch of time, so the ratio compares the
implementations, not two moments of the machine. gloo, if not skipped, then sweeps alone.

    /usr/bin/python3 bench/compare_collectives.py --build build/release --out runs/collectives

A peer that is missing (no mpirun, no torch) is left out with a note.
"""
import argparse
import errno
import json
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
COLORS = {"weightlift": "#d62728", "openmpi": "#1f77b4", "gloo": "#2ca02c"}


def rows_from(cmd, env=None):
    """Runs cmd and returns the JSON objects among its output lines (launcher prefixes ok)."""
    print("# running: " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, timeout=3600)
    rows = json_rows(proc.stdout)
    if proc.returncode != 0:
        print("# %s exited %d:\n%s" % (cmd[0], proc.returncode, proc.stdout[-3000:]),
              file=sys.stderr)
    return rows


# OpenMPI's allreduce takes a temporary buffer per call. glibc returns blocks of 32 MiB and
# more to the system when they are freed, so from 32 MiB every call page-faults its buffer in
# again; on these virtual machines that took OpenMPI from 3.7 to 0.2 GB/s (BENCHMARKS.md).
# --mpi-keep-heap runs OpenMPI with glibc told to keep such blocks, as a tuned install would.
KEEP_HEAP = ("GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:"
             "glibc.malloc.trim_threshold=4294967296")


def mpirun(nprocs, keep_heap):
    """The start of an mpirun command line for `nprocs` ranks on this host."""
    return (["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nprocs)] +
            (["-x", KEEP_HEAP] if keep_heap else []))


def json_rows(text):
    """The JSON objects among the lines of `text` (launcher prefixes ok)."""
    rows = []
    for line in text.splitlines():
        at = line.find("{")
        if at < 0:
            continue
        try:
            rows.append(json.loads(line[at:]))
        except json.JSONDecodeError:
            pass
    return rows


class TurnTaker:
    """One program under the turns protocol of apps/weightlift/bench/turns.h: its ranks' FIFOs
    and its process, with its output in a file."""

    def __init__(self, impl, cmd, folder, nprocs):
        self.impl, self.folder, self.nprocs = impl, folder, nprocs
        self.paths = [os.path.join(folder, "%s.%d" % (impl, r)) for r in range(nprocs)]
        for base in self.paths:
            os.mkfifo(base + ".go")
            os.mkfifo(base + ".done")
        # Open for reading before the ranks open for writing, so neither side waits.
        self.done = [os.open(base + ".done", os.O_RDONLY | os.O_NONBLOCK) for base in self.paths]
        self.go = []
        self.log = open(os.path.join(folder, impl + ".out"), "w+")
        print("# running: " + " ".join(cmd), file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def connect(self, deadline):
        """Opens every rank's go FIFO once the rank has opened it; False if the program ended."""
        for base in self.paths[len(self.go):]:
            while True:
                try:
                    self.go.append(os.open(base + ".go", os.O_WRONLY | os.O_NONBLOCK))
                    break
                except OSError as e:
                    if e.errno != errno.ENXIO:
                        raise
                if self.proc.poll() is not None:
                    return False
                if time.monotonic() > deadline:
                    sys.exit("%s: no rank opened %s.go in time" % (self.impl, base))
                time.sleep(0.01)
        return True

    def turn(self, timeout):
        """Gives every rank one turn and waits until all are done; False once the program ended."""
        try:
            for fd in self.go:
                os.write(fd, b"g")
        except BrokenPipeError:
            return False
        ended = 0
        for fd, base in zip(self.done, self.paths):
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                self.proc.kill()
                sys.exit("%s: %s.done: no answer within %d s" % (self.impl, base, timeout))
            ended += os.read(fd, 1) == b""
        if ended and ended != len(self.done):
            print("# %s: %d of %d ranks ended mid-sweep" % (self.impl, ended, len(self.done)),
                  file=sys.stderr)
        return ended == 0

    def finish(self):
        for fd in self.go + self.done:
            os.close(fd)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.seek(0)
        out = self.log.read()
        self.log.close()
        if self.proc.returncode != 0:
            print("# %s exited %d:\n%s" % (self.impl, self.proc.returncode, out[-3000:]),
                  file=sys.stderr)
        return json_rows(out)


def measure_by_turns(args, op, sizes, skip):
    """weightlift and OpenMPI at once, taking turns (see the module's comment)."""
    wl = os.path.join(args.build, "apps", "weightlift")
    folder = tempfile.mkdtemp(prefix="wl-turns-")
    turns = ["--turns", folder, "--turn-blocks", str(args.turn_blocks)]
    takers = [TurnTaker("weightlift", [wl, "launch", "-n", str(args.nprocs), "--", wl, "bench",
                                       "collectives", "--json", "--ops", op] + sizes + turns,
                        folder, args.nprocs)]
    if "openmpi" not in skip:
        takers.append(TurnTaker("openmpi", mpirun(args.nprocs, args.mpi_keep_heap) +
                                [os.path.join(args.build, "bench", "mpi_collectives"),
                                 "--ops", op] + sizes + turns, folder, args.nprocs))
    deadline = time.monotonic() + 300
    active = [t for t in takers if t.connect(deadline)]
    k = 0
    while active:
        # Who goes first alternates, so neither always runs right after the other.
        for t in list(active if k % 2 == 0 else reversed(active)):
            if not t.turn(timeout=600):
                active.remove(t)
        k += 1
    rows = []
    for t in takers:
        rows += t.finish()
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def human(n):
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return "%d%s" % (n // size, unit)
    return str(n)


def svg_plot(path, op, series, ranks):
    """busbw (GB/s) against size (log2 axis) for each implementation."""
    w, h, l, r, t, b = 820, 500, 70, 150, 40, 60
    pts = [(x, y) for rows in series.values() for x, y in rows]
    if not pts:
        return
    xmin, xmax = math.log2(min(p[0] for p in pts)), math.log2(max(p[0] for p in pts))
    ymax = max(p[1] for p in pts) * 1.1 or 1.0
    sx = lambda x: l + (math.log2(x) - xmin) / max(1e-9, xmax - xmin) * (w - l - r)
    sy = lambda y: h - b - y / ymax * (h - t - b)
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
           'font-family="sans-serif" font-size="12">' % (w, h),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="22" font-size="15">%s busbw, %d ranks (higher is better)</text>'
           % (l, op, ranks)]
    for i in range(6):
        y = ymax * i / 5
        out.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>'
                   % (l, w - r, sy(y), sy(y)))
        out.append('<text x="%d" y="%.1f" text-anchor="end">%.2f</text>' % (l - 6, sy(y) + 4, y))
    e = int(xmin)
    while e <= xmax:
        if e % 2 == 0 or xmax - xmin < 12:
            x = sx(2 ** e)
            out.append('<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#eee"/>' % (x, x, t, h - b))
            out.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>'
                       % (x, h - b + 16, human(2 ** e)))
        e += 1
    out.append('<text x="%d" y="%d" text-anchor="middle">size (bytes)</text>' % ((l + w - r) // 2, h - 15))
    out.append('<text x="16" y="%d" transform="rotate(-90 16 %d)" text-anchor="middle">busbw (GB/s)</text>'
               % ((t + h - b) // 2, (t + h - b) // 2))
    for k, (impl, rows) in enumerate(series.items()):
        if not rows:
            continue
        c = COLORS.get(impl, "#555")
        d = " ".join("%s%.1f,%.1f" % ("M" if i == 0 else "L", sx(x), sy(y))
                     for i, (x, y) in enumerate(rows))
        out.append('<path d="%s" fill="none" stroke="%s" stroke-width="2"/>' % (d, c))
        for x, y in rows:
            out.append('<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"/>' % (sx(x), sy(y), c))
        out.append('<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="2"/>'
                   % (w - r + 12, w - r + 36, t + 20 * k + 10, t + 20 * k + 10, c))
        out.append('<text x="%d" y="%d">%s</text>' % (w - r + 42, t + 20 * k + 14, impl))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    n = int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)
    if n < 1:
        sys.exit("a size of %r: expected 1 byte or more" % text)
    return n


def sizes_of(min_bytes, max_bytes, factor):
    n, last, out = parse_bytes(min_bytes), parse_bytes(max_bytes), []
    while n <= last:
        out.append(n)
        n *= factor
    return out


def measure(args, op, sizes, skip, wl=True):
    """The rows of every implementation not in `skip`, one after the other, for `sizes` (flags)."""
    rows = []
    if wl:
        binary = os.path.join(args.build, "apps", "weightlift")
        rows += rows_from([binary, "launch", "-n", str(args.nprocs), "--", binary, "bench",
                           "collectives", "--json", "--ops", op] + sizes)
    if "openmpi" not in skip:
        mpi = os.path.join(args.build, "bench", "mpi_collectives")
        rows += rows_from(mpirun(args.nprocs, args.mpi_keep_heap) + [mpi, "--ops", op] + sizes)
    if "gloo" not in skip:
        rows += rows_from(["/usr/bin/python3", os.path.join(HERE, "gloo_collectives.py"),
                           "--nprocs", str(args.nprocs), "--ops", op] + sizes)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build/release", help="CMake build directory")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--ops", default="allreduce,allgather,reduce_scatter,broadcast")
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--factor", type=int, default=2)
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--out", default="runs/collectives", help="prefix of the SVG and JSON files")
    ap.add_argument("--skip", default="", help="comma-separated peers to leave out: openmpi,gloo")
    ap.add_argument("--interleave", action="store_true",
                    help="one size at a time, every implementation in turn, so that each size's "
                         "figures share the machine's state (slower: a launch per size)")
    ap.add_argument("--turns", action="store_true",
                    help="weightlift and OpenMPI at once, taking turns within each size "
                         "(see above); gloo, if not skipped, sweeps after them")
    ap.add_argument("--turn-blocks", type=int, default=10, help="--turns: turns per size")
    ap.add_argument("--mpi-keep-heap", action="store_true",
                    help="run OpenMPI with glibc keeping freed blocks of 32 MiB and more (see "
                         "KEEP_HEAP), as a tuned install would")
    args = ap.parse_args()
    if args.turns and args.interleave:
        sys.exit("--turns and --interleave: choose one")
    if args.turn_blocks < 1:
        sys.exit("--turn-blocks %d: expected 1 or more" % args.turn_blocks)
    if args.factor < 2:
        sys.exit("--factor %d: expected 2 or more" % args.factor)

    sweep = ["--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes,
             "--factor", str(args.factor), "--iters", str(args.iters)]
    mpi = os.path.join(args.build, "bench", "mpi_collectives")
    skip = set(filter(None, args.skip.split(",")))
    if not (os.path.exists(mpi) and shutil.which("mpirun")):
        print("# OpenMPI peer not available (no mpi_collectives or mpirun); left out", file=sys.stderr)
        skip.add("openmpi")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    all_rows = []
    for op in args.ops.split(","):
        if args.turns:
            rows = measure_by_turns(args, op, sweep, skip)
            if "gloo" not in skip:
                rows += measure(args, op, sweep, skip | {"openmpi"}, wl=False)
        elif args.interleave:
            rows = []
            for n in sizes_of(args.min_bytes, args.max_bytes, args.factor):
                one = ["--min-bytes", str(n), "--max-bytes", str(n), "--iters", str(args.iters)]
                rows += measure(args, op, one, skip)
        else:
            rows = measure(args, op, sweep, skip)
        all_rows += rows
        by = {}
        for row in rows:
            by.setdefault(row["impl"], {})[row["bytes"]] = row
        sizes = sorted(by.get("weightlift", {}))
        print("\n## %s, %d ranks, f32: busbw GB/s (time us), ratio = weightlift / peer" % (op, args.nprocs))
        print("%10s %20s %20s %20s %9s %9s %7s %7s %7s" % ("size", "weightlift", "openmpi", "gloo",
              "x mpi", "x gloo", "t/mpi", "t/gloo", "bound"))
        for n in sizes:
            us = by["weightlift"][n]
            cells, ratios, tratios = [], [], []
            for impl in ("weightlift", "openmpi", "gloo"):
                row = by.get(impl, {}).get(n)
                cells.append("%8.3f (%9.1f)" % (row["busbw_gbps"], row["time_us"]) if row else "-")
                if impl != "weightlift":
                    ratios.append("%9.2f" % (us["busbw_gbps"] / row["busbw_gbps"])
                                  if row and row["busbw_gbps"] > 0 else "%9s" % "-")
                    tratios.append("%7.2f" % (us["time_us"] / row["time_us"]) if row else "%7s" % "-")
            bound = "%6.0f%%" % (100 * us.get("bound_fraction", 0))
            print("%10s %20s %20s %20s %s %s %s" % (human(n), cells[0], cells[1], cells[2],
                  " ".join(ratios), " ".join(tratios), bound))
        series = {impl: sorted((n, r["busbw_gbps"]) for n, r in by.get(impl, {}).items())
                  for impl in ("weightlift", "openmpi", "gloo")}
        svg_plot("%s_%s.svg" % (args.out, op), op, series, args.nprocs)
        print("# plot: %s_%s.svg" % (args.out, op))
    with open(args.out + ".jsonl", "w") as f:
        for row in all_rows:
            f.write(json.dumps(row) + "\n")
    print("# rows: %s.jsonl" % args.out)


if __name__ == "__main__":
    main()
