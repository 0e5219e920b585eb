#!/usr/bin/env bash
# weightlift vs PyTorch eager on the `small` preset, batch 8 x 256, 2 threads, in one run:
# prints both step times and the ratios, f32 and bf16. Needs a release build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
wl=${WL:-build/release/apps/weightlift}
steps=${STEPS:-5}
for dtype in f32 bf16; do
  ours=$("$wl" --threads 2 bench train --preset small --batch 8 --seq 256 --dtype "$dtype" \
         --steps "$steps" --json)
  theirs=$(/usr/bin/python3 bench/torch_train_small.py --threads 2 --dtype "$dtype" --steps 3)
  /usr/bin/python3 - "$ours" "$theirs" <<'PY'
import json, sys
o, t = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"{o['dtype']:>5}: weightlift {o['step_ms_median']:8.1f} ms/step "
      f"({o['tokens_per_s']:7.0f} tok/s, {o['gflops']:.1f} GFLOP/s = "
      f"{100 * o['fraction_of_gemm_peak']:.0f}% of the {o['gemm_peak_gflops']:.0f} GFLOP/s GEMM peak) | "
      f"PyTorch {t['torch']} eager {t['step_ms_median']:8.1f} ms/step | "
      f"speedup {t['step_ms_median'] / o['step_ms_median']:.2f}x")
PY
done
