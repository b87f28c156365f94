"""Paired bootstrap over users: is run A's test AUC / GAUC really above run B's?

    python scripts/compare_ranking_runs.py runs/ranking-ml100k-hstu runs/ranking-ml100k-dlrm --task like
    python scripts/compare_ranking_runs.py runs/h-s42,runs/h-s1 runs/d-s42,runs/d-s1 --task like   # seeds

Both runs must rank the same test impressions (same dataset and ranking split settings). Users
are resampled with replacement ``--samples`` times; the table gives each metric's difference
A - B and its 95% interval. Comma-separated lists pair runs by position (e.g. one per seed):
the difference is then the mean over pairs, every pair scored on the same resampled users, so
the interval covers both the users and the seeds given.
"""

from __future__ import annotations

import argparse

import torch

from recforge.checkpoint import find_checkpoint, load_checkpoint
from recforge.config import load_config
from recforge.jagged.index import (
    offsets_from_lengths,
    positions_in_sequence,
    sequence_ids,
)
from recforge.train import ranking
from recforge.train.metrics import auc, gauc


def _predictions(run_dir: str, split: str) -> dict[str, torch.Tensor]:
    cfg = load_config(f"{run_dir}/config.yaml", ["train.device=cpu"])
    s = ranking.setup(cfg)
    load_checkpoint(find_checkpoint(run_dir, "latest" if cfg.ranking.refit else "best"), s.model)  # as `recforge eval`
    out = ranking.predict(s, split)
    out["task_names"] = [t.name for t in s.data.tasks]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", help="run directory, or a comma-separated list paired with run_b's")
    parser.add_argument("run_b")
    parser.add_argument("--task", required=True, help="binary task name, e.g. like")
    parser.add_argument("--split", default="test", choices=("test", "valid"))
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    runs_a, runs_b = args.run_a.split(","), args.run_b.split(",")
    if len(runs_a) != len(runs_b):
        raise SystemExit(f"{len(runs_a)} runs for A but {len(runs_b)} for B; give one B run per A run")
    a = [_predictions(r, args.split) for r in runs_a]
    b = [_predictions(r, args.split) for r in runs_b]
    for p in a[1:] + b:
        if not torch.equal(a[0]["events"], p["events"]):
            raise SystemExit("the runs did not rank the same impressions; compare runs of one dataset and split")
    k_a, k_b = a[0]["task_names"].index(args.task), b[0]["task_names"].index(args.task)
    y = a[0]["labels"][:, k_a]
    known = ~torch.isnan(y)
    pairs = [(pa["outputs"][:, k_a], pb["outputs"][:, k_b]) for pa, pb in zip(a, b)]
    users = a[0]["users"]
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
        yr = y[rows]
        diffs["auc"].append(sum(auc(za[rows], yr, m) - auc(zb[rows], yr, m) for za, zb in pairs) / len(pairs))
        diffs["gauc"].append(
            sum(gauc(za[rows], yr, groups, m)[0] - gauc(zb[rows], yr, groups, m)[0] for za, zb in pairs) / len(pairs)
        )
    print(f"A = {args.run_a}\nB = {args.run_b}\n{args.split} split, task {args.task}, {uniq.numel()} users, "
          f"{len(pairs)} run pair(s), {args.samples} bootstrap samples")  # fmt: skip
    points = {
        "auc": sum(auc(za, y, known) - auc(zb, y, known) for za, zb in pairs) / len(pairs),
        "gauc": sum(gauc(za, y, users, known)[0] - gauc(zb, y, users, known)[0] for za, zb in pairs) / len(pairs),
    }
    for name, point in points.items():
        d = torch.tensor(diffs[name])
        lo, hi = torch.quantile(d, torch.tensor([0.025, 0.975], dtype=d.dtype)).tolist()
        print(f"{name:>5}: A - B = {point:+.4f}  95% interval [{lo:+.4f}, {hi:+.4f}]  P(A > B) = {(d > 0).double().mean():.2f}")


if __name__ == "__main__":
    main()
