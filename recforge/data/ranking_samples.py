"""Ranking training samples on disk: the Parquet form of ``RankingSamples``.

One row per (user, period) sample of ``RankingData.samples``, in sample order (so the
row number is the sample id)::

    sample      int64          the sample's index in RankingData.samples(split, ...)
    user_index  int64          row of the user in RankingData
    events      list<int64>    the sample's target event rows (RankingSamples.events[offsets[s]:offsets[s+1]])
    num_tokens  int64          contextual + history + target tokens of the sample's sequence

The rows hold the samples' identity, not their tokens: histories, items, actions and labels
are gathered from the ``RankingData`` arrays (in memory for evaluation anyway) by
``RankingData.batch`` itself, so a streamed batch equals the memory loader's batch of the
same samples by construction, for both action encodings. (``recforge.data.compress`` is the
self-contained on-disk form with raw IDs; the recipe's model needs ``RankingData``'s coded
IDs, item features and task labels.)

``ranking_pipeline`` streams these rows through ``Pipeline`` (shuffle, fixed or token-budget
batches, prefetch, exactly-once resume); ``ranking_source`` is that pipeline as the training
loop's ``BatchSource`` (``train.loader=pipeline``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recforge.data.collate import _tensor
from recforge.data.parquet_source import ROW_ID
from recforge.data.pipeline import Pipeline, PipelineSource
from recforge.data.ranking import ACTION_ENCODINGS, RankingData, RankingSamples
from recforge.io import atomic_directory
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import sequence_ids

SAMPLES_FILE = "train-00000.parquet"


def sample_tokens(data: RankingData, samples: RankingSamples, max_seq_len: int, action_encoding: str = "sum") -> torch.Tensor:
    """(S,) tokens of each sample's sequence in ``RankingData.batch``: contextual + history + targets."""
    if action_encoding not in ACTION_ENCODINGS:
        raise ValueError(f"action_encoding={action_encoding!r}: expected one of {ACTION_ENCODINGS}")
    per_event = 2 if action_encoding == "interleave" else 1
    _, t_count, _, h_count = data.window(samples, torch.arange(len(samples)), max_seq_len, per_event)
    return data.num_contextual + per_event * h_count + t_count


def write_ranking_samples(data: RankingData, samples: RankingSamples, tokens: torch.Tensor, out_dir: str | os.PathLike,
                          row_group_size: int = 8192) -> Path:  # fmt: skip
    """Write ``samples`` (with their ``sample_tokens``) as ``out_dir/train-00000.parquet``; the
    directory appears whole or not at all. Returns the file's path."""
    if tokens.shape != (len(samples),):
        raise ValueError(f"tokens must be (S,) = ({len(samples)},) from sample_tokens, got {tuple(tokens.shape)}")
    if len(samples) and int(samples.user.max()) >= data.num_users:
        raise ValueError(f"samples name user rows up to {int(samples.user.max())} but the data has {data.num_users} users")
    columns = {
        "sample": pa.array(np.arange(len(samples), dtype=np.int64)),
        "user_index": pa.array(samples.user.numpy()),
        "events": pa.LargeListArray.from_arrays(pa.array(samples.offsets.numpy()), pa.array(samples.events.numpy())),
        "num_tokens": pa.array(tokens.numpy()),
    }
    with atomic_directory(Path(out_dir)) as tmp:
        pq.write_table(pa.table(columns), tmp / SAMPLES_FILE, row_group_size=row_group_size)
    return Path(out_dir) / SAMPLES_FILE


def samples_of(rb: pa.RecordBatch) -> RankingSamples:
    """The rows of ``rb`` as a ``RankingSamples`` view (sample b = row b), without a per-row loop."""
    events = rb.column("events")
    off = events.offsets.to_numpy()  # a slice of a larger batch: offsets need not start at 0
    return RankingSamples(
        user=_tensor(rb.column("user_index")),
        offsets=torch.from_numpy(off - off[0]),
        events=_tensor(events.values.slice(off[0], off[-1] - off[0])),
    )


@dataclass(frozen=True)
class RankingCollate:
    """RecordBatch of ``write_ranking_samples`` rows -> ``RankingData.batch`` of those samples.

    Adds ``dense["row_ids"]`` (the pipeline's row identity) and ``dense["sample_ids"]``.
    """

    data: RankingData
    max_seq_len: int
    action_encoding: str = "sum"

    def __call__(self, rb: pa.RecordBatch) -> JaggedBatch:
        batch = self.data.batch(samples_of(rb), torch.arange(rb.num_rows), self.max_seq_len, self.action_encoding)
        batch.dense["sample_ids"] = _tensor(rb.column("sample"))
        if ROW_ID in rb.schema.names:
            batch.dense["row_ids"] = _tensor(rb.column(ROW_ID))
        return batch


def ranking_pipeline(paths, data: RankingData, max_seq_len: int, batch_size: int, *, action_encoding: str = "sum",
                     num_workers: int = 2, shuffle_rows: int = 65536, prefetch: int = 4, seed: int = 0,
                     state: dict | None = None, token_budget: int = 0) -> Pipeline:  # fmt: skip
    """The ranking recipe's training batches from ``write_ranking_samples`` files.

    Each batch equals ``data.batch(samples, ids, max_seq_len, action_encoding)`` for the
    batch's sample ids. With ``token_budget`` > 0 a batch holds as many samples as fit that
    many tokens (contextual + history + targets; ``batch_size`` is then ignored).

    Example:
        >>> pipe = ranking_pipeline(["run/samples/train-00000.parquet"], data, 256, 64, token_budget=8192)
        >>> for batch in pipe:                      # JaggedBatch, batch.dense["sample_ids"]
        ...     train_step(batch); save(model, pipe.state_dict())
    """
    pipe = Pipeline.from_parquet(paths, columns=["sample", "user_index", "events", "num_tokens"], num_workers=num_workers,
                                 seed=seed, state=state)  # fmt: skip
    if token_budget:
        pipe = pipe.shuffle(shuffle_rows).batch(token_budget=token_budget, length_column="num_tokens")
    else:
        pipe = pipe.shuffle(shuffle_rows).batch(batch_size)
    return pipe.collate(RankingCollate(data, max_seq_len, action_encoding)).prefetch(prefetch)


@dataclass(frozen=True)
class TokenReference:
    """What a batch of ``token_budget`` tokens holds on average over the training samples.

    A token-budget batch weighs each known label of task k ``1 / labels[k]`` and each list with a
    positive ``1 / lists``: constant weights, so the objective of two batches is that of their
    union, and a batch of average content gets the memory loader's per-batch-mean loss.
    """

    labels: torch.Tensor  # (K,) float64: known (non-NaN) labels per task
    lists: float  # samples with a positive label of the listwise task (0 without one)


def token_reference(data: RankingData, samples: RankingSamples, tokens: torch.Tensor, token_budget: int,
                    list_task: int | None = None) -> TokenReference:  # fmt: skip
    """Labels (and positive lists of task ``list_task``) per ``token_budget`` tokens of ``samples``."""
    per_token = token_budget / max(1, int(tokens.sum()))
    labels = data.labels[samples.events]  # (N, K)
    known = (~torch.isnan(labels)).sum(0).double() * per_token
    lists = 0.0
    if list_task is not None:
        positives = torch.nan_to_num(labels[:, list_task], nan=0.0) > 0
        sample_of_target = sequence_ids(samples.offsets, samples.events.numel())
        has_positive = torch.zeros(len(samples), dtype=torch.bool).index_fill_(0, sample_of_target[positives], True)
        lists = int(has_positive.sum()) * per_token
    return TokenReference(known, lists)


def ranking_source(paths: Sequence[str | os.PathLike], data: RankingData, max_seq_len: int, batch_size: int, *,
                   num_steps_estimate: int, action_encoding: str = "sum", num_workers: int = 2, token_budget: int = 0,
                   seed: int = 0) -> PipelineSource:  # fmt: skip
    """``ranking_pipeline`` over ``paths`` as the training loop's ``BatchSource`` (``PipelineSource``).

    ``batch_size``: rows per batch when ``token_budget`` is 0; ``num_steps_estimate``: batches per
    epoch (``steps_per_epoch``).

    Example:
        >>> source = ranking_source(["run/samples/train-00000.parquet"], data, 256, 64, num_steps_estimate=40)
        >>> run_loop(cfg, ..., source=source, step=lambda batch: train_step(batch))
    """
    build = functools.partial(ranking_pipeline, paths, data, max_seq_len, batch_size, action_encoding=action_encoding,
                              num_workers=num_workers, seed=seed, token_budget=token_budget)  # fmt: skip
    return PipelineSource(lambda state: build(state=state), num_steps_estimate)
