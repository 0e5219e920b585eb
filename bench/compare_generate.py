#!/usr/bin/python3
"""The rollout engine's generation of a GRPO batch against PyTorch eager's generate loop with a
KV cache (bench/torch_grpo.py's, the GRPO baseline's), same preset, same rows, same lengths.

Ours is `weightlift bench generate --json` (one process, bf16 weights widened per band, or once
per generation with `--widen-per-generation`, or multiplied as bf16 against activations rounded
to bf16 with `--bf16-activations`; every core), the engine as the rollout workers run it: a
group's prompt is prefilled once and its KV cache shared by the group's rows (its prefill with
every row prefilled is printed beside, for what that saves). Theirs is torch_grpo.generate on f32
weights, the loop a GRPO user runs: every row's prompt prefilled, then the decode steps,
sampling at temperature 1, with torch.set_num_threads(1) and (2), the faster taken (Debian's
OpenBLAS uses every core inside a matmul either way). With `--bf16-activations` PyTorch also
runs under bf16 autocast (its oneDNN takes AMX where the CPU has it), on its f32 weights (cast
to bf16 at every matmul, as autocast does) and on weights stored in bf16 (no cast), and the
fastest of the six configurations is the one compared and named. Both sides run every row the
same number of steps (a PyTorch row that samples the end token keeps being computed with the
batch until all have; rows x steps is the work either way).

The sides alternate `--rounds` times (a neighbour's load moves absolute times within minutes),
each side's figure being the median of its `--runs` after one untimed run; the ratio is taken
per round.
Usage: bench/compare_generate.py [--preset small] [--shapes 8x8,64x8] [--rounds 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# PyTorch's precisions: f32; bf16 autocast on the f32 weights; bf16 autocast on bf16 weights.
PRECISIONS = {0: "f32", 1: "bf16 autocast", 2: "bf16 autocast, bf16 weights"}


def torch_side(a, prompts, group, threads, precision):
    """Tokens/s of PyTorch's generate: rows x steps over the call's time, median of the runs."""
    import contextlib
    import torch
    sys.path.insert(0, HERE)
    import torch_grpo as g
    torch.set_num_threads(threads)
    c = g.PRESETS[a.preset]
    gen = torch.Generator().manual_seed(1)
    w = {k: v.detach() for k, v in g.init_params(c, gen).items()}
    if precision == 2:
        w = {k: v.to(torch.bfloat16) for k, v in w.items()}
    table = g.rope_table(c)
    rows = []
    for _ in range(prompts):
        p = torch.randint(0, 256, (a.prompt_tokens,), generator=gen).tolist()
        rows += [p] * group
    rates = []
    for run in range(a.runs + 1):
        t = time.perf_counter()
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
        with bf16 if precision > 0 else contextlib.nullcontext():
            completions, _ = g.generate(w, c, rows, a.new_tokens, table, gen)
        seconds = time.perf_counter() - t
        steps = max(len(x) for x in completions)
        if run > 0:
            rates.append(len(rows) * steps / seconds)
    return statistics.median(rates)


def ours(a, prompts, group):
    out = subprocess.run([a.weightlift, "bench", "generate", "--preset", a.preset, "--prompts",
                          str(prompts), "--group", str(group), "--prompt-tokens",
                          str(a.prompt_tokens), "--new-tokens", str(a.new_tokens), "--runs",
                          str(a.runs), "--json"] + (["--widen-per-generation"] if a.widen else [])
                         + (["--bf16-activations"] if a.bf16_activations else []),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weightlift", default=os.path.join(HERE, "..", "build", "release", "apps",
                                                          "weightlift"))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--shapes", default="8x8,64x8", help="prompts x group, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--widen-per-generation", dest="widen", action="store_true",
                    help="ours: the weights widened to f32 once per generation (an f32 copy held)")
    ap.add_argument("--bf16-activations", action="store_true",
                    help="ours: bf16 GEMMs on the stored weights; PyTorch: bf16 autocast as well")
    ap.add_argument("--torch-child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_child:  # one PyTorch measurement in a process of its own
        prompts, group, threads, precision = (int(x) for x in a.torch_child.split(","))
        print(json.dumps({"tokens_per_s": torch_side(a, prompts, group, threads, precision)}))
        return
    for shape in a.shapes.split(","):
        prompts, group = (int(x) for x in shape.split("x"))
        rows = []
        for rnd in range(a.rounds):
            us = ours(a, prompts, group)
            theirs, best = 0.0, ""
            for precision in PRECISIONS if a.bf16_activations else (0,):
                for threads in (1, 2):
                    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--preset",
                                          a.preset, "--prompt-tokens", str(a.prompt_tokens),
                                          "--new-tokens", str(a.new_tokens), "--runs",
                                          str(a.runs), "--torch-child",
                                          f"{prompts},{group},{threads},{precision}"],
                                         capture_output=True, text=True)
                    plural = "s" if threads > 1 else ""
                    config = f"{threads} thread{plural}, {PRECISIONS[precision]}"
                    if out.returncode != 0:
                        raise SystemExit(f"PyTorch ({config}) failed:\n{out.stderr}")
                    rate = json.loads(out.stdout)["tokens_per_s"]
                    if rate > theirs:
                        theirs, best = rate, config
            rows.append((us, theirs, best))
            print(f"# {shape} round {rnd + 1}: ours {us['tokens_per_s']:.0f} tokens/s "
                  f"(decode {100 * us['decode_fraction_of_bound']:.0f}% of its bound, prefill "
                  f"{us['prefill_ms']:.1f} ms, every row prefilled "
                  f"{us['prefill_every_row_ms']:.1f}), "
                  f"PyTorch {theirs:.0f} ({best}): {us['tokens_per_s'] / theirs:.2f}x",
                  file=sys.stderr,
                  flush=True)
        ours_rates = [u["tokens_per_s"] for u, _, _ in rows]
        ratios = [u["tokens_per_s"] / t for u, t, _ in rows]
        bests = "; ".join(sorted(set(b for _, _, b in rows)))
        decode = statistics.median(u["decode_fraction_of_bound"] for u, _, _ in rows)
        prefill = statistics.median(u["prefill_fraction_of_bound"] for u, _, _ in rows)
        print(f"| {a.preset} {shape}, {a.prompt_tokens} + {a.new_tokens} tokens, "
              f"{rows[0][0]['cpu']} | ours {statistics.median(ours_rates):.0f} tokens/s "
              f"({', '.join('%.0f' % r for r in ours_rates)}) | PyTorch eager "
              f"{statistics.median(t for _, t, _ in rows):.0f} ({bests}) | "
              f"{statistics.median(ratios):.2f}x ({', '.join('%.2f' % r for r in ratios)}) | "
              f"decode {100 * decode:.0f}% of bound, prefill {100 * prefill:.0f}% |")


if __name__ == "__main__":
    main()
