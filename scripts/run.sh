#!/usr/bin/env bash
# The main job: install what is missing, build, then
#   1. RL post-training across processes: a trainer and two rollout workers (weightlift launch),
#      an SFT warm start on generated demonstrations stopped once 30% of the held-out problems
#      are right, then GRPO on the `sort` task with the weights pushed to the workers through
#      the p2p engine before every step; output runs/rl/{report.html,summary.json,
#      rl_metrics.jsonl,reward.svg,model.safetensors,config.json,processes.json};
#   2. pretraining the `small` MoE model on the Brown corpus for a few minutes, then generating
#      from it; output runs/small/{metrics.jsonl,loss.svg,model.safetensors,config.json,...}.
# WL_STEPS sets the pretraining steps, WL_RL_STEPS the RL steps.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
bash scripts/build.sh release weightlift
wl=$PWD/build/release/apps/weightlift
"$wl" launch -n 3 --restart-failed 2 -- "$wl" --threads 1 rl --trainer-threads "$(nproc)" \
  --preset tiny --task sort --difficulty 3 \
  --sft-steps 1000 --sft-lr 1e-3 --sft-target 0.3 --steps "${WL_RL_STEPS:-600}" --lr 5e-4 \
  --checkpoint-every 100 \
  --eval-every 50 --eval-problems 128 --out runs/rl --overwrite
echo "the RL run, with its plots: runs/rl/report.html"
"$wl" model-info --preset small
"$wl" train --preset small --batch 8 --seq 256 --steps "${WL_STEPS:-300}" --warmup-steps 30 \
  --lr 3e-3 --min-lr 3e-4 --eval-every 50 --out runs/small --overwrite
"$wl" generate --run runs/small --max-new-tokens 200 --temperature 0.8 --top-p 0.95 --seed 1 \
  --prompt "The jury said that " --prompt "In the morning, she" --compare-cache
echo "loss curve: runs/small/loss.svg"
