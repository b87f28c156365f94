"""AttentionMask.dense against an independent per-element definition."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _oracles import dense_ref, offsets_of, random_lengths, random_segments, random_split

from recforge.jagged import AttentionMask


def _case(seed: int, batch: int = 8, max_len: int = 7):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, batch, max_len)
    contextual, targets = random_split(gen, lengths)
    return lengths, contextual, targets


def test_oracle_hand_written_example() -> None:
    """The oracle itself, on one sequence: n = 6, 1 contextual, 3 history, 2 targets, max_len 7."""
    o, x = 1, 0
    expected = [
        # keys: c  h  h  h  t  t  pad
        [o, x, x, x, x, x, x],  # contextual
        [o, o, x, x, x, x, x],  # history 1
        [o, o, o, x, x, x, x],  # history 2
        [o, o, o, o, x, x, x],  # history 3
        [o, o, o, o, o, x, x],  # target 1: contextual + history + self
        [o, o, o, o, x, o, x],  # target 2
        [x, x, x, x, x, x, o],  # padding: only itself
    ]
    ref = dense_ref([6], 7, contextual=[1], targets=[2])
    assert ref[0].int().tolist() == expected
    mask = AttentionMask(num_targets=torch.tensor([2]), num_contextual=torch.tensor([1]))
    assert mask.dense(offsets_of([6]), 7)[0].int().tolist() == expected


def test_contextual_prefix_example() -> None:
    o, x = 1, 0
    expected = [
        [o, o, o, x, x],  # contextual tokens see the whole prefix, including later prefix tokens
        [o, o, o, x, x],
        [o, o, o, x, x],
        [o, o, o, o, x],
        [o, o, o, o, o],
    ]
    mask = AttentionMask(num_contextual=torch.tensor([3]))
    assert mask.dense(offsets_of([5]), 5)[0].int().tolist() == expected


def test_window_example() -> None:
    o, x = 1, 0
    # max_attn_len 2: every history token sees itself and the one before; the target sees
    # what the last history token sees, plus itself
    expected = [
        [o, x, x, x, x],
        [o, o, x, x, x],
        [x, o, o, x, x],
        [x, x, o, o, x],
        [x, x, o, o, o],
    ]
    mask = AttentionMask(num_targets=torch.tensor([1]), max_attn_len=2)
    assert mask.dense(offsets_of([5]), 5)[0].int().tolist() == expected


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("extra", [0, 2])
@pytest.mark.parametrize("use_targets", [False, True])
@pytest.mark.parametrize("use_contextual", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_dense_causal_against_oracle(seed, extra, use_targets, use_contextual, window) -> None:
    lengths, contextual, targets = _case(seed)
    max_len = max(lengths) + extra
    mask = AttentionMask(
        causal=True,
        num_targets=torch.tensor(targets) if use_targets else None,
        num_contextual=torch.tensor(contextual) if use_contextual else None,
        max_attn_len=window,
    )
    got = mask.dense(offsets_of(lengths), max_len)
    expected = dense_ref(
        lengths,
        max_len,
        causal=True,
        contextual=contextual if use_contextual else None,
        targets=targets if use_targets else None,
        window=window,
    )
    assert got.dtype == torch.bool and got.shape == (len(lengths), max_len, max_len)
    assert torch.equal(got, expected), (got ^ expected).nonzero().tolist()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("use_targets", [False, True])
@pytest.mark.parametrize("use_contextual", [False, True])
def test_dense_non_causal_against_oracle(seed, use_targets, use_contextual) -> None:
    lengths, contextual, targets = _case(seed)
    max_len = max(lengths) + 1
    mask = AttentionMask(
        causal=False,
        num_targets=torch.tensor(targets) if use_targets else None,
        num_contextual=torch.tensor(contextual) if use_contextual else None,
    )
    expected = dense_ref(
        lengths,
        max_len,
        causal=False,
        contextual=contextual if use_contextual else None,
        targets=targets if use_targets else None,
    )
    assert torch.equal(mask.dense(offsets_of(lengths), max_len), expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_dense_edge_splits(seed: int) -> None:
    """All tokens contextual, all tokens targets, and everything in between for one length."""
    n = 5
    lengths, cs, ts = [], [], []
    for c in range(n + 1):
        for t in range(n - c + 1):
            lengths.append(n)
            cs.append(c)
            ts.append(t)
    lengths += [0, 1, 1]
    cs += [0, 1, 0]
    ts += [0, 0, 1]
    for window in (None, 2):
        mask = AttentionMask(num_targets=torch.tensor(ts), num_contextual=torch.tensor(cs), max_attn_len=window)
        expected = dense_ref(lengths, n + seed, contextual=cs, targets=ts, window=window)
        assert torch.equal(mask.dense(offsets_of(lengths), n + seed), expected)


def test_targets_never_see_each_other_and_padding_sees_itself() -> None:
    lengths = [6, 0, 3]
    targets = torch.tensor([3, 0, 3])
    dense = AttentionMask(num_targets=targets).dense(offsets_of(lengths), 8)
    for b, n in enumerate(lengths):
        t = int(targets[b])
        for i in range(n - t, n):
            for j in range(n - t, n):
                assert bool(dense[b, i, j]) == (i == j)
        for i in range(n, 8):
            assert dense[b, i].nonzero().flatten().tolist() == [i]
        assert not dense[b, :n, n:].any()


def test_dense_cache_hit_and_invalidation() -> None:
    mask = AttentionMask(num_targets=torch.tensor([1, 0, 2]), max_attn_len=3)
    offsets = offsets_of([4, 0, 3])
    first = mask.dense(offsets, 5)
    assert mask.dense(offsets, 5) is first  # same batch, every layer: one materialisation
    expected = dense_ref([4, 0, 3], 5, targets=[1, 0, 2], window=3)
    assert torch.equal(first, expected)

    other = offsets_of([2, 2, 3])  # a different tensor: must not hit the entry for `offsets`
    assert torch.equal(mask.dense(other, 5), dense_ref([2, 2, 3], 5, targets=[1, 0, 2], window=3))

    assert mask.dense(offsets, 6).shape == (3, 6, 6)  # a different max_len
    assert torch.equal(mask.dense(offsets, 6), dense_ref([4, 0, 3], 6, targets=[1, 0, 2], window=3))

    offsets[1] = 3  # in place: lengths become [3, 1, 3]
    assert torch.equal(mask.dense(offsets, 5), dense_ref([3, 1, 3], 5, targets=[1, 0, 2], window=3))


def test_to_keeps_fields_and_dataclass_replace_has_no_cache() -> None:
    mask = AttentionMask(causal=True, num_targets=torch.tensor([1]), num_contextual=torch.tensor([1]), max_attn_len=2)
    offsets = offsets_of([4])
    mask.dense(offsets, 4)
    moved = mask.to("cpu")
    assert moved.max_attn_len == 2 and torch.equal(moved.num_targets, mask.num_targets)
    assert torch.equal(moved.dense(offsets, 4), mask.dense(offsets, 4))
    wider = dataclasses.replace(mask, max_attn_len=None)
    assert torch.equal(wider.dense(offsets, 4), dense_ref([4], 4, contextual=[1], targets=[1]))


def test_dense_cache_invalidated_when_mask_fields_change() -> None:
    offsets = offsets_of([4, 3])
    mask = AttentionMask()
    mask.dense(offsets, 4)
    mask.num_targets = torch.tensor([2, 1])
    assert torch.equal(mask.dense(offsets, 4), dense_ref([4, 3], 4, targets=[2, 1]))


def test_dense_under_inference_mode() -> None:
    with torch.inference_mode():
        got = AttentionMask().dense(offsets_of([2, 3]), 3)
    assert torch.equal(got, dense_ref([2, 3], 3))


def test_segments_example() -> None:
    """n = 7: contextual 1 | full segment of 2 | causal segment of 2 | rest (causal) 1 | 1 target."""
    o, x = 1, 0
    expected = [
        [o, x, x, x, x, x, x],
        [o, o, o, x, x, x, x],  # full segment: sees its later member
        [o, o, o, x, x, x, x],
        [o, o, o, o, x, x, x],  # causal segment sees the whole full segment
        [o, o, o, o, o, x, x],
        [o, o, o, o, o, o, x],
        [o, o, o, o, o, o, o],  # target
    ]
    mask = AttentionMask(
        num_contextual=torch.tensor([1]),
        num_targets=torch.tensor([1]),
        segment_lengths=torch.tensor([[2, 2]]),
        segment_full=(True, False),
    )
    mask.validate(offsets_of([7]))
    assert mask.dense(offsets_of([7]), 7)[0].int().tolist() == expected
    assert dense_ref([7], 7, contextual=[1], targets=[1], segments=[[2, 2]], segment_full=[True, False])[0].int().tolist() == expected


def test_timestamps_example() -> None:
    """Aggregated sample: history at t = 1, 2, 3, 5; impressions at t = 3 and 6."""
    o, x = 1, 0
    expected = [
        [o, x, x, x, x, x],
        [o, o, x, x, x, x],
        [o, o, o, x, x, x],
        [o, o, o, o, x, x],
        [o, o, x, x, o, x],  # impression at t=3 sees only events at t=1, 2
        [o, o, o, o, x, o],  # impression at t=6 sees all history
    ]
    ts = torch.tensor([1, 2, 3, 5, 3, 6])
    mask = AttentionMask(num_targets=torch.tensor([2]), timestamps=ts)
    assert mask.dense(offsets_of([6]), 6)[0].int().tolist() == expected


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("use_ts", [False, True])
def test_dense_segments_and_timestamps_against_oracle(seed, causal, window, use_ts) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    lengths = random_lengths(gen, 6, 9)
    contextual, targets = random_split(gen, lengths)
    segments = random_segments(gen, lengths, contextual, targets, 2)
    flags = [bool(torch.randint(0, 2, (1,), generator=gen)) for _ in range(2)]
    ts = [torch.randint(0, 5, (n,), generator=gen).tolist() for n in lengths]
    offsets = offsets_of(lengths)
    mask = AttentionMask(
        causal=causal,
        num_targets=torch.tensor(targets),
        num_contextual=torch.tensor(contextual),
        max_attn_len=window,
        segment_lengths=torch.tensor(segments),
        segment_full=tuple(flags),
        timestamps=torch.tensor(sum(ts, []), dtype=torch.int64) if use_ts else None,
    )
    mask.validate(offsets)
    expected = dense_ref(lengths, max(lengths) + 1, causal, contextual, targets, window, segments, flags, ts if use_ts else None)
    assert torch.equal(mask.dense(offsets, max(lengths) + 1), expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_targets": torch.tensor([1, 2])}, "num_targets has shape"),
        ({"num_targets": torch.tensor([-1])}, "negative"),
        ({"num_targets": torch.tensor([3]), "num_contextual": torch.tensor([2])}, "add up to 5"),
        ({"segment_lengths": torch.tensor([[2, 1]])}, "one flag per segment"),
        ({"segment_lengths": torch.tensor([[3, 2]]), "segment_full": (True, False)}, "add up to 5"),
        ({"segment_full": (True,)}, "without segment_lengths"),
        ({"timestamps": torch.tensor([1, 2])}, "one time per token"),
        ({"max_attn_len": 0}, "max_attn_len"),
    ],
)
def test_validate_rejects_inconsistent_descriptions(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionMask(**kwargs).validate(offsets_of([4]))
