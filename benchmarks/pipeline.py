"""Sample-engine throughput: read -> transform -> jagged batch, against a per-row PyTorch DataLoader,
at every worker count, plus the engine's scaling with workers. One invocation answers both questions
of issue 15 (>= 10x the best per-row DataLoader at equal worker counts; >= 0.7 x linear scaling
from 1 to 8 workers).

Usage (the 16-core GPU host; about 3-4 minutes):
    python benchmarks/pipeline.py --rows 4000000 --files 16 --workers-list 1,2,4,8,16 --out benchmarks/results/pipeline-h200-host.json
On a small machine:
    python benchmarks/pipeline.py --rows 400000 --files 8 --workers-list 1,2 --out benchmarks/results/pipeline-workers-cpu-2core.json

Both sides read the same Parquet sample files (user_id, item_ids list, timestamps list,
label), keep the last ``--max-len`` items of each history and produce the same
``JaggedBatch`` (item_ids + timestamps tokens, user_id dense, label):

- **pipeline**: ``Pipeline.from_parquet(num_workers=W).map(truncate).shuffle().batch().collate().prefetch()``,
  W reader workers (forked processes: read, truncate, shuffle and cut batches), whole-batch work.
- **DataLoader (Arrow row -> Python)**: a map-style ``Dataset`` whose ``__getitem__`` reads one row
  (each worker holds the Parquet table in memory), truncates it and makes tensors; ``collate_fn``
  concatenates the rows into a JaggedBatch; W worker processes, shuffled.
- **DataLoader (numpy row slices)**: the same, but ``__getitem__`` slices pre-extracted numpy
  offsets/values instead of converting an Arrow row to Python: a stronger per-row baseline.

The DataLoaders decode their files once per worker at start-up, outside the timed window (so they
load only the first files, enough for ``--baseline-rows-per-worker`` x W rows: their per-row cost
does not depend on the file count); the pipeline decodes inside it. Rates are steady state: the
clock starts after the first batch. Each (loader, W) runs ``--repeats`` times, interleaved, and the
median run is reported. For the pipeline the table also shows the CPU time per row of the consumer
process (what cannot scale with workers) and of the worker processes.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset

from recforge.data.collate import JaggedCollate
from recforge.data.pipeline import Pipeline
from recforge.data.transforms import truncate_lists
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import offsets_from_lengths
from recforge.io import atomic_write_json
from _machine import cpu_model

COLUMNS = ["user_id", "item_ids", "timestamps", "label"]



def make_samples(directory: Path, rows: int, mean_len: int, files: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    per_file = rows // files
    for f in range(files):
        lengths = rng.integers(1, 2 * mean_len, per_file)
        off = np.r_[0, np.cumsum(lengths)].astype(np.int64)
        ts = np.sort(rng.integers(1_600_000_000, 1_700_000_000, off[-1]))
        table = pa.table({
            "user_id": np.arange(per_file, dtype=np.int64) + f * per_file,
            "item_ids": pa.LargeListArray.from_arrays(pa.array(off), pa.array(rng.integers(1, 1_000_000, off[-1]))),
            "timestamps": pa.LargeListArray.from_arrays(pa.array(off), pa.array(ts)),
            "label": rng.random(per_file).astype(np.float32),
        })  # fmt: skip
        pq.write_table(table, directory / f"part-{f:03d}.parquet", row_group_size=8192)


class ArrowRowDataset(Dataset):
    """The usual per-row Dataset: one Arrow row -> Python -> tensors."""

    def __init__(self, paths: list[str], max_len: int):
        self.paths, self.max_len, self.table = paths, max_len, None
        self.length = sum(pq.ParquetFile(p).metadata.num_rows for p in paths)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if self.table is None:  # each worker process reads the files once
            self.table = pa.concat_tables([pq.read_table(p, columns=COLUMNS) for p in self.paths])
        row = self.table.slice(i, 1).to_pylist()[0]
        return {
            "item_ids": torch.tensor(row["item_ids"][-self.max_len :], dtype=torch.int64),
            "timestamps": torch.tensor(row["timestamps"][-self.max_len :], dtype=torch.int64),
            "user_id": row["user_id"],
            "label": row["label"],
        }


class NumpyRowDataset(ArrowRowDataset):
    """A stronger per-row Dataset: numpy offsets/values extracted once, rows are slices."""

    def __getitem__(self, i: int) -> dict:
        if self.table is None:
            table = pa.concat_tables([pq.read_table(p, columns=COLUMNS) for p in self.paths]).combine_chunks()
            self.table = {
                "off": table.column("item_ids").chunk(0).offsets.to_numpy(),
                "items": table.column("item_ids").chunk(0).values.to_numpy(),
                "ts": table.column("timestamps").chunk(0).values.to_numpy(),
                "user": table.column("user_id").to_numpy(),
                "label": table.column("label").to_numpy(),
            }
        t = self.table
        a, b = t["off"][i], t["off"][i + 1]
        a = max(a, b - self.max_len)
        return {"item_ids": torch.from_numpy(t["items"][a:b]), "timestamps": torch.from_numpy(t["ts"][a:b]),
                "user_id": int(t["user"][i]), "label": float(t["label"][i])}  # fmt: skip


def collate_rows(rows: list[dict]) -> JaggedBatch:
    lengths = torch.tensor([r["item_ids"].numel() for r in rows])
    batch = JaggedBatch(
        offsets_from_lengths(lengths),
        {"item_ids": torch.cat([r["item_ids"] for r in rows]), "timestamps": torch.cat([r["timestamps"] for r in rows])},
        int(lengths.max()),
    )
    batch.dense["user_id"] = torch.tensor([r["user_id"] for r in rows])
    batch.labels["label"] = torch.tensor([r["label"] for r in rows])
    return batch


def timed(batches, max_rows: int, warmup: int = 1) -> dict:
    """Steady-state rates: the clock starts after ``warmup`` batches (worker start-up, file opening)."""
    rows = tokens = 0
    for _ in range(warmup):
        next(batches)
    t0, cpu0, kids0 = time.perf_counter(), time.process_time(), _children_cpu()
    for batch in batches:
        rows += batch.batch_size
        tokens += batch.num_tokens
        if rows >= max_rows:
            break
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if hasattr(batches, "close"):
        batches.close()  # stop the pipeline's workers, and wait until they are reaped, before reading their CPU time
        deadline = time.perf_counter() + 10
        while multiprocessing.active_children() and time.perf_counter() < deadline:
            time.sleep(0.01)
    kids = _children_cpu() - kids0
    return {"rows": rows, "tokens": tokens, "seconds": seconds, "rows_per_s": rows / seconds, "tokens_per_s": tokens / seconds,
            "consumer_cpu_us_per_row": 1e6 * cpu / rows, "worker_cpu_us_per_row": 1e6 * kids / rows}  # fmt: skip


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def median_run(runs: list[dict]) -> dict:
    """The run with the median rows/s, plus every run's rows/s."""
    ordered = sorted(runs, key=lambda r: r["rows_per_s"])
    return {**ordered[len(ordered) // 2], "all_rows_per_s": [r["rows_per_s"] for r in runs]}


def run_pipeline(paths: list[str], workers: int, args) -> dict:
    collate = JaggedCollate({"item_ids": "item_ids", "timestamps": "timestamps"}, dense={"user_id": "user_id"}, labels={"label": "label"})
    pipe = (
        Pipeline.from_parquet(paths, columns=COLUMNS, num_workers=workers, worker_mode=args.worker_mode)
        .map(truncate_lists(["item_ids", "timestamps"], args.max_len))
        .shuffle(args.shuffle_buffer)
        .batch(args.batch_size)
        .collate(collate)
        .prefetch(args.prefetch)
    )
    return timed(iter(pipe), min(args.rows, args.pipeline_rows_per_worker * workers))


def run_dataloader(dataset_cls, paths: list[str], workers: int, args) -> dict:
    loader = DataLoader(
        dataset_cls(paths, args.max_len), batch_size=args.batch_size, shuffle=True, num_workers=workers,
        collate_fn=collate_rows, prefetch_factor=args.prefetch if workers else None, persistent_workers=False,
    )  # fmt: skip
    out = timed(iter(loader), args.baseline_rows_per_worker * workers)
    out["worker_cpu_us_per_row"] = None  # its workers are reaped later, outside the measurement
    return out


LOADERS = {"pipeline": None, "DataLoader (Arrow row -> Python)": ArrowRowDataset, "DataLoader (numpy row slices)": NumpyRowDataset}


def summarize(rows: list[dict], workers: list[int]) -> dict:
    """Per worker count: the pipeline over the best DataLoader; and the pipeline's scaling vs linear."""
    rate = {(r["loader"], r["workers"]): r["rows_per_s"] for r in rows}
    vs_best = {}
    for w in workers:
        best = max((name for name in LOADERS if name != "pipeline"), key=lambda n: rate[(n, w)])
        vs_best[w] = {"best_dataloader": best, "ratio": rate[("pipeline", w)] / rate[(best, w)]}
    base = workers[0]
    scaling = {w: {"speedup": rate[("pipeline", w)] / rate[("pipeline", base)],
                   "fraction_of_linear": rate[("pipeline", w)] / rate[("pipeline", base)] / (w / base)} for w in workers}  # fmt: skip
    return {"pipeline_vs_best_dataloader": vs_best, "pipeline_scaling": scaling, "scaling_base_workers": base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000, help="rows in the generated sample files")
    p.add_argument("--pipeline-rows-per-worker", type=int, default=400_000, help="timed pipeline rows per worker (capped by --rows)")
    p.add_argument("--baseline-rows-per-worker", type=int, default=25_000, help="timed DataLoader rows per worker (they are slow)")
    p.add_argument("--mean-len", type=int, default=50)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--shuffle-buffer", type=int, default=8192)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--workers-list", default="1,2,4", help="worker counts; every loader runs at each, the first is the scaling base")
    p.add_argument("--worker-mode", default="auto", choices=["auto", "process", "thread"], help="the pipeline's reader workers")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per loader and worker count; the median is reported")
    p.add_argument("--data", default="", help="existing directory of sample files (default: generate in a temp dir)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    workers = [int(w) for w in args.workers_list.split(",")]
    tmp = None
    if args.data:
        data = Path(args.data)
    else:
        tmp = tempfile.TemporaryDirectory()
        data = Path(tmp.name)
        make_samples(data, args.rows, args.mean_len, args.files)
    paths = sorted(str(x) for x in data.glob("*.parquet"))
    file_rows = [pq.ParquetFile(x).metadata.num_rows for x in paths]
    need = args.baseline_rows_per_worker * max(workers) * 5 // 4  # rows the largest DataLoader run reads, and a margin
    baseline_paths = paths[: next((i + 1 for i, n in enumerate(np.cumsum(file_rows)) if n >= need), len(paths))]
    load_at_start = os.getloadavg()[0]
    run_pipeline(paths, workers[0], args)  # warm-up: the first pass over fresh files runs slower (allocator, caches)
    runs: dict[tuple[str, int], list[dict]] = {}
    for w in workers:
        # interleaved repeats, median per loader: other jobs on a shared machine slow whichever run they overlap
        for _ in range(args.repeats):
            for name, cls in LOADERS.items():
                run = run_pipeline(paths, w, args) if cls is None else run_dataloader(cls, baseline_paths, w, args)
                runs.setdefault((name, w), []).append(run)
    rows = [{"loader": name, "workers": w, **median_run(r)} for (name, w), r in runs.items()]
    summary = summarize(rows, workers)
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    print(f"\nread -> truncate({args.max_len}) -> shuffle -> batch({args.batch_size}) -> JaggedBatch; {machine}; "
          f"{sum(file_rows)} rows in {len(paths)} files, mean history {args.mean_len}; 1-min load average at start {load_at_start:.2f}")  # fmt: skip
    print(f"{'loader':34s} {'workers':>7s} {'rows':>8s} {'rows/s':>11s} {'tokens/s':>13s} {'consumer us/row':>15s} "
          f"{'worker us/row':>13s}  rows/s of each run")  # fmt: skip
    for r in rows:
        print(f"{r['loader']:34s} {r['workers']:7d} {r['rows']:8d} {r['rows_per_s']:11,.0f} {r['tokens_per_s']:13,.0f} "
              f"{r['consumer_cpu_us_per_row']:15.2f} {_us(r['worker_cpu_us_per_row']):>13s}  "
              + " ".join(f"{x:,.0f}" for x in r["all_rows_per_s"]))  # fmt: skip
    print(f"\n{'workers':>7s} {'pipeline / best DataLoader':>27s} {'pipeline speedup':>17s} {'fraction of linear':>19s}")
    for w in workers:
        vs, sc = summary["pipeline_vs_best_dataloader"][w], summary["pipeline_scaling"][w]
        print(f"{w:7d} {vs['ratio']:26.1f}x {sc['speedup']:16.2f}x {sc['fraction_of_linear']:19.2f}")
    if args.out:
        payload = {"benchmark": "pipeline", "command": "python " + " ".join(sys.argv), "machine": machine,
                   "torch": torch.__version__, "pyarrow": pa.__version__, "date": datetime.date.today().isoformat(),
                   "load_average_at_start": load_at_start, "args": vars(args), "rows": rows, "summary": summary}  # fmt: skip
        atomic_write_json(Path(args.out), payload)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
