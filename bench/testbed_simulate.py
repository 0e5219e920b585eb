#!/usr/bin/python3
"""`weightlift transfer simulate` held to the testbed: predicted against measured p2p update
times across scripts/testbed.sh hosts, one rank per host or several sharing its NIC.

  sudo bench/testbed_simulate.py --weightlift build/release/apps/weightlift [--rounds 3]
      [--configs small:2:2:2:bf16:1gbit,small:2:2:2:bf16:200mbit,...]

A configuration is preset:trainers:receivers:tp:dtype:rate[:ranks_per_host[:mesh_size]]
(trainers on the first hosts, in FSDP meshes of `mesh_size` ranks holding bf16 shards, each
mesh a replica of the model, one mesh of them all by default; receivers on the other hosts,
engines of TP `tp`, holding `dtype`; `ranks_per_host` ranks on each host, 1 by default, whose
writes to other hosts share its one NIC: with mesh_size = ranks_per_host, seed 000's shape of a
mesh per host). For each one the simulator's inputs are measured on
the spot, never fitted to the transfer it predicts:
  - the NIC: a plain TCP stream from host 1 to host 0 on a fresh testbed at that rate, its
    payload bytes/s (what a link of that rate carries once Ethernet, IP and TCP take theirs);
  - the barrier: the 8-byte allreduce (comm's default algorithm, as an update's closing
    barrier runs it) across all the configuration's hosts, median of its calls;
  - the prepare rate: `bench transfer` of the same preset and dtype with one trainer and one
    receiver as processes on one host, the shard bytes its trainer read over its prepare time
    (bf16 into bf16 casts nothing: the simulator charges no prepare then);
  - with a mesh of several ranks, the round in which it shares the block maxima of the fp8
    bands split across its ranks (the simulator's --maxima-ms): an allreduce of 1 KiB over
    ranks placed as the mesh's are (on testbed hosts when the mesh spans hosts, on this
    machine when it fits in one), median of its calls.
  - the cost of a put: `bench puts` on a fresh testbed laid out as the configuration (its
    trainers put into its receivers in turn, as many at once as an update has), at the
    update's mean put size (the simulator's bytes over its messages); its time per put less
    those bytes' time through the sender's NIC at the rate above (the simulator's
    --message-overhead-us: a sender's time per put beyond its bytes).
Then `transfer simulate --model <preset> --gpus-per-node R --gpus-per-nic R --dense-mesh T
--expert-mesh 0` (R ranks per host)
predicts the update, and `bench transfer --mode p2p` measures it on a fresh testbed, --rounds
times. Printed: one row per configuration with the inputs, the prediction, the measured
medians (per round) and the error, |predicted - measured| / measured, and the worst error.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from testbed_runs import rate_bytes_per_s, run_on_testbed

HERE = os.path.abspath(__file__)
DEFAULT_CONFIGS = ("small:2:2:2:bf16:1gbit,small:2:2:2:bf16:200mbit,small:2:2:2:fp8:1gbit,"
                   "small:2:4:2:bf16:1gbit,small:4:2:2:bf16:1gbit,small:1:2:2:bf16:1gbit,"
                   "small:2:2:1:bf16:500mbit")


def tcp_stream(total):
    """One rank of the TCP micro-benchmark (run on every host by the launcher): host 1 sends
    `total` bytes to host 0, which prints the payload rate from first byte to last."""
    rank = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"]) + 2  # the launcher's store holds MASTER_PORT
    if rank == 0:
        server = socket.create_server(("0.0.0.0", port))
        server.settimeout(60)
        conn, _ = server.accept()
        conn.settimeout(60)
        got, first, before_first = 0, None, 0
        while got < total:
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise SystemExit(f"the sender closed after {got} of {total} bytes")
            if first is None:  # the clock starts at the first read: count what came after it
                first, before_first = time.perf_counter(), len(chunk)
            got += len(chunk)
        seconds = time.perf_counter() - first
        print(f"TCP {(got - before_first) / seconds:.0f}", flush=True)
    elif rank == 1:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = socket.create_connection((os.environ["MASTER_ADDR"], port), timeout=60)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        block = b"\0" * (1 << 20)
        sent = 0
        while sent < total:
            sent += conn.send(block[:min(len(block), total - sent)])
        conn.close()


def measure_tcp(exe, rate):
    total = int(max(rate_bytes_per_s(rate), 4e6))  # about a second of the link
    code, lines, output = run_on_testbed(
        exe, 2, rate, ["/usr/bin/python3", HERE, "--tcp-stream", str(total)])
    rates = [float(text.split()[1]) for host, text in lines if text.startswith("TCP ")]
    if code != 0 or len(rates) != 1:
        raise SystemExit(f"TCP stream at {rate}: exit {code}\n{output}")
    return rates[0]


def measure_barrier_ms(exe, hosts, rate, ranks_per_host):
    cmd = [exe, "--threads", "1", "bench", "collectives", "--ops", "allreduce", "--min-bytes",
           "8", "--max-bytes", "8", "--iters", "50", "--warmup", "5", "--timeout", "60", "--json"]
    code, lines, output = run_on_testbed(exe, hosts, rate, cmd, ranks_per_host=ranks_per_host)
    rows = [json.loads(text) for host, text in lines if host == 0 and text.startswith("{")]
    if code != 0 or len(rows) != 1:
        raise SystemExit(f"8-byte allreduce on {hosts} hosts: exit {code}\n{output}")
    return rows[0]["p50_us"] / 1e3


def measure_maxima_ms(exe, c):
    """Milliseconds of one allreduce of 1 KiB over the mesh's ranks, placed as the
    configuration places them: the round that shares the block maxima of its split bands."""
    mesh, per_host = c["mesh"], c["per_host"]
    if mesh == 1:
        return 0.0
    size = "1024"
    sweep = ["--threads", "1", "bench", "collectives", "--ops", "allreduce", "--min-bytes", size,
             "--max-bytes", size, "--iters", "50", "--warmup", "5", "--timeout", "60", "--json"]
    if mesh > per_host:  # across hosts: mesh / per_host testbed hosts of per_host ranks
        code, lines, output = run_on_testbed(exe, mesh // per_host, c["rate"], [exe] + sweep,
                                             ranks_per_host=per_host)
        rows = [json.loads(text) for host, text in lines if host == 0 and text.startswith("{")]
    else:  # inside one host
        r = subprocess.run([exe, "launch", "-n", str(mesh), "--", exe] + sweep,
                           capture_output=True, text=True, timeout=300)
        code, output = r.returncode, r.stderr[-2000:]
        rows = [json.loads(line.split("] ", 1)[1]) for line in r.stdout.splitlines()
                if line.startswith("[rank 0] {")]
    if code != 0 or len(rows) != 1:
        raise SystemExit(f"1 KiB allreduce over a mesh of {mesh}: exit {code}\n{output}")
    return rows[0]["p50_us"] / 1e3


def measure_prepare_s(exe, preset, dtype):
    """Seconds one trainer process spends preparing a whole update, one host, no network;
    None when there is nothing to prepare (bf16 shards into bf16 receivers)."""
    cmd = [exe, "--threads", "1", "bench", "transfer", "--preset", preset, "--trainers", "1",
           "--receivers", "1", "--tp", "1", "--dtype", dtype, "--mode", "p2p", "--updates", "5",
           "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not rows:
        raise SystemExit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-2000:]}")
    prepare_s = rows[-1]["split_ms"]["trainer"]["prepare"] / 1e3 / rows[-1]["updates"]
    return prepare_s if dtype != "bf16" else None


def measure_put_us(exe, c, nic_bytes_per_s, put_bytes):
    """A sender's time per put beyond its bytes: `bench puts` from the configuration's trainers
    into its receivers, on its hosts, at `put_bytes` a put; the slowest sender's time per put
    less the time the busiest NIC takes for those bytes (a sending host's carries a put of each
    of its senders, a receiving host's trainers / receivers of them per target it holds)."""
    puts = 2000
    cmd = [exe, "--threads", "1", "bench", "puts", "--senders", str(c["trainers"]), "--bytes",
           str(put_bytes), "--puts", str(puts), "--window", "64", "--timeout", "120", "--json"]
    code, lines, output = run_on_testbed(exe, c["hosts"], c["rate"], cmd,
                                         ranks_per_host=c["per_host"])
    rows = [json.loads(text) for host, text in lines if host == 0 and text.startswith("{")]
    if code != 0 or len(rows) != 1:
        raise SystemExit(f"bench puts for {c['name']}: exit {code}\n{output}")
    puts_per_nic = c["per_host"] * max(1.0, c["trainers"] / c["receivers"])
    nic_us = put_bytes * puts_per_nic / nic_bytes_per_s * 1e6
    return rows[0]["us_per_put_max"], max(0.0, rows[0]["us_per_put_max"] - nic_us)


def predict(exe, c, nic_bytes_per_s, barrier_ms, prepare_gbs, maxima_ms=0.0, put_us=None):
    cmd = [exe, "transfer", "simulate", "--model", c["preset"], "--trainers", str(c["trainers"]),
           "--receivers", str(c["receivers"]), "--gpus-per-node", str(c["per_host"]),
           "--gpus-per-nic", str(c["per_host"]), "--engine-gpus",
           str(c["tp"]), "--dense-mesh", str(c["mesh"]), "--expert-mesh", "0", "--dtype",
           c["dtype"], "--shard-dtype", "bf16", "--nic-gbps", "%.6f" % (nic_bytes_per_s * 8e-9),
           "--barrier-ms", "%.4f" % barrier_ms, "--maxima-ms", "%.4f" % maxima_ms,
           "--no-sensitivity", "--json"]
    if prepare_gbs:
        cmd += ["--prepare-gbs", "%.3f" % prepare_gbs]
    if put_us is not None:
        cmd += ["--message-overhead-us", "%.3f" % put_us]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def measure_update_ms(exe, c, updates):
    hosts = c["hosts"]
    cmd = [exe, "--threads", "1", "bench", "transfer", "--as-rank", "--memcpy-gbps", "10",
           "--mode", "p2p", "--dtype", c["dtype"], "--json", "--preset", c["preset"],
           "--trainers", str(c["trainers"]), "--mesh-size", str(c["mesh"]), "--receivers",
           str(c["receivers"]), "--tp", str(c["tp"]), "--updates", str(updates)]
    code, lines, output = run_on_testbed(exe, hosts, c["rate"], cmd, ranks_per_host=c["per_host"])
    rows = [json.loads(text) for host, text in lines if text.startswith("{")]
    if code != 0 or not rows or rows[0].get("wrong", 1) != 0:
        raise SystemExit(f"p2p {c['name']}: exit {code}\n{output}")
    return rows[0]["update_ms_p50"]


def parse_config(text):
    fields = text.split(":")
    preset, trainers, receivers, tp, dtype, rate = fields[:6]
    per_host = int(fields[6]) if len(fields) > 6 else 1
    mesh = int(fields[7]) if len(fields) > 7 else int(trainers)
    c = {"name": text, "preset": preset, "trainers": int(trainers), "receivers": int(receivers),
         "tp": int(tp), "dtype": dtype, "rate": rate, "per_host": per_host, "mesh": mesh}
    if c["trainers"] % mesh:
        raise SystemExit(f"{text}: meshes of {mesh} do not divide the trainers")
    if c["trainers"] % per_host or c["receivers"] % per_host:
        raise SystemExit(f"{text}: {per_host} ranks per host do not divide the trainers and "
                         "the receivers (a host is one or the other)")
    c["hosts"] = (c["trainers"] + c["receivers"]) // per_host
    return c


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--tcp-stream":
        tcp_stream(int(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weightlift", required=True)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args()
    exe = os.path.abspath(a.weightlift)
    prepare = {}
    rows = []
    for c in map(parse_config, a.configs.split(",")):
        key = (c["preset"], c["dtype"])
        if key not in prepare:
            seconds = measure_prepare_s(exe, c["preset"], c["dtype"])
            params = predict(exe, c, 1e9, 1, None)["params"]
            prepare[key] = None if seconds is None else 2 * params / seconds / 1e9
        nic = measure_tcp(exe, c["rate"])
        barrier = measure_barrier_ms(exe, c["hosts"], c["rate"], c["per_host"])
        maxima = measure_maxima_ms(exe, c)
        shape = predict(exe, c, nic, barrier, prepare[key], maxima)
        put_bytes = max(1, round(shape["bytes"] / shape["messages"]))
        put_total_us, put_us = measure_put_us(exe, c, nic, put_bytes)
        sim = predict(exe, c, nic, barrier, prepare[key], maxima, put_us)
        sim_without = shape  # the model as it was run before the puts were measured: 1 us a put
        measured = [measure_update_ms(exe, c, a.updates) for _ in range(a.rounds)]
        predicted_ms = sim["predicted_s"] * 1e3
        m = statistics.median(measured)
        row = dict(c, nic_mb_s=nic / 1e6, nic_fraction=nic / rate_bytes_per_s(c["rate"]),
                   barrier_ms=barrier, prepare_gbs=prepare[key], predicted_ms=predicted_ms,
                   bound=sim["bound"], measured_ms=measured, error=(predicted_ms - m) / m,
                   maxima_ms=maxima, split_bands=sim["split_bands"], put_bytes=put_bytes,
                   put_total_us=put_total_us, put_us=put_us,
                   messages_per_sender=sim["messages"] / c["trainers"],
                   predicted_at_1us_ms=sim_without["predicted_s"] * 1e3)
        rows.append(row)
        print(f"# {c['name']}: predicted {predicted_ms:.1f} ms ({sim['bound']}), measured "
              f"{', '.join('%.1f' % x for x in measured)} ms", file=sys.stderr, flush=True)
    print("| configuration (preset, trainers in meshes of M -> receivers, TP, dtype, NIC rate, "
          "ranks per host) | TCP payload "
          "MB/s (of the rate) | barrier ms | prepare GB/s | split bands, maxima round ms | "
          "put: bytes, us, us beyond its bytes | predicted ms (bound) | measured ms (rounds) | "
          "error | at 1 us a put: predicted, error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        prep = "-" if r["prepare_gbs"] is None else "%.1f" % r["prepare_gbs"]
        m_ = statistics.median(r["measured_ms"])
        print(f"| {r['preset']}, {r['trainers']} (M {r['mesh']}) -> {r['receivers']}, "
              f"TP {r['tp']}, "
              f"{r['dtype']}, {r['rate']}, {r['per_host']} | {r['nic_mb_s']:.1f} "
              f"({r['nic_fraction']:.1%}) | "
              f"{r['barrier_ms']:.2f} | {prep} | {r['split_bands']}, {r['maxima_ms']:.2f} | "
              f"{r['put_bytes']}, {r['put_total_us']:.1f}, {r['put_us']:.1f} | "
              f"{r['predicted_ms']:.1f} ({r['bound']}) | {m_:.1f} "
              f"({', '.join('%.1f' % x for x in r['measured_ms'])}) | {r['error']:+.1%} | "
              f"{r['predicted_at_1us_ms']:.1f}, {(r['predicted_at_1us_ms'] - m_) / m_:+.1%} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\nworst error: {worst['error']:+.1%} ({worst['name']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
