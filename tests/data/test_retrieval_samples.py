"""Retrieval samples streamed by the pipeline (built in memory, or written to Parquet) equal UserSequences.training_batch."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from recforge.data.dataset import Dataset
from recforge.data.parquet_source import decode_row_ids
from recforge.data.retrieval_samples import retrieval_pipeline, retrieval_sample_source, write_retrieval_samples
from recforge.data.sequences import UserSequences


def sequences(with_timestamps: bool) -> UserSequences:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 50)
    user = np.repeat(np.arange(50, dtype=np.int64) * 3, lengths)
    ts = np.arange(len(user), dtype=np.int64) * 10
    events = pa.table({"user_id": user, "item_id": rng.integers(500, 600, len(user)),
                       "timestamp": pa.array(ts if with_timestamps else [None] * len(user), pa.int64())})  # fmt: skip
    return UserSequences.from_dataset(Dataset(events, None, {"has_timestamps": with_timestamps}))


@pytest.mark.parametrize(("with_timestamps", "rows"), [(True, "memory"), (False, "memory"), (True, "file")])
def test_pipeline_batches_equal_training_batch(tmp_path, with_timestamps, rows):
    seqs = sequences(with_timestamps)
    samples = seqs.training_samples(holdout=1, max_seq_len=8, windows="all")
    if rows == "file":
        source = write_retrieval_samples(seqs, samples, 8, tmp_path / "train.parquet", row_group_size=64)
    else:
        source = retrieval_sample_source(seqs, samples, 8)
    pipe = retrieval_pipeline(source, 8, 32, timestamps=with_timestamps, shuffle_rows=100)
    seen = []
    for batch in pipe:
        batch.validate()
        _, rows = decode_row_ids(batch.dense["row_ids"].numpy())
        expected = seqs.training_batch(samples[torch.from_numpy(rows)], 8)
        assert torch.equal(batch.seq_offsets, expected.seq_offsets)
        assert torch.equal(batch.item_ids, expected.item_ids)
        assert torch.equal(batch.labels["next_item"], expected.labels["next_item"])
        if with_timestamps:
            assert torch.equal(batch.timestamps, expected.timestamps)
        else:
            assert batch.timestamps is None
        seen.append(rows)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(samples.shape[0]))


def test_bad_samples_shape(tmp_path):
    with pytest.raises(ValueError, match=r"\(S, 2\)"):
        write_retrieval_samples(sequences(True), torch.zeros(3, dtype=torch.int64), 8, tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"\(S, 2\)"):
        retrieval_sample_source(sequences(True), torch.zeros(3, dtype=torch.int64), 8)


@pytest.mark.parametrize("token_budget", [0, 60])
def test_memory_rows_give_the_batches_of_the_same_rows_on_disk(tmp_path, token_budget):
    """Groups of 8192 rows, as the file's row groups: the same seed gives the very same batches in the
    same order, whether the rows are built in memory or read from Parquet."""
    seqs = sequences(True)
    samples = seqs.training_samples(holdout=1, max_seq_len=8, windows="all")
    path = write_retrieval_samples(seqs, samples, 8, tmp_path / "train.parquet")
    kwargs = {"timestamps": True, "shuffle_rows": 40, "seed": 5, "token_budget": token_budget, "num_workers": 2}
    on_disk = list(retrieval_pipeline(path, 8, 16, **kwargs))
    in_memory = list(retrieval_pipeline(retrieval_sample_source(seqs, samples, 8), 8, 16, **kwargs))
    assert len(on_disk) == len(in_memory) > 3
    for a, b in zip(on_disk, in_memory, strict=True):
        assert torch.equal(a.dense["row_ids"], b.dense["row_ids"])
        assert torch.equal(a.item_ids, b.item_ids) and torch.equal(a.timestamps, b.timestamps)
        assert torch.equal(a.labels["next_item"], b.labels["next_item"])
