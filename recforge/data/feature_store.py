"""Item features joined at batch time by key, instead of copied into every sample.

Two backends with one interface (``lookup(keys) -> RecordBatch`` aligned with ``keys``):

- ``ArrowFeatureStore`` (the embedded default, no server): an Arrow IPC file sorted by key,
  memory-mapped; the sorted key column is the index (``np.searchsorted``, vectorised,
  nothing to build at open). Any Arrow column type. ``benchmarks/feature_store.py``
  measured it against SQLite (see BENCHMARKS.md) and it is the default because of that.
- ``RedisFeatureStore`` (networked): one Redis string per key holding the row's
  fixed-width columns packed as a numpy structured record; ``MGET`` per batch and one
  ``np.frombuffer`` decode, so decoding is vectorised too. Numeric scalar and fixed-size
  list columns only.

Missing keys never raise: each column gets its configured default (null when none) and
the store counts them (``stats``).

``join_features`` is the pipeline stage: for a list column of keys (a batch's
``item_ids``) it looks up each distinct key once and adds aligned list columns.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import ipc

from recforge.io import atomic_file


@dataclass
class LookupStats:
    """Keys looked up and keys not found (given defaults), since the store was opened."""

    lookups: int = 0
    missing: int = 0


def _defaults_check(schema: pa.Schema, key: str, defaults: dict) -> None:
    unknown = set(defaults) - set(schema.names)
    if unknown:
        raise ValueError(f"defaults for unknown feature columns {sorted(unknown)} (features: {[n for n in schema.names if n != key]})")


def _fill_missing(col: pa.Array, found: np.ndarray, default) -> pa.Array:
    if found.all():
        return col
    fill = pa.scalar(default, col.type) if default is not None else pa.nulls(1, col.type)[0]
    return pc.if_else(pa.array(found), col, fill)


class ArrowFeatureStore:
    """Memory-mapped Arrow IPC feature table with a sorted-key index.

    Example:
        >>> ArrowFeatureStore.write(items_table, "items.arrow", key="item_id")
        >>> store = ArrowFeatureStore("items.arrow", defaults={"category": 0})
        >>> store.lookup(np.array([3, 99, 7]))     # RecordBatch of 3 rows; 99 missing -> defaults
    """

    def __init__(self, path: str | os.PathLike, *, key: str = "item_id", defaults: dict | None = None):
        self.path = Path(path)
        try:
            self._source = pa.memory_map(str(self.path), "r")
            self.table = ipc.open_file(self._source).read_all()
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{self.path}: cannot open the feature store ({err}); rebuild it with ArrowFeatureStore.write") from err
        if key not in self.table.column_names:
            raise ValueError(f"{self.path}: no key column {key!r} (have {self.table.column_names})")
        self.key = key
        self.keys = self.table.column(key).to_numpy()  # sorted by write(); zero-copy from the map
        self.features = self.table.drop_columns([key]).combine_chunks()
        self.defaults = defaults or {}
        _defaults_check(self.table.schema, key, self.defaults)
        self.stats = LookupStats()

    @staticmethod
    def write(table: pa.Table, path: str | os.PathLike, *, key: str = "item_id") -> Path:
        """Sort ``table`` by ``key`` and write it as an uncompressed Arrow IPC file (atomically)."""
        if key not in table.column_names or not pa.types.is_integer(table.schema.field(key).type):
            raise ValueError(f"feature table needs an integer key column {key!r} (have {table.schema})")
        keys = table.column(key)
        if keys.null_count:
            raise ValueError(f"feature table: {keys.null_count} null keys in {key!r}")
        table = table.sort_by(key).combine_chunks()
        sorted_keys = table.column(key).to_numpy()
        if len(sorted_keys) > 1 and (sorted_keys[1:] == sorted_keys[:-1]).any():
            raise ValueError(f"feature table: duplicate keys in {key!r}")
        path = Path(path)
        with atomic_file(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return path

    def lookup(self, keys: np.ndarray) -> pa.RecordBatch:
        """Features of ``keys`` (N,) int64, in order; missing keys get defaults and are counted."""
        keys = np.asarray(keys, dtype=np.int64)
        pos = np.searchsorted(self.keys, keys)
        pos_clipped = np.minimum(pos, max(len(self.keys) - 1, 0))
        found = (pos < len(self.keys)) & (self.keys[pos_clipped] == keys) if len(self.keys) else np.zeros(len(keys), bool)
        self.stats.lookups += len(keys)
        self.stats.missing += int((~found).sum())
        taken = self.features.take(pa.array(pos_clipped)) if len(self.keys) else None
        columns = []
        for name in self.features.column_names:
            col = taken.column(name).combine_chunks() if taken is not None else pa.nulls(len(keys), self.features.schema.field(name).type)
            columns.append(_fill_missing(col, found, self.defaults.get(name)))
        return pa.RecordBatch.from_arrays(columns, names=self.features.column_names)

    def close(self) -> None:
        self._source.close()


def _record_dtype(schema: pa.Schema) -> np.dtype:
    """numpy structured dtype for fixed-width columns (scalars and fixed-size lists)."""
    fields = []
    for f in schema:
        if pa.types.is_fixed_size_list(f.type):
            fields.append((f.name, f.type.value_type.to_pandas_dtype(), (f.type.list_size,)))
        elif pa.types.is_integer(f.type) or pa.types.is_floating(f.type):
            fields.append((f.name, f.type.to_pandas_dtype()))
        else:
            raise ValueError(
                f"RedisFeatureStore stores numeric scalar and fixed-size list columns; {f.name!r} is {f.type} "
                "(map it to ids first, or use ArrowFeatureStore)"
            )
    return np.dtype(fields)


def _to_arrow(values: np.ndarray, t: pa.DataType) -> pa.Array:
    if pa.types.is_fixed_size_list(t):
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), t.value_type), t.list_size)
    return pa.array(values, t)


class RedisFeatureStore:
    """Features in Redis: key ``{prefix}{id}`` -> packed fixed-width record; batched ``MGET``.

    Args:
        client: a ``redis.Redis`` (``decode_responses=False``).
        schema: the feature columns (no key column); numeric or fixed-size lists.
        prefix: key namespace.
        defaults: column -> value for missing keys (null when absent).
    """

    def __init__(self, client, schema: pa.Schema, *, prefix: str = "item:", defaults: dict | None = None):
        self.client, self.schema, self.prefix = client, schema, prefix
        self.dtype = _record_dtype(schema)
        self.defaults = defaults or {}
        _defaults_check(schema, "", self.defaults)
        self.stats = LookupStats()

    def write(self, table: pa.Table, *, key: str = "item_id", chunk: int = 10_000) -> None:
        """Store every row of ``table`` (key column + ``schema`` columns), ``chunk`` keys per ``MSET``."""
        keys = table.column(key).to_numpy()
        records = np.zeros(table.num_rows, self.dtype)
        for f in self.schema:
            col = table.column(f.name).combine_chunks()
            if pa.types.is_fixed_size_list(f.type):
                records[f.name] = col.flatten().to_numpy().reshape(len(col), f.type.list_size)
            else:
                records[f.name] = col.to_numpy(zero_copy_only=False)
        raw = records.tobytes()
        size = self.dtype.itemsize
        for a in range(0, len(keys), chunk):
            self.client.mset({f"{self.prefix}{k}": raw[i * size : (i + 1) * size] for i, k in enumerate(keys[a : a + chunk], start=a)})

    def lookup(self, keys: np.ndarray) -> pa.RecordBatch:
        keys = np.asarray(keys, dtype=np.int64)
        values = self.client.mget([f"{self.prefix}{k}" for k in keys.tolist()]) if len(keys) else []
        found = np.fromiter((v is not None for v in values), bool, len(keys))
        blank = bytes(self.dtype.itemsize)
        records = np.frombuffer(b"".join(v if v is not None else blank for v in values), self.dtype)
        self.stats.lookups += len(keys)
        self.stats.missing += int((~found).sum())
        columns = [_fill_missing(_to_arrow(records[f.name], f.type), found, self.defaults.get(f.name)) for f in self.schema]
        return pa.RecordBatch.from_arrays(columns, names=self.schema.names)


def join_features(store, key_column: str = "item_ids", *, columns: list[str] | None = None,
                  prefix: str = "") -> Callable[[pa.RecordBatch], pa.RecordBatch]:  # fmt: skip
    """Pipeline map stage: add the store's features for every key of ``key_column``.

    For a list column the result columns are lists aligned with it (one feature value per
    token); for a scalar column, scalars. Each distinct key of a batch is looked up once.
    """

    def fn(rb: pa.RecordBatch) -> pa.RecordBatch:
        col = rb.column(key_column)
        is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
        flat = col.flatten() if is_list else col
        unique, inverse = np.unique(flat.to_numpy(zero_copy_only=False), return_inverse=True)
        feats = store.lookup(unique)
        names = columns or feats.schema.names
        offsets = None
        if is_list:
            offsets = col.offsets if col.offsets[0].as_py() == 0 else pc.subtract(col.offsets, col.offsets[0])
        for name in names:
            values = feats.column(name).take(pa.array(inverse))
            if is_list:
                values = (pa.LargeListArray if pa.types.is_large_list(col.type) else pa.ListArray).from_arrays(offsets, values)
            rb = rb.append_column(prefix + name, values)
        return rb

    return fn
