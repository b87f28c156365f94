"""Trainer idle time waiting for data in a real training run fed by the sample engine.

Usage:
    python benchmarks/pipeline_idle.py --steps 150 --out benchmarks/results/pipeline_idle-cpu-2core.json
    python benchmarks/pipeline_idle.py --train-config configs/ml1m-hstu.yaml --steps 50 \
        --out benchmarks/results/pipeline_idle-ml1m-cpu-2core.json

Trains the retrieval model (HSTU, sampled softmax, AdamW: the retrieval recipe's step) on
batches from ``Pipeline.from_parquet(...).map(truncate).map(next_item_targets).shuffle()
.batch().collate().prefetch()`` and times, per step, the wait in ``next(batches)`` and the
step itself. Then the same number of steps from the IO-free replay mode (the same batches
from memory): the model's own ceiling. Idle fraction = waiting / (waiting + stepping),
after one warm-up step.

With ``--train-config`` it instead runs the real ``recforge train CONFIG train.loader=pipeline
train.max_steps=STEPS`` (into a temporary directory) and reads the same two times per step
from the run's ``train_log.jsonl`` (``data_wait_s``, ``step_s``, logged by the training loop).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recforge.config import ModelConfig
from recforge.data.collate import JaggedCollate
from recforge.data.pipeline import Pipeline, replay
from recforge.data.transforms import next_item_targets, truncate_lists
from recforge.models.builders import build_retrieval_model
from recforge.train.losses import sampled_softmax_loss
from recforge.io import atomic_write_json

sys.path.insert(0, str(Path(__file__).parent))
from _machine import cpu_model


def make_samples(directory: Path, rows: int, mean_len: int, num_items: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 2 * mean_len, rows)
    off = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    table = pa.table({
        "user_id": np.arange(rows, dtype=np.int64),
        "item_ids": pa.LargeListArray.from_arrays(pa.array(off), pa.array(rng.integers(1, num_items + 1, off[-1]))),
    })  # fmt: skip
    pq.write_table(table, directory / "samples.parquet", row_group_size=4096)


def train(batches, steps: int, model, optimizer, num_items: int) -> dict:
    waits, computes, tokens = [], [], 0
    it = iter(batches)
    for i in range(steps + 1):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        user = model(batch)  # (T, d)
        loss = sampled_softmax_loss(user, batch.labels["next_item"], model.item_vectors, num_items, num_negatives=128)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        t2 = time.perf_counter()
        if i:  # step 0 is warm-up (thread start, first shuffle window)
            waits.append(t1 - t0)
            computes.append(t2 - t1)
            tokens += batch.num_tokens
    return summarise(waits, computes, tokens)


def summarise(waits: list[float], computes: list[float], tokens: int) -> dict:
    wait, compute = sum(waits), sum(computes)
    return {"steps": len(waits), "wait_s": wait, "step_s": compute, "idle_fraction": wait / (wait + compute),
            "median_wait_ms": 1e3 * statistics.median(waits), "max_wait_ms": 1e3 * max(waits),
            "median_step_ms": 1e3 * statistics.median(computes), "tokens_per_s": tokens / (wait + compute)}  # fmt: skip


def train_with_recipe(config: str, steps: int, workers: int, out_dir: Path) -> dict:
    """Run the real ``recforge train`` with the pipeline loader; summarise its logged waits and steps."""
    overrides = ["train.loader=pipeline", f"train.max_steps={steps + 1}", f"train.loader_workers={workers}",
                 f"train.output_dir={out_dir}/{{name}}"]  # fmt: skip
    recforge = Path(sys.executable).with_name("recforge")
    subprocess.run([str(recforge), "--no-progress", "train", config, *overrides], check=True)
    (log,) = out_dir.glob("*/train_log.jsonl")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    later = rows[1:]  # step 1 is warm-up: its wait includes reading and shuffling the first window
    result = summarise([r["data_wait_s"] for r in later], [r["step_s"] for r in later],
                       round(sum(r["tokens_per_s"] * r["step_s"] for r in later)))  # fmt: skip
    return {**result, "first_wait_ms": 1e3 * rows[0]["data_wait_s"], "command": "recforge train " + " ".join([config, *overrides[:3]])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=60_000)
    p.add_argument("--mean-len", type=int, default=50)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--num-items", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    p.add_argument("--train-config", default="", help="run the real `recforge train CONFIG train.loader=pipeline` instead")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()[0]
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    if args.train_config:
        with tempfile.TemporaryDirectory() as tmp:
            r = train_with_recipe(args.train_config, args.steps, args.workers, Path(tmp))
        print(f"\n{r['command']}; {machine}; 1-min load average at start {load_at_start:.2f}")
        print(f"{'steps':>5s} {'idle %':>7s} {'first wait ms':>14s} {'median wait ms':>15s} {'max wait ms':>12s} "
              f"{'median step ms':>15s} {'tokens/s':>10s}")  # fmt: skip
        print(f"{r['steps']:5d} {100 * r['idle_fraction']:7.3f} {r['first_wait_ms']:14.1f} {r['median_wait_ms']:15.3f} "
              f"{r['max_wait_ms']:12.2f} {r['median_step_ms']:15.1f} {r['tokens_per_s']:10,.0f}")  # fmt: skip
        results = {"recforge train": r}
    else:
        results = run_synthetic(args)
    if args.out:
        payload = {"benchmark": "pipeline_idle", "command": "python " + " ".join(sys.argv), "machine": machine,
                   "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                   "load_average_at_start": load_at_start, "args": vars(args), "results": results}  # fmt: skip
        atomic_write_json(Path(args.out), payload)


def run_synthetic(args: argparse.Namespace) -> dict:
    """The pipeline-fed step vs the IO-free replay, on synthetic samples."""
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        make_samples(Path(tmp), args.rows, args.mean_len, args.num_items)
        pipe = (
            Pipeline.from_parquet(tmp, num_workers=args.workers)
            .map(truncate_lists(["item_ids"], args.max_len + 1))
            .map(next_item_targets("item_ids", "input_ids", "next_item"))
            .shuffle(16384)
            .batch(args.batch_size)
            .collate(JaggedCollate({"input_ids": "item_ids"}, labels={"next_item": "next_item"}, max_seq_len=args.max_len))
            .prefetch(args.prefetch)
        )
        results = {}
        for mode in ("pipeline", "replay (IO-free)"):
            torch.manual_seed(0)
            model = build_retrieval_model(ModelConfig(kind="hstu", dropout=0.0), args.num_items, args.max_len)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            source = pipe if mode == "pipeline" else replay(list(pipe.take(16)), args.steps + 1)
            results[mode] = train(source, args.steps, model, optimizer, args.num_items)
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    print(f"\nHSTU retrieval training step fed by the pipeline; {machine}; trainer {args.threads} torch thread(s), "
          f"{args.workers} reader worker(s), prefetch {args.prefetch}; batch {args.batch_size}, max_len {args.max_len}; "
          f"1-min load average at start {load_at_start:.2f}")  # fmt: skip
    print(f"{'source':18s} {'steps':>5s} {'idle %':>7s} {'median wait ms':>15s} {'max wait ms':>12s} {'median step ms':>15s} {'tokens/s':>10s}")
    for mode, r in results.items():
        print(f"{mode:18s} {r['steps']:5d} {100 * r['idle_fraction']:7.2f} {r['median_wait_ms']:15.3f} {r['max_wait_ms']:12.2f} "
              f"{r['median_step_ms']:15.1f} {r['tokens_per_s']:10,.0f}")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
