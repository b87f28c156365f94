"""Malformed rows are counted and skipped or rejected with file and row; corrupt files name themselves."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recforge.data.bad_rows import RowRules
from recforge.data.pipeline import Pipeline


@pytest.fixture
def dirty(tmp_path):
    table = pa.table({
        "user_id": pa.array([1, None, 3, 4, 5, 6], pa.int64()),
        "item_ids": pa.array([[1, 2], [3], [4, None], [5, 6], [7], [8, 9]], pa.list_(pa.int64())),
        "timestamps": pa.array([[10, 20], [30], [40, 50], [60], [70], [80, 90]], pa.list_(pa.int64())),
        "rating": pa.array(["4", "5", "3", "x", "2", "1.5"], pa.string()),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "dirty.parquet", row_group_size=4)
    return tmp_path / "dirty.parquet"


RULES = {"ids": ("user_id", "item_ids"), "types": {"rating": pa.float32()}, "aligned": ("item_ids", "timestamps")}


def test_skip_counts_each_reason_and_keeps_good_rows(dirty):
    pipe = Pipeline.from_parquet(dirty, rules=RowRules(**RULES, policy="skip")).batch(10)
    (batch,) = list(pipe)
    assert batch.column("user_id").to_pylist() == [1, 5, 6]
    assert batch.column("rating").type == pa.float32()
    assert batch.column("rating").to_pylist() == [4.0, 2.0, 1.5]
    report = pipe.bad_rows
    assert report.total == 3
    assert report.counts == {
        "null in ID column 'user_id'": 1,
        "null in ID column 'item_ids'": 1,
        "column 'rating' is not float": 1,
    }
    assert any(e.startswith(f"{dirty} row 1: null in ID column 'user_id'") for e in report.examples)
    assert any(e.startswith(f"{dirty} row 3: column 'rating'") for e in report.examples)
    assert pipe.state.complete  # skipped rows count as consumed once the epoch is read


def test_length_disagreement(tmp_path):
    table = pa.table({
        "item_ids": pa.array([[1, 2], [3]], pa.list_(pa.int64())),
        "timestamps": pa.array([[1, 2], [3, 4]], pa.list_(pa.int64())),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "a.parquet")
    rules = RowRules(aligned=("item_ids", "timestamps"))
    pipe = Pipeline.from_parquet(tmp_path, rules=rules).batch(10)
    assert [b.num_rows for b in pipe] == [1]
    assert pipe.bad_rows.examples == [f"{tmp_path / 'a.parquet'} row 1: list lengths of ['item_ids', 'timestamps'] disagree"]


def test_raise_policy_names_file_and_row(dirty):
    pipe = Pipeline.from_parquet(dirty, rules=RowRules(**RULES, policy="raise")).batch(10)
    with pytest.raises(ValueError, match=rf"malformed row {dirty} row 1: null in ID column 'user_id'"):
        list(pipe)


def test_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        RowRules(policy="ignore")


def test_truncated_file_is_named(tmp_path):
    pq.write_table(pa.table({"item_ids": pa.array([[1]] * 100, pa.list_(pa.int64()))}), tmp_path / "ok.parquet")
    raw = (tmp_path / "ok.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=r"cut\.parquet: cannot read Parquet.*truncated or corrupt"):
        Pipeline.from_parquet(tmp_path)


def test_corrupt_data_page_is_named(tmp_path):
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"x": rng.integers(0, 1 << 40, 20000)}), tmp_path / "bad.parquet", compression="snappy")
    raw = bytearray((tmp_path / "bad.parquet").read_bytes())
    raw[200:60000] = bytes(len(raw[200:60000]))  # zero the data pages, keep the footer
    (tmp_path / "bad.parquet").write_bytes(bytes(raw))
    pipe = Pipeline.from_parquet(tmp_path).batch(1000)
    with pytest.raises(ValueError, match=r"bad\.parquet: row group 0 cannot be decoded"):
        list(pipe)


def test_missing_path():
    with pytest.raises(ValueError, match="no such Parquet"):
        Pipeline.from_parquet("/nonexistent/x.parquet")


def test_files_with_different_column_types(tmp_path):
    pq.write_table(pa.table({"item_ids": pa.array([[1]], pa.list_(pa.int64())), "r": pa.array([1.0])}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"item_ids": pa.array([[2]], pa.list_(pa.int64())), "r": pa.array(["2"])}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet: column 'r' is string but double in .*a\.parquet"):
        Pipeline.from_parquet(tmp_path)
    pipe = Pipeline.from_parquet(tmp_path, rules=RowRules(types={"r": pa.float64()})).batch(10)
    assert [b.column("r").to_pylist() for b in pipe] == [[1.0, 2.0]]
