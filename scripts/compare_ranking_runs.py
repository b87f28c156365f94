"""Paired bootstrap over users: is run A's test AUC / GAUC really above run B's?

    python scripts/compare_ranking_runs.py runs/ranking-ml100k-hstu runs/ranking-ml100k-dlrm --task like

Both runs must rank the same test impressions (same dataset and ranking split settings). Users
are resampled with replacement ``--samples`` times; the table gives each metric's difference
A - B and its 95% interval.
"""

from __future__ import annotations

import argparse

import torch

from recforge.config import load_config
from recforge.train import ranking
from recforge.train.checkpoint import find_checkpoint, load_checkpoint
from recforge.ops.jagged import offsets_from_lengths, positions_in_sequence, sequence_ids
from recforge.train.metrics import auc, gauc


def _predictions(run_dir: str, split: str) -> dict[str, torch.Tensor]:
    cfg = load_config(f"{run_dir}/config.yaml", ["train.device=cpu"])
    s = ranking.setup(cfg)
    load_checkpoint(find_checkpoint(run_dir, "best"), s.model)
    out = ranking.predict(s, split)
    out["task_names"] = [t.name for t in s.data.tasks]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--task", required=True, help="binary task name, e.g. like")
    parser.add_argument("--split", default="test", choices=("test", "valid"))
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    a, b = _predictions(args.run_a, args.split), _predictions(args.run_b, args.split)
    if not torch.equal(a["events"], b["events"]):
        raise SystemExit("the two runs did not rank the same impressions; compare runs of one dataset and split")
    k_a, k_b = a["task_names"].index(args.task), b["task_names"].index(args.task)
    y = a["labels"][:, k_a]
    known = ~torch.isnan(y)
    za, zb, users = a["outputs"][:, k_a], b["outputs"][:, k_b], a["users"]
    uniq, inverse = torch.unique(users, return_inverse=True)
    gen = torch.Generator().manual_seed(args.seed)
    diffs = {"auc": [], "gauc": []}
    for _ in range(args.samples):
        pick = torch.randint(0, uniq.numel(), (uniq.numel(),), generator=gen)
        weight = torch.bincount(pick, minlength=uniq.numel())[inverse]  # times each row's user was drawn
        offsets = offsets_from_lengths(weight)
        rows = sequence_ids(offsets)
        copy = positions_in_sequence(offsets)  # a user drawn twice counts as two users: one group id per copy
        groups = inverse[rows] * (int(weight.max()) + 1) + copy
        m = known[rows]
        diffs["auc"].append(auc(za[rows], y[rows], m) - auc(zb[rows], y[rows], m))
        diffs["gauc"].append(gauc(za[rows], y[rows], groups, m)[0] - gauc(zb[rows], y[rows], groups, m)[0])
    print(f"A = {args.run_a}\nB = {args.run_b}\n{args.split} split, task {args.task}, {uniq.numel()} users, "
          f"{args.samples} bootstrap samples")  # fmt: skip
    for name, point in (("auc", auc(za, y, known) - auc(zb, y, known)),
                        ("gauc", gauc(za, y, users, known)[0] - gauc(zb, y, users, known)[0])):  # fmt: skip
        d = torch.tensor(diffs[name])
        lo, hi = torch.quantile(d, torch.tensor([0.025, 0.975], dtype=d.dtype)).tolist()
        print(f"{name:>5}: A - B = {point:+.4f}  95% interval [{lo:+.4f}, {hi:+.4f}]  P(A > B) = {(d > 0).double().mean():.2f}")


if __name__ == "__main__":
    main()
