"""Where does a ranking model's GAUC come from? GAUC of several runs per group of users.

    python scripts/ranking_user_groups.py runs/ranking-ml100k-hstu runs/ranking-ml100k-dlrm runs/ranking-ml100k-item

Users are grouped by how many training events they have and by the time between their first
impression of the split and their latest earlier event (training, and for test also validation;
under 0.5 days ~ the same session, more ~ a returning user). All runs
must rank the same impressions (one dataset and split).
"""

from __future__ import annotations

import argparse

import torch
from compare_ranking_runs import _predictions

from recforge.config import load_config
from recforge.train import ranking
from recforge.train.metrics import gauc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--task", default="like", help="binary task name")
    parser.add_argument("--split", default="test", choices=("test", "valid"))
    args = parser.parse_args()
    preds = [_predictions(r, args.split) for r in args.runs]
    for p in preds[1:]:
        if not torch.equal(p["events"], preds[0]["events"]):
            raise SystemExit("the runs did not rank the same impressions; compare runs of one dataset and split")
    data = ranking.load_ranking_data(load_config(f"{args.runs[0]}/config.yaml", ["train.device=cpu"]))
    k = preds[0]["task_names"].index(args.task)
    y, users, events = preds[0]["labels"][:, k], preds[0]["users"], preds[0]["events"]
    known = ~torch.isnan(y)
    train_rows = torch.nonzero(data.split == 0).flatten()
    n_train = torch.bincount(data.event_user[train_rows], minlength=data.num_users)
    before = torch.nonzero(data.split < (1 if args.split == "valid" else 2)).flatten()
    last_before = torch.full((data.num_users,), -(2**62), dtype=torch.int64)
    last_before.scatter_reduce_(0, data.event_user[before], data.timestamps[before], "amax")
    first_seen = torch.full((data.num_users,), 2**62, dtype=torch.int64)
    first_seen.scatter_reduce_(0, users, data.timestamps[events], "amin")
    gap_days = ((first_seen - last_before).double() / 86400)[users]
    groups = [("all users", torch.ones_like(known))]
    for lo, hi in ((0, 40), (40, 100), (100, None)):
        n = n_train[users]
        groups.append((f"{lo}-{hi or ''} training events", (n > lo) & ((n <= hi) if hi else True)))
    for lo, hi, name in ((None, 0.5, "< 0.5 days"), (0.5, 30, "0.5-30 days"), (30, None, "> 30 days")):
        sel = torch.ones_like(known) if lo is None else gap_days > lo
        groups.append((f"gap {name}", sel & ((gap_days <= hi) if hi else True)))
    names = [r.rstrip("/").split("/")[-1] for r in args.runs]
    print(f"{args.split} split, task {args.task}: GAUC per user group (users = those with both classes)")
    print(f"{'group':<24}{'users':>7}{'impr.':>8}" + "".join(f"{n[-24:]:>26}" for n in names))
    for name, sel in groups:
        m = known & sel
        cells = [gauc(p["outputs"][:, k], y, users, m) for p in preds]
        print(f"{name:<24}{int(cells[0][1]):>7}{int(m.sum()):>8}" + "".join(f"{c[0]:>26.4f}" for c in cells))


if __name__ == "__main__":
    main()
