#!/usr/bin/env bash
# Train ranking configs one after another on one GPU (recforge train evaluates each on its test
# split at the end) and pack the run directories (without optimizer state) into $OUT.
# Usage (on a GPU machine, from the repo root, with data/ml-100k and data/synthetic-impressions):
#   RUNS="ranking-ml100k-hstu ranking-ml100k-dlrm" bash scripts/gpu_ranking.sh
# Each entry of RUNS is CONFIG[:NAME[:OVERRIDE,OVERRIDE...]].
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu-out}; mkdir -p "$OUT" runs
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
for entry in ${RUNS:-ranking-ml100k-hstu ranking-ml100k-dlrm}; do
  IFS=: read -r cfg name overrides <<< "$entry"
  name=${name:-$cfg}
  start=$(date +%s)
  python3 -m recforge.cli --no-progress train configs/$cfg.yaml name=$name train.device=cuda \
    train.keep_checkpoints=1 ${overrides//,/ } ${EXTRA:-} > runs/$name.log 2>&1
  echo "== $name ($(( $(date +%s) - start )) s)"; grep -v -E "INFO|Warning" runs/$name.log | tail -6
done
tar czf "$OUT/runs.tar.gz" --exclude=optimizer.safetensors --exclude='*.log' runs/
