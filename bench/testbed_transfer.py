#!/usr/bin/python3
"""Weight updates between testbed hosts: weightlift's p2p, broadcast and naive modes against
PyTorch/gloo's broadcast (checkpoint-engine's scheme), each host's NIC held to one rate.

  sudo bench/testbed_transfer.py --weightlift build/release/apps/weightlift \\
      [--preset small] [--rate 1gbit] [--loss 0] [--trainers 2] [--receivers 2] [--tp 2]
      [--rounds 3]

One rank per host (scripts/testbed.sh): trainers on hosts 0 .. T-1, receivers on the rest, so
every byte of an update crosses two NICs. Each round runs every implementation in turn on a
fresh testbed; each rank reports its host NIC's byte counters at the end, so the table gives
the bytes the busiest NIC carried per update (the warm-up update included, hence / (updates
+ 1)) and the NIC-limited bound: those bytes at the NIC's rate. Rows: update time (median of
the timed updates), its ratio to PyTorch's in the same round, and the bound over the time
(1.0 = the network is all the time there is).
"""
import argparse
import json
import os
import shlex
import statistics
import sys

from testbed_runs import ROOT, rate_bytes_per_s, run_on_testbed

TORCH = os.path.join(ROOT, "bench", "torch_broadcast_baseline.py")
NIC = "echo NIC $(cat /sys/class/net/eth0/statistics/tx_bytes) " \
      "$(cat /sys/class/net/eth0/statistics/rx_bytes)"


def run(a, impl):
    """(update_ms_p50, {host: (tx, rx)}) of one implementation on a fresh testbed."""
    hosts = a.trainers + a.receivers
    shape = ["--preset", a.preset, "--trainers", str(a.trainers), "--receivers",
             str(a.receivers), "--tp", str(a.tp), "--updates", str(a.updates)]
    if impl == "torch-gloo":
        cmd = ["env", "GLOO_SOCKET_IFNAME=eth0", "/usr/bin/python3", TORCH, "--as-rank"] + shape
    else:
        cmd = [a.weightlift, "--threads", "1", "bench", "transfer", "--as-rank", "--memcpy-gbps",
               "10", "--mode", impl, "--dtype", "bf16", "--json"] + shape
    line = " ".join(shlex.quote(c) for c in cmd) + " && " + NIC
    code, lines, output = run_on_testbed(a.weightlift, hosts, a.rate, ["sh", "-c", line], a.loss)
    report, nic = None, {}
    for host, text in lines:
        if text.startswith("{"):
            report = json.loads(text)
        elif text.startswith("NIC "):
            tx, rx = text.split()[1:]
            nic[host] = (int(tx), int(rx))
    if code != 0 or report is None or len(nic) != hosts:
        raise SystemExit(f"{impl}: exit {code}\n{output}")
    if impl != "torch-gloo" and report.get("wrong", 1) != 0:
        raise SystemExit(f"{impl}: {report['wrong']} wrong tensors")
    return report["update_ms_p50"], nic


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weightlift", required=True)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--loss", default="0", help="percent of packets every NIC drops each way")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    a.weightlift = os.path.abspath(a.weightlift)
    impls = ["p2p", "broadcast", "naive", "torch-gloo"]
    rows = {i: [] for i in impls}  # per round: (ms, busiest NIC bytes per update)
    for rnd in range(a.rounds):
        for impl in impls:
            ms, nic = run(a, impl)
            busiest = max(max(tx, rx) for tx, rx in nic.values()) / (a.updates + 1)
            rows[impl].append((ms, busiest))
            print(f"# round {rnd + 1} {impl}: {ms:.1f} ms, busiest NIC {busiest / 1e6:.1f} MB "
                  "per update", file=sys.stderr, flush=True)
    rate = rate_bytes_per_s(a.rate)
    loss = f", {a.loss}% loss each way" if float(a.loss) > 0 else ""
    print(f"| {a.preset}, {a.trainers} -> {a.receivers} TP {a.tp}, bf16, NIC {a.rate}{loss} | "
          "update ms (rounds) | x PyTorch/gloo (rounds) | busiest NIC per update | "
          "NIC bound / update |")
    print("|---|---|---|---|---|")
    for impl in impls:
        ms = [m for m, _ in rows[impl]]
        ratio = [t / m for (m, _), (t, _) in zip(rows[impl], rows["torch-gloo"])]
        busiest = statistics.median(b for _, b in rows[impl])
        bound = [b / rate * 1e3 / m for m, b in rows[impl]]
        print(f"| {impl} | {statistics.median(ms):.0f} ({', '.join('%.0f' % x for x in ms)}) | "
              f"{statistics.median(ratio):.2f} ({', '.join('%.2f' % x for x in ratio)}) | "
              f"{busiest / 1e6:.1f} MB | {statistics.median(bound):.2f} "
              f"({', '.join('%.2f' % x for x in bound)}) |")


if __name__ == "__main__":
    main()
