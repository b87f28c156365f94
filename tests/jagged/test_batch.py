"""Tests for JaggedBatch: construction from Arrow, validation, device moves."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from recforge.jagged.batch import JaggedBatch
from recforge.jagged.mask import AttentionMask


def _random_lists(rng: np.random.Generator, batch: int, max_len: int) -> list[list[int]]:
    lengths = rng.integers(0, max_len + 1, size=batch)
    lengths[0] = max_len  # make the maximum length deterministic
    return [rng.integers(1, 1000, size=n).tolist() for n in lengths]


def _good_batch(max_seq_len: int = 5) -> JaggedBatch:
    offsets = torch.tensor([0, 3, 3, 7], dtype=torch.int64)
    batch = JaggedBatch(
        offsets,
        {"item_ids": torch.randint(1, 50, (7,)), "timestamps": torch.arange(7, dtype=torch.int64)},
        max_seq_len,
        dense={"user_feat": torch.randn(3, 4)},
        labels={"next_item": torch.randint(1, 50, (7,)), "clicked": torch.rand(3)},
        mask=AttentionMask(num_targets=torch.tensor([1, 0, 2]), num_contextual=torch.tensor([0, 0, 1])),
    )
    return batch


# --------------------------------------------------------------------------- from_arrow


def test_from_arrow_values_and_offsets_match_arrow() -> None:
    rng = np.random.default_rng()
    lists = _random_lists(rng, batch=6, max_len=9)
    items = pa.array(lists, type=pa.list_(pa.int64()))
    ts = pa.array([[10 * v for v in row] for row in lists], type=pa.list_(pa.int64()))
    batch = JaggedBatch.from_arrow({"item_ids": items, "timestamps": ts})

    assert batch.seq_offsets.dtype == torch.int64
    np.testing.assert_array_equal(batch.seq_offsets.numpy(), items.offsets.to_numpy())
    np.testing.assert_array_equal(batch.item_ids.numpy(), items.values.to_numpy())
    np.testing.assert_array_equal(batch.timestamps.numpy(), ts.values.to_numpy())
    assert batch.batch_size == 6
    assert batch.num_tokens == sum(map(len, lists))
    assert batch.max_seq_len == 9  # computed from the data
    assert batch.lengths.tolist() == [len(r) for r in lists]
    batch.validate()


def test_from_arrow_explicit_max_seq_len_and_chunked_array() -> None:
    lists = [[1, 2, 3], [], [4]]
    chunked = pa.chunked_array([pa.array(lists[:2], type=pa.list_(pa.int64())), pa.array(lists[2:], type=pa.list_(pa.int64()))])
    batch = JaggedBatch.from_arrow({"item_ids": chunked}, max_seq_len=50)
    assert batch.max_seq_len == 50
    assert batch.seq_offsets.tolist() == [0, 3, 3, 4]
    assert batch.item_ids.tolist() == [1, 2, 3, 4]


def test_from_arrow_sliced_list_array_is_rebased() -> None:
    rng = np.random.default_rng()
    lists = _random_lists(rng, batch=8, max_len=6)
    lists[1] = [7, 8]  # the slice below starts after a non-empty list
    full = pa.array(lists, type=pa.list_(pa.int64()))
    sliced = full.slice(2, 4)
    assert sliced.offsets.to_numpy()[0] != 0  # the case under test: a non-zero first offset
    batch = JaggedBatch.from_arrow({"item_ids": sliced})

    expected = lists[2:6]
    assert batch.seq_offsets[0].item() == 0
    assert batch.lengths.tolist() == [len(r) for r in expected]
    assert batch.item_ids.tolist() == [v for row in expected for v in row]
    batch.validate()


def test_from_arrow_sliced_columns_with_equal_lengths_agree() -> None:
    """Two columns sliced at different places but with the same lengths share offsets after rebasing."""
    a = pa.array([[1], [2, 3], [4]], type=pa.list_(pa.int64())).slice(1, 2)  # [[2,3],[4]]
    b = pa.array([[9, 9, 9], [5, 6], [7]], type=pa.list_(pa.int64())).slice(1, 2)  # [[5,6],[7]]
    batch = JaggedBatch.from_arrow({"item_ids": a, "timestamps": b})
    assert batch.seq_offsets.tolist() == [0, 2, 3]
    assert batch.item_ids.tolist() == [2, 3, 4]
    assert batch.timestamps.tolist() == [5, 6, 7]


def test_from_arrow_mismatched_lengths_raise() -> None:
    items = pa.array([[1, 2], [3]], type=pa.list_(pa.int64()))
    ts = pa.array([[1], [2, 3]], type=pa.list_(pa.int64()))  # same total, different split
    with pytest.raises(ValueError, match="timestamps"):
        JaggedBatch.from_arrow({"item_ids": items, "timestamps": ts})
    ts_short = pa.array([[1, 2]], type=pa.list_(pa.int64()))  # different number of lists
    with pytest.raises(ValueError, match="different lengths"):
        JaggedBatch.from_arrow({"item_ids": items, "timestamps": ts_short})


def test_from_arrow_needs_a_column() -> None:
    with pytest.raises(ValueError, match="at least one column"):
        JaggedBatch.from_arrow({})


# --------------------------------------------------------------------------- validate


def test_validate_passes_on_good_batch() -> None:
    _good_batch().validate()
    # an empty batch (B = 0) is also valid
    JaggedBatch(torch.zeros(1, dtype=torch.int64), {"item_ids": torch.zeros(0, dtype=torch.int64)}, 1).validate()


def test_validate_bad_offsets_dtype() -> None:
    batch = _good_batch()
    batch.seq_offsets = batch.seq_offsets.to(torch.int32)
    with pytest.raises(ValueError, match="1-D int64"):
        batch.validate()


def test_validate_bad_offsets_shape() -> None:
    batch = _good_batch()
    batch.seq_offsets = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match="1-D int64"):
        batch.validate()


def test_validate_nonzero_start() -> None:
    batch = _good_batch()
    batch.seq_offsets = torch.tensor([1, 3, 3, 7])
    with pytest.raises(ValueError, match="start at 0, got 1"):
        batch.validate()


def test_validate_decreasing_offsets() -> None:
    batch = _good_batch()
    batch.seq_offsets = torch.tensor([0, 4, 3, 7])
    with pytest.raises(ValueError, match=r"non-decreasing \(sequence 1\)"):
        batch.validate()


def test_validate_feature_row_count_mismatch() -> None:
    batch = _good_batch()
    batch.features["timestamps"] = torch.arange(6)
    with pytest.raises(ValueError, match="feature 'timestamps' has 6 rows, seq_offsets say 7 tokens"):
        batch.validate()


def test_validate_dense_and_label_row_counts() -> None:
    batch = _good_batch()
    batch.dense["user_feat"] = torch.randn(2, 4)
    batch.labels["next_item"] = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError) as err:
        batch.validate()
    assert "dense feature 'user_feat' has 2 rows" in str(err.value)
    assert "label 'next_item' has 5 rows" in str(err.value)


def test_validate_sequence_longer_than_max_seq_len() -> None:
    batch = _good_batch(max_seq_len=3)
    with pytest.raises(ValueError, match="4 tokens > max_seq_len=3"):
        batch.validate()


def test_validate_missing_item_ids() -> None:
    batch = _good_batch()
    del batch.features["item_ids"]
    with pytest.raises(ValueError, match="must include 'item_ids'"):
        batch.validate()


@pytest.mark.parametrize(
    "num_targets",
    [
        torch.tensor([1, 0]),  # wrong shape
        torch.tensor([1, 0, -1]),  # negative
        torch.tensor([4, 0, 0]),  # more than the sequence length (3)
        torch.tensor([0, 1, 0]),  # the empty sequence cannot have a target
    ],
)
def test_validate_bad_num_targets(num_targets: torch.Tensor) -> None:
    batch = _good_batch()
    batch.mask = AttentionMask(num_targets=num_targets)
    with pytest.raises(ValueError, match="mask.num_targets"):
        batch.validate()


def test_validate_bad_num_contextual() -> None:
    batch = _good_batch()
    batch.mask = AttentionMask(num_contextual=torch.tensor([0, 0, 5]))
    with pytest.raises(ValueError, match="mask.num_contextual"):
        batch.validate()


def test_validate_reports_all_problems_together() -> None:
    batch = _good_batch(max_seq_len=3)
    del batch.features["item_ids"]
    batch.features["timestamps"] = torch.arange(2)
    batch.mask = AttentionMask(num_targets=torch.tensor([9, 9, 9]))
    with pytest.raises(ValueError) as err:
        batch.validate()
    msg = str(err.value)
    assert msg.startswith("invalid JaggedBatch: ")
    for part in ("max_seq_len=3", "'item_ids'", "feature 'timestamps' has 2 rows", "mask.num_targets"):
        assert part in msg


# --------------------------------------------------------------------------- to()


def test_to_cpu_keeps_everything() -> None:
    batch = _good_batch()
    moved = batch.to("cpu")
    assert moved is not batch
    assert torch.equal(moved.seq_offsets, batch.seq_offsets)
    assert moved.max_seq_len == batch.max_seq_len
    for src, dst in ((batch.features, moved.features), (batch.dense, moved.dense), (batch.labels, moved.labels)):
        assert set(src) == set(dst)
        for key in src:
            assert torch.equal(src[key], dst[key])
            assert dst[key].dtype == src[key].dtype
            assert dst[key].device.type == "cpu"
    assert moved.mask.causal == batch.mask.causal
    assert moved.mask.max_attn_len == batch.mask.max_attn_len
    assert torch.equal(moved.mask.num_targets, batch.mask.num_targets)
    assert torch.equal(moved.mask.num_contextual, batch.mask.num_contextual)
    moved.validate()
