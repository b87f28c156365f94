"""Training samples built in memory and streamed by the sample engine, with no file in between.

A recipe's training samples are rows it can build from arrays it already holds (a retrieval
window from ``UserSequences``, a ranking sample from ``RankingData``). ``SampleSource`` gives the
pipeline those rows exactly as ``ParquetSource`` gives a file's: fixed-size groups of rows (the
"row groups"), each with its ``__row_id__`` column, built by the reader workers when a group is
read. Shuffling, token-budget batching, prefetching and exactly-once resume work unchanged::

    source = SampleSource("retrieval", num_rows=S, build=lambda rows: table_of(rows), tokens=tokens)
    pipe = Pipeline.from_samples(source, num_workers=2).shuffle(65536).batch(256).collate(...)

Rows are numbered 0..S-1 and must be the same rows every time the source is built for a run (the
recipes build them deterministically from the dataset and the config); the source's name carries
a fingerprint of their identity so a resume refuses a state saved for other samples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from recforge.data.parquet_source import ROW_ID, ReadUnit, decode_row_ids, encode_row_ids, one_batch

SAMPLE_PREFIX = "samples:"  # the "path" of a SampleSource in pipeline states: samples:<kind>:<fingerprint>
GROUP_ROWS = 8192  # rows per group, as the recipes' sample files had per row group


def fingerprint(*arrays: np.ndarray) -> str:
    """A short hex digest of the arrays' shapes, dtypes and bytes (identifies a set of samples)."""
    digest = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.ascontiguousarray(a)
        digest.update(f"{a.dtype.str}{a.shape};".encode())
        digest.update(a.data)
    return digest.hexdigest()


class SampleSource:
    """``num_rows`` sample rows made on demand by ``build``, read through the pipeline like one file.

    Args:
        kind: what the rows are ("retrieval", "ranking"), for names and messages.
        num_rows: rows 0..num_rows-1.
        build: ``build(rows)`` -> ``pa.Table`` of the samples ``rows`` ((n,) int64, ascending), one
            row each in that order; runs in the reader workers (threads, or forked processes that
            inherit it), so it must not depend on state those change.
        tokens: optional (num_rows,) tokens per row: ranks' shares are balanced by it under
            token-budget batching (``PipelineState.plan``).
        group_mean_tokens: weigh each row by its group's mean ``tokens``, as ``ParquetSource`` does for
            a list column (from the file footer): the shares of the same rows in a file, exactly.
        tokens_of: the list column of the rows that ``tokens`` counts (e.g. ``item_ids``), so maps'
            declared length changes (``Pipeline.map``) apply to it as they do to that column of a
            file; None: ``tokens`` are already what the batches are cut by.
        identity: arrays that identify the samples (fingerprinted into the name).
        group_rows: rows per read group (the unit of shuffling and of a worker's read).

    Example:
        >>> source = SampleSource("retrieval", len(samples), build, tokens=tokens, identity=(samples.numpy(),))
        >>> pipe = Pipeline.from_samples(source).shuffle(65536).batch(256)
    """

    def __init__(self, kind: str, num_rows: int, build: Callable[[np.ndarray], pa.Table], *,
                 tokens: np.ndarray | None = None, group_mean_tokens: bool = False, tokens_of: str | None = None,
                 identity: tuple[np.ndarray, ...] = (), group_rows: int = GROUP_ROWS) -> None:  # fmt: skip
        if num_rows < 1:
            raise ValueError(f"a {kind} sample source needs at least one sample, got {num_rows}")
        if group_rows < 1:
            raise ValueError(f"group_rows must be >= 1, got {group_rows}")
        if tokens is not None and np.shape(tokens) != (num_rows,):
            raise ValueError(f"tokens must be ({num_rows},) per row, got {np.shape(tokens)}")
        self.kind = kind
        self.build = build
        self.paths = [f"{SAMPLE_PREFIX}{kind}:{fingerprint(np.array([num_rows]), *identity)}"]
        self.columns = None
        full, rest = divmod(num_rows, group_rows)
        self.row_group_rows = [np.array([group_rows] * full + ([rest] if rest else []), np.int64)]
        self.tokens = None if tokens is None else np.asarray(tokens, np.float64)
        self.group_mean_tokens = group_mean_tokens
        self.tokens_of = tokens_of
        self.schema = build(np.arange(1, dtype=np.int64)).schema  # one row built now: the schema, and any error early
        self.file_schemas = [self.schema]

    # -- what ParquetSource offers the pipeline ---------------------------------------------
    def check_types(self, cast: set[str]) -> None:
        """One source, one schema: nothing to check."""

    @property
    def num_files(self) -> int:
        return 1

    @property
    def file_rows(self) -> np.ndarray:
        return np.array([int(self.row_group_rows[0].sum())], np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.file_rows[0])

    def read(self, unit: ReadUnit, use_threads: bool = True) -> pa.RecordBatch:
        """Build rows ``[start, stop)`` of group ``unit.row_group`` with their ``__row_id__`` column."""
        first = int(self.row_group_rows[0][: unit.row_group].sum()) + unit.start
        rows = np.arange(first, first + unit.stop - unit.start, dtype=np.int64)
        table = self.build(rows)
        if table.num_rows != len(rows):
            raise RuntimeError(f"{self.kind} samples: build({len(rows)} rows) returned {table.num_rows} rows")
        return one_batch(table.append_column(ROW_ID, pa.array(encode_row_ids(0, rows))))

    def token_column(self, column: str) -> str | None:
        """Rows are weighed by their ``tokens`` (of ``tokens_of``, else of whatever column batches are cut by); None without."""
        return None if self.tokens is None else self.tokens_of or column

    def row_tokens(self, column: str, per_row: bool = False) -> list[list[np.ndarray]]:
        """Per group, the (rows,) tokens of each row, or (``group_mean_tokens`` without ``per_row``) their 0-d mean."""
        if self.tokens is None:
            raise ValueError(f"{self.kind} samples were given no tokens per row")
        cuts = np.r_[0, np.cumsum(self.row_group_rows[0])]
        groups = [self.tokens[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        return [[np.array(g.mean()) for g in groups] if self.group_mean_tokens and not per_row else groups]

    def location(self, row_id: int) -> str:
        """'<kind> sample N' for messages."""
        _, row = decode_row_ids(np.array([row_id]))
        return f"{self.kind} sample {int(row[0])}"

    def check_state(self, paths: list[str]) -> None:
        """Refuse a pipeline state saved for other samples (their count or fingerprinted identity differs).

        A state saved while the samples were read from a file (an older run) names that file: only
        its row count is checked, as for any file (``Pipeline.from_samples`` then renames it to these
        samples, so the next resume checks their fingerprint)."""
        saved = paths[0] if len(paths) == 1 else ""
        if saved.startswith(SAMPLE_PREFIX) and saved != self.paths[0]:
            raise ValueError(
                f"the pipeline state was saved for the samples {saved} but this run builds {self.paths[0]}: the samples "
                "differ (their count or identity, which the name fingerprints), so the saved progress does not apply. "
                "Resume with the checkpoint's dataset and data settings, or start a new run."
            )
