"""Jagged helpers against plain per-sequence Python loops."""

from __future__ import annotations

import pytest
import torch
from _oracles import offsets_of, random_lengths

from recforge.jagged import gather_sequences, jagged_to_padded, padded_to_jagged, positions_in_sequence, trim_sequences
from recforge.jagged.index import lengths_from_offsets, offsets_from_lengths, padding_index, sequence_ids

SEEDS = [0, 1, 2, 3]


def _case(seed: int, batch: int = 7, max_len: int = 6) -> tuple[list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, batch, max_len)
    return lengths, offsets_of(lengths)


def _padded_ref(values: torch.Tensor, lengths: list[int], max_len: int, pad: float) -> torch.Tensor:
    out = torch.full((len(lengths), max_len, *values.shape[1:]), pad, dtype=values.dtype)
    start = 0
    for b, n in enumerate(lengths):
        for p in range(n):
            out[b, p] = values[start + p]
        start += n
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_lengths_offsets_sequence_ids(seed: int) -> None:
    lengths, offsets = _case(seed)
    assert lengths_from_offsets(offsets).tolist() == lengths
    assert offsets_from_lengths(torch.tensor(lengths)).tolist() == offsets.tolist()
    expected = [b for b, n in enumerate(lengths) for _ in range(n)]
    assert sequence_ids(offsets).tolist() == expected
    assert sequence_ids(offsets, sum(lengths)).tolist() == expected


@pytest.mark.parametrize("seed", SEEDS)
def test_positions_in_sequence(seed: int) -> None:
    lengths, offsets = _case(seed)
    expected = [p for n in lengths for p in range(n)]
    assert positions_in_sequence(offsets).tolist() == expected
    assert positions_in_sequence(offsets, sum(lengths)).tolist() == expected
    assert positions_in_sequence(offsets).dtype == torch.int64


def test_positions_in_sequence_all_empty() -> None:
    assert positions_in_sequence(torch.zeros(4, dtype=torch.int64)).tolist() == []
    assert positions_in_sequence(torch.zeros(1, dtype=torch.int64)).tolist() == []


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("drop_last", [0, 1, 3, 10])
@pytest.mark.parametrize("keep_last", [None, 0, 1, 4])
def test_trim_sequences(seed: int, drop_last: int, keep_last: int | None) -> None:
    lengths, offsets = _case(seed)
    exp_index, exp_lengths = [], []
    start = 0
    for n in lengths:
        end = start + n - min(n, drop_last)
        lo = start if keep_last is None else max(start, end - keep_last)
        exp_index.extend(range(lo, end))
        exp_lengths.append(end - lo)
        start += n
    index, new_offsets = trim_sequences(offsets, drop_last=drop_last, keep_last=keep_last)
    assert index.tolist() == exp_index
    assert new_offsets.tolist() == offsets_of(exp_lengths).tolist()
    assert index.dtype == torch.int64 and new_offsets.dtype == torch.int64


@pytest.mark.parametrize("seed", SEEDS)
def test_gather_sequences(seed: int) -> None:
    lengths, offsets = _case(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    rows = torch.randint(0, len(lengths), (9,), generator=gen)  # any order, with repeats
    exp_index = []
    for r in rows.tolist():
        exp_index.extend(range(int(offsets[r]), int(offsets[r + 1])))
    index, new_offsets = gather_sequences(offsets, rows)
    assert index.tolist() == exp_index
    assert new_offsets.tolist() == offsets_of([lengths[r] for r in rows.tolist()]).tolist()


def test_gather_sequences_no_rows() -> None:
    index, new_offsets = gather_sequences(offsets_of([2, 0, 3]), torch.zeros(0, dtype=torch.int64))
    assert index.tolist() == [] and new_offsets.tolist() == [0]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("extra", [0, 2])
@pytest.mark.parametrize("trailing", [(), (3,), (2, 3)])
def test_jagged_padded_round_trip(seed: int, extra: int, trailing: tuple[int, ...]) -> None:
    lengths, offsets = _case(seed)
    max_len = max(lengths) + extra
    torch.manual_seed(seed)
    values = torch.randn(sum(lengths), *trailing, dtype=torch.float64)
    expected = _padded_ref(values, lengths, max_len, pad=-7.5)
    padded = jagged_to_padded(values, offsets, max_len, pad_value=-7.5)
    torch.testing.assert_close(padded, expected, rtol=0, atol=0)
    torch.testing.assert_close(jagged_to_padded(values, offsets, max_len), _padded_ref(values, lengths, max_len, 0.0))
    torch.testing.assert_close(padded_to_jagged(padded, offsets), values, rtol=0, atol=0)
    torch.testing.assert_close(padded_to_jagged(padded, offsets, sum(lengths)), values, rtol=0, atol=0)


def test_jagged_padded_gradients() -> None:
    lengths = [3, 0, 1, 4]
    offsets = offsets_of(lengths)
    torch.manual_seed(0)
    values = torch.randn(8, 2, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 5, 2, dtype=torch.float64)
    (jagged_to_padded(values, offsets, 5) * weight).sum().backward()
    expected = padded_to_jagged(weight, offsets)
    torch.testing.assert_close(values.grad, expected, rtol=0, atol=0)


def _padding_index_ref(lengths: list[int]) -> tuple[list[int], list[int]]:
    return [b for b, n in enumerate(lengths) for _ in range(n)], [p for n in lengths for p in range(n)]


def _check_padding_index(offsets: torch.Tensor) -> None:
    lengths = lengths_from_offsets(offsets).tolist()
    seq, pos = padding_index(offsets, int(offsets[-1]))
    assert (seq.tolist(), pos.tolist()) == _padding_index_ref(lengths)


def test_padding_index_cache_hit_is_correct() -> None:
    offsets = offsets_of([2, 0, 3])
    first = padding_index(offsets, 5)
    second = padding_index(offsets, 5)
    assert first[0] is second[0] and first[1] is second[1]  # the cache is used for the same tensor
    _check_padding_index(offsets)


def test_padding_index_cache_new_tensor_same_shape() -> None:
    a = offsets_of([2, 0, 3])
    _check_padding_index(a)
    b = offsets_of([1, 3, 1])  # same shape and total, different boundaries
    _check_padding_index(b)
    _check_padding_index(a)  # and back
    values = torch.arange(5.0)
    torch.testing.assert_close(jagged_to_padded(values, b, 3), _padded_ref(values, [1, 3, 1], 3, 0.0))


@pytest.mark.parametrize(
    "modify",
    [
        lambda o: o.copy_(offsets_of([1, 3, 1])),
        lambda o: o.__setitem__(1, 1),
        lambda o: o[1:3].sub_(1),  # through a view
        lambda o: o.index_fill_(0, torch.tensor([1, 2]), 4),
    ],
    ids=["copy_", "setitem", "view_sub_", "index_fill_"],
)
def test_padding_index_cache_in_place_modification(modify) -> None:
    offsets = offsets_of([2, 0, 3])
    values = torch.arange(5.0)
    before = jagged_to_padded(values, offsets, 4)  # fills the cache
    torch.testing.assert_close(before, _padded_ref(values, [2, 0, 3], 4, 0.0))
    modify(offsets)
    lengths = lengths_from_offsets(offsets).tolist()
    assert lengths != [2, 0, 3] and sum(lengths) == 5
    _check_padding_index(offsets)
    torch.testing.assert_close(jagged_to_padded(values, offsets, 4), _padded_ref(values, lengths, 4, 0.0))
    torch.testing.assert_close(padded_to_jagged(_padded_ref(values, lengths, 4, 0.0), offsets), values)


def test_padding_index_cache_different_total() -> None:
    offsets = offsets_of([2, 3])
    seq, pos = padding_index(offsets, 5)
    assert seq.numel() == 5
    seq, pos = padding_index(offsets, 5)
    other = offsets_of([2, 3, 1])
    assert padding_index(other, 6)[0].tolist() == [0, 0, 1, 1, 1, 2]


def test_jagged_to_padded_under_inference_mode() -> None:
    with torch.inference_mode():
        offsets = offsets_of([2, 0, 3])
        values = torch.arange(5.0)
        padded = jagged_to_padded(values, offsets, 3)
    torch.testing.assert_close(padded, _padded_ref(values, [2, 0, 3], 3, 0.0))
