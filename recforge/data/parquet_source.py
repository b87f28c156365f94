"""Parquet files as a sample source with row identity, projection and clear errors.

Every row read gets a ``__row_id__`` column so the pipeline can record what the trainer
consumed (exactly-once resume)::

    row_id = file_index * 2**40 + row_in_file         int64; 2**40 rows per file, 2**23 files

A *read unit* is one row group, or a row range inside one, of one file. Files are opened
(footer only) when the source is built, so a truncated or non-Parquet file raises a
``ValueError`` naming it before any training starts; a data page that fails to decode
later raises one naming the file and row group.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recforge.data.arrow import pc  # pyarrow.compute, imported on first use

ROW_ID = "__row_id__"
ROWS_PER_FILE = 1 << 40


def encode_row_ids(file_index: int, rows: np.ndarray) -> np.ndarray:
    """(file, row-in-file) -> global int64 row ids."""
    return np.int64(file_index) * ROWS_PER_FILE + rows.astype(np.int64, copy=False)


def decode_row_ids(row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global row ids -> (file index, row in file)."""
    row_ids = np.asarray(row_ids, dtype=np.int64)
    return row_ids >> 40, row_ids & (ROWS_PER_FILE - 1)  # ROWS_PER_FILE = 2**40; shifts beat // and %


@dataclass(frozen=True)
class ReadUnit:
    """Rows ``[start, stop)`` of row group ``row_group`` of file ``file_index`` (rows counted in the row group)."""

    file_index: int
    row_group: int
    start: int
    stop: int


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def one_batch(table: pa.Table) -> pa.RecordBatch:
    """A table as one RecordBatch (zero-copy when it already has a single chunk)."""
    if table.num_rows == 0:
        return pa.RecordBatch.from_pylist([], schema=table.schema)
    batches = table.combine_chunks().to_batches()
    return batches[0]


class ParquetSource:
    """A fixed list of Parquet files with projected columns and row-group geometry.

    Args:
        paths: Parquet files (or directories: their ``*.parquet`` files, sorted).
        columns: columns to read (projection); None reads all.

    Raises:
        ValueError: a path does not exist, is not valid Parquet (truncated, corrupt), or
            lacks a requested column.
    """

    def __init__(self, paths: list[str | os.PathLike] | str | os.PathLike, columns: list[str] | None = None):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        files: list[Path] = []
        for p in map(Path, paths):
            if p.is_dir():
                files.extend(sorted(p.glob("*.parquet")))
            elif p.is_file():
                files.append(p)
            else:
                raise ValueError(f"{p}: no such Parquet file or directory")
        if not files:
            raise ValueError(f"no Parquet files found in {[str(p) for p in paths]}")
        self.paths = [str(f) for f in files]
        self.columns = list(columns) if columns is not None else None
        self.row_group_rows: list[np.ndarray] = []  # per file: rows of each row group
        self.schema: pa.Schema | None = None  # the first file's (projected) schema
        self.file_schemas: list[pa.Schema] = []
        for path in self.paths:
            meta = self._open(path).metadata
            self.row_group_rows.append(np.array([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], np.int64))
            schema = meta.schema.to_arrow_schema()
            missing = [c for c in self.columns or [] if c not in schema.names]
            if missing:
                raise ValueError(f"{path}: no column(s) {missing} (the file has {schema.names})")
            projected = schema if self.columns is None else pa.schema([schema.field(c) for c in self.columns])
            self.file_schemas.append(projected)
            if self.schema is None:
                self.schema = projected
        self._local = threading.local()
        self._tokens: dict[str, list[list[np.ndarray]]] = {}  # column -> per file, per row group: row tokens

    def check_types(self, cast: set[str]) -> None:
        """Raise ``ValueError`` naming the file when a column's type differs from the first file's,
        unless the column is in ``cast`` (row rules cast it to one type)."""
        for path, schema in zip(self.paths[1:], self.file_schemas[1:], strict=True):
            for field in self.schema:
                if field.name in cast or field.name not in schema.names:
                    continue
                other = schema.field(field.name).type
                if other != field.type:
                    raise ValueError(
                        f"{path}: column {field.name!r} is {other} but {field.type} in {self.paths[0]}; rewrite the "
                        f"file or pass rules=RowRules(types={{{field.name!r}: ...}}) to cast every file to one type"
                    )

    @staticmethod
    def _open(path: str) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path}: cannot read Parquet ({err}); the file is truncated or corrupt, rewrite it") from err

    @property
    def num_files(self) -> int:
        return len(self.paths)

    @property
    def file_rows(self) -> np.ndarray:
        """(files,) rows per file."""
        return np.array([int(r.sum()) for r in self.row_group_rows], np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.file_rows.sum())

    def _file(self, file_index: int) -> pq.ParquetFile:
        # one ParquetFile per thread and file: readers are not shared between worker threads
        cache = self._local.__dict__.setdefault("files", {})
        if file_index not in cache:
            cache[file_index] = self._open(self.paths[file_index])
        return cache[file_index]

    def read(self, unit: ReadUnit, use_threads: bool = True) -> pa.RecordBatch:
        """Read one unit (projected) with its ``__row_id__`` column appended; ``use_threads=False``
        decodes its columns one after another (a worker process that is itself one of many)."""
        path = self.paths[unit.file_index]
        try:
            table = self._file(unit.file_index).read_row_group(unit.row_group, columns=self.columns, use_threads=use_threads)
        except (pa.ArrowException, OSError) as err:
            raise ValueError(
                f"{path}: row group {unit.row_group} cannot be decoded ({err}); the file is truncated or corrupt"
            ) from err
        rg_rows = self.row_group_rows[unit.file_index]
        if unit.start or unit.stop != rg_rows[unit.row_group]:
            table = table.slice(unit.start, unit.stop - unit.start)
        first = int(rg_rows[: unit.row_group].sum()) + unit.start
        row_ids = encode_row_ids(unit.file_index, np.arange(first, first + table.num_rows))
        return one_batch(table.append_column(ROW_ID, pa.array(row_ids)))

    def token_column(self, column: str) -> str | None:
        """The column of the files to weigh rows by when batches are cut by ``column``'s tokens: the
        column itself when the files have it as a list or integer column, else (a column made by a
        map, e.g. ``input_ids`` from ``item_ids``) the files' first list column; None when there is none."""
        fields = {f.name: f.type for f in self.schema}
        if column in fields and (_is_list(fields[column]) or pa.types.is_integer(fields[column])):
            return column
        return next((name for name, t in fields.items() if _is_list(t)), None)

    def row_tokens(self, column: str, per_row: bool = False) -> list[list[np.ndarray]]:
        """Per file, per row group: the tokens of each row, to balance ranks' shares.

        For a list column, a 0-d array: the row group's mean list length, from the value count in
        the Parquet footer (no data is decoded), or with ``per_row`` (for lengths that maps change
        row by row, e.g. a truncation) each row's length, from the column read once and cached. For
        an integer column (per-row token counts), the (rows,) column itself, read once and cached.
        """
        key = f"{column}/rows" if per_row else column
        if key not in self._tokens:
            out = []
            for path in self.paths:
                pf = self._open(path)
                meta = pf.metadata
                if per_row and not pa.types.is_integer(self.schema.field(column).type):
                    out.append([pc.fill_null(pc.list_value_length(pf.read_row_group(g, columns=[column]).column(0)), 0)
                                .to_numpy().astype(np.float64) for g in range(meta.num_row_groups)])  # fmt: skip
                    continue
                if pa.types.is_integer(self.schema.field(column).type):
                    out.append([pf.read_row_group(g, columns=[column]).column(0).to_numpy().astype(np.float64)
                                for g in range(meta.num_row_groups)])  # fmt: skip
                    continue
                leaf = next(j for j in range(meta.num_columns) if meta.schema.column(j).path.split(".")[0] == column)
                out.append([np.array(meta.row_group(g).column(leaf).num_values / max(meta.row_group(g).num_rows, 1))
                            for g in range(meta.num_row_groups)])  # fmt: skip
            self._tokens[key] = out
        return self._tokens[key]

    def location(self, row_id: int) -> str:
        """'path row N' for messages."""
        f, r = decode_row_ids(np.array([row_id]))
        return f"{self.paths[int(f[0])]} row {int(r[0])}"
