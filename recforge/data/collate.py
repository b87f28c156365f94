"""Whole-batch collation: an Arrow RecordBatch -> ``JaggedBatch``, zero-copy where Arrow allows.

List columns that share one offsets layout become the batch's token features (their values
buffers are shared with torch, not copied); scalar columns become dense per-sequence
features or labels; the pipeline's ``__row_id__`` column becomes ``dense["row_ids"]``.
No per-row Python anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from recforge.data.parquet_source import ROW_ID
from recforge.jagged.batch import JaggedBatch, readonly_tensor


def _tensor(col: pa.Array) -> torch.Tensor:
    if col.null_count:
        raise ValueError(f"cannot collate a column with {col.null_count} nulls; add RowRules(ids=...) to drop such rows")
    return readonly_tensor(col.to_numpy(zero_copy_only=False))


@dataclass(frozen=True)
class JaggedCollate:
    """Collate function: RecordBatch -> JaggedBatch.

    Attributes:
        jagged: list column -> token feature name (must produce ``item_ids``), e.g.
            ``{"item_ids": "item_ids", "timestamps": "timestamps"}``.
        dense: scalar column -> dense feature name.
        labels: column (scalar or list aligned with the tokens) -> label name.
        max_seq_len: upper bound recorded in the batch; computed per batch when None.

    Example:
        >>> collate = JaggedCollate(jagged={"item_ids": "item_ids"}, dense={"user_id": "user_id"})
        >>> batch = collate(record_batch)      # batch.dense["row_ids"] carries row identity
    """

    jagged: dict[str, str]
    dense: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    max_seq_len: int | None = None

    def __call__(self, rb: pa.RecordBatch) -> JaggedBatch:
        if "item_ids" not in self.jagged.values():
            raise ValueError(f"JaggedCollate.jagged must map some list column to 'item_ids', got {self.jagged}")
        batch = JaggedBatch.from_arrow({name: rb.column(col) for col, name in self.jagged.items()}, self.max_seq_len)
        for col, name in self.dense.items():
            batch.dense[name] = _tensor(rb.column(col))
        for col, name in self.labels.items():
            c = rb.column(col)
            if pa.types.is_list(c.type) or pa.types.is_large_list(c.type):
                off = c.offsets.to_numpy()
                c = c.values.slice(off[0], off[-1] - off[0])
            batch.labels[name] = _tensor(c)
        if ROW_ID in rb.schema.names:
            batch.dense["row_ids"] = _tensor(rb.column(ROW_ID))
        return batch


    def collate_slices(self, rb: pa.RecordBatch, cuts: np.ndarray) -> list[JaggedBatch]:
        """The batches ``[cuts[i], cuts[i+1])`` of ``rb``, each equal to ``self(rb.slice(...))``.

        Every column is converted to numpy once for all the batches; each batch is then numpy views
        (zero-copy) plus its rebased offsets, which costs a fraction of one ``__call__`` per batch.
        The pipeline uses it for the full batches of a worker task.
        """
        if "item_ids" not in self.jagged.values():
            raise ValueError(f"JaggedCollate.jagged must map some list column to 'item_ids', got {self.jagged}")
        offsets, lists = None, {}
        for col, name in self.jagged.items():
            offsets, lists[name] = self._list_values(rb, col, offsets)
        label_lists, label_rows = {}, {}
        for col, name in self.labels.items():
            if _is_list(rb.column(col).type):
                label_lists[name] = self._list_values(rb, col, None)
            else:
                label_rows[name] = _numpy(rb.column(col))
        dense = {name: _numpy(rb.column(col)) for col, name in self.dense.items()}
        if ROW_ID in rb.schema.names:
            dense["row_ids"] = _numpy(rb.column(ROW_ID))
        lengths = np.diff(offsets)
        out = []
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
            lo, hi = int(offsets[a]), int(offsets[b])
            max_len = self.max_seq_len if self.max_seq_len is not None else (int(lengths[a:b].max()) if b > a else 0)
            batch = JaggedBatch(torch.from_numpy(offsets[a : b + 1] - lo), {n: readonly_tensor(v[lo:hi]) for n, v in lists.items()}, max_len)
            batch.dense = {n: readonly_tensor(v[a:b]) for n, v in dense.items()}
            batch.labels = {n: readonly_tensor(v[a:b]) for n, v in label_rows.items()}
            for n, (off, v) in label_lists.items():
                batch.labels[n] = readonly_tensor(v[int(off[a]) : int(off[b])])
            out.append(batch)
        return out

    @staticmethod
    def _list_values(rb: pa.RecordBatch, col: str, offsets: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(offsets rebased to 0 as int64, the values they index) of list column ``col``; with ``offsets``,
        the column must have the same lengths."""
        c = rb.column(col)
        if c.null_count:
            raise ValueError(f"cannot collate a column with {c.null_count} nulls; add RowRules(ids=...) to drop such rows")
        off = c.offsets.to_numpy()
        values = c.values.slice(off[0], off[-1] - off[0]).to_numpy(zero_copy_only=False)
        off = off.astype(np.int64) - off[0]
        if offsets is not None and not np.array_equal(off, offsets):
            raise ValueError(f"list column {col!r} has different lengths from the others")
        return off, values


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _numpy(col: pa.Array) -> np.ndarray:
    if col.null_count:
        raise ValueError(f"cannot collate a column with {col.null_count} nulls; add RowRules(ids=...) to drop such rows")
    return col.to_numpy(zero_copy_only=False)


def row_ids_of(rb: pa.RecordBatch) -> np.ndarray:
    """The ``__row_id__`` values of a batch (raises when a transform dropped the column)."""
    if ROW_ID not in rb.schema.names:
        raise ValueError(
            f"a pipeline transform dropped the {ROW_ID!r} column (have {rb.schema.names}); map functions "
            "must keep it so every sample keeps its row identity"
        )
    return rb.column(ROW_ID).to_numpy()
