#!/usr/bin/python3
"""Weight transfer side by side, in one run: our three modes and the PyTorch/gloo baseline.

For `--preset` (medium), `--trainers` (2) -> `--receivers` (2) with TP `--tp` (2):
  weightlift  `weightlift bench transfer --mode p2p|broadcast|naive --dtype bf16|fp8 --json`
              (apps/weightlift/bench/transfer.h), one run per mode, dtype and `--ranks` kind:
              separate processes (what users run, and what the torch peer does) and, for the
              record, threads of one process
  torch-gloo  `/usr/bin/python3 bench/torch_broadcast_baseline.py` (bf16 only: torch 1.13 has
              no float8; its bf16 figure is the baseline for both dtypes)
then prints the median update time per mode with its ratio to p2p of the same dtype,
effective GB/s and its fraction of single-thread memcpy, and writes an SVG bar chart of the
update time per mode and dtype.

    /usr/bin/python3 bench/compare_transfer.py --weightlift build/release/apps/weightlift \
        --out runs/transfer

`--rounds K` repeats every run K times, interleaved (p2p, broadcast, naive, torch, then again),
and reports medians over rounds; `--modes` picks a subset (naive is slow); the load average
before each run is kept in the JSON and printed. The last lines check the issue's speed bars
against this run's own figures.

`--weightlift` may be any command that takes `bench transfer` and its flags.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["p2p", "broadcast", "naive", "torch-gloo"]
COLORS = {"bf16": "#1f77b4", "fp8": "#d62728"}


def json_line(cmd):
    print("# running: " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=3600)
    for line in reversed(proc.stdout.splitlines()):
        at = line.find("{")
        if at >= 0:
            try:
                return json.loads(line[at:])
            except json.JSONDecodeError:
                pass
    print("# %s exited %d:\n%s" % (cmd[0], proc.returncode, proc.stdout[-3000:]),
          file=sys.stderr)
    return None


def svg_bars(path, title, rows):
    """rows: {(mode, dtype): update_ms}; grouped bars, one group per mode."""
    w, h, l, r, t, b = 760, 440, 80, 140, 50, 60
    top = max(rows.values()) * 1.1
    modes = [m for m in MODES if any((m, d) in rows for d in COLORS)]
    gw = (w - l - r) / len(modes)
    bw = gw * 0.35
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
           'font-family="sans-serif" font-size="12">' % (w, h),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="25" font-size="15">%s</text>' % (l, title)]
    for i in range(6):
        v = top * i / 5
        y = h - b - (h - t - b) * i / 5
        out.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>' % (l, w - r, y, y))
        out.append('<text x="%d" y="%.1f" text-anchor="end">%.0f</text>' % (l - 6, y + 4, v))
    out.append('<text x="20" y="%d" transform="rotate(-90 20 %d)" text-anchor="middle">'
               'update time (ms, median)</text>' % ((h - b + t) / 2, (h - b + t) / 2))
    for i, m in enumerate(modes):
        x0 = l + i * gw + gw * 0.15
        for j, d in enumerate(COLORS):
            if (m, d) not in rows:
                continue
            v = rows[(m, d)]
            bh = (h - t - b) * v / top
            x = x0 + j * bw
            out.append('<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>'
                       % (x, h - b - bh, bw * 0.9, bh, COLORS[d]))
            out.append('<text x="%.1f" y="%.1f" text-anchor="middle" font-size="10">%.0f</text>'
                       % (x + bw * 0.45, h - b - bh - 4, v))
        out.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>'
                   % (l + i * gw + gw / 2, h - b + 20, m))
    for j, d in enumerate(COLORS):
        y = t + 20 * j
        out.append('<rect x="%d" y="%d" width="14" height="10" fill="%s"/>' % (w - r + 15, y, COLORS[d]))
        out.append('<text x="%d" y="%d">%s receivers</text>' % (w - r + 35, y + 10, d))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else float("nan")


def run_round(a, shape, rnd, dtypes, modes, ranks):
    """One weightlift run per (dtype, mode, ranks kind) and one torch run, each row tagged with
    the round and the 1-minute load average before it started."""
    rows = []
    for dtype in dtypes:
        for mode in [m for m in MODES[:3] if m in modes]:
            for kind in ranks:
                load = os.getloadavg()[0]
                row = json_line(shlex.split(a.weightlift) +
                                ["bench", "transfer", "--mode", mode, "--dtype", dtype,
                                 "--ranks", kind, "--json"] + shape +
                                ([] if a.verify else ["--no-verify"]))
                if row:
                    row.update({"round": rnd, "load1": load})
                    rows.append(row)
    if "torch-gloo" in modes:
        load = os.getloadavg()[0]
        row = json_line(["/usr/bin/python3", os.path.join(HERE, "torch_broadcast_baseline.py"),
                         "--preset", a.preset, "--trainers", str(a.trainers), "--receivers",
                         str(a.receivers), "--tp", str(a.tp), "--updates", str(a.updates)])
        if row:
            row.update({"round": rnd, "load1": load, "mode": "torch-gloo", "dtype": "bf16",
                        "ranks": "processes"})
            rows.append(row)
    return rows


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weightlift", default="weightlift",
                    help="command that runs `bench transfer` (quoted words allowed)")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="subset of " + ",".join(MODES))
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every run this many times, interleaved (all modes once per "
                         "round), and report the median over rounds: a shared machine's load "
                         "then weighs on every mode alike")
    ap.add_argument("--ranks", default="processes,threads",
                    help="weightlift's ranks as separate processes and/or threads of one "
                         "process; the bars use processes")
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip the untimed comparison with the reference after each run")
    ap.add_argument("--out", default="runs/transfer", help="directory for the SVG and JSON")
    return ap.parse_args()


def run_rounds(a, dtypes, modes, ranks):
    """Every round's rows, also written to `--out`/transfer.jsonl, one JSON object per line."""
    os.makedirs(a.out, exist_ok=True)
    shape = ["--preset", a.preset, "--trainers", str(a.trainers), "--receivers",
             str(a.receivers), "--tp", str(a.tp), "--updates", str(a.updates)]
    rows = []
    for rnd in range(a.rounds):
        rows += run_round(a, shape, rnd, dtypes, modes, ranks)
    with open(os.path.join(a.out, "transfer.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def pick(rows, mode, dtype, key, kind="processes"):
    """`key` of every run of (mode, dtype, ranks kind) that reported it, one per round."""
    return [r[key] for r in rows if r["mode"] == mode and r.get("dtype") == dtype and
            r.get("ranks") == kind and key in r]


def print_table(a, rows, dtypes, ranks, torch):
    """Prints one line per (mode, dtype, ranks kind), then the torch baseline and memcpy;
    returns {(mode, dtype, kind): median update ms}. torch: the torch-gloo runs' p50s, ms."""
    torch_ms, have_torch = median(torch), bool(torch)
    loads = [r["load1"] for r in rows]
    print("%s, %d trainers -> %d receivers, TP %d, p50 of %d updates, median of %d round(s); "
          "load average (1 min) %.1f-%.1f" % (a.preset, a.trainers, a.receivers, a.tp,
                                              a.updates, a.rounds, min(loads or [0]),
                                              max(loads or [0])))
    print("%-10s %-5s %-9s %10s %8s %9s %9s %9s %11s %6s" % (
        "mode", "dtype", "ranks", "update_ms", "spread", "vs_p2p", "vs_torch", "eff_GB/s",
        "memcpy_frac", "wrong"))
    # Per (mode, dtype, ranks): the median over rounds of each run's p50 update time.
    times = {}
    for d in dtypes:
        for m in MODES[:3]:
            for kind in ranks:
                ms_all = pick(rows, m, d, "update_ms_p50", kind)
                if not ms_all:
                    continue
                ms = times[(m, d, kind)] = median(ms_all)
                p2p = median(pick(rows, "p2p", d, "update_ms_p50", kind))
                print("%-10s %-5s %-9s %10.1f %8s %8.2fx %9s %9.3f %11.3f %6d" % (
                    m, d, kind, ms, "%.0f-%.0f" % (min(ms_all), max(ms_all)), ms / p2p,
                    "%.2fx" % (torch_ms / ms) if have_torch else "-",
                    median(pick(rows, m, d, "effective_gbps", kind)),
                    median(pick(rows, m, d, "memcpy_fraction", kind)),
                    sum(pick(rows, m, d, "wrong", kind))))
    if have_torch:
        print("%-10s %-5s %-9s %10.1f %8s   (baseline; vs_torch = torch time / this time)"
              % ("torch-gloo", "bf16", "processes", torch_ms,
                 "%.0f-%.0f" % (min(torch), max(torch))))
    memcpy = [r["memcpy_gbps"] for r in rows if "memcpy_gbps" in r]
    if memcpy:
        print("single-thread memcpy: %s GB/s" % ", ".join("%.2f" % m for m in memcpy))
    return times


def print_bar(name, value, at_least):
    if value == value:  # not NaN
        print("bar: %-44s %7.2f (target >= %g: %s)" % (name, value, at_least,
                                                      "met" if value >= at_least else
                                                      "NOT met"))


def print_speed_bars(rows, times, torch):
    """The issue's speed bars, from this run's medians, and staging against the watermark."""
    torch_ms, have_torch = median(torch), bool(torch)
    p2p8, bc8 = times.get(("p2p", "fp8", "processes")), times.get(("broadcast", "fp8", "processes"))
    if p2p8 and bc8:
        print_bar("fp8: broadcast time / p2p time", bc8 / p2p8, 2)
    if p2p8 and have_torch:
        print_bar("fp8: torch-gloo (bf16) time / p2p time", torch_ms / p2p8, 5)
    if pick(rows, "p2p", "bf16", "memcpy_fraction"):  # processes
        print_bar("bf16: p2p effective GB/s / memcpy GB/s",
                  median(pick(rows, "p2p", "bf16", "memcpy_fraction")), 0.5)
    over = [r for r in rows if r.get("peak_staging_bytes", 0) > r.get("watermark_bytes", 1 << 62)]
    print("staging above the watermark in %d of %d runs" % (len(over), len(rows)))


def plot_update_times(a, dtypes, times, torch):
    """The SVG bar chart of the processes runs' update times, torch's bf16 beside each dtype."""
    torch_ms, have_torch = median(torch), bool(torch)
    bars = {(m, d): ms for (m, d, kind), ms in times.items() if kind == "processes"}
    if have_torch:
        for d in dtypes:
            bars[("torch-gloo", d)] = torch_ms
    if bars:
        path = os.path.join(a.out, "transfer_update_ms.svg")
        svg_bars(path, "weight update, %s, %d -> %d receivers, TP %d (separate processes)" %
                 (a.preset, a.trainers, a.receivers, a.tp), bars)
        print("plot: " + path)


def main():
    a = parse_args()
    dtypes = a.dtypes.split(",")
    modes = a.modes.split(",")
    ranks = a.ranks.split(",")
    rows = run_rounds(a, dtypes, modes, ranks)
    torch = pick(rows, "torch-gloo", "bf16", "update_ms_p50")
    times = print_table(a, rows, dtypes, ranks, torch)
    print_speed_bars(rows, times, torch)
    plot_update_times(a, dtypes, times, torch)


if __name__ == "__main__":
    main()
