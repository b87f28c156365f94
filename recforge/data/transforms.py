"""Vectorised RecordBatch transforms for ``Pipeline.map``/``Pipeline.filter`` (pyarrow.compute + numpy).

Each factory returns a function of one RecordBatch that works on whole columns: no Python
loop over rows. All keep the ``__row_id__`` column.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from recforge.data.arrow import pc  # pyarrow.compute, imported on first use


def _replace(rb: pa.RecordBatch, name: str, col: pa.Array) -> pa.RecordBatch:
    return rb.set_column(rb.schema.get_field_index(name), pa.field(name, col.type), col)


def truncate_lists(columns: list[str], max_len: int, keep: str = "last") -> Callable[[pa.RecordBatch], pa.RecordBatch]:
    """Keep each row's last (or first) ``max_len`` elements of every list column in ``columns``.

    Aligned list columns stay aligned (same cut per row). Rows already short enough are unchanged.
    """
    if max_len < 0 or keep not in ("last", "first"):
        raise ValueError(f"truncate_lists: need max_len >= 0 and keep in (last, first), got {max_len}, {keep!r}")

    def fn(rb: pa.RecordBatch) -> pa.RecordBatch:
        for name in columns:
            col = rb.column(name)
            off = col.offsets.to_numpy().astype(np.int64)
            lengths = np.diff(off)
            if lengths.size == 0 or lengths.max() <= max_len:
                continue
            new_len = np.minimum(lengths, max_len)
            start = off[1:] - new_len if keep == "last" else off[:-1]
            new_off = np.zeros(len(lengths) + 1, np.int64)
            np.cumsum(new_len, out=new_off[1:])
            index = np.repeat(start - new_off[:-1], new_len) + np.arange(new_off[-1])
            values = col.values.take(pa.array(index))
            list_type = pa.LargeListArray if pa.types.is_large_list(col.type) else pa.ListArray
            offsets = pa.array(new_off if list_type is pa.LargeListArray else new_off.astype(np.int32))
            rb = _replace(rb, name, list_type.from_arrays(offsets, values, mask=col.is_null() if col.null_count else None))
        return rb

    fn.token_lengths = lambda lengths: {c: np.minimum(v, max_len) if c in columns else v for c, v in lengths.items()}
    return fn


def map_ids(column: str, vocabulary: pa.Array | np.ndarray, default: int = 0) -> Callable[[pa.RecordBatch], pa.RecordBatch]:
    """Map raw IDs (scalar or list column) to dense indices: ``vocabulary[i]`` -> ``i + 1``; unknown -> ``default``."""
    vocab = pa.array(vocabulary, pa.int64()) if not isinstance(vocabulary, pa.Array) else vocabulary

    def fn(rb: pa.RecordBatch) -> pa.RecordBatch:
        col = rb.column(column)
        is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
        flat = col.flatten() if is_list else col
        index = pc.index_in(flat, value_set=vocab)
        dense = pc.fill_null(pc.add(index.cast(pa.int64()), 1), default)
        if is_list:
            list_type = pa.LargeListArray if pa.types.is_large_list(col.type) else pa.ListArray
            off = col.offsets
            if off[0].as_py() != 0:
                off = pc.subtract(off, off[0])
            dense = list_type.from_arrays(off, dense)
        return _replace(rb, column, dense)

    return fn


def dedupe(key_columns: list[str]) -> Callable[[pa.RecordBatch], pa.RecordBatch]:
    """Drop rows whose key (one or more scalar columns) already appeared earlier in the batch."""

    def fn(rb: pa.RecordBatch) -> pa.RecordBatch:
        keys = np.stack([rb.column(c).to_numpy(zero_copy_only=False) for c in key_columns], axis=1)
        _, first = np.unique(keys, axis=0, return_index=True)
        keep = np.zeros(rb.num_rows, bool)
        keep[first] = True
        return rb if keep.all() else rb.filter(pa.array(keep))

    return fn


def min_length(column: str, n: int) -> Callable[[pa.RecordBatch], pa.Array]:
    """Filter: rows whose list column has at least ``n`` elements."""

    def fn(rb: pa.RecordBatch) -> pa.Array:
        return pc.fill_null(pc.greater_equal(pc.list_value_length(rb.column(column)), n), False)

    return fn


def next_item_targets(
    column: str = "item_ids", inputs: str = "input_ids", targets: str = "next_item", aligned: tuple[str, ...] = ()
) -> Callable[[pa.RecordBatch], pa.RecordBatch]:
    """Add aligned list columns for next-item training: ``inputs`` = all but the last element of
    ``column``, ``targets`` = all but the first (rows with fewer than 2 elements get empty lists).
    Each list column in ``aligned`` (e.g. ``timestamps``) is replaced by all but its last element,
    so it stays aligned with ``inputs``."""

    def fn(rb: pa.RecordBatch) -> pa.RecordBatch:
        col = rb.column(column)
        off = col.offsets.to_numpy().astype(np.int64)
        lengths = np.maximum(np.diff(off) - 1, 0)
        new_off = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=new_off[1:])
        index = pa.array(np.repeat(off[:-1] - new_off[:-1], lengths) + np.arange(new_off[-1]))
        offsets = pa.array(new_off)
        for name in aligned:
            other = rb.column(name)
            if not np.array_equal(other.offsets.to_numpy(), col.offsets.to_numpy()):
                raise ValueError(f"next_item_targets: list column {name!r} is not aligned with {column!r}")
            rb = _replace(rb, name, pa.LargeListArray.from_arrays(offsets, other.values.take(index)))
        rb = rb.append_column(inputs, pa.LargeListArray.from_arrays(offsets, col.values.take(index)))
        return rb.append_column(targets, pa.LargeListArray.from_arrays(offsets, col.values.take(pc.add(index, 1))))

    def token_lengths(lengths: dict) -> dict:
        if column not in lengths:
            return lengths
        shorter = np.maximum(lengths[column] - 1, 0)
        return {**lengths, **{name: shorter for name in aligned if name in lengths}, inputs: shorter, targets: shorter}

    fn.token_lengths = token_lengths
    return fn
