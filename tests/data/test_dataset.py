"""Tests for the canonical dataset layout: write/load, validation, error messages."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recforge.data.dataset import (
    EVENTS_FILE,
    FORMAT_VERSION,
    ITEMS_FILE,
    META_FILE,
    load_dataset,
    validate_events,
    write_dataset,
)


def _events(num_users: int = 6, seed: int | None = None) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 8, size=num_users)
    users = np.repeat(rng.permutation(np.arange(100, 100 + 3 * num_users, 3))[:num_users], lengths)
    n = len(users)
    return pa.table(
        {
            "user_id": pa.array(users, pa.int64()),
            "item_id": pa.array(rng.integers(1, 50, size=n), pa.int64()),
            "timestamp": pa.array(np.sort(rng.integers(1_600_000_000, 1_700_000_000, size=n)), pa.int64()),
            "action": pa.array(rng.choice(["view", "buy"], size=n).tolist(), pa.string()),
            "rating": pa.array(rng.random(n).astype(np.float32), pa.float32()),
        }
    )


def _items(events: pa.Table) -> pa.Table:
    ids = np.unique(events.column("item_id").to_numpy())
    return pa.table({"item_id": pa.array(ids, pa.int64()), "title": pa.array([f"item {i}" for i in ids])})


def test_round_trip(tmp_path: Path) -> None:
    events = _events()
    items = _items(events)
    out = write_dataset(tmp_path / "ds", events, items, name="toy", source="unit test")
    assert out == tmp_path / "ds"
    assert sorted(p.name for p in out.iterdir()) == sorted([EVENTS_FILE, ITEMS_FILE, META_FILE])
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]  # no temporary directory left behind

    ds = load_dataset(out)
    assert ds.events.equals(events)
    assert ds.items is not None and ds.items.equals(items)
    meta = ds.meta
    assert meta == json.loads((out / META_FILE).read_text())
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["name"] == "toy" and meta["source"] == "unit test"
    assert meta["num_events"] == events.num_rows
    assert meta["num_users"] == len(set(events.column("user_id").to_pylist()))
    assert meta["num_items"] == len(set(events.column("item_id").to_pylist()))
    assert meta["has_timestamps"] is True and ds.has_timestamps
    assert meta["has_actions"] is True
    assert meta["label_columns"] == ["rating"]
    assert meta["item_feature_columns"] == ["title"]


def test_round_trip_without_items_or_timestamps(tmp_path: Path) -> None:
    events = _events().select(["user_id", "item_id", "timestamp"])
    events = events.set_column(2, "timestamp", pa.nulls(events.num_rows, pa.int64()))
    ds = load_dataset(write_dataset(tmp_path / "ds", events, name="toy", source="x"))
    assert ds.items is None
    assert not ds.has_timestamps
    assert ds.meta["has_actions"] is False
    assert ds.meta["label_columns"] == [] and ds.meta["item_feature_columns"] == []
    assert ds.events.equals(events)


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    first, second = _events(seed=1), _events(num_users=3, seed=2)
    out = write_dataset(tmp_path / "ds", first, name="one", source="x")
    with pytest.raises(ValueError, match="already exists; pass --overwrite"):
        write_dataset(out, second, name="two", source="x")
    assert load_dataset(out).meta["name"] == "one"  # untouched
    write_dataset(out, second, name="two", source="x", overwrite=True)
    ds = load_dataset(out)
    assert ds.meta["name"] == "two" and ds.events.equals(second)
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]


def test_invalid_events_write_nothing(tmp_path: Path) -> None:
    events = _events().drop_columns(["user_id"])
    with pytest.raises(ValueError, match="missing column 'user_id'"):
        write_dataset(tmp_path / "ds", events, name="bad", source="x")
    assert list(tmp_path.iterdir()) == []


def test_items_need_int64_item_id(tmp_path: Path) -> None:
    events = _events()
    items = _items(events).cast(pa.schema([("item_id", pa.int32()), ("title", pa.string())]))
    with pytest.raises(ValueError, match="int64 'item_id'"):
        write_dataset(tmp_path / "ds", events, items, name="bad", source="x")
    with pytest.raises(ValueError, match="int64 'item_id'"):
        write_dataset(tmp_path / "ds", events, pa.table({"title": ["a"]}), name="bad", source="x")
    assert not (tmp_path / "ds").exists()


# --------------------------------------------------------------------------- validate_events


def test_validate_events_accepts_good_table() -> None:
    validate_events(_events())
    validate_events(_events().slice(0, 0))


@pytest.mark.parametrize("column", ["user_id", "item_id", "timestamp"])
def test_validate_events_missing_column(column: str) -> None:
    with pytest.raises(ValueError, match=f"events: missing column '{column}'"):
        validate_events(_events().drop_columns([column]))


def test_validate_events_wrong_types_all_reported() -> None:
    events = _events()
    events = events.set_column(0, "user_id", events.column("user_id").cast(pa.int32()))
    events = events.set_column(2, "timestamp", events.column("timestamp").cast(pa.float64()))
    with pytest.raises(ValueError) as err:
        validate_events(events, source="my.parquet")
    msg = str(err.value)
    assert msg.startswith("my.parquet: ")
    assert "column 'user_id' has type int32, expected int64" in msg
    assert "column 'timestamp' has type double, expected int64" in msg


@pytest.mark.parametrize("column", ["user_id", "item_id"])
def test_validate_events_null_ids(column: str) -> None:
    events = _events()
    values = events.column(column).to_pylist()
    values[0] = values[-1] = None
    events = events.set_column(events.column_names.index(column), column, pa.array(values, pa.int64()))
    with pytest.raises(ValueError, match=f"column '{column}' has 2 null values"):
        validate_events(events)


def test_validate_events_null_timestamps_allowed() -> None:
    events = _events()
    events = events.set_column(2, "timestamp", pa.nulls(events.num_rows, pa.int64()))
    validate_events(events)


def test_validate_events_non_contiguous_users() -> None:
    events = pa.table(
        {
            "user_id": pa.array([1, 1, 2, 1], pa.int64()),
            "item_id": pa.array([1, 2, 3, 4], pa.int64()),
            "timestamp": pa.array([1, 2, 3, 4], pa.int64()),
        }
    )
    with pytest.raises(ValueError, match="not contiguous"):
        validate_events(events)
    # contiguous but unsorted users are fine
    validate_events(events.take([0, 1, 3, 2]))


# --------------------------------------------------------------------------- load_dataset errors


def test_load_non_dataset_directory(tmp_path: Path) -> None:
    (tmp_path / "stuff.txt").write_text("hello")
    with pytest.raises(ValueError) as err:
        load_dataset(tmp_path)
    msg = str(err.value)
    assert str(tmp_path) in msg and "is not a recforge dataset" in msg
    assert "recforge data prepare" in msg
    with pytest.raises(ValueError, match="recforge data prepare"):
        load_dataset(tmp_path / "missing")


def test_load_unsupported_format_version(tmp_path: Path) -> None:
    out = write_dataset(tmp_path / "ds", _events(), name="x", source="x")
    meta = json.loads((out / META_FILE).read_text())
    meta["format_version"] = FORMAT_VERSION + 1
    (out / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not supported"):
        load_dataset(out)


def test_load_corrupt_events_file_names_it(tmp_path: Path) -> None:
    out = write_dataset(tmp_path / "ds", _events(), name="x", source="x")
    (out / EVENTS_FILE).write_bytes(b"this is not a parquet file" * 10)
    with pytest.raises(ValueError) as err:
        load_dataset(out)
    assert str(out / EVENTS_FILE) in str(err.value)
    assert "recforge data prepare" in str(err.value)


def test_load_events_with_wrong_schema_names_the_file(tmp_path: Path) -> None:
    out = write_dataset(tmp_path / "ds", _events(), name="x", source="x")
    pq.write_table(pa.table({"user_id": pa.array([1], pa.int32())}), out / EVENTS_FILE)
    with pytest.raises(ValueError) as err:
        load_dataset(out)
    assert str(out / EVENTS_FILE) in str(err.value)
    assert "missing column 'item_id'" in str(err.value)


def _corrupt_body(path: Path) -> None:
    """Overwrite the first half of a Parquet file (keeping magic bytes and footer intact)."""
    data = bytearray(path.read_bytes())
    data[4 : len(data) // 2] = b"\xab" * (len(data) // 2 - 4)
    path.write_bytes(bytes(data))


def test_load_corrupt_events_body_names_the_file(tmp_path: Path) -> None:
    out = write_dataset(tmp_path / "ds", _events(num_users=200, seed=0), name="x", source="x")
    _corrupt_body(out / EVENTS_FILE)
    with pytest.raises(ValueError) as err:
        load_dataset(out)
    assert EVENTS_FILE in str(err.value)


def test_load_corrupt_meta_names_the_file(tmp_path: Path) -> None:
    out = write_dataset(tmp_path / "ds", _events(), name="x", source="x")
    (out / META_FILE).write_text("{not json")
    with pytest.raises(ValueError) as err:
        load_dataset(out)
    assert META_FILE in str(err.value)
