"""The canonical on-disk dataset layout every converter writes and every recipe reads.

A dataset is a directory::

    DIR/
      events.parquet   one row per user action, sorted by (user_id, timestamp, source order)
      items.parquet    optional: one row per item with content features
      users.parquet    optional: one row per user with profile features (contextual features)
      dataset.json     name, source, counts and which optional columns exist

``events.parquet`` columns:

    user_id    int64, not null   raw user ID as in the source
    item_id    int64, not null   raw item ID as in the source
    timestamp  int64, nullable   unix seconds; all null when the source has none
    action     string, optional  action type ("click", "buy", ...)
    rating     float32, optional explicit label from the source
    other label columns (float32) are allowed and listed in dataset.json

Rows of one user are contiguous and in the order the user acted, so a user's
sequence is a run of rows; readers rely on this and ``validate_events`` checks it.
``items.parquet`` has an int64 ``item_id`` column plus any feature columns;
``users.parquet`` likewise with ``user_id``.

Writes are atomic: everything goes into a temporary sibling directory that is
renamed into place only when complete, so a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recforge.data.arrow import column_numpy, pc
from recforge.io import atomic_directory, atomic_write_json, check_replaceable

FORMAT_VERSION = 1
EVENTS_FILE = "events.parquet"
ITEMS_FILE = "items.parquet"
USERS_FILE = "users.parquet"
META_FILE = "dataset.json"
DATASET_FILES = (EVENTS_FILE, ITEMS_FILE, USERS_FILE, META_FILE)  # what write_dataset puts in a dataset directory
REQUIRED_EVENT_COLUMNS = {"user_id": pa.int64(), "item_id": pa.int64(), "timestamp": pa.int64()}


@dataclass
class Dataset:
    """A loaded canonical dataset.

    Attributes:
        events: the events table (see module docstring).
        items: the items table, or None when the source has no item features.
        meta: the contents of ``dataset.json``.
        users: the users table, or None when the source has no user features.
    """

    events: pa.Table
    items: pa.Table | None
    meta: dict
    users: pa.Table | None = None

    @property
    def has_timestamps(self) -> bool:
        return bool(self.meta.get("has_timestamps", False))


def validate_events(events: pa.Table, source: str = "events") -> None:
    """Raise ``ValueError`` naming what is wrong when ``events`` breaks the canonical layout."""
    problems = []
    for name, dtype in REQUIRED_EVENT_COLUMNS.items():
        if name not in events.column_names:
            problems.append(f"missing column {name!r}")
        elif events.schema.field(name).type != dtype:
            problems.append(f"column {name!r} has type {events.schema.field(name).type}, expected {dtype}")
    if not problems:
        for name in ("user_id", "item_id"):
            if events.column(name).null_count:
                problems.append(f"column {name!r} has {events.column(name).null_count} null values")
    if not problems and events.num_rows:
        users = column_numpy(events.column("user_id"))
        starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
        if len(np.unique(users[starts])) != len(starts):
            problems.append("rows of one user are not contiguous (sort by user_id, then time)")
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))


def write_dataset(
    out_dir: str | os.PathLike,
    events: pa.Table,
    items: pa.Table | None = None,
    *,
    name: str,
    source: str,
    overwrite: bool = False,
    users: pa.Table | None = None,
) -> Path:
    """Validate and atomically write a canonical dataset directory.

    Args:
        out_dir: target directory; must not exist unless ``overwrite``.
        events: events table in the canonical layout.
        items: optional items table with an int64 ``item_id`` column.
        name: short dataset name recorded in ``dataset.json``.
        source: where the data came from (path or generator description).
        overwrite: replace an existing dataset directory (refused when it holds other files than a
            dataset's: they would be deleted with it).
        users: optional users table with an int64 ``user_id`` column.

    Returns:
        The path written.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; pass --overwrite to replace it")
    check_replaceable(out, DATASET_FILES, "recforge dataset")
    validate_events(events)
    if items is not None and ("item_id" not in items.column_names or items.schema.field("item_id").type != pa.int64()):
        raise ValueError("items table needs an int64 'item_id' column")
    if users is not None and ("user_id" not in users.column_names or users.schema.field("user_id").type != pa.int64()):
        raise ValueError("users table needs an int64 'user_id' column")
    ts = events.column("timestamp")
    label_columns = [c for c in events.column_names if c not in REQUIRED_EVENT_COLUMNS and c != "action"]
    meta = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "source": source,
        "num_events": events.num_rows,
        "num_users": len(pc.unique(events.column("user_id"))),
        "num_items": len(pc.unique(events.column("item_id"))),
        "has_timestamps": ts.null_count < len(ts) if len(ts) else False,
        "has_actions": "action" in events.column_names,
        "label_columns": label_columns,
        "item_feature_columns": [c for c in items.column_names if c != "item_id"] if items is not None else [],
        "user_feature_columns": [c for c in users.column_names if c != "user_id"] if users is not None else [],
    }
    with atomic_directory(out) as tmp:
        pq.write_table(events, tmp / EVENTS_FILE, row_group_size=1 << 20)
        if items is not None:
            pq.write_table(items, tmp / ITEMS_FILE)
        if users is not None:
            pq.write_table(users, tmp / USERS_FILE)
        atomic_write_json(tmp / META_FILE, meta)
    return out


def _read_parquet(path: Path) -> pa.Table:
    try:  # ParquetFile, not read_table: the same table without importing pyarrow.dataset (and pandas), ~0.5-1 s
        with pq.ParquetFile(path) as f:
            return f.read()
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: cannot read Parquet ({err}); the file is corrupt or truncated, re-run `recforge data prepare`") from err


def load_dataset(path: str | os.PathLike) -> Dataset:
    """Read a canonical dataset directory written by ``write_dataset``."""
    root = Path(path)
    if not (root / META_FILE).is_file() or not (root / EVENTS_FILE).is_file():
        raise ValueError(
            f"{root} is not a recforge dataset (no {META_FILE} / {EVENTS_FILE}); "
            f"create one with `recforge data prepare FORMAT SOURCE --out {root}`"
        )
    try:
        meta = json.loads((root / META_FILE).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{root / META_FILE}: not valid JSON ({err}); re-run `recforge data prepare`") from err
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ValueError(f"{root / META_FILE}: dataset format {version} is not supported (need {FORMAT_VERSION})")
    events = _read_parquet(root / EVENTS_FILE)
    items = _read_parquet(root / ITEMS_FILE) if (root / ITEMS_FILE).is_file() else None
    users = _read_parquet(root / USERS_FILE) if (root / USERS_FILE).is_file() else None
    validate_events(events, str(root / EVENTS_FILE))
    return Dataset(events=events, items=items, meta=meta, users=users)
