#!/usr/bin/python3
"""An arithmetic dataset as JSONL: {"prompt": "347+1=", "answer": "348"} per line, every
three-digit number plus one, shuffled. weightlift holds out the rows whose prompt hashes into
the lowest 1/8 (the same ones in every run); training never sees them, so held-out accuracy
measures the carry rule learnt, not rows remembered.

    make_dataset.py OUT.jsonl [--seed 0]
"""
import argparse
import json
import random


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rows = [{"prompt": f"{n}+1=", "answer": str(n + 1)} for n in range(100, 1000)]
    random.Random(a.seed).shuffle(rows)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{a.out}: {len(rows)} problems")


if __name__ == "__main__":
    main()
