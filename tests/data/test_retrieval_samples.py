"""Retrieval samples written to Parquet and read by the pipeline equal UserSequences.training_batch."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from recforge.data.dataset import Dataset
from recforge.data.parquet_source import decode_row_ids
from recforge.data.retrieval_samples import retrieval_pipeline, write_retrieval_samples
from recforge.data.sequences import UserSequences


def sequences(with_timestamps: bool) -> UserSequences:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 50)
    user = np.repeat(np.arange(50, dtype=np.int64) * 3, lengths)
    ts = np.arange(len(user), dtype=np.int64) * 10
    events = pa.table({"user_id": user, "item_id": rng.integers(500, 600, len(user)),
                       "timestamp": pa.array(ts if with_timestamps else [None] * len(user), pa.int64())})  # fmt: skip
    return UserSequences.from_dataset(Dataset(events, None, {"has_timestamps": with_timestamps}))


@pytest.mark.parametrize("with_timestamps", [True, False])
def test_pipeline_batches_equal_training_batch(tmp_path, with_timestamps):
    seqs = sequences(with_timestamps)
    samples = seqs.training_samples(holdout=1, max_seq_len=8, windows="all")
    write_retrieval_samples(seqs, samples, 8, tmp_path / "train.parquet", row_group_size=64)
    pipe = retrieval_pipeline(tmp_path / "train.parquet", 8, 32, timestamps=with_timestamps, shuffle_rows=100)
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
