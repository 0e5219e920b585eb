#!/usr/bin/env bash
# The main job: install what is missing, build, train the `small` MoE model on the Brown
# corpus for a few minutes, then generate from it.
# Output: runs/small/{metrics.jsonl,loss.svg,model.safetensors,config.json,checkpoint-*}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
bash scripts/build.sh release weightlift
wl=build/release/apps/weightlift
"$wl" model-info --preset small
"$wl" train --preset small --batch 8 --seq 256 --steps "${WL_STEPS:-300}" --warmup-steps 30 \
  --lr 3e-3 --min-lr 3e-4 --eval-every 50 --out runs/small --overwrite
"$wl" generate --run runs/small --max-new-tokens 200 --temperature 0.8 --top-p 0.95 --seed 1 \
  --prompt "The jury said that " --prompt "In the morning, she" --compare-cache
echo "loss curve: runs/small/loss.svg"
