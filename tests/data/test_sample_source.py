"""Samples built in memory stream through the pipeline as the same rows in a Parquet file would."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recforge.data.collate import row_ids_of
from recforge.data.parquet_source import ParquetSource, decode_row_ids
from recforge.data.pipeline import Pipeline
from recforge.data.resume import PipelineState
from recforge.data.sample_source import SampleSource


def _rows(seed: int, n: int) -> tuple[pa.Table, np.ndarray]:
    """n rows of random-length lists; row r's values are r * 1000 + position."""
    lengths = np.random.default_rng(seed).integers(1, 30, n)
    offsets = np.r_[0, np.cumsum(lengths)]
    values = np.repeat(np.arange(n) * 1000, lengths) + np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    table = pa.table({"sample": np.arange(n), "item_ids": pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))})
    return table, lengths


def _source(table: pa.Table, lengths: np.ndarray, **kwargs) -> SampleSource:
    return SampleSource("test", table.num_rows, lambda rows: table.take(pa.array(rows)), tokens=lengths,
                        identity=(table.column("sample").to_numpy(),), **kwargs)  # fmt: skip


def _epoch(pipe: Pipeline, stop_after: int | None = None) -> list[np.ndarray]:
    out = []
    for batch in pipe:
        out.append(row_ids_of(batch))
        if stop_after is not None and len(out) == stop_after:
            break
    return out


@pytest.mark.parametrize("worker_mode", ["thread", "process"])
def test_rows_and_order_equal_a_parquet_file_of_the_same_rows(tmp_path, worker_mode) -> None:
    table, lengths = _rows(seed=1, n=1000)
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=64)
    source = _source(table, lengths, group_rows=64)
    assert source.row_group_rows[0].tolist() == ParquetSource(tmp_path / "rows.parquet").row_group_rows[0].tolist()
    kwargs = {"num_workers": 2, "seed": 7, "worker_mode": worker_mode}
    built = list(Pipeline.from_samples(source, **kwargs).shuffle(200).batch(token_budget=150))
    read = list(Pipeline.from_parquet(tmp_path / "rows.parquet", **kwargs).shuffle(200).batch(token_budget=150))
    assert len(built) == len(read) > 10
    for a, b in zip(built, read, strict=True):
        assert a.equals(b)
    _, rows = decode_row_ids(np.concatenate([row_ids_of(b) for b in built]))
    assert np.array_equal(np.sort(rows), np.arange(1000))
    first = built[0]  # every row is what build made for its id
    assert first.column("sample").to_numpy().tolist() == decode_row_ids(row_ids_of(first))[1].tolist()


def test_resume_after_a_partial_epoch_reads_each_row_once(tmp_path) -> None:
    table, lengths = _rows(seed=2, n=700)
    pipe = Pipeline.from_samples(_source(table, lengths, group_rows=50), num_workers=2, seed=3).shuffle(120).batch(32)
    before = _epoch(pipe, stop_after=9)
    state = pipe.state_dict()
    resumed = Pipeline.from_samples(_source(table, lengths, group_rows=50), num_workers=1, seed=3, state=state)
    after = _epoch(resumed.shuffle(120).batch(32))
    _, rows = decode_row_ids(np.concatenate(before + after))
    assert np.array_equal(np.sort(rows), np.arange(700))  # each row exactly once over the crash


def test_ranks_split_by_exact_tokens_or_group_means(tmp_path) -> None:
    table, lengths = _rows(seed=3, n=500)
    exact = _source(table, lengths, group_rows=64)
    shares = []
    for rank in range(3):
        units, keep = PipelineState.fresh(exact).plan(exact, rank, 3, token_column=exact.token_column("item_ids"))
        rows = np.concatenate([np.arange(u.row_group * 64 + u.start, u.row_group * 64 + u.stop)[k] for u, k in zip(units, keep)])
        shares.append(int(lengths[rows].sum()))
    assert max(shares) - min(shares) <= 2 * lengths.max()  # even tokens (within a row at each of two cuts)
    # group means: the very shares of the same rows in a Parquet file (footer means of a list column)
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=64)
    means, parquet = _source(table, lengths, group_rows=64, group_mean_tokens=True), ParquetSource(tmp_path / "rows.parquet")
    for rank in range(3):
        got = PipelineState.fresh(means).plan(means, rank, 3, token_column="item_ids")
        want = PipelineState.fresh(parquet).plan(parquet, rank, 3, token_column="item_ids")
        assert got[0] == want[0] and all(np.array_equal(a, b) for a, b in zip(got[1], want[1], strict=True))


def test_a_state_of_other_samples_is_refused() -> None:
    table, lengths = _rows(seed=4, n=100)
    pipe = Pipeline.from_samples(_source(table, lengths), num_workers=1).batch(10)
    _epoch(pipe, stop_after=2)
    state = pipe.state_dict()
    other, other_lengths = _rows(seed=5, n=100)
    other = other.set_column(0, "sample", pa.array(np.arange(100) + 1))  # same count, other samples
    with pytest.raises(ValueError, match="samples differ"):
        Pipeline.from_samples(_source(other, other_lengths), state=state)
    with pytest.raises(ValueError, match="pipeline state was saved for 1 files"):
        Pipeline.from_samples(_source(table.slice(0, 60), lengths[:60]), state=dict(state, files=[
            dict(state["files"][0], path="old/samples/train-00000.parquet")]))  # fmt: skip


def test_a_legacy_file_state_is_renamed_to_the_samples_so_later_resumes_check_them() -> None:
    table, lengths = _rows(seed=int(np.random.default_rng().integers(100, 10_000)), n=100)
    pipe = Pipeline.from_samples(_source(table, lengths), num_workers=1).batch(10)
    _epoch(pipe, stop_after=2)
    state = pipe.state_dict()
    legacy = dict(state, files=[dict(state["files"][0], path="old/samples/train-00000.parquet")])  # an older run's file
    resumed = Pipeline.from_samples(_source(table, lengths), num_workers=1, state=legacy).batch(10)
    saved = resumed.state_dict()
    assert saved["files"][0]["path"] == _source(table, lengths).paths[0]  # the samples' fingerprint from now on
    other = table.set_column(0, "sample", pa.array(np.arange(100) + 7))  # same count, other samples
    with pytest.raises(ValueError, match="samples differ"):
        Pipeline.from_samples(_source(other, lengths), state=saved)


def test_bad_arguments_are_explained() -> None:
    table, lengths = _rows(seed=6, n=10)
    with pytest.raises(ValueError, match="at least one sample"):
        SampleSource("test", 0, lambda rows: table)
    with pytest.raises(ValueError, match=r"tokens must be \(10,\)"):
        SampleSource("test", 10, lambda rows: table.take(pa.array(rows)), tokens=lengths[:5])
    broken = SampleSource("test", 10, lambda rows: table.slice(0, 1))
    with pytest.raises(RuntimeError, match="returned 1 rows"):
        list(Pipeline.from_samples(broken, num_workers=1).batch(5))
