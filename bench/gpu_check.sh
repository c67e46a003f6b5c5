#!/usr/bin/env bash
# The short device check for a session lent a GPU: a learner on CUDA, fp32 and bf16 autocast,
# tokens/s of Learner.step against the bare loop over the same model and data.
# Usage (repository root, venv installed): bash bench/gpu_check.sh [OUT_DIR]
set -euo pipefail
out="${1:-bench/results/gpu}"
mkdir -p "$out"
py="${PY:-.venv/bin/python}"
"$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0), torch.__version__)'
for model in tiny small; do
  for prec in fp32 bf16; do
    flag=""; [ "$prec" = bf16 ] && flag="--bf16"
    echo "== $model $prec"
    "$py" -m trainer.perf --device cuda $flag --no-syncer --model "$model" --batch-size 32 --seq-len 256 \
      --steps 50 --threads 4 --json "$out/learner-$model-$prec.json"
  done
done
