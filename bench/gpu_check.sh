#!/usr/bin/env bash
# The prepared device check for a session lent a GPU (fits in about 6 minutes on one H200):
# 1. the learner bench on CUDA under bf16 autocast, batch 64x256: tokens/s of Learner.step
#    against the bare loop for tiny, small and a 38M model (bench/gpu_models.py:mid);
# 2. `python -m trainer compare` for small on CUDA: decoupled with the defaults (only model, M,
#    H, steps, batch and seed given) against ddp at its own best inner lr (1.5e-3 for small at this
#    batch and 460 steps: the sweep in docs/engine.md, "Defaults"), bf16, batch 64x256 per learner.
# Usage (repository root): bash bench/gpu_check.sh [OUT_DIR]   (PY=python3 where torch lives)
set -euo pipefail
out="${1:-bench/results/gpu}"
mkdir -p "$out"
py="${PY:-.venv/bin/python}"
steps="${COMPARE_STEPS:-460}"
export PYTHONUNBUFFERED=1
"$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0), torch.__version__)'
for model in tiny small bench.gpu_models:mid; do
  name="${model##*:}"
  echo "== learner bench $name bf16"
  "$py" -m trainer.perf --device cuda --bf16 --no-syncer --model "$model" --batch-size 64 --seq-len 256 \
    --steps 30 --repeats 3 --threads 4 --json "$out/learner-$name-bf16.json"
done
echo "== compare small: ddp vs decoupled defaults, $steps inner steps"
"$py" -m trainer compare --model small -M 4 -H 20 --steps "$steps" --batch-size 64 --seq-len 256 \
  --seeds 0 --baseline-inner-lr 1.5e-3 --device cuda --bf16 --eval-batches 16 --eval-every 5 --threads 4 \
  --json "$out/compare-small.json" --markdown "$out/compare-small.md"
