"""Does the model use a long history? HR@10 on long-range synthetic data against the history length read.

Usage (one GPU, ~8 minutes: the trainings run side by side, each with 2 CPU threads):
    python benchmarks/long_seq_quality.py --out benchmarks/results/long_seq_quality-h200.json

Writes the dataset once (``--data``, default ``data/synthetic-long-quality``; a preset of
``recforge.data.synthetic_long``: 1,000 users of 16K-100K events, cycles of 32-8K events),
then runs ``recforge train configs/long-synthetic-hstu.yaml`` once per ``--lengths`` value as
parallel processes (``data.max_seq_len=L``, ``train.batch_size=--tokens/L``: every run sees the
same tokens per step and the same wall-clock budget ``--minutes``), and tabulates each run's
test HR@10 / NDCG@10 next to the data's ceiling for that history length
(``synthetic_long.recall_ceiling``: the hit rate of an oracle that knows the rule). The history
is used when HR@10 rises with L as the ceiling does; the script exits 1 when it does not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from recforge.data.dataset import load_dataset
from recforge.data.synthetic_long import LongSyntheticConfig, recall_ceiling, write_long_synthetic
from recforge.io import atomic_write_json

CONFIG = "configs/long-synthetic-hstu.yaml"
# every user long enough for every cycle (2 x 8192): a fifth of the users per cycle length
QUALITY_DATA = LongSyntheticConfig(num_users=1000, num_items=50_000, median_seq_len=20_000, seq_len_sigma=0.3,
                                   min_seq_len=16_384, max_seq_len=100_000, cycle_lengths=(32, 128, 512, 2048, 8192),
                                   seed=0)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="data/synthetic-long-quality")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--tokens", type=int, default=65_536, help="tokens per training step (every run)")
    p.add_argument("--minutes", type=float, default=6.0, help="training wall-clock per run (they run in parallel)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per training process")
    p.add_argument("--runs", default="runs/long-seq-quality", help="parent directory of the run directories")
    p.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every run")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not (Path(args.data) / "dataset.json").is_file():
        t0 = time.perf_counter()
        write_long_synthetic(args.data, QUALITY_DATA)
        print(f"wrote {args.data} in {time.perf_counter() - t0:.0f} s", flush=True)
    ceiling = recall_ceiling(load_dataset(args.data), args.lengths)

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=os.getcwd())
    procs = {}
    for length in args.lengths:
        overrides = [f"data.path={args.data}", f"data.max_seq_len={length}", f"name=long-synthetic-hstu-L{length}",
                     f"train.batch_size={max(1, args.tokens // length)}", f"train.max_minutes={args.minutes}",
                     f"eval.batch_size={max(1, 262_144 // length)}", f"train.threads={args.threads}",
                     f"train.output_dir={args.runs}/{{name}}", *args.extra]  # fmt: skip
        log = Path(args.runs) / f"L{length}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "recforge.cli", "--no-progress", "train", CONFIG, *overrides]
        procs[length] = (subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT), log)
        print(" ".join(cmd), flush=True)
    rows, failed = [], []
    for length, (proc, log) in procs.items():
        if proc.wait() != 0:
            failed.append(length)
            print(f"L={length} failed; last lines of {log}:\n" + "\n".join(log.read_text().splitlines()[-15:]), file=sys.stderr)
            continue
        result = json.loads((Path(args.runs) / f"long-synthetic-hstu-L{length}" / "eval.json").read_text())
        steps = (Path(args.runs) / f"long-synthetic-hstu-L{length}" / "train_log.jsonl").read_text().splitlines()
        rows.append({"max_seq_len": length, "hr@10": result["hr@10"], "ndcg@10": result["ndcg@10"], "hr@50": result.get("hr@50"),
                     "ceiling_hr": ceiling[length], "train_steps": result["step"], "users": result["num_users"],
                     "last_train_log": json.loads(steps[-1]) if steps else None})  # fmt: skip
    print(f"\n{'max_seq_len':>11} {'HR@10':>7} {'NDCG@10':>8} {'ceiling':>8} {'steps':>6}")
    for r in rows:
        print(f"{r['max_seq_len']:>11} {r['hr@10']:>7.4f} {r['ndcg@10']:>8.4f} {r['ceiling_hr']:>8.4f} {r['train_steps']:>6}")
    hrs = [r["hr@10"] for r in rows]
    rises = len(hrs) >= 2 and hrs[-1] > hrs[0] and all(b >= a - 0.01 for a, b in zip(hrs, hrs[1:]))
    result = {"benchmark": "long_seq_quality", "date": datetime.datetime.now(datetime.UTC).isoformat(),
              "config": CONFIG, "data": repr(QUALITY_DATA), "tokens_per_step": args.tokens, "minutes": args.minutes,
              "extra": args.extra, "rows": rows, "failed": failed, "hr_rises_with_history": rises}  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), result)
    print(f"HR@10 rises with the history read: {rises}")
    return 0 if rises and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
