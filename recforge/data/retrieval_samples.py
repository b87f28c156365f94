"""Retrieval training samples streamed by the sample engine: ``UserSequences.training_samples`` as rows.

One row per (user, end) sample, exactly the window ``UserSequences.training_batch`` would
assemble: the ``max_seq_len`` inputs before position ``end - 1`` plus the item after the
last input, so ``transforms.next_item_targets`` splits each row into inputs and next-item
labels::

    user_index  int64          row of the user in UserSequences
    end         int64          the sample's end (items of the user used: the first ``end``)
    item_ids    list<int64>    dense item indices (1..num_items), inputs + 1
    timestamps  list<int64>    aligned with item_ids (when the dataset has timestamps)

``retrieval_sample_source`` builds these rows in the reader workers as the pipeline reads them
(nothing is written to disk); ``write_retrieval_samples`` writes the same rows as Parquet for
other tools. ``retrieval_pipeline`` turns either into the recipe's training batches with exact
resume; ``retrieval_source`` is that pipeline as the training loop's ``BatchSource``
(``train.loader=pipeline``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recforge.data.collate import JaggedCollate
from recforge.data.pipeline import Pipeline, PipelineSource
from recforge.data.sample_source import SampleSource
from recforge.data.sequences import UserSequences
from recforge.data.transforms import next_item_targets
from recforge.io import atomic_file
from recforge.jagged.index import range_index


def retrieval_rows(seqs: UserSequences, samples: torch.Tensor, max_seq_len: int) -> pa.Table:
    """The rows (see the module docstring) of ``samples``, (S, 2) (user, end) from ``training_samples``."""
    if samples.ndim != 2 or samples.shape[1] != 2:
        raise ValueError(f"samples must be (S, 2) (user, end) rows from UserSequences.training_samples, got {tuple(samples.shape)}")
    users, ends = samples[:, 0], samples[:, 1]
    lengths = torch.clamp(ends - 1, max=max_seq_len) + 1  # inputs + the last label
    first = seqs.offsets[users] + ends - lengths
    index, offsets = range_index(first, lengths)
    off = pa.array(offsets.numpy())
    columns = {
        "user_index": pa.array(users.numpy()),
        "end": pa.array(ends.numpy()),
        "item_ids": pa.LargeListArray.from_arrays(off, pa.array(seqs.item_ids[index].numpy())),
    }
    if seqs.timestamps is not None:
        columns["timestamps"] = pa.LargeListArray.from_arrays(off, pa.array(seqs.timestamps[index].numpy()))
    return pa.table(columns)


def retrieval_sample_source(seqs: UserSequences, samples: torch.Tensor, max_seq_len: int) -> SampleSource:
    """``samples`` ((S, 2) (user, end)) as a ``SampleSource``: row s is ``retrieval_rows`` of sample s, built when read."""
    if samples.ndim != 2 or samples.shape[1] != 2:
        raise ValueError(f"samples must be (S, 2) (user, end) rows from UserSequences.training_samples, got {tuple(samples.shape)}")
    build = functools.partial(_rows, seqs, samples, max_seq_len)
    # ranks' token shares weigh rows as a file of these rows did (its item_ids lengths, a mean per row group)
    lengths = (sample_tokens(samples, max_seq_len) + 1).numpy()
    return SampleSource("retrieval", samples.shape[0], build, tokens=lengths, group_mean_tokens=True, tokens_of="item_ids",
                        identity=(samples.numpy(), np.array([max_seq_len])))  # fmt: skip


def _rows(seqs: UserSequences, samples: torch.Tensor, max_seq_len: int, rows: np.ndarray) -> pa.Table:
    return retrieval_rows(seqs, samples[torch.from_numpy(rows)], max_seq_len)


def write_retrieval_samples(
    seqs: UserSequences, samples: torch.Tensor, max_seq_len: int, out_path: str | os.PathLike, row_group_size: int = 8192
) -> Path:
    """Write ``retrieval_rows`` of ``samples`` ((S, 2) (user, end) from ``training_samples``) as Parquet, atomically."""
    table = retrieval_rows(seqs, samples, max_seq_len)
    out_path = Path(out_path)
    with atomic_file(out_path) as tmp:
        pq.write_table(table, tmp, row_group_size=row_group_size)
    return out_path


def retrieval_pipeline(samples: SampleSource | Sequence[str | os.PathLike] | str | os.PathLike, max_seq_len: int,
                       batch_size: int, *, timestamps: bool, num_workers: int = 2, shuffle_rows: int = 65536,
                       prefetch: int = 4, seed: int = 0, state: dict | None = None, rank: int = 0, world_size: int = 1,
                       token_budget: int = 0) -> Pipeline:  # fmt: skip
    """The retrieval recipe's training batches from a ``retrieval_sample_source`` or ``write_retrieval_samples`` files.

    Each batch matches ``UserSequences.training_batch`` for the same samples: features
    ``item_ids`` (+ ``timestamps``), label ``next_item``, and ``dense["row_ids"]`` (row = sample
    index). With ``token_budget`` > 0 a batch holds as many samples as fit that many input tokens
    (``batch_size`` is then ignored).
    """
    jagged = {"input_ids": "item_ids", **({"timestamps": "timestamps"} if timestamps else {})}
    columns = ["item_ids", *(["timestamps"] if timestamps else [])]
    where = {"num_workers": num_workers, "seed": seed, "state": state, "rank": rank, "world_size": world_size}
    if isinstance(samples, SampleSource):
        start = Pipeline.from_samples(samples, **where)
    else:
        start = Pipeline.from_parquet(samples, columns=columns, **where)
    return (
        start
        .map(next_item_targets("item_ids", "input_ids", "next_item", aligned=tuple(columns[1:])))
        .shuffle(shuffle_rows)
        .batch(**({"token_budget": token_budget, "length_column": "input_ids"} if token_budget else {"batch_size": batch_size}))
        .collate(JaggedCollate(jagged, labels={"next_item": "next_item"}, max_seq_len=max_seq_len))
        .prefetch(prefetch)
    )


def sample_tokens(samples: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """(S,) input tokens of each (user, end) sample (each input predicts the next item)."""
    return torch.clamp(samples[:, 1] - 1, max=max_seq_len)


def retrieval_source(samples: SampleSource | Sequence[str | os.PathLike], max_seq_len: int, batch_size: int, *, timestamps: bool,
                     num_steps_estimate: int, num_workers: int = 2, token_budget: int = 0, seed: int = 0) -> PipelineSource:  # fmt: skip
    """``retrieval_pipeline`` over ``samples`` as the training loop's ``BatchSource`` (``PipelineSource``).

    ``batch_size``: rows per batch when ``token_budget`` is 0; ``timestamps``: the samples carry a
    timestamps column; ``num_steps_estimate``: batches per epoch (``steps_per_epoch``).

    Example:
        >>> source = retrieval_source(retrieval_sample_source(seqs, samples, 200), 200, 128, timestamps=False,
        ...                           num_steps_estimate=48)
        >>> run_loop(cfg, ..., source=source, step=lambda batch: train_step(batch))
    """
    build = functools.partial(retrieval_pipeline, samples, max_seq_len, batch_size, timestamps=timestamps,
                              num_workers=num_workers, seed=seed, token_budget=token_budget)  # fmt: skip
    return PipelineSource(lambda state: build(state=state), num_steps_estimate)
