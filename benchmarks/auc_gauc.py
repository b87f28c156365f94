"""AUC and GAUC: recforge's sort-based torch versions vs scikit-learn, on random impressions.

Usage:
    python benchmarks/auc_gauc.py --rows 10000000 --users 100000 --out benchmarks/results/auc_gauc-cpu-2core.json
    python benchmarks/auc_gauc.py --rows 1000000 --users 10000 --device cuda

Draws `--rows` impressions over `--users` users: a float32 logit per row, a label drawn from
sigmoid(logit + user bias), and a score = logit rounded to 3 decimals (so ties are common).
Times `auc` against `sklearn.metrics.roc_auc_score` on all rows, and `gauc` against the naive
GAUC (group rows by user, then one `roc_auc_score` per user with both classes), checks that the
values agree to 1e-9, and prints one table. Our timings are medians over `--repeats`; the naive
per-user loop runs once.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from recforge.train.metrics import auc, gauc
from recforge.io import atomic_write_json
from _machine import cpu_model

TOLERANCE = 1e-9


def make_data(rows: int, users: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    user_ids = torch.randint(0, users, (rows,), generator=g)
    user_bias = torch.randn(users, generator=g)[user_ids]  # (rows,) makes per-user AUC differ from pooled
    logits = torch.randn(rows, generator=g)
    labels = torch.rand(rows, generator=g) < torch.sigmoid(logits + user_bias - 1.0)
    scores = torch.round(logits, decimals=3)  # float32, heavy ties
    return scores, labels.float(), user_ids


def timed(fn, repeats: int, sync) -> tuple[float, object]:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        value = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), value


def naive_gauc(scores: np.ndarray, labels: np.ndarray, user_ids: np.ndarray) -> tuple[float, int]:
    """What GAUC code usually looks like: group rows by user, loop, call sklearn per user."""
    order = np.argsort(user_ids, kind="stable")
    starts = np.flatnonzero(np.diff(user_ids[order], prepend=-1))
    total, weight, used = 0.0, 0, 0
    for rows in np.split(order, starts[1:]):
        y = labels[rows]
        positives = int(y.sum())
        if positives == 0 or positives == len(y):
            continue
        total += len(y) * roc_auc_score(y, scores[rows])
        weight += len(y)
        used += 1
    return total / weight, used



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of ours and of pooled sklearn (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]  # other processes on a small machine slow every row

    scores, labels, user_ids = make_data(args.rows, args.users, args.seed)
    np_scores, np_labels, np_users = scores.numpy(), labels.numpy(), user_ids.numpy()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    scores_d, labels_d, users_d = scores.to(device), labels.to(device), user_ids.to(device)
    auc(scores_d[:1000], labels_d[:1000])  # warm-up (allocator, kernels)

    results = []
    ours_s, ours = timed(lambda: auc(scores_d, labels_d), args.repeats, sync)
    ref_s, ref = timed(lambda: roc_auc_score(np_labels, np_scores), args.repeats, lambda: None)
    results.append({"metric": "auc", "scores": "float32", "ours_s": ours_s, "reference": "roc_auc_score, all rows", "reference_s": ref_s, "ours": ours, "reference_value": float(ref)})

    t0 = time.perf_counter()
    naive, naive_users = naive_gauc(np_scores, np_labels, np_users)
    naive_s = time.perf_counter() - t0
    for dtype in (torch.float32, torch.float64):
        s = scores_d.to(dtype)
        ours_s, (ours, ours_users) = timed(lambda: gauc(s, labels_d, users_d), args.repeats, sync)
        if ours_users != naive_users:
            sys.exit(f"gauc used {ours_users} users but the per-user loop used {naive_users}")
        name = "float32" if dtype == torch.float32 else "float64"
        results.append({"metric": "gauc", "scores": name, "ours_s": ours_s, "reference": "per-user roc_auc_score loop", "reference_s": naive_s, "ours": ours, "reference_value": naive, "users_used": ours_users})

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    print(f"AUC / GAUC on {args.rows:,} rows, {args.users:,} users, {device_name}, torch {torch.__version__}")
    print(f"{'metric':<8}{'scores':<9}{'ours s':>9}  {'reference':<29}{'ref s':>9}{'ratio':>9}{'value':>11}{'|diff|':>10}")
    for r in results:
        r["ratio"] = r["reference_s"] / r["ours_s"]
        r["abs_diff"] = abs(r["ours"] - r["reference_value"])
        print(f"{r['metric']:<8}{r['scores']:<9}{r['ours_s']:>9.3f}  {r['reference']:<29}{r['reference_s']:>9.3f}{r['ratio']:>8.1f}x{r['ours']:>11.6f}{r['abs_diff']:>10.1e}")
    print(f"gauc used {results[1]['users_used']:,} users with both classes; ratio = reference s / ours s; 1-min load average at start {load_at_start:.2f}")
    bad = [r for r in results if not r["abs_diff"] <= TOLERANCE]
    if bad:
        sys.exit(f"values disagree beyond {TOLERANCE}: {bad}")
    if args.out:
        payload = {
            "benchmark": "auc_gauc",
            "command": "python benchmarks/auc_gauc.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None),
            "machine": device_name,
            "torch": torch.__version__,
            "sklearn": __import__("sklearn").__version__,
            "date": datetime.date.today().isoformat(),
            "load_average_1m_at_start": load_at_start,
            "rows": results,
        }
        atomic_write_json(Path(args.out), payload)


if __name__ == "__main__":
    main()
