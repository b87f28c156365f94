"""Do two ranking runs carry different within-user signal? Test AUC / GAUC of their mixed scores.

    python scripts/ranking_score_mix.py runs/ranking-ml100k-hstu-selgauc runs/x-item-s42 --task like

Each run's test logits are standardised over all impressions, then mixed ``w * A + (1 - w) * B``
for a few ``w``. A mix that beats both runs' GAUC means each ranks some users' items better than
the other: a diagnostic (the mix is not a model the recipe trains), used to decide what to try.
"""

from __future__ import annotations

import argparse

import torch
from compare_ranking_runs import (
    _predictions,  # scripts/ is on sys.path when run as a script
)

from recforge.train.metrics import auc, gauc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--task", required=True, help="binary task name, e.g. like")
    parser.add_argument("--split", default="test", choices=("test", "valid"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    a, b = _predictions(args.run_a, args.split), _predictions(args.run_b, args.split)
    if not torch.equal(a["events"], b["events"]):
        raise SystemExit("the two runs did not rank the same impressions; compare runs of one dataset and split")
    k = a["task_names"].index(args.task)
    y, users = a["labels"][:, k], a["users"]
    known = ~torch.isnan(y)
    za, zb = a["outputs"][:, k], b["outputs"][:, b["task_names"].index(args.task)]
    za, zb = (za - za.mean()) / za.std(), (zb - zb.mean()) / zb.std()
    print(f"| w (A = {args.run_a}, B = {args.run_b}) | {args.split} AUC | {args.split} GAUC |\n| --- | --- | --- |")
    for w in (1.0, 0.75, 0.5, 0.25, 0.0):
        z = w * za + (1 - w) * zb
        print(f"| {w:.2f} | {auc(z, y, known):.4f} | {gauc(z, y, users, known)[0]:.4f} |")


if __name__ == "__main__":
    main()
