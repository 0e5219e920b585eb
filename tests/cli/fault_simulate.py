#!/usr/bin/env python3
"""`weightlift fault simulate` end to end: two stages killed by hand in a 5-stage CheckFree+ run
(swap pairs 0-1 and 3-4, stage 2 between them), each recovered the way the rules say
(summary.json), the validation curve and its plot written, and a second run into the same
directory refused without --overwrite, leaving the first's results.

Usage: fault_simulate.py <weightlift binary> <Brown corpus directory>"""
import json
import os
import subprocess
import sys
import tempfile

CONFIG = {"hidden_size": 64, "num_layers": 5, "num_heads": 4, "num_kv_heads": 1, "head_dim": 16,
          "num_experts": 4, "top_k": 2, "ffn_dim": 128, "vocab_size": 320, "max_seq_len": 128}


def main():
    exe, corpus = sys.argv[1], sys.argv[2]
    failures = []

    def check(ok, what):
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="wl_fault_") as d:
        config = os.path.join(d, "config.json")
        json.dump(CONFIG, open(config, "w"))
        out = os.path.join(d, "run")
        cmd = [exe, "--threads", "1", "fault", "simulate", "--config", config, "--stages", "5",
               "--recovery", "checkfree+", "--kill", "3:0", "--kill", "5:2", "--iterations",
               "8", "--eval-every", "4", "--eval-windows", "16", "--seq", "32", "--corpus",
               corpus, "--out", out]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        check(r.returncode == 0, f"the run succeeds (exit {r.returncode}: {r.stderr[-300:]})")
        s = json.load(open(os.path.join(out, "summary.json")))
        losses = [(l["iteration"], l["stages"]) for l in s["losses"]]
        check(losses == [(3, [{"stage": 0, "how": "copy", "from": [1]}]),
                         (5, [{"stage": 2, "how": "average", "from": [1, 3]}])],
              f"stage 0 copies its swap partner, stage 2 averages its neighbours: {losses}")
        check(all(l["loss_after"] > 0 for l in s["losses"]), "each loss records the loss after")
        check([e["iteration"] for e in s["evaluations"]] == [4, 8], "validation at 4 and 8")
        check(s["swap"] is True and s["progress"] == 8, "checkfree+ swaps; no step is lost")
        check(os.path.getsize(os.path.join(out, "val_loss.svg")) > 0, "the plot is written")
        before = open(os.path.join(out, "summary.json")).read()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        check(r.returncode == 1 and "--overwrite" in r.stderr,
              f"a second run into the same --out is refused: {r.stderr.strip()}")
        check(open(os.path.join(out, "summary.json")).read() == before,
              "the first run's results are untouched")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
