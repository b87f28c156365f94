"""Malformed sample rows: find them vectorised, then count and skip or reject them per a policy.

A row is malformed when an ID column is null (or holds a null element), a column cannot
be cast to its expected type (a string ``"abc"`` where an int64 is expected), or list
columns that must align (``item_ids`` and ``timestamps``) have different lengths.
``policy="skip"`` drops such rows and counts them by reason; ``policy="raise"`` raises a
``ValueError`` naming the file, the row and what is wrong. Either way every message and
example names ``path row N``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from recforge.data.arrow import pc  # pyarrow.compute, imported on first use
from recforge.data.parquet_source import ROW_ID, decode_row_ids

POLICIES = ("skip", "raise")
_INT_RE = r"^\s*[-+]?\d+\s*$"
_FLOAT_RE = r"^\s*[-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?|nan|NaN|inf|-inf)\s*$"


@dataclass(frozen=True)
class RowRules:
    """What a well-formed sample row looks like.

    Attributes:
        ids: columns (scalar or list) that must contain no nulls.
        types: column -> expected Arrow type; values are cast (safely) to it.
        aligned: list columns whose per-row lengths must be equal.
        policy: ``skip`` (count and drop) or ``raise``.
    """

    ids: tuple[str, ...] = ()
    types: dict[str, pa.DataType] = field(default_factory=dict)
    aligned: tuple[str, ...] = ()
    policy: str = "skip"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"bad-row policy {self.policy!r}: expected one of {POLICIES}")


class BadRowReport:
    """Counts of skipped rows by reason, and the first few examples (thread-safe enough: GIL-atomic updates)."""

    def __init__(self, max_examples: int = 10):
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []
        self.max_examples = max_examples

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, reason: str, where: list[str]) -> None:
        self.counts[reason] += len(where)
        room = self.max_examples - len(self.examples)
        self.examples.extend(f"{w}: {reason}" for w in where[:room])

    def merge(self, other: BadRowReport) -> None:
        """Add another report's counts and examples (a worker's report for one task)."""
        self.counts.update(other.counts)
        self.examples.extend(other.examples[: max(self.max_examples - len(self.examples), 0)])

    def __repr__(self) -> str:
        return f"BadRowReport(total={self.total}, counts={dict(self.counts)}, examples={self.examples[:3]})"


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _row_of_elements(col: pa.Array, bad_elements: np.ndarray) -> np.ndarray:
    """Rows (bool, len(col)) containing at least one flagged element of a list column."""
    parents = pc.list_parent_indices(col).to_numpy()
    rows = np.zeros(len(col), bool)
    rows[parents[bad_elements]] = True
    return rows


def _null_rows(col: pa.Array) -> np.ndarray:
    bad = col.is_null().to_numpy(zero_copy_only=False)
    if _is_list(col.type):
        flat_null = pc.list_flatten(col).is_null().to_numpy(zero_copy_only=False)
        bad = bad | _row_of_elements(col, flat_null)
    return bad


def _uncastable_rows(col: pa.Array, target: pa.DataType) -> tuple[np.ndarray, pa.Array | None]:
    """(bad rows, cast column or None when the column as a whole cannot be repaired)."""
    try:
        return np.zeros(len(col), bool), col.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    elem_target = target.value_type if _is_list(target) else target
    flat = pc.list_flatten(col) if _is_list(col.type) else col
    if not (pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type)):
        return np.ones(len(col), bool), None
    pattern = _INT_RE if pa.types.is_integer(elem_target) else _FLOAT_RE if pa.types.is_floating(elem_target) else None
    if pattern is None:
        return np.ones(len(col), bool), None
    ok = pc.fill_null(pc.match_substring_regex(flat, pattern), True).to_numpy(zero_copy_only=False)
    bad = _row_of_elements(col, ~ok) if _is_list(col.type) else ~ok
    return bad, None


def check_rows(batch: pa.RecordBatch, rules: RowRules, report: BadRowReport, paths: list[str]) -> pa.RecordBatch:
    """Apply ``rules`` to a batch that carries ``__row_id__``; return the good rows, cast.

    Raises:
        ValueError: ``policy="raise"`` and a row is malformed, or a column is missing or of a
            type that cannot hold the expected values at all.
    """
    n = batch.num_rows
    bad = np.zeros(n, bool)
    reasons: list[tuple[str, np.ndarray]] = []
    columns = {name: batch.column(name) for name in batch.schema.names}
    for name in {*rules.ids, *rules.types, *rules.aligned}:
        if name not in columns:
            raise ValueError(f"{paths[0] if len(paths) == 1 else 'source'}: no column {name!r} (have {batch.schema.names})")
    for name, target in rules.types.items():
        col_bad, cast = _uncastable_rows(columns[name], target)
        if col_bad.any():
            reasons.append((f"column {name!r} is not {target}", col_bad))
            bad |= col_bad
        if cast is not None:
            columns[name] = cast
    for name in rules.ids:
        col_bad = _null_rows(columns[name]) & ~bad
        if col_bad.any():
            reasons.append((f"null in ID column {name!r}", col_bad))
            bad |= col_bad
    if len(rules.aligned) > 1:
        lengths = [pc.fill_null(pc.list_value_length(columns[c]), -1).to_numpy(zero_copy_only=False) for c in rules.aligned]
        col_bad = np.zeros(n, bool)
        for other in lengths[1:]:
            col_bad |= other != lengths[0]
        col_bad &= ~bad
        if col_bad.any():
            reasons.append((f"list lengths of {list(rules.aligned)} disagree", col_bad))
            bad |= col_bad
    if bad.any():
        row_ids = batch.column(ROW_ID).to_numpy()
        if rules.policy == "raise":  # report the first malformed row of the batch
            reasons.sort(key=lambda r: int(np.argmax(r[1])))
        for reason, rows in reasons:
            files, in_file = decode_row_ids(row_ids[rows])
            where = [f"{paths[int(f)]} row {int(r)}" for f, r in zip(files[:10], in_file[:10], strict=True)]
            if rules.policy == "raise":
                raise ValueError(f"malformed row {where[0]}: {reason} (policy='raise'; use policy='skip' to drop such rows)")
            report.counts[reason] += int(rows.sum()) - len(where)
            report.add(reason, where)
    if not bad.any():
        if all(columns[c] is batch.column(c) for c in columns):
            return batch
        return pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
    # drop bad rows first; the good rows of a column that failed to cast as a whole cast now
    out = pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns)).filter(pa.array(~bad))
    return pa.RecordBatch.from_arrays(
        [out.column(c).cast(rules.types[c]) if c in rules.types else out.column(c) for c in out.schema.names],
        names=out.schema.names,
    )
