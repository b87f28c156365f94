"""Arrow helpers that keep heavy imports off a training run's start-up.

``pyarrow.compute`` takes ~0.1 s to import and ``Array.to_numpy`` / ``pa.array`` import pandas (~0.15 s) on
first use, whatever the type; a ``train.loader=memory`` run needs neither. ``pc`` is ``pyarrow.compute``
imported on first attribute access, and ``column_numpy`` views a numeric column's buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa


class _LazyCompute:
    """``pyarrow.compute``, imported at the first attribute read (each name is then cached on the proxy)."""

    def __getattr__(self, name: str) -> Any:
        import pyarrow.compute

        value = getattr(pyarrow.compute, name)
        setattr(self, name, value)
        return value


pc: Any = _LazyCompute()


def column_numpy(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A numeric Arrow column as a read-only NumPy array, zero-copy when it is one chunk without nulls.

    Other columns (nulls, bit-packed booleans, strings, timestamps) fall back to
    ``to_numpy(zero_copy_only=False)``, which imports pandas."""
    if isinstance(column, pa.ChunkedArray):
        column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    kind = column.type
    if column.null_count or not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        return column.to_numpy(zero_copy_only=False)
    dtype = np.dtype(kind.to_pandas_dtype())  # a NumPy dtype (no pandas import)
    if not len(column):
        return np.zeros(0, dtype)
    out = np.frombuffer(column.buffers()[1], dtype=dtype, count=len(column), offset=column.offset * dtype.itemsize)
    out.flags.writeable = False  # Arrow memory is immutable (to_numpy's views are read-only too)
    return out
