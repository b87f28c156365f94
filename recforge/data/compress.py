"""Fixed-period user-event compression: raw events -> one sample per (user, period), streamed.

The on-disk counterpart of ``RankingData.samples``/``RankingData.batch`` (same
conventions, see ``recforge/data/ranking.py``): a sample is one user and one period of
``period_seconds``; the period's impressions (events of the chosen split) are its
*targets*, at most ``max_targets`` per sample (a busy period becomes several samples);
its *history* is the user's events before the sample's last target, including earlier
events of the same period, at most ``max_history`` of the latest. Every token keeps its
timestamp, so the mask (``AttentionMask(timestamps=...)``) lets an impression see only
history events strictly before it: no leakage although the period's events share one
sample.

``compress_events`` reads the canonical ``events.parquet`` (rows grouped by user, in time
order) in chunks, carries a user whose rows straddle a chunk boundary into the next chunk,
and writes one Parquet row per sample::

    user_id, period_start                                int64
    history_item_ids, history_timestamps                 list<int64>
    history_<action_column>                              list<action type>   (when given)
    target_item_ids, target_timestamps                   list<int64>
    target_<label column>                                list<float32>       per label column

``recforge.data.collate.RankingCollate`` turns a batch of such rows into the ranking
``JaggedBatch`` (history then targets per sequence, ``num_targets``, per-token timestamps),
vectorised; e.g. ``RankingCollate(("rating",), action_column="action")``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recforge.data.ranking import SPLITS, fraction_check
from recforge.io import atomic_file


@dataclass(frozen=True)
class CompressConfig:
    """How to cut events into samples.

    Attributes:
        period_seconds: length of a period (86400 = one sample per user per day).
        max_targets: impressions per sample; more in one period start another sample.
        max_history: latest history events kept per sample.
        split: which events are targets: ``train``/``valid``/``test`` per ``RankingData``'s
            per-user time split, or ``all``.
        valid_fraction, test_fraction: the per-user split fractions (as ``RankingData``).
        label_columns: event columns carried as per-target labels (cast to float32).
        action_column: event column carried as the history's action signal ("" = none).
        chunk_rows: events read per chunk.
    """

    period_seconds: int = 86400
    max_targets: int = 32
    max_history: int = 256
    split: str = "train"
    valid_fraction: float = 0.1
    test_fraction: float = 0.1
    label_columns: tuple[str, ...] = ()
    action_column: str = ""
    chunk_rows: int = 1 << 20

    def check(self) -> None:
        if self.period_seconds <= 0 or self.max_targets <= 0 or self.max_history < 0:
            raise ValueError("period_seconds and max_targets must be > 0, max_history >= 0")
        if self.split != "all" and self.split not in SPLITS:
            raise ValueError(f"split={self.split!r}: expected all or one of {tuple(SPLITS)}")
        fraction_check(self.valid_fraction, self.test_fraction)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    return index, offsets


def compress_chunk(events: pa.Table, cfg: CompressConfig) -> pa.Table:
    """Samples of a table holding complete users (all of each user's events, in order)."""
    users = events.column("user_id").to_numpy()
    ts = events.column("timestamp")
    if ts.null_count:
        raise ValueError(f"{ts.null_count} events have no timestamp; period samples need timestamps")
    ts = ts.to_numpy()
    n = len(users)
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]]) if n else np.zeros(0, np.int64)
    user_starts = np.r_[starts, n].astype(np.int64)
    lengths = np.diff(user_starts)
    owner = np.repeat(np.arange(len(lengths)), lengths)
    if cfg.split == "all":
        targets = np.arange(n)
    else:  # RankingData's per-user time split: the last test_fraction are test, valid_fraction before them valid
        n_test = np.ceil(lengths * cfg.test_fraction).astype(np.int64)
        n_valid = np.ceil(lengths * cfg.valid_fraction).astype(np.int64)
        pos_from_end = np.repeat(user_starts[1:], lengths) - np.arange(n) - 1
        split = np.where(pos_from_end < n_test[owner], 2, np.where(pos_from_end < (n_test + n_valid)[owner], 1, 0))
        targets = np.flatnonzero(split == SPLITS[cfg.split])
    t_user = owner[targets]
    period = ts[targets] // cfg.period_seconds
    new_group = np.ones(len(targets), bool)
    new_group[1:] = (t_user[1:] != t_user[:-1]) | (period[1:] != period[:-1])
    group_start = np.flatnonzero(new_group)
    rank_in_group = np.arange(len(targets)) - group_start[np.cumsum(new_group) - 1]
    sample_starts = np.flatnonzero(new_group | (rank_in_group % cfg.max_targets == 0))
    t_offsets = np.r_[sample_starts, len(targets)].astype(np.int64)
    last_target = targets[t_offsets[1:] - 1] if len(targets) else np.zeros(0, np.int64)
    s_user = t_user[sample_starts]
    h_start = np.maximum(user_starts[s_user], last_target - cfg.max_history)
    h_index, h_offsets = _ranges(h_start, last_target - h_start)
    t_index = targets

    def lists(offsets: np.ndarray, col: pa.ChunkedArray | pa.Array, index: np.ndarray) -> pa.Array:
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        return pa.LargeListArray.from_arrays(pa.array(offsets), col.take(pa.array(index)))

    out = {
        "user_id": pa.array(users[user_starts[s_user]] if len(s_user) else np.zeros(0, np.int64)),
        "period_start": pa.array(period[sample_starts] * cfg.period_seconds if len(targets) else np.zeros(0, np.int64)),
        "history_item_ids": lists(h_offsets, events.column("item_id"), h_index),
        "history_timestamps": lists(h_offsets, events.column("timestamp"), h_index),
    }
    if cfg.action_column:
        out[f"history_{cfg.action_column}"] = lists(h_offsets, events.column(cfg.action_column), h_index)
    out["target_item_ids"] = lists(t_offsets - t_offsets[0], events.column("item_id"), t_index)
    out["target_timestamps"] = lists(t_offsets - t_offsets[0], events.column("timestamp"), t_index)
    for name in cfg.label_columns:
        out[f"target_{name}"] = lists(t_offsets - t_offsets[0], events.column(name).cast(pa.float32()), t_index)
    return pa.table(out)


def compress_events(events_paths: list[str | os.PathLike] | str | os.PathLike, out_path: str | os.PathLike,
                    cfg: CompressConfig, row_group_size: int = 8192) -> dict:  # fmt: skip
    """Stream raw events into period samples written to ``out_path`` (atomically). Returns counts.

    Example:
        >>> compress_events("data/ml-1m/events.parquet", "samples/train.parquet",
        ...                 CompressConfig(period_seconds=86400, label_columns=("rating",), split="train"))
    """
    cfg.check()
    paths = [events_paths] if isinstance(events_paths, (str, os.PathLike)) else list(events_paths)
    needed = ["user_id", "item_id", "timestamp", *cfg.label_columns] + ([cfg.action_column] if cfg.action_column else [])
    out_path = Path(out_path)
    writer, carry, counts = None, None, {"events": 0, "samples": 0, "targets": 0, "history_tokens": 0}

    def emit(chunk: pa.Table) -> None:
        nonlocal writer
        samples = compress_chunk(chunk, cfg)
        if writer is None:
            writer = pq.ParquetWriter(str(tmp), samples.schema)
        if samples.num_rows:
            writer.write_table(samples, row_group_size=row_group_size)
        counts["samples"] += samples.num_rows
        counts["targets"] += int(np.diff(samples.column("target_item_ids").combine_chunks().offsets.to_numpy()).sum())
        counts["history_tokens"] += int(np.diff(samples.column("history_item_ids").combine_chunks().offsets.to_numpy()).sum())

    with atomic_file(out_path) as tmp:
        try:
            for path in paths:
                try:
                    pf = pq.ParquetFile(path)
                except (pa.ArrowException, OSError) as err:
                    raise ValueError(f"{path}: cannot read Parquet ({err}); the file is truncated or corrupt") from err
                missing = [c for c in needed if c not in pf.schema_arrow.names]
                if missing:
                    raise ValueError(f"{path}: no column(s) {missing} (have {pf.schema_arrow.names})")
                for rb in pf.iter_batches(batch_size=cfg.chunk_rows, columns=needed):
                    table = pa.Table.from_batches([rb])
                    if carry is not None:
                        table = pa.concat_tables([carry, table])
                    counts["events"] += rb.num_rows
                    users = table.column("user_id").to_numpy()
                    last = np.flatnonzero(users != users[-1])
                    cut = int(last[-1]) + 1 if len(last) else 0  # the last user may continue in the next chunk
                    if cut:
                        emit(table.slice(0, cut))
                    carry = table.slice(cut)
            if carry is not None and carry.num_rows:
                emit(carry)
            if writer is None:
                raise ValueError(f"no events in {[str(p) for p in paths]}")
        finally:
            if writer is not None:
                writer.close()
    return counts
