#!/usr/bin/env bash
# Amazon Beauty semantic-ID ablation on one GPU (clean protocol; results in runs/*/eval.json).
#
#   bash benchmarks/sid_beauty_ablation.sh prep    # data, a SASRec run for collaborative embeddings, 4 SID sets (~3 min)
#   bash benchmarks/sid_beauty_ablation.sh train   # 5 generative trainings in parallel, each <= MINUTES, then the table
#
# Each stage fits in one 10-minute command. BEAUTY_SRC: the amazon-s3rec source directory if not the
# default (../shared/data/amazon-beauty or $RECFORGE_DATA); MINUTES (default 6): wall-time budget per run.
set -euo pipefail
cd "$(dirname "$0")/.."
RF="${PYTHON:-python} -m recforge.cli --no-progress"
MINUTES="${MINUTES:-6}"
RUNS="tiger-text-rk tiger-text-rqvae tiger-collab-rk tiger-collab-rqvae hstu-collab-rk"

if [[ "${1:-}" == "prep" ]]; then
  [[ -f data/beauty/dataset.json ]] || $RF data prepare amazon-s3rec ${BEAUTY_SRC:-} --out data/beauty
  [[ -f runs/beauty-sasrec-collab/checkpoints/best.json ]] || \
    $RF train configs/beauty-sasrec.yaml name=beauty-sasrec-collab train.epochs=40 train.eval_every=5
  $RF sid fit data/beauty --out data/beauty/sids --source text --balanced --overwrite &
  $RF sid fit data/beauty --out data/beauty/sids-text-rqvae --source text --method rqvae --overwrite &
  $RF sid fit data/beauty --out data/beauty/sids-collab --source run:runs/beauty-sasrec-collab --balanced --overwrite &
  $RF sid fit data/beauty --out data/beauty/sids-collab-rqvae --source run:runs/beauty-sasrec-collab --method rqvae --overwrite &
  wait
elif [[ "${1:-}" == "train" ]]; then
  common="train.max_minutes=$MINUTES train.threads=2"  # 5 runs share the host CPUs
  $RF train configs/beauty-sid-tiger.yaml name=tiger-text-rk $common > /tmp/tiger-text-rk.log 2>&1 &
  $RF train configs/beauty-sid-tiger.yaml name=tiger-text-rqvae generative.sids=data/beauty/sids-text-rqvae $common > /tmp/tiger-text-rqvae.log 2>&1 &
  $RF train configs/beauty-sid-tiger.yaml name=tiger-collab-rk generative.sids=data/beauty/sids-collab $common > /tmp/tiger-collab-rk.log 2>&1 &
  $RF train configs/beauty-sid-tiger.yaml name=tiger-collab-rqvae generative.sids=data/beauty/sids-collab-rqvae $common > /tmp/tiger-collab-rqvae.log 2>&1 &
  $RF train configs/beauty-sid-hstu.yaml name=hstu-collab-rk generative.sids=data/beauty/sids-collab $common > /tmp/hstu-collab-rk.log 2>&1 &
  wait
  for run in $RUNS; do tail -n 3 /tmp/$run.log; done
  ${PYTHON:-python} - $RUNS <<'PY'
import json, sys
print(f"{'run':<22}{'R@5':>8}{'N@5':>8}{'R@10':>8}{'N@10':>8}  step  sids")
for run in sys.argv[1:]:
    try:
        r = json.load(open(f"runs/{run}/eval.json"))
    except FileNotFoundError:
        print(f"{run:<22} no eval.json (see /tmp/{run}.log)")
        continue
    print(f"{run:<22}{r['hr@5']:>8.4f}{r['ndcg@5']:>8.4f}{r['hr@10']:>8.4f}{r['ndcg@10']:>8.4f}  {r['step']:>5}  {r['sids']}")
PY
else
  echo "usage: $0 prep|train" >&2
  exit 2
fi
