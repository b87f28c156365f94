#!/usr/bin/env bash
# Train the ML-1M configurations concurrently on one GPU, evaluate each with `recforge eval`,
# and pack the run directories (without optimizer state) into $OUT.
# Usage (on a GPU machine, from the repo root, with data/ml-1m prepared):
#   MINUTES=7 bash scripts/gpu_ml1m.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu-out}; mkdir -p "$OUT" runs
MINUTES=${MINUTES:-7}
mkdir -p benchmarks/results
EXTRA=${EXTRA:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${BENCH:-1}" = 1 ]; then
  python3 benchmarks/train_throughput.py --device cuda --steps 30 --warmup 5 \
    --out benchmarks/results/train_throughput-gpu.json 2>&1 | grep -v INFO
  cp benchmarks/results/train_throughput-gpu.json "$OUT/"
fi
pids=()
for cfg in ${CONFIGS:-ml1m-sasrec ml1m-hstu ml1m-hstu-large ml1m-hstu-large-full}; do
  for protocol in ${PROTOCOLS:-paper clean}; do
    name=$cfg-$protocol
    python3 -m recforge.cli --no-progress train configs/$cfg.yaml name=$name data.protocol=$protocol \
      train.max_minutes=$MINUTES train.keep_checkpoints=1 $EXTRA > runs/$name.log 2>&1 &
    pids+=($!)
    # one process at a time unless PARALLEL=1: concurrent processes time-slice the GPU and
    # measured 9.4x slower each with 8 of them (launch-bound small models)
    [ "${PARALLEL:-0}" = 1 ] || { wait $!; grep -E "test:|valid:" runs/$name.log | tail -1; }
  done
done
wait "${pids[@]}"
for log in runs/*.log; do echo "== $log"; grep -E "test:|valid:|error" "$log" | tail -3; done
for d in runs/*/; do
  python3 -m recforge.cli --no-progress eval "$d" > /dev/null 2>&1 || echo "eval failed: $d"
done
tar czf "$OUT/runs.tar.gz" --exclude=optimizer.safetensors runs/
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob("runs/*/eval.json")):
    m = json.load(open(f))
    print(f"{f:<45} step {m['step']:>6}  hr@10 {m['hr@10']:.4f}  ndcg@10 {m['ndcg@10']:.4f}  hr@50 {m['hr@50']:.4f}  hr@200 {m['hr@200']:.4f}")
PY
