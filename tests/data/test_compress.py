"""Fixed-period compression on disk matches RankingData's in-memory (user, period) samples."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recforge.data.collate import RankingCollate
from recforge.data.compress import CompressConfig, compress_events
from recforge.data.dataset import Dataset
from recforge.data.pipeline import Pipeline
from recforge.data.ranking import RankingData

DAY = 86400


def random_events(users: int = 40, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, users)
    user = np.repeat(np.arange(users, dtype=np.int64) * 7 + 3, lengths)
    ts = np.concatenate([np.sort(rng.integers(0, 10 * DAY, n)) for n in lengths]).astype(np.int64)
    return pa.table({
        "user_id": user, "item_id": rng.integers(1000, 1100, len(user)), "timestamp": ts,
        "rating": rng.integers(1, 6, len(user)).astype(np.float32),
    })  # fmt: skip


@pytest.mark.parametrize("split", ["train", "test"])
def test_matches_ranking_data(tmp_path, split):
    events = random_events()
    pq.write_table(events, tmp_path / "events.parquet", row_group_size=100)
    cfg = CompressConfig(period_seconds=DAY, max_targets=4, max_history=10_000, split=split, label_columns=("rating",),
                         chunk_rows=97)  # small chunks: users straddle chunk boundaries  # fmt: skip
    counts = compress_events(tmp_path / "events.parquet", tmp_path / "samples.parquet", cfg)
    data = RankingData.from_dataset(Dataset(events, None, {"has_timestamps": True}), ["rating:rating"])
    samples = data.samples(split, DAY, max_targets=4)
    expected = data.batch(samples, torch.arange(len(samples)), max_seq_len=100_000)
    assert counts["samples"] == len(samples) and counts["targets"] == samples.num_targets
    pipe = Pipeline.from_parquet(tmp_path / "samples.parquet").batch(10_000).collate(RankingCollate(("rating",)))
    (got,) = list(pipe)
    got.validate()
    vocab = np.r_[-1, np.array(data.vocab["item_ids"])]
    assert torch.equal(got.seq_offsets, expected.seq_offsets)
    assert got.item_ids.tolist() == vocab[expected.item_ids.numpy()].tolist()
    assert torch.equal(got.timestamps, expected.timestamps)
    assert torch.equal(got.mask.num_targets, expected.mask.num_targets)
    torch.testing.assert_close(got.labels["rating"], expected.labels["tasks"][:, 0], rtol=0, atol=0)


def test_history_cap_and_errors(tmp_path):
    events = random_events(users=5)
    pq.write_table(events, tmp_path / "events.parquet")
    cfg = CompressConfig(max_history=3, split="all")
    compress_events(tmp_path / "events.parquet", tmp_path / "s.parquet", cfg)
    hist = pq.read_table(tmp_path / "s.parquet").column("history_item_ids")
    assert max(len(h) for h in hist.to_pylist()) == 3
    with pytest.raises(ValueError, match="split"):
        CompressConfig(split="dev").check()
    with pytest.raises(ValueError, match="no column"):
        compress_events(tmp_path / "events.parquet", tmp_path / "x.parquet", CompressConfig(label_columns=("clicks",)))
    assert not (tmp_path / "x.parquet").exists()


def test_contextual_tokens_and_coded_items_match_ranking_data(tmp_path):
    import pyarrow.compute as pc

    from recforge.data.transforms import map_ids

    events = random_events(users=12, seed=3)
    pq.write_table(events, tmp_path / "events.parquet")
    cfg = CompressConfig(period_seconds=DAY, max_targets=3, max_history=10_000, split="valid", label_columns=("rating",))
    compress_events(tmp_path / "events.parquet", tmp_path / "samples.parquet", cfg)
    data = RankingData.from_dataset(Dataset(events, None, {"has_timestamps": True}), ["rating:rating"], user_features=["user_id"])
    samples = data.samples("valid", DAY, max_targets=3)
    expected = data.batch(samples, torch.arange(len(samples)), max_seq_len=100_000)
    # RankingData codes items by sorted raw ID and user features by their string form
    item_vocab = np.array(data.vocab["item_ids"], np.int64)
    user_vocab = pa.array([int(v) for v in data.vocab["user_features"]["user_id"]["values"]], pa.int64())

    def user_code(rb):
        return rb.append_column("user_code", pc.add(pc.index_in(rb.column("user_id"), value_set=user_vocab), 1))

    pipe = (
        Pipeline.from_parquet(tmp_path / "samples.parquet")
        .map(map_ids("history_item_ids", item_vocab))
        .map(map_ids("target_item_ids", item_vocab))
        .map(user_code)
        .batch(10_000)
        .collate(RankingCollate(("rating",), context_columns=("user_code",)))
    )
    (got,) = list(pipe)
    got.validate()
    assert torch.equal(got.seq_offsets, expected.seq_offsets)
    for name in ("item_ids", "context_ids", "timestamps"):
        assert torch.equal(got.features[name], expected.features[name]), name
    assert torch.equal(got.mask.num_contextual, expected.mask.num_contextual)
    assert torch.equal(got.mask.num_targets, expected.mask.num_targets)
