#!/usr/bin/env python3
"""weightlift's synchronous RL step against a synchronous GRPO loop in PyTorch eager
(bench/torch_grpo.py) on the same model preset, task, G and prompts per step.

Ours is the `scripts/run.sh` command without its SFT warm start:
    weightlift launch -n 3 -- weightlift --threads 1 rl --trainer-threads 2 --preset P --task sort
        --difficulty 3 --sft-steps 0 --steps S --prompts 8 --group 8 --lr 5e-4
        --no-dynamic-sampling ...
a trainer and two rollout workers, one compute thread per worker and every core for the trainer
(it computes while they wait); its step is
sync_s + generate_s + train_s of rl_metrics.jsonl (the weights pushed to the workers, the
generation and scoring, the policy step; held-out evaluations fall between steps and are not
counted). Theirs is one process doing generate then train, timed the same way; it has no weight
sync to do, which is the point of comparing with what a user would run instead.

Both sides get every core of the machine: our three processes take turns (the trainer waits
while the workers generate, the workers wait while it trains); PyTorch runs twice per round,
with torch.set_num_threads(1) (Debian's default, OpenBLAS then uses every core inside a matmul)
and set_num_threads(2), and the ratio is taken against the faster of the two, so that we are
not flattered by PyTorch's worse configuration (bench/compare_train.py does the same).

The sides alternate, `--rounds` times each (the machine is shared; a neighbour moves absolute
times by 2x within minutes but hits interleaved runs alike), the first step of every run is
warm-up and skipped, and each round's ratio is between the medians of that round. Generated
lengths depend on the sampled tokens, so the time per generated token is printed beside the
time per step: a side that generated less cannot look faster for it.
The roofline: after the rounds, the bound of one step of this configuration on this machine,
measured on the spot (`weightlift bench generate` and `bench train` at the step's shapes, on
every core): the generation's prefill and its decode steps (the longest answer's, each the
larger of reading the weights and KV cache at the measured copy rate and its FLOPs at the
measured f32 GEMM peak), the policy step's FLOPs at that peak, and the sync's bf16 weights
copied once per worker; and the fraction of it each side reaches.
Usage: bench/compare_rl.py [--presets tiny,small] [--rounds 3] [--steps tiny:10,small:6]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_THREADS = (1, 2)


def cpu():
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    isa = next((i for i in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if i in flags), "other")
    return model, isa, os.cpu_count()


def load():
    return "%.2f %.2f %.2f" % os.getloadavg()


def run(cmd, attempts=3):
    """stdout of `cmd`. The binary is rebuilt in place by whoever works in this checkout: a run
    that fails is retried after a pause, and its error is shown."""
    for attempt in range(attempts):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode == 0:
            return p.stdout
        print(f"  (exit {p.returncode}: {p.stderr.strip()[-400:]}; retrying in 30 s)",
              file=sys.stderr, flush=True)
        time.sleep(30)
    sys.exit(f"compare_rl: {' '.join(cmd)} failed {attempts} times")


def ours(a, preset, steps, out):
    wl = a.weightlift
    cmd = a.nice + [wl, "launch", "-n", str(a.procs), "--", wl, "--threads", str(a.threads),
                    "rl", "--trainer-threads", str(a.trainer_threads), "--preset", preset, "--task", a.task, "--difficulty",
                    str(a.difficulty), "--sft-steps", "0", "--steps", str(steps), "--prompts",
                    str(a.prompts), "--group", str(a.group), "--lr", str(a.lr),
                    "--no-dynamic-sampling", "--eval-every", "100000", "--eval-problems", "8",
                    "--seed", str(a.seed), "--out", out, "--overwrite"]
    run(cmd)
    rows = [json.loads(line) for line in open(os.path.join(out, "rl_metrics.jsonl"))]
    rows = [r for r in rows if r["phase"] == "rl"][1:]  # the first step is warm-up
    return [{"step_s": r["sync_s"] + r["generate_s"] + r["train_s"], "sync_s": r["sync_s"],
             "generate_s": r["generate_s"], "train_s": r["train_s"], "tokens": r["tokens"]}
            for r in rows], " ".join(cmd[len(a.nice):])


def theirs(a, preset, steps, threads):
    cmd = a.nice + ["/usr/bin/python3", os.path.join(HERE, "torch_grpo.py"), "--preset", preset,
                    "--task", a.task, "--difficulty", str(a.difficulty), "--steps", str(steps),
                    "--prompts", str(a.prompts), "--group", str(a.group), "--lr", str(a.lr),
                    "--threads", str(threads), "--seed", str(a.seed),
                    "--weightlift", a.weightlift]
    out = run(cmd)
    j = json.loads(out.strip().splitlines()[-1])
    rows = j["steps"][1:]
    return [{"step_s": r["generate_s"] + r["train_s"], "sync_s": 0.0,
             "generate_s": r["generate_s"], "train_s": r["train_s"], "tokens": r["tokens"]}
            for r in rows], j, " ".join(cmd[len(a.nice):])


def med(rows, key):
    return statistics.median(r[key] for r in rows)


def per_token(rows, key):
    """Median over steps of seconds of `key` per generated token."""
    return statistics.median(r[key] / max(r["tokens"], 1) for r in rows)


def summary(rows):
    return {"step_ms": 1e3 * med(rows, "step_s"), "sync_ms": 1e3 * med(rows, "sync_s"),
            "generate_ms": 1e3 * med(rows, "generate_s"), "train_ms": 1e3 * med(rows, "train_s"),
            "tokens": med(rows, "tokens"),
            "step_us_per_token": 1e6 * per_token(rows, "step_s"),
            "generate_us_per_token": 1e6 * per_token(rows, "generate_s")}


def bench_json(cmd):
    return json.loads(run(cmd).strip().splitlines()[-1])


def bounds(a, preset, seq, max_new):
    """The bound of one RL step of `preset` (ms by phase), measured now on every core: rows of
    `seq` positions trained, prompts of seq - max_new positions (the beginning token and the
    longest prompt) and max_new decode steps generated, the bf16 weights copied into each
    rollout worker."""
    wl, cores = a.weightlift, str(os.cpu_count() or 1)
    rows = a.prompts * a.group
    gen = bench_json([wl, "--threads", cores, "bench", "generate", "--preset", preset,
                      "--prompts", str(a.prompts), "--group", str(a.group), "--prompt-tokens",
                      str(seq - max_new), "--new-tokens", str(max_new), "--runs", "1", "--json"])
    train = bench_json([wl, "--threads", cores, "bench", "train", "--preset", preset,
                        "--batch", str(rows), "--seq", str(seq), "--steps", "2", "--json"])
    workers = a.procs - 1
    # A peak is the best rate seen: the larger of the two benchmarks' measurements (a
    # neighbour's burst during one of them would otherwise inflate the bound).
    peak = max(train["gemm_peak_gflops"], gen["gemm_peak_gflops_f32"])
    train_gflop = train["gflops"] * train["step_ms_median"] / 1e3  # the step's FLOPs / 1e9
    b = {"generate_ms": gen["prefill_bound_ms"] + max_new * gen["decode_step_bound_ms"],
         "train_ms": 1e3 * train_gflop / peak,
         "sync_ms": 1e3 * workers * gen["weight_bytes_per_step"] / (gen["copy_gbps"] * 1e9),
         "gemm_peak_gflops_f32": peak, "copy_gbps": gen["copy_gbps"], "cpu": train["cpu"]}
    b["step_ms"] = b["generate_ms"] + b["train_ms"] + b["sync_ms"]
    return b


def print_bounds(preset, b, ours, theirs):
    def frac(key, side):
        return b[key] / side[key] if side[key] > 0 else float("nan")
    print(f"{preset} roofline ({b['cpu']}; f32 GEMM peak {b['gemm_peak_gflops_f32']:.0f} GFLOP/s, "
          f"copy {b['copy_gbps']:.1f} GB/s, measured now): bound {b['step_ms']:.1f} ms/step "
          f"(generate {b['generate_ms']:.1f}, train {b['train_ms']:.1f}, sync "
          f"{b['sync_ms']:.2f}); weightlift reaches {100 * frac('step_ms', ours):.0f}% of it "
          f"(generate {100 * frac('generate_ms', ours):.0f}%, train "
          f"{100 * frac('train_ms', ours):.0f}%, sync {100 * frac('sync_ms', ours):.0f}%), "
          f"PyTorch eager {100 * frac('step_ms', theirs):.0f}%", flush=True)


def run_preset(a, preset, steps):
    print(f"== {preset}: {steps} steps per run (first skipped), load {load()}", flush=True)
    rounds, cmds = [], {}
    for r in range(a.rounds):
        load_before = load()
        o_rows, cmds["ours"] = ours(a, preset, steps, os.path.join(a.out, preset))
        o = summary(o_rows)
        t = {}
        for n in TORCH_THREADS:
            t_rows, info, cmds[f"torch{n}"] = theirs(a, preset, steps, n)
            t[n] = summary(t_rows)
        best = min(TORCH_THREADS, key=lambda n: t[n]["step_ms"])
        row = {"round": r + 1, "load": load_before, "ours": o, "torch": t, "torch_best": best,
               "ratio": t[best]["step_ms"] / o["step_ms"],
               "ratio_per_token": t[best]["step_us_per_token"] / o["step_us_per_token"],
               "torch_version": info["torch"], "torch_isa": info["isa"]}
        rounds.append(row)
        print(f"  round {r + 1} (load {load_before}): weightlift {o['step_ms']:7.1f} ms/step "
              f"(sync {o['sync_ms']:.1f} + generate {o['generate_ms']:.1f} + train "
              f"{o['train_ms']:.1f}; {o['tokens']:.0f} tokens, {o['step_us_per_token']:.0f} "
              f"us/token) | PyTorch " +
              ", ".join(f"{n} thread{'s' if n > 1 else ''} {t[n]['step_ms']:.1f}"
                        for n in TORCH_THREADS) +
              f" ms/step (best {best}: generate {t[best]['generate_ms']:.1f} + train "
              f"{t[best]['train_ms']:.1f}; {t[best]['tokens']:.0f} tokens, "
              f"{t[best]['step_us_per_token']:.0f} us/token) | ratio {row['ratio']:.2f}x "
              f"(per token {row['ratio_per_token']:.2f}x)", flush=True)
    ratios = [x["ratio"] for x in rounds]
    per_tok = [x["ratio_per_token"] for x in rounds]
    o_med = statistics.median(x["ours"]["step_ms"] for x in rounds)
    t_med = statistics.median(x["torch"][x["torch_best"]]["step_ms"] for x in rounds)
    b = bounds(a, preset, info["seq"], info["max_new_tokens"])
    ours_med = {k: statistics.median(x["ours"][k] for x in rounds)
                for k in ("step_ms", "generate_ms", "train_ms", "sync_ms")}
    theirs_med = {"step_ms": t_med}
    print_bounds(preset, b, ours_med, theirs_med)
    res = {"preset": preset, "rounds": rounds, "median_ratio": statistics.median(ratios),
           "ratio_min": min(ratios), "ratio_max": max(ratios),
           "median_ratio_per_token": statistics.median(per_tok),
           "ours_step_ms_median": o_med, "torch_step_ms_median": t_med,
           "bound": b, "fraction_of_bound": b["step_ms"] / o_med,
           "commands": cmds, "load_after": load()}
    print(f"{preset}: weightlift {o_med:.1f} ms/step, PyTorch eager (faster configuration) "
          f"{t_med:.1f} ms/step; median ratio {res['median_ratio']:.2f}x (rounds "
          f"{res['ratio_min']:.2f}-{res['ratio_max']:.2f}x), per generated token "
          f"{res['median_ratio_per_token']:.2f}x; bar 4x: "
          f"{'met' if res['median_ratio'] >= 4 else 'NOT met'}; load after {res['load_after']}",
          flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weightlift", default=os.path.join(HERE, "..", "build", "release", "apps",
                                                         "weightlift"))
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", default="tiny:10,small:6",
                    help="steps per run for each preset (the first is skipped)")
    ap.add_argument("--procs", type=int, default=3, help="ours: trainer + rollout workers")
    ap.add_argument("--threads", type=int, default=1, help="ours: compute threads per process")
    ap.add_argument("--trainer-threads", type=int, default=os.cpu_count() or 1,
                    help="ours: compute threads of the trainer (rank 0)")
    ap.add_argument("--task", default="sort")
    ap.add_argument("--difficulty", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--nice", type=int, default=5, help="run both sides under nice -n N")
    ap.add_argument("--out", default="/tmp/wl_compare_rl")
    a = ap.parse_args()
    a.weightlift = os.path.abspath(a.weightlift)
    a.nice = ["nice", "-n", str(a.nice)] if a.nice else []
    steps = dict(kv.split(":") for kv in a.steps.split(","))
    model, isa, cores = cpu()
    print(f"cpu: {model}, {cores} cores, ISA {isa}; {platform.node()}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"weightlift: {a.procs} processes (trainer + {a.procs - 1} rollout workers) x "
          f"--threads {a.threads}, trainer --trainer-threads {a.trainer_threads}; PyTorch eager: 1 process, torch.set_num_threads "
          f"{' and '.join(map(str, TORCH_THREADS))} (OpenBLAS threads: "
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'its default, one per core')}); "
          f"task {a.task} difficulty {a.difficulty}, {a.prompts} prompts x G {a.group}, "
          f"temperature 1, lr {a.lr}, f32 trainer", flush=True)
    results = [run_preset(a, p, int(steps.get(p, 6))) for p in a.presets.split(",")]
    print(json.dumps({"cpu": model, "isa": isa, "cores": cores, "procs": a.procs,
                      "threads": a.threads, "trainer_threads": a.trainer_threads,
                      "torch_threads": TORCH_THREADS,
                      "results": results}))


if __name__ == "__main__":
    main()
