"""Building one epoch of training input: samples written to Parquet and read back vs streamed as built.

Usage:
    python benchmarks/training_input.py --out benchmarks/results/training_input-cpu-2core.json
    python benchmarks/training_input.py --users 20000 --workers 8 --out benchmarks/results/training_input-h200-host.json

On a synthetic dataset (``generate_impressions``), for each recipe's ``train.loader=pipeline`` input:

- ``file`` (before): what the recipes did until now: write the training samples to Parquet, then
  stream them back through the sample engine. Ranking rows held only the samples' identity, and the
  collate called back into ``RankingData.batch`` (reproduced here as ``LegacyRankingCollate``).
- ``stream`` (now): ``retrieval_sample_source`` / ``ranking_sample_source``: the reader workers build
  the rows as they read them; the ranking rows carry everything the batch needs.

Both run the same chain (shuffle, batch, collate, prefetch) with the same seed, so they give the very
same batches: the script checks that batch by batch, then reports the median seconds per epoch of
each (from sample ids to the last batch, the write included) and their ratio, measured in the same
run, alternating the order.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recforge.data.collate import _tensor
from recforge.data.dataset import Dataset
from recforge.data.parquet_source import ROW_ID
from recforge.data.pipeline import Pipeline
from recforge.data.ranking import RankingData, RankingSamples
from recforge.data.ranking_samples import ranking_pipeline, ranking_sample_source, sample_tokens
from recforge.data.retrieval_samples import retrieval_pipeline, retrieval_sample_source, write_retrieval_samples
from recforge.data.sequences import UserSequences
from recforge.data.synthetic import SyntheticConfig, generate_impressions
from recforge.jagged.batch import JaggedBatch
from recforge.io import atomic_write_json

sys.path.insert(0, str(Path(__file__).parent))
from _machine import cpu_model

DAY = 86400


@dataclass(frozen=True)
class LegacyRankingCollate:
    """The ranking collate before this change: identity rows -> ``RankingData.batch`` (a call back into memory)."""

    data: RankingData
    max_seq_len: int
    action_encoding: str

    def __call__(self, rb: pa.RecordBatch) -> JaggedBatch:
        events = rb.column("events")
        off = events.offsets.to_numpy()
        samples = RankingSamples(_tensor(rb.column("user_index")), torch.from_numpy(off - off[0]),
                                 _tensor(events.values.slice(off[0], off[-1] - off[0])))  # fmt: skip
        batch = self.data.batch(samples, torch.arange(rb.num_rows), self.max_seq_len, self.action_encoding)
        batch.dense["sample_ids"] = _tensor(rb.column("sample"))
        batch.dense["row_ids"] = _tensor(rb.column(ROW_ID))
        return batch


def legacy_ranking_file(samples: RankingSamples, tokens: torch.Tensor, path: Path) -> Path:
    """The identity rows the ranking recipe wrote to ``RUN_DIR/samples`` before this change."""
    table = pa.table({
        "sample": np.arange(len(samples), dtype=np.int64), "user_index": samples.user.numpy(),
        "events": pa.LargeListArray.from_arrays(pa.array(samples.offsets.numpy()), pa.array(samples.events.numpy())),
        "num_tokens": tokens.numpy(),
    })  # fmt: skip
    pq.write_table(table, path, row_group_size=8192)
    return path


def epoch(pipe: Pipeline) -> list[tuple]:
    """One epoch; per batch a fingerprint (row ids, token count, sums of the features and labels)."""
    out = []
    for batch in pipe:
        sums = tuple(float(t.double().nansum()) for _, t in sorted({**batch.features, **batch.labels}.items()))
        out.append((batch.dense["row_ids"].numpy().tobytes(), batch.num_tokens, sums))
    return out


def time_variants(variants: dict, repeats: int) -> dict:
    times = {name: [] for name in variants}
    reference = None
    for r in range(repeats):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):  # alternate the order
            started = time.perf_counter()
            batches = variants[name]()
            times[name].append(time.perf_counter() - started)
            if reference is None:
                reference = batches
            elif batches != reference:
                raise AssertionError(f"{name}: its batches differ from the other variant's")
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"seconds": medians, "all_seconds": times, "batches": len(reference),
            "file_over_stream": medians["file"] / medians["stream"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, default=4000)
    ap.add_argument("--mean-len", type=int, default=100)
    ap.add_argument("--max-seq-len", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--recipes", default="retrieval,ranking")
    ap.add_argument("--torch-threads", type=int, default=1, help="intra-op threads (batch assembly is many small ops)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    load = os.getloadavg()[0]  # other processes on the machine: the times are only as good as it is quiet

    cfg = SyntheticConfig(num_users=args.users, num_items=2000, num_clusters=20, mean_seq_len=args.mean_len,
                          max_seq_len=4 * args.mean_len, seed=0)  # fmt: skip
    events, items = generate_impressions(cfg)
    ds = Dataset(events, items, {"name": "synthetic", "has_timestamps": True})
    L, B, W = args.max_seq_len, args.batch_size, args.workers
    result = {"events": events.num_rows, "users": args.users, "max_seq_len": L, "batch_size": B, "workers": W,
              "torch_threads": args.torch_threads}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "retrieval" in args.recipes:
            seqs = UserSequences.from_dataset(ds)
            samples = seqs.training_samples(1, L, "all")
            kw = {"timestamps": True, "num_workers": W, "seed": 0}

            def retrieval_file() -> list:
                path = write_retrieval_samples(seqs, samples, L, tmp / "retrieval.parquet")
                return epoch(retrieval_pipeline(path, L, B, **kw))

            variants = {"file": retrieval_file,
                        "stream": lambda: epoch(retrieval_pipeline(retrieval_sample_source(seqs, samples, L), L, B, **kw))}
            result["retrieval"] = {"samples": int(samples.shape[0]), **time_variants(variants, args.repeats)}
            print(f"retrieval: {result['retrieval']['seconds']}  file/stream {result['retrieval']['file_over_stream']:.2f}x")
        if "ranking" in args.recipes:
            data = RankingData.from_dataset(ds, ["click:click>=1", "like:like>=1"], action_column="action",
                                            user_features=["user_id"])  # fmt: skip
            samples = data.samples("train", DAY, max_targets=16)

            def ranking_file() -> list:
                tokens = sample_tokens(data, samples, L)
                path = legacy_ranking_file(samples, tokens, tmp / "ranking.parquet")
                pipe = (Pipeline.from_parquet(path, num_workers=W, seed=0).shuffle(65536).batch(B)
                        .collate(LegacyRankingCollate(data, L, "sum")).prefetch(4))  # fmt: skip
                return epoch(pipe)

            def ranking_stream() -> list:
                return epoch(ranking_pipeline(ranking_sample_source(data, samples, L), L, B, num_workers=W, seed=0))

            variants = {"file": ranking_file, "stream": ranking_stream}
            result["ranking"] = {"samples": len(samples), **time_variants(variants, args.repeats)}
            print(f"ranking: {result['ranking']['seconds']}  file/stream {result['ranking']['file_over_stream']:.2f}x")
    result.update(machine=cpu_model(), cpus=os.cpu_count(), load_average_at_start=load, torch=torch.__version__,
                  date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  command=" ".join(["python", *sys.argv]))  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
