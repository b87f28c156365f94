"""What within-user signal can a model read from the synthetic impressions' history?

    python scripts/ranking_synthetic_probe.py data/synthetic-impressions --split test

The generator draws each impression's labels from ``sigmoid(b + w_a * affinity + w_s * same)``
(``recforge.data.synthetic.IMPRESSION_LOGITS``): ``affinity`` is the user's taste for the item's
cluster, ``same`` whether the item continues the previous event's cluster. This script splits
the Bayes-optimal GAUC into the two parts (scoring with each part alone) and measures how much of
each a model can recover from the history it sees: the share of the user's earlier events in
the candidate's cluster (the empirical affinity) and ``same`` itself (read off the previous
event). A logistic regression over those history features, fitted on the training impressions,
gives the GAUC a history-reading model could reach without any user or item id.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from recforge.data.dataset import load_dataset
from recforge.data.ranking import SPLITS
from recforge.data.synthetic import IMPRESSION_LOGITS
from recforge.train.metrics import auc, gauc


def history_features(users: np.ndarray, clusters: np.ndarray, num_clusters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(share of the user's earlier events in this event's cluster, their count, same cluster as the previous event)."""
    n = len(users)
    first = np.r_[True, users[1:] != users[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    onehot = np.zeros((n, num_clusters), np.int32)
    onehot[np.arange(n), clusters] = 1
    cum = np.cumsum(onehot, 0) - onehot  # events strictly before, over the whole array
    base = cum[start]  # counts before the user's first event
    counts = (cum - base)[np.arange(n), clusters]
    seen = np.arange(n) - start
    share = np.where(seen > 0, counts / np.maximum(seen, 1), 0.0)
    same = np.zeros(n, bool)
    same[1:] = (clusters[1:] == clusters[:-1]) & ~first[1:]
    return share, counts, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data")
    parser.add_argument("--split", default="test", choices=("valid", "test"))
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--valid-fraction", type=float, default=0.1)
    args = parser.parse_args()
    ds = load_dataset(args.data)
    ev = ds.events
    users = ev.column("user_id").to_numpy()
    items = ev.column("item_id").to_numpy()
    item_cluster = dict(zip(ds.items.column("item_id").to_pylist(), ds.items.column("cluster").to_pylist()))
    clusters = np.asarray([item_cluster[i] for i in items])
    share, counts, same = history_features(users, clusters, int(clusters.max()) + 1)
    # per-user time split, as recforge.data.ranking does it
    first = np.r_[True, users[1:] != users[:-1]]
    starts = np.flatnonzero(first)
    lengths = np.diff(np.r_[starts, len(users)])
    owner = np.repeat(np.arange(len(starts)), lengths)
    pos_from_end = np.repeat(starts + lengths, lengths) - np.arange(len(users)) - 1
    n_test = np.ceil(lengths * args.test_fraction).astype(int)
    n_valid = np.ceil(lengths * args.valid_fraction).astype(int)
    split = np.where(pos_from_end < n_test[owner], 2, np.where(pos_from_end < (n_test + n_valid)[owner], 1, 0))
    feats = np.stack([share, np.log1p(counts), same.astype(float), np.log1p(np.arange(len(users)) - np.repeat(starts, lengths))], 1)
    rows = []
    for task, (b, wa, ws) in IMPRESSION_LOGITS.items():
        y = ev.column(task).to_numpy().astype(np.float32)
        p = ev.column(f"p_{task}").to_numpy().astype(np.float64)
        logit = np.log(p / (1 - p))
        affinity = (logit - b - ws * same) / wa
        sel = split == SPLITS[args.split]
        tr = split == 0
        # logistic regression on the history features (train impressions), by Newton steps
        x_tr = np.c_[np.ones(tr.sum()), feats[tr]]
        w = np.zeros(x_tr.shape[1])
        for _ in range(25):
            z = 1 / (1 + np.exp(-x_tr @ w))
            g = x_tr.T @ (y[tr] - z)
            h = (x_tr * (z * (1 - z))[:, None]).T @ x_tr + 1e-6 * np.eye(len(w))
            w += np.linalg.solve(h, g)
        fitted = np.c_[np.ones(sel.sum()), feats[sel]] @ w
        scores = {
            "bayes (true p)": logit[sel],
            "true affinity only": affinity[sel],
            "true same-as-previous only": same[sel].astype(float),
            "history share in cluster": share[sel],
            "history count in cluster": counts[sel].astype(float),
            "history has the cluster (0/1)": (counts[sel] > 0).astype(float),
            "history features, logistic": fitted,
        }
        yt, ut = torch.from_numpy(y[sel]), torch.from_numpy(owner[sel])
        for name, s in scores.items():
            st = torch.from_numpy(np.asarray(s, np.float64)).float()
            rows.append((task, name, auc(st, yt), gauc(st, yt, ut)[0]))
    print(f"| task | scorer ({args.split}) | AUC | GAUC |\n| --- | --- | --- | --- |")
    for task, name, a, g in rows:
        print(f"| {task} | {name} | {a:.4f} | {g:.4f} |")


if __name__ == "__main__":
    main()
