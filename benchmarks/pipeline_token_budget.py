"""Token balance of fixed-size vs token-budget batches, per batch and across data-parallel ranks.

Usage:
    python benchmarks/pipeline_token_budget.py --ranks 4 --out benchmarks/results/pipeline_token_budget-cpu-2core.json
    python benchmarks/pipeline_token_budget.py --ranks 4 --max-len 50 --out benchmarks/results/pipeline_token_budget-trunc-cpu-2core.json

Reads the same synthetic sample files (history lengths uniform in 1..2*mean, or heavy-tailed lognormal) through the
pipeline on ``--ranks`` ranks (in one process, rank by rank), once with fixed batches of
``--batch-size`` rows and once with a token budget equal to the fixed batches' mean tokens.
Reports, per mode: tokens per batch (mean, coefficient of variation), and the *straggler
factor* of synchronous data parallelism: at each step every rank waits for the rank with the
most tokens, so the step costs max-over-ranks tokens while the work done is the mean; the
factor is sum(max) / sum(mean) over steps (1.0 = perfectly balanced). It is a data statistic
(what a cost linear in tokens would lose), not a measured training speed-up. Also the
pipeline's rows/s for both modes on rank 0.

With ``--max-len`` the histories are truncated by a map (``truncate_lists``) before batching, and
a third mode shows the same token budget with shares balanced on the files' lengths (the map
wrapped so it does not declare its effect): what ranks' shares were before they used the lengths
after the maps.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recforge.data.collate import JaggedCollate
from recforge.data.pipeline import Pipeline
from recforge.data.transforms import truncate_lists
from recforge.io import atomic_write_json

sys.path.insert(0, str(Path(__file__).parent))
from _machine import cpu_model
from pipeline import make_samples


def make_lognormal_samples(directory: Path, rows: int, mean_len: int, files: int, seed: int = 0) -> None:
    """Heavy-tailed history lengths (lognormal, sigma 1, median ``mean_len / 1.65``, clipped to 1..2000), like real users."""
    rng = np.random.default_rng(seed)
    per_file = rows // files
    for f in range(files):
        lengths = np.clip(rng.lognormal(np.log(mean_len / 1.65), 1.0, per_file).astype(np.int64), 1, 2000)
        off = np.r_[0, np.cumsum(lengths)].astype(np.int64)
        items = pa.LargeListArray.from_arrays(pa.array(off), pa.array(rng.integers(1, 1_000_000, off[-1])))
        pq.write_table(pa.table({"item_ids": items}), directory / f"part-{f:03d}.parquet", row_group_size=8192)


def rank_tokens(paths: list[str], ranks: int, batch: dict, max_len: int = 0, declared: bool = True) -> tuple[list[np.ndarray], float]:
    per_rank, rows_per_s = [], 0.0
    truncate = truncate_lists(["item_ids"], max_len)
    for rank in range(ranks):
        pipe = Pipeline.from_parquet(paths, columns=["item_ids"], num_workers=2, rank=rank, world_size=ranks, seed=1)
        if max_len:
            pipe = pipe.map(truncate if declared else lambda rb: truncate(rb))
        pipe = (
            pipe.shuffle(8192)
            .batch(**batch)
            .collate(JaggedCollate({"item_ids": "item_ids"}))
        )
        t0 = time.perf_counter()
        tokens, rows = [], 0
        for b in pipe:
            tokens.append(b.num_tokens)
            rows += b.batch_size
        if rank == 0:
            rows_per_s = rows / (time.perf_counter() - t0)
        per_rank.append(np.array(tokens))
    return per_rank, rows_per_s


def summarise(per_rank: list[np.ndarray]) -> dict:
    steps = min(len(t) for t in per_rank)  # synchronous steps all ranks take
    grid = np.stack([t[:steps] for t in per_rank])  # (ranks, steps)
    all_batches = np.concatenate(per_rank)
    return {
        "batches_per_rank": [len(t) for t in per_rank],
        "mean_tokens": float(all_batches.mean()),
        "cv_tokens": float(all_batches.std() / all_batches.mean()),
        "straggler_factor": float(grid.max(axis=0).sum() / grid.mean(axis=0).sum()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--mean-len", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--lengths", default="uniform,lognormal", help="history-length distributions to run")
    p.add_argument("--max-len", type=int, default=0, help="truncate histories to this many items by a map (0: no map)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    load_at_start = os.getloadavg()[0]
    rows = []
    for dist in args.lengths.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            if dist == "uniform":
                make_samples(Path(tmp), args.rows, args.mean_len, files=4)
            elif dist == "lognormal":
                make_lognormal_samples(Path(tmp), args.rows, args.mean_len, files=4)
            else:
                raise ValueError(f"--lengths: unknown distribution {dist!r} (uniform, lognormal)")
            paths = sorted(str(x) for x in Path(tmp).glob("*.parquet"))
            fixed, fixed_rate = rank_tokens(paths, args.ranks, {"batch_size": args.batch_size}, args.max_len)
            budget = round(float(np.concatenate(fixed).mean()))
            spec = {"token_budget": budget, "length_column": "item_ids"}
            if args.max_len:
                blind, blind_rate = rank_tokens(paths, args.ranks, spec, args.max_len, declared=False)
            balanced, balanced_rate = rank_tokens(paths, args.ranks, spec, args.max_len)
        rows.append({"lengths": dist, "mode": f"fixed {args.batch_size} rows", "rank0_rows_per_s": fixed_rate, **summarise(fixed)})
        if args.max_len:
            rows.append({"lengths": dist, "mode": f"budget {budget}, pre-map", "rank0_rows_per_s": blind_rate, **summarise(blind)})
        rows.append({"lengths": dist, "mode": f"token budget {budget}", "rank0_rows_per_s": balanced_rate, **summarise(balanced)})
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    trunc = f", truncated to {args.max_len} by a map" if args.max_len else ""
    print(f"\n{args.rows} rows, mean history ~{args.mean_len} (uniform 1..{2 * args.mean_len - 1} or lognormal){trunc}, {args.ranks} ranks; {machine}; "
          f"1-min load average at start {load_at_start:.2f}")  # fmt: skip
    print(f"{'lengths':10s} {'mode':22s} {'mean tokens':>11s} {'CV tokens':>9s} {'straggler':>9s} {'batches/rank':>16s} {'rows/s (rank 0)':>15s}")
    for r in rows:
        per_rank = "/".join(map(str, r["batches_per_rank"]))
        print(f"{r['lengths']:10s} {r['mode']:22s} {r['mean_tokens']:11.0f} {r['cv_tokens']:9.3f} {r['straggler_factor']:9.3f} {per_rank:>16s} "
              f"{r['rank0_rows_per_s']:15,.0f}")  # fmt: skip
    if args.out:
        payload = {"benchmark": "pipeline_token_budget", "command": "python " + " ".join(sys.argv), "machine": machine,
                   "date": datetime.date.today().isoformat(), "load_average_at_start": load_at_start, "args": vars(args),
                   "rows": rows}  # fmt: skip
        atomic_write_json(Path(args.out), payload)


if __name__ == "__main__":
    main()
