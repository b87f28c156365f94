"""Tests for UserSequences: grouping, training samples/batches, evaluation batches, counts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from recforge.data.dataset import load_dataset, write_dataset
from recforge.data.arrow import column_numpy
from recforge.data.sequences import PROTOCOL_HOLDOUT, UserSequences, _dense_codes

# Raw events of four users, in the order written; user 5 comes last (rows must be contiguous,
# not sorted). Items repeat within a user (user 10 sees item 100 twice).
RAW = {
    10: [300, 100, 205, 410, 100],
    20: [205, 300],
    30: [999, 100, 410, 300, 205, 777, 555],
    5: [410],
}
VOCAB = [100, 205, 300, 410, 555, 777, 999]  # sorted raw IDs -> dense 1..7


def _events(with_timestamps: bool) -> pa.Table:
    users, items, ts = [], [], []
    for u, seq in RAW.items():
        users += [u] * len(seq)
        items += seq
        ts += [1_000 * u + 7 * i for i in range(len(seq))]
    return pa.table(
        {
            "user_id": pa.array(users, pa.int64()),
            "item_id": pa.array(items, pa.int64()),
            "timestamp": pa.array(ts if with_timestamps else [None] * len(ts), pa.int64()),
        }
    )


def _seqs_from_table(tmp_path: Path, with_timestamps: bool) -> UserSequences:
    path = write_dataset(tmp_path / "ds", _events(with_timestamps), name="hand", source="test")
    return UserSequences.from_dataset(load_dataset(path))


def _random_unique_seqs(lengths: list[int]) -> UserSequences:
    """Sequences whose item index is the global position + 1: every token is identifiable."""
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths_t, 0)
    total = int(offsets[-1])
    return UserSequences(
        item_ids=torch.arange(1, total + 1),
        timestamps=torch.arange(total) * 10,
        offsets=offsets,
        user_ids=np.arange(len(lengths)) + 100,
        item_vocab=np.r_[-1, np.arange(1, total + 1)].astype(np.int64),
    )


def _python_seq(seqs: UserSequences, u: int) -> list[int]:
    return seqs.item_ids[int(seqs.offsets[u]) : int(seqs.offsets[u + 1])].tolist()


# --------------------------------------------------------------------------- from_dataset


@pytest.mark.parametrize("with_timestamps", [True, False])
def test_from_dataset_vocab_offsets_timestamps(tmp_path: Path, with_timestamps: bool) -> None:
    seqs = _seqs_from_table(tmp_path, with_timestamps)
    assert seqs.num_users == 4
    assert seqs.num_items == 7
    assert seqs.user_ids.tolist() == [10, 20, 30, 5]
    assert seqs.item_vocab.tolist() == [-1, *VOCAB]
    assert seqs.offsets.dtype == torch.int64
    assert seqs.offsets.tolist() == [0, 5, 7, 14, 15]
    assert seqs.lengths.tolist() == [5, 2, 7, 1]
    assert seqs.item_ids.dtype == torch.int64
    dense = {raw: i + 1 for i, raw in enumerate(VOCAB)}
    for u, (raw_user, raw_seq) in enumerate(RAW.items()):
        got = _python_seq(seqs, u)
        assert got == [dense[r] for r in raw_seq], raw_user
        assert seqs.item_vocab[got].tolist() == raw_seq  # vocab maps back to raw IDs
    if with_timestamps:
        expected = [1_000 * u + 7 * i for u, seq in RAW.items() for i in range(len(seq))]
        assert seqs.timestamps is not None and seqs.timestamps.tolist() == expected
    else:
        assert seqs.timestamps is None


def test_from_dataset_partial_timestamps_rejected(tmp_path: Path) -> None:
    events = _events(True)
    ts = events.column("timestamp").to_pylist()
    ts[3] = None
    events = events.set_column(2, "timestamp", pa.array(ts, pa.int64()))
    path = write_dataset(tmp_path / "ds", events, name="hand", source="test")
    with pytest.raises(ValueError, match="1 events have no timestamp"):
        UserSequences.from_dataset(load_dataset(path))


def test_from_dataset_empty_events(tmp_path: Path) -> None:
    events = _events(True).slice(0, 0)
    path = write_dataset(tmp_path / "ds", events, name="empty", source="test")
    seqs = UserSequences.from_dataset(load_dataset(path))
    assert seqs.num_users == 0 and seqs.num_items == 0
    assert seqs.offsets.tolist() == [0]


@pytest.mark.parametrize("kind", ["small", "sparse", "negative", "huge", "empty"])
def test_dense_codes_equal_np_unique(kind: str) -> None:
    """The lookup-table coding (non-negative, bounded IDs) and the sort fallback both give np.unique's answer."""
    rng = np.random.default_rng()
    n = int(rng.integers(1, 5_000))
    raw = {"small": rng.integers(0, 300, n), "sparse": rng.integers(0, 8 * n + 1024, n),
           "negative": rng.integers(-50, 50, n), "huge": rng.integers(0, 2**62, n) | (1 << 61),
           "empty": np.zeros(0, np.int64)}[kind]  # fmt: skip
    vocab, dense = _dense_codes(raw)
    want_vocab, want_dense = np.unique(raw, return_inverse=True)
    assert vocab.dtype == np.int64 and dense.dtype == np.int64
    assert np.array_equal(vocab, want_vocab) and np.array_equal(dense, want_dense.reshape(-1))


def test_column_numpy_equals_to_numpy() -> None:
    """A view of the buffer where possible (sliced, chunked), to_numpy otherwise (nulls, booleans, strings)."""
    rng = np.random.default_rng()
    values = rng.integers(-(2**40), 2**40, 50)
    cases = [pa.array(values).slice(7, 30), pa.chunked_array([values[:20], values[20:]]), pa.chunked_array([values]),
             pa.array(values.astype(np.float32)), pa.array([1, None, 3], pa.int64()), pa.array([True, False]),
             pa.array(["a", "b"]), pa.chunked_array([], pa.int64())]  # fmt: skip
    for column in cases:
        got = column_numpy(column)
        want = column.to_numpy() if isinstance(column, pa.ChunkedArray) else column.to_numpy(zero_copy_only=False)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want, equal_nan=got.dtype.kind == "f") or (got == want).all()
    for column in (cases[0], cases[2], cases[3]):  # one chunk without nulls: a read-only view, no copy
        chunk = column.chunk(0) if isinstance(column, pa.ChunkedArray) else column
        buffer = np.frombuffer(chunk.buffers()[1], dtype=np.uint8)
        got = column_numpy(column)
        assert np.shares_memory(got, buffer) and not got.flags.writeable


# --------------------------------------------------------------------------- training_samples


def _python_samples(lengths: list[int], holdout: int, max_seq_len: int, windows: str) -> list[tuple[int, int]]:
    out = []
    for u, length in enumerate(lengths):
        n = length - holdout
        if n < 2:
            continue
        if windows == "last":
            out.append((u, n))
            continue
        end = n
        while end >= 2:  # a window of `end` items has end - 1 >= 1 transitions
            out.append((u, end))
            end -= max_seq_len
    return out


@pytest.mark.parametrize("windows", ["last", "all"])
@pytest.mark.parametrize("holdout", [1, 2])
@pytest.mark.parametrize("max_seq_len", [1, 2, 3, 7])
def test_training_samples_match_python_loop(windows: str, holdout: int, max_seq_len: int) -> None:
    lengths = torch.randint(0, 25, (30,)).tolist() + [0, 1, 2, 3, max_seq_len + 1, max_seq_len + 2, 2 * max_seq_len + 1]
    seqs = _random_unique_seqs(lengths)
    samples = seqs.training_samples(holdout, max_seq_len, windows)
    assert samples.dtype == torch.int64 and samples.shape[1] == 2
    got = sorted(map(tuple, samples.tolist()))
    assert got == sorted(_python_samples(lengths, holdout, max_seq_len, windows))


def test_training_samples_bad_windows() -> None:
    with pytest.raises(ValueError, match="windows='some'"):
        _random_unique_seqs([5, 6]).training_samples(1, 3, "some")


@pytest.mark.parametrize("holdout", [1, 2])
@pytest.mark.parametrize("max_seq_len", [1, 3, 5, 50])
def test_all_windows_cover_every_transition_exactly_once(holdout: int, max_seq_len: int) -> None:
    lengths = torch.randint(0, 30, (25,)).tolist() + [max_seq_len + 1, max_seq_len + 2, 3 * max_seq_len + holdout]
    seqs = _random_unique_seqs(lengths)
    samples = seqs.training_samples(holdout, max_seq_len, "all")
    batch = seqs.training_batch(samples, max_seq_len)
    batch.validate()
    assert int(batch.lengths.max()) <= max_seq_len  # no window input longer than max_seq_len
    assert (batch.lengths >= 1).all()

    # Item index = global position + 1, so each (input, label) pair names one transition.
    inputs = (batch.item_ids - 1).tolist()
    labels = (batch.labels["next_item"] - 1).tolist()
    assert all(b == a + 1 for a, b in zip(inputs, labels, strict=True))
    counts = Counter(inputs)
    assert all(c == 1 for c in counts.values()), "a transition appears in more than one window"
    expected = set()
    for u, length in enumerate(lengths):
        start, n = int(seqs.offsets[u]), length - holdout
        expected |= {start + t for t in range(n - 1)}  # t -> t + 1 with t + 1 < n
    assert set(counts) == expected


@pytest.mark.parametrize("max_seq_len", [2, 4, 100])
def test_last_window_is_most_recent_training_window(max_seq_len: int) -> None:
    lengths = torch.randint(0, 20, (20,)).tolist() + [2, 3]
    holdout = 1
    seqs = _random_unique_seqs(lengths)
    samples = seqs.training_samples(holdout, max_seq_len, "last")
    batch = seqs.training_batch(samples, max_seq_len)
    batch.validate()
    for row, (u, end) in enumerate(samples.tolist()):
        seq = _python_seq(seqs, u)
        assert end == len(seq) - holdout
        lo, hi = int(batch.seq_offsets[row]), int(batch.seq_offsets[row + 1])
        first = max(0, end - 1 - max_seq_len)
        assert batch.item_ids[lo:hi].tolist() == seq[first : end - 1]
        assert batch.labels["next_item"][lo:hi].tolist() == seq[first + 1 : end]
        assert batch.timestamps[lo:hi].tolist() == [10 * (i - 1) for i in seq[first : end - 1]]


def test_training_batch_labels_are_next_items_hand_table(tmp_path: Path) -> None:
    seqs = _seqs_from_table(tmp_path, with_timestamps=True)
    samples = torch.tensor([[0, 4], [2, 6], [2, 3], [1, 2]])
    batch = seqs.training_batch(samples, max_seq_len=3)
    batch.validate()
    assert batch.max_seq_len == 3
    # user 10 dense: [3, 1, 2, 4, 1]; user 30: [7, 1, 4, 3, 2, 6, 5]; user 20: [2, 3]
    assert batch.seq_offsets.tolist() == [0, 3, 6, 8, 9]
    assert batch.item_ids.tolist() == [3, 1, 2, 4, 3, 2, 7, 1, 2]
    assert batch.labels["next_item"].tolist() == [1, 2, 4, 3, 2, 6, 1, 4, 3]
    assert batch.timestamps.tolist() == [10_000, 10_007, 10_014, 30_014, 30_021, 30_028, 30_000, 30_007, 20_000]


def test_training_labels_never_reach_heldout_items() -> None:
    lengths = torch.randint(0, 40, (40,)).tolist()
    seqs = _random_unique_seqs(lengths)
    for name, holdout in PROTOCOL_HOLDOUT.items():
        for windows in ("last", "all"):
            for max_seq_len in (1, 4, 64):
                samples = seqs.training_samples(holdout, max_seq_len, windows)
                batch = seqs.training_batch(samples, max_seq_len)
                pos = batch.labels["next_item"] - 1  # global position of each label
                user = torch.searchsorted(seqs.offsets, pos, right=True) - 1
                local = pos - seqs.offsets[user]
                assert (local < seqs.lengths[user] - holdout).all(), (name, windows, max_seq_len)
                assert (local >= 1).all()


# --------------------------------------------------------------------------- eval_batch


@pytest.mark.parametrize("target_from_end", [1, 2])
@pytest.mark.parametrize("max_seq_len", [1, 3, 50])
def test_eval_batch_matches_python(target_from_end: int, max_seq_len: int) -> None:
    lengths = torch.randint(0, 15, (30,)).tolist() + [target_from_end + 1]
    seqs = _random_unique_seqs(lengths)
    users = seqs.evaluable_users(target_from_end)
    assert users.tolist() == [u for u, n in enumerate(lengths) if n - target_from_end >= 1]
    users = users[torch.randperm(users.numel())]  # any order
    ev = seqs.eval_batch(users, max_seq_len, target_from_end)
    ev.inputs.validate()
    assert ev.targets.shape == (users.numel(),)
    for row, u in enumerate(users.tolist()):
        seq = _python_seq(seqs, u)
        pos = len(seq) - target_from_end
        assert int(ev.targets[row]) == seq[pos]
        lo, hi = int(ev.inputs.seq_offsets[row]), int(ev.inputs.seq_offsets[row + 1])
        assert ev.inputs.item_ids[lo:hi].tolist() == seq[max(0, pos - max_seq_len) : pos]
        assert ev.inputs.timestamps[lo:hi].tolist() == [10 * (i - 1) for i in seq[max(0, pos - max_seq_len) : pos]]
        slo, shi = int(ev.seen_offsets[row]), int(ev.seen_offsets[row + 1])
        assert ev.seen_index[slo:shi].tolist() == seq[:pos]
    moved = ev.to("cpu")
    assert torch.equal(moved.targets, ev.targets) and torch.equal(moved.seen_index, ev.seen_index)


def test_eval_batch_hand_table(tmp_path: Path) -> None:
    seqs = _seqs_from_table(tmp_path, with_timestamps=False)
    assert seqs.evaluable_users(1).tolist() == [0, 1, 2]  # user 5 has a single item
    assert seqs.evaluable_users(2).tolist() == [0, 2]
    ev = seqs.eval_batch(torch.tensor([2, 0]), max_seq_len=3, target_from_end=2)
    # user 30 dense [7, 1, 4, 3, 2, 6, 5]: target 6, inputs [4, 3, 2]; user 10 [3, 1, 2, 4, 1]: target 4
    assert ev.targets.tolist() == [6, 4]
    assert ev.inputs.seq_offsets.tolist() == [0, 3, 6]
    assert ev.inputs.item_ids.tolist() == [4, 3, 2, 3, 1, 2]
    assert ev.seen_offsets.tolist() == [0, 5, 8]
    assert ev.seen_index.tolist() == [7, 1, 4, 3, 2, 3, 1, 2]
    assert ev.inputs.timestamps is None


# --------------------------------------------------------------------------- item_counts


@pytest.mark.parametrize("holdout", [0, 1, 2])
def test_item_counts(tmp_path: Path, holdout: int) -> None:
    seqs = _seqs_from_table(tmp_path, with_timestamps=True)
    counts = seqs.item_counts(holdout)
    assert counts.shape == (seqs.num_items + 1,)
    expected = Counter()
    for u in range(seqs.num_users):
        seq = _python_seq(seqs, u)
        expected.update(seq[: max(0, len(seq) - holdout)])
    assert counts.tolist() == [expected.get(i, 0) for i in range(seqs.num_items + 1)]
    assert int(counts[0]) == 0  # padding is never counted


def test_item_counts_random() -> None:
    lengths = torch.randint(0, 12, (20,)).tolist()
    total = sum(lengths)
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    items = torch.randint(1, 6, (total,))
    seqs = UserSequences(items, None, offsets, np.arange(20), np.arange(-1, 5).astype(np.int64))
    expected = torch.zeros(6, dtype=torch.int64)
    for u, n in enumerate(lengths):
        for i in items[int(offsets[u]) : int(offsets[u]) + max(0, n - 1)].tolist():
            expected[i] += 1
    assert torch.equal(seqs.item_counts(1), expected)
