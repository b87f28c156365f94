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

from recforge.data.batch import JaggedBatch, readonly_tensor
from recforge.data.parquet_source import ROW_ID


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


def row_ids_of(rb: pa.RecordBatch) -> np.ndarray:
    """The ``__row_id__`` values of a batch (raises when a transform dropped the column)."""
    if ROW_ID not in rb.schema.names:
        raise ValueError(
            f"a pipeline transform dropped the {ROW_ID!r} column (have {rb.schema.names}); map functions "
            "must keep it so every sample keeps its row identity"
        )
    return rb.column(ROW_ID).to_numpy()
