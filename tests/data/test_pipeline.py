"""The sample-engine chain: reading, transforms, shuffle, batching, zero-copy collation, prefetch."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from recforge.data.collate import JaggedCollate
from recforge.data.parquet_source import ROW_ID, decode_row_ids
from recforge.data.pipeline import Pipeline, replay
from recforge.data.transforms import dedupe, map_ids, min_length, truncate_lists


def write_samples(directory, files: int = 3, rows: int = 500, row_group: int = 64, seed: int = 0) -> list[np.ndarray]:
    """Sample files: user_id, item_ids (list), timestamps (aligned list), label. Returns per-file lengths."""
    rng = np.random.default_rng(seed)
    all_lengths = []
    for f in range(files):
        lengths = rng.integers(0, 30, rows)
        off = np.r_[0, np.cumsum(lengths)].astype(np.int64)
        table = pa.table({
            "user_id": np.arange(rows, dtype=np.int64) + f * rows,
            "item_ids": pa.LargeListArray.from_arrays(pa.array(off), pa.array(rng.integers(1, 1000, off[-1]))),
            "timestamps": pa.LargeListArray.from_arrays(pa.array(off), pa.array(np.arange(off[-1], dtype=np.int64))),
            "label": rng.random(rows).astype(np.float32),
        })  # fmt: skip
        pq.write_table(table, directory / f"part-{f}.parquet", row_group_size=row_group)
        all_lengths.append(lengths)
    return all_lengths


@pytest.fixture
def sample_dir(tmp_path):
    write_samples(tmp_path)
    return tmp_path


COLLATE = JaggedCollate({"item_ids": "item_ids", "timestamps": "timestamps"}, dense={"user_id": "user_id"}, labels={"label": "label"})


def test_every_row_once_in_order_without_shuffle(sample_dir):
    pipe = Pipeline.from_parquet(sample_dir, num_workers=3).batch(100).collate(COLLATE)
    batches = list(pipe)
    users = torch.cat([b.dense["user_id"] for b in batches])
    assert torch.equal(users, torch.arange(1500))
    assert [b.batch_size for b in batches] == [100] * 15
    for b in batches:
        b.validate()
    files, rows = decode_row_ids(torch.cat([b.dense["row_ids"] for b in batches]).numpy())
    assert np.array_equal(files * 500 + rows, np.arange(1500))
    assert pipe.state.complete


def test_collated_batch_matches_the_rows(sample_dir):
    table = pa.concat_tables([pq.read_table(sample_dir / f"part-{f}.parquet") for f in range(3)])
    batch = next(iter(Pipeline.from_parquet(sample_dir).shuffle(200).batch(50).collate(COLLATE)))
    users = batch.dense["user_id"].numpy()
    expected = table.take(pa.array(users))
    assert batch.item_ids.tolist() == pc.list_flatten(expected.column("item_ids")).to_pylist()
    assert batch.lengths.tolist() == pc.list_value_length(expected.column("item_ids")).to_pylist()
    np.testing.assert_allclose(batch.labels["label"].numpy(), expected.column("label").to_numpy(), rtol=0, atol=0)


def test_collation_is_zero_copy():
    off = pa.array(np.array([0, 2, 5], np.int64))
    values = pa.array(np.arange(5, dtype=np.int64))
    rb = pa.record_batch({"item_ids": pa.LargeListArray.from_arrays(off, values), ROW_ID: pa.array([0, 1], pa.int64())})
    batch = JaggedCollate({"item_ids": "item_ids"})(rb)
    assert batch.item_ids.data_ptr() == values.buffers()[1].address


def test_shuffle_is_seeded_and_complete(sample_dir):
    def users(seed):
        pipe = Pipeline.from_parquet(sample_dir, seed=seed).shuffle(300).batch(64).collate(COLLATE)
        return torch.cat([b.dense["user_id"] for b in pipe]).numpy()

    a, b, c = users(1), users(1), users(2)
    assert sorted(a.tolist()) == list(range(1500))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert not np.array_equal(a, np.arange(1500))


def test_map_filter_take_prefetch(sample_dir):
    pipe = (
        Pipeline.from_parquet(sample_dir, columns=["user_id", "item_ids"], num_workers=2)
        .map(truncate_lists(["item_ids"], 5))
        .filter(min_length("item_ids", 3))
        .batch(32)
        .collate(JaggedCollate({"item_ids": "item_ids"}))
        .prefetch(2)
        .take(4)
    )
    batches = list(pipe)
    assert len(batches) == 4
    for b in batches:
        assert int(b.lengths.min()) >= 3 and int(b.lengths.max()) <= 5
    assert "timestamps" not in batches[0].features  # projection
    assert not pipe.state.complete  # take() stopped early: the rest is unconsumed


def test_truncate_keeps_aligned_lists_aligned():
    off = pa.array(np.array([0, 4, 5], np.int64))
    rb = pa.record_batch({
        "item_ids": pa.LargeListArray.from_arrays(off, pa.array([1, 2, 3, 4, 5])),
        "timestamps": pa.LargeListArray.from_arrays(off, pa.array([10, 20, 30, 40, 50])),
    })  # fmt: skip
    out = truncate_lists(["item_ids", "timestamps"], 2)(rb)
    assert out.column("item_ids").to_pylist() == [[3, 4], [5]]
    assert out.column("timestamps").to_pylist() == [[30, 40], [50]]
    assert truncate_lists(["item_ids"], 2, keep="first")(rb).column("item_ids").to_pylist() == [[1, 2], [5]]


def test_map_ids_and_dedupe():
    rb = pa.record_batch({
        "user_id": pa.array([7, 8, 7], pa.int64()),
        "item_ids": pa.array([[100, 300], [200], [999]], pa.list_(pa.int64())),
    })  # fmt: skip
    mapped = map_ids("item_ids", np.array([100, 200, 300]))(rb)
    assert mapped.column("item_ids").to_pylist() == [[1, 3], [2], [0]]
    assert map_ids("user_id", np.array([8]), default=-1)(rb).column("user_id").to_pylist() == [-1, 1, -1]
    assert dedupe(["user_id"])(rb).column("user_id").to_pylist() == [7, 8]


def test_map_that_drops_row_ids_is_an_error(sample_dir):
    pipe = Pipeline.from_parquet(sample_dir).map(lambda rb: rb.select(["user_id"])).batch(10)
    with pytest.raises(ValueError, match="__row_id__"):
        next(iter(pipe))


def test_errors_in_workers_reach_the_consumer(sample_dir):
    def boom(rb):
        raise RuntimeError("transform failed")

    with pytest.raises(RuntimeError, match="transform failed"):
        list(Pipeline.from_parquet(sample_dir).map(boom).batch(10).prefetch(2))


def test_token_budget_batches(sample_dir):
    budget = 300
    pipe = Pipeline.from_parquet(sample_dir).batch(token_budget=budget, length_column="item_ids").collate(COLLATE)
    batches = list(pipe)
    assert sorted(torch.cat([b.dense["user_id"] for b in batches]).tolist()) == list(range(1500))
    tokens = np.array([b.num_tokens for b in batches])
    assert tokens.max() <= budget  # every row here is shorter than the budget
    assert np.median(tokens[:-1]) >= budget - 30  # batches are filled close to the budget (rows < 30 tokens)
    assert len({b.batch_size for b in batches}) > 1  # the row count varies


def test_token_budget_by_an_integer_length_column(sample_dir):
    """An integer column of per-row token counts cuts the same batches as the list column it counts."""

    def with_counts(rb):
        return rb.append_column("n", pc.list_value_length(rb.column("item_ids")).cast(pa.int64()))

    by_list = [b.column(ROW_ID) for b in Pipeline.from_parquet(sample_dir).batch(token_budget=300, length_column="item_ids")]
    by_count = [b.column(ROW_ID) for b in Pipeline.from_parquet(sample_dir).map(with_counts).batch(token_budget=300, length_column="n")]
    assert len(by_list) > 1 and [c.to_pylist() for c in by_count] == [c.to_pylist() for c in by_list]


def test_replay_cycles_cached_batches(sample_dir):
    cached = list(Pipeline.from_parquet(sample_dir).batch(10).take(3))
    out = list(replay(cached, 7))
    assert len(out) == 7 and out[3] is cached[0]
    with pytest.raises(ValueError, match="at least one batch"):
        list(replay([], 1))


def test_chain_argument_errors(sample_dir):
    pipe = Pipeline.from_parquet(sample_dir)
    with pytest.raises(ValueError, match="exactly one"):
        pipe.batch()
    with pytest.raises(ValueError, match="prefetch"):
        pipe.prefetch(0)
    with pytest.raises(ValueError, match="num_workers"):
        Pipeline.from_parquet(sample_dir, num_workers=0)
    with pytest.raises(ValueError, match="no column"):
        Pipeline.from_parquet(sample_dir, columns=["nope"])
    with pytest.raises(ValueError, match="before collate"):
        pipe.batch(4).collate(COLLATE).map(lambda rb: rb)


def test_next_item_targets():
    from recforge.data.transforms import next_item_targets

    rb = pa.record_batch({"item_ids": pa.array([[1, 2, 3], [4], [5, 6]], pa.list_(pa.int64()))})
    out = next_item_targets()(rb)
    assert out.column("input_ids").to_pylist() == [[1, 2], [], [5]]
    assert out.column("next_item").to_pylist() == [[2, 3], [], [6]]
