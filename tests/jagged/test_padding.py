"""Padding a jagged batch to shape buckets: the ladder, the padding sequences' layout, labels named explicitly."""

from __future__ import annotations

import pytest
import torch

from recforge.jagged import AttentionMask, JaggedBatch, offsets_from_lengths
from recforge.jagged.padding import bucket, pad_batch, pad_offsets, pad_rows


def test_bucket_ladder_bounds_the_padding() -> None:
    assert [bucket(n, 1.25, 64) for n in (1, 64, 65, 300)] == [64, 64, 128, 320]
    sizes = {bucket(n, 1.125, 64) for n in range(1, 50_001, 37)}
    for n in range(1, 50_001, 101):
        b = bucket(n, 1.125, 64)
        assert b >= n and b % 64 == 0 and (b <= 1.125 * n + 64 or b == 64), (n, b)
    assert len(sizes) < 60  # a geometric ladder: few sizes over the whole range
    with pytest.raises(ValueError, match="ratio"):
        bucket(5, 0.5, 8)


def test_pad_offsets_layout() -> None:
    offsets = torch.tensor([0, 3, 5])  # the module doc's example: T 5 -> 9, B 2 -> 6, max_seq_len 3
    assert pad_offsets(offsets, 5, 9, 6, 3).tolist() == [0, 3, 5, 8, 9, 9, 9]
    assert pad_offsets(offsets, 5, 5, 2, 3).tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="need 4 sequences"):
        pad_offsets(offsets, 5, 9, 3, 3)


def test_pad_rows_with_a_device_value() -> None:
    values = torch.arange(6).view(3, 2)
    out = pad_rows(values, 5, torch.tensor([7]))
    assert out.shape == (5, 2) and out[3:].eq(7).all() and out[:3].equal(values)
    with pytest.raises(ValueError, match="do not fit"):
        pad_rows(values, 2)


def test_pad_batch_is_a_valid_batch_with_the_real_one_first() -> None:
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 20, (7,), generator=gen)
    total = int(lengths.sum())
    batch = JaggedBatch(offsets_from_lengths(lengths), {"item_ids": torch.randint(1, 50, (total,), generator=gen),
                                                        "timestamps": torch.randint(0, 10**6, (total,), generator=gen)},
                        20, dense={"age": torch.rand(7, generator=gen)},
                        labels={"next_item": torch.randint(1, 50, (total,), generator=gen), "clicked": torch.ones(7)},
                        mask=AttentionMask(num_targets=torch.clamp(lengths, max=2)))  # fmt: skip
    tokens = bucket(total, 1.5, 64)
    out = pad_batch(batch, tokens, 7 + -(-(tokens - total) // 20) + 3, {"next_item": -1, "clicked": 0.0})
    out.validate()
    assert out.num_tokens == tokens and out.seq_offsets[: 8].equal(batch.seq_offsets)
    assert out.lengths[7:].max() <= 20 and int(out.seq_offsets[-1]) == tokens and out.lengths[-3:].eq(0).all()
    assert out.item_ids[:total].equal(batch.item_ids) and out.item_ids[total:].eq(0).all()
    assert out.labels["next_item"][total:].eq(-1).all() and out.labels["clicked"].shape == (out.batch_size,)
    assert out.mask.num_targets[7:].eq(0).all() and out.dense["age"][7:].eq(0).all()
    with pytest.raises(ValueError, match="clicked"):
        pad_batch(batch, tokens, 20, {"next_item": -1})
