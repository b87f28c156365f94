"""Ranking training samples streamed by the sample engine: ``RankingData.rows`` as a ``Pipeline``.

One row per (user, period) sample of ``RankingData.samples``, carrying everything its batch needs
(contextual codes, the history's items, timestamps and actions, the targets' items, timestamps,
labels, users and event rows; see ``RankingData.rows``), so the collate (``rows_collate``, a
``RankingCollate``) needs no ``RankingData``, and a streamed batch equals ``RankingData.batch`` of
the same samples by construction, for both action encodings.

``ranking_sample_source`` builds the rows in the reader workers as the pipeline reads them (nothing
is written to disk); ``write_ranking_samples`` writes the same rows as Parquet for other tools.
``ranking_pipeline`` streams either through ``Pipeline`` (shuffle, fixed or token-budget batches,
prefetch, exactly-once resume); ``ranking_source`` is that pipeline as the training loop's
``BatchSource`` (``train.loader=pipeline``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from recforge.data.pipeline import Pipeline, PipelineSource
from recforge.data.ranking import ACTION_ENCODINGS, RankingData, RankingSamples, rows_collate
from recforge.data.sample_source import SampleSource
from recforge.io import atomic_directory
from recforge.jagged.index import sequence_ids

SAMPLES_FILE = "train-00000.parquet"


def sample_tokens(data: RankingData, samples: RankingSamples, max_seq_len: int, action_encoding: str = "sum") -> torch.Tensor:
    """(S,) tokens of each sample's sequence in ``RankingData.batch``: contextual + history + targets."""
    if action_encoding not in ACTION_ENCODINGS:
        raise ValueError(f"action_encoding={action_encoding!r}: expected one of {ACTION_ENCODINGS}")
    per_event = 2 if action_encoding == "interleave" else 1
    _, t_count, _, h_count = data.window(samples, torch.arange(len(samples)), max_seq_len, per_event)
    return data.num_contextual + per_event * h_count + t_count


def ranking_sample_source(data: RankingData, samples: RankingSamples, max_seq_len: int, action_encoding: str = "sum",
                          tokens: torch.Tensor | None = None) -> SampleSource:  # fmt: skip
    """``samples`` as a ``SampleSource``: row s is ``data.rows(samples, [s], ...)``, built when read.

    ``tokens``: ``sample_tokens`` of the samples when already computed (they balance ranks' shares)."""
    if tokens is None:
        tokens = sample_tokens(data, samples, max_seq_len, action_encoding)
    build = functools.partial(_rows, data, samples, max_seq_len, action_encoding)
    identity = (samples.user.numpy(), samples.offsets.numpy(), samples.events.numpy(), np.array([max_seq_len]),
                np.frombuffer(action_encoding.encode(), np.uint8))  # fmt: skip
    return SampleSource("ranking", len(samples), build, tokens=tokens.numpy(), identity=identity)


def _rows(data: RankingData, samples: RankingSamples, max_seq_len: int, action_encoding: str, rows: np.ndarray):
    return data.rows(samples, torch.from_numpy(rows), max_seq_len, action_encoding)


def write_ranking_samples(data: RankingData, samples: RankingSamples, out_dir: str | os.PathLike, max_seq_len: int,
                          action_encoding: str = "sum", row_group_size: int = 8192) -> Path:  # fmt: skip
    """Write the rows of ``samples`` (``RankingData.rows``, in sample order) as ``out_dir/train-00000.parquet``;
    the directory appears whole or not at all. Returns the file's path."""
    if len(samples) and int(samples.user.max()) >= data.num_users:
        raise ValueError(f"samples name user rows up to {int(samples.user.max())} but the data has {data.num_users} users")
    with atomic_directory(Path(out_dir)) as tmp:
        writer = None
        try:
            for start in range(0, max(len(samples), 1), row_group_size):
                table = data.rows(samples, torch.arange(start, min(start + row_group_size, len(samples))), max_seq_len,
                                  action_encoding)  # fmt: skip
                if writer is None:
                    writer = pq.ParquetWriter(tmp / SAMPLES_FILE, table.schema)
                writer.write_table(table, row_group_size=row_group_size)
        finally:
            if writer is not None:
                writer.close()
    return Path(out_dir) / SAMPLES_FILE


def ranking_pipeline(samples: SampleSource | Sequence[str | os.PathLike] | str | os.PathLike, max_seq_len: int,
                     batch_size: int, *, action_encoding: str = "sum", num_workers: int = 2, shuffle_rows: int = 65536,
                     prefetch: int = 4, seed: int = 0, state: dict | None = None, token_budget: int = 0) -> Pipeline:  # fmt: skip
    """The ranking recipe's training batches from a ``ranking_sample_source`` or ``write_ranking_samples`` files.

    Each batch equals ``data.batch(samples, ids, max_seq_len, action_encoding)`` for the batch's
    sample ids ``dense["sample_ids"]`` (``max_seq_len`` and ``action_encoding`` must be those the
    rows were built with). With ``token_budget`` > 0 a batch holds as many samples as fit that many
    tokens (contextual + history + targets; ``batch_size`` is then ignored).

    Example:
        >>> source = ranking_sample_source(data, samples, 256)
        >>> pipe = ranking_pipeline(source, 256, 64, token_budget=8192)
        >>> for batch in pipe:                      # JaggedBatch, batch.dense["sample_ids"]
        ...     train_step(batch); save(model, pipe.state_dict())
    """
    if isinstance(samples, SampleSource):
        pipe = Pipeline.from_samples(samples, num_workers=num_workers, seed=seed, state=state)
    else:
        pipe = Pipeline.from_parquet(samples, num_workers=num_workers, seed=seed, state=state)
    num_contextual = sum(1 for name in pipe.source.schema.names if name.startswith("context_"))
    if token_budget:
        pipe = pipe.shuffle(shuffle_rows).batch(token_budget=token_budget, length_column="num_tokens")
    else:
        pipe = pipe.shuffle(shuffle_rows).batch(batch_size)
    collate = rows_collate(num_contextual, max_seq_len, action_encoding, dense={"sample": "sample_ids"})
    return pipe.collate(collate).prefetch(prefetch)


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


def ranking_source(samples: SampleSource | Sequence[str | os.PathLike], max_seq_len: int, batch_size: int, *,
                   num_steps_estimate: int, action_encoding: str = "sum", num_workers: int = 2, token_budget: int = 0,
                   seed: int = 0) -> PipelineSource:  # fmt: skip
    """``ranking_pipeline`` over ``samples`` as the training loop's ``BatchSource`` (``PipelineSource``).

    ``batch_size``: rows per batch when ``token_budget`` is 0; ``num_steps_estimate``: batches per
    epoch (``steps_per_epoch``).

    Example:
        >>> source = ranking_source(ranking_sample_source(data, samples, 256), 256, 64, num_steps_estimate=40)
        >>> run_loop(cfg, ..., source=source, step=lambda batch: train_step(batch))
    """
    build = functools.partial(ranking_pipeline, samples, max_seq_len, batch_size, action_encoding=action_encoding,
                              num_workers=num_workers, seed=seed, token_budget=token_budget)  # fmt: skip
    return PipelineSource(lambda state: build(state=state), num_steps_estimate)
