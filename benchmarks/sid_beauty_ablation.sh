#!/usr/bin/env bash
# Amazon Beauty semantic-ID tokenizer ablation at equal training steps on one GPU (clean protocol):
# {residual k-means (balanced), RQ-VAE} x {attribute text, collaborative (a clean SASRec run's items)},
# TIGER-style model, SEEDS seeds each, every run STEPS steps; RUN/eval.json per run, then the table
# (mean ± 95% t-interval) in the log and in benchmarks/results/sid_beauty_ablation.json.
#
#   bash benchmarks/sid_beauty_ablation.sh                 # the H200 run (~8 minutes, one command)
#   STEPS=1000 SEEDS="1 2" bash benchmarks/sid_beauty_ablation.sh   # smaller
#   python benchmarks/sid_beauty_ablation.py --tiny --work /tmp/abl/work --data /tmp/abl/data --steps 4 --seeds 1 2 --sasrec-epochs 1
#
# BEAUTY_SRC: amazon-s3rec source directory (default .gpu_data/amazon-beauty, a copy of
# /work/shared/data/amazon-beauty); DATA: prepared dataset (default data/beauty, made if missing);
# WORK: runs and SID sets (default runs/sid-ablation); PARALLEL processes share the GPU (default 6),
# each with OMP_NUM_THREADS=2; BUDGET_MINUTES (default 9): what still runs then is stopped and the
# table shows what finished. Details: benchmarks/sid_beauty_ablation.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=2
PY="${PYTHON:-$(command -v python3 || command -v python)}"
exec "$PY" benchmarks/sid_beauty_ablation.py \
  --src "${BEAUTY_SRC:-.gpu_data/amazon-beauty}" --data "${DATA:-data/beauty}" --work "${WORK:-runs/sid-ablation}" \
  --steps "${STEPS:-1500}" --seeds ${SEEDS:-1 2 3} --parallel "${PARALLEL:-6}" --sasrec-epochs "${SASREC_EPOCHS:-40}" \
  --budget-minutes "${BUDGET_MINUTES:-9}" "$@"
