"""The long-history synthetic generator: lengths, the re-consumption rule, the ceiling, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from recforge.cli import main
from recforge.data.dataset import Dataset, load_dataset, validate_events
from recforge.data.synthetic_long import LongSyntheticConfig, generate_long, recall_ceiling

SMALL = LongSyntheticConfig(num_users=60, num_items=3000, median_seq_len=600, seq_len_sigma=1.0, min_seq_len=64,
                            max_seq_len=2500, cycle_lengths=(8, 32, 128, 512), seed=3)  # fmt: skip


def _per_user(events) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    users = events.column("user_id").to_numpy()
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    return users, starts, np.diff(np.r_[starts, len(users)])


def test_lengths_and_layout() -> None:
    events, items, users_table = generate_long(SMALL)
    validate_events(events)
    users, starts, lengths = _per_user(events)
    assert len(starts) == SMALL.num_users and np.all(np.diff(users[starts]) > 0)
    assert lengths.min() >= SMALL.min_seq_len and lengths.max() <= SMALL.max_seq_len
    assert np.median(lengths) > 0.5 * SMALL.median_seq_len and lengths.max() > 2 * np.median(lengths)  # heavy tail
    ts = events.column("timestamp").to_numpy()
    assert np.all(np.diff(ts)[np.diff(users) == 0] > 0)
    item_ids = events.column("item_id").to_numpy()
    assert item_ids.min() >= 1 and item_ids.max() <= SMALL.num_items and items.num_rows == SMALL.num_items
    cycles = users_table.column("cycle_length").to_numpy()
    assert set(cycles.tolist()) <= set(SMALL.cycle_lengths) and np.all(cycles * SMALL.min_repeats <= lengths)


def test_noise_free_sequences_repeat_exactly_at_the_cycle() -> None:
    events, _, users_table = generate_long(replace(SMALL, noise_prob=0.0))
    _, starts, lengths = _per_user(events)
    items = events.column("item_id").to_numpy()
    for start, n, c in zip(starts, lengths, users_table.column("cycle_length").to_numpy()):
        seq = items[start : start + n]
        assert np.array_equal(seq[c:], seq[:-c])  # item[t] == item[t - C]
        assert len(np.unique(seq[:c])) == c  # and nothing shorter: a cycle holds distinct items


def test_noise_share_and_determinism() -> None:
    events, _, users_table = generate_long(SMALL)
    _, starts, lengths = _per_user(events)
    items = events.column("item_id").to_numpy()
    same = [np.mean(items[s + c : s + n] == items[s : s + n - c])
            for s, n, c in zip(starts, lengths, users_table.column("cycle_length").to_numpy())]  # fmt: skip
    assert abs(np.mean(same) - (1 - SMALL.noise_prob) ** 2) < 0.03  # both ends must be playlist events
    again, _, _ = generate_long(SMALL)
    assert again.equals(events)
    assert not generate_long(replace(SMALL, seed=4))[0].equals(events)


def test_recall_ceiling_rises_in_steps_with_the_history() -> None:
    events, items, users_table = generate_long(replace(SMALL, num_users=400))
    ceiling = recall_ceiling(Dataset(events, items, {}, users_table), [4, 8, 32, 128, 512, 4096])
    values = list(ceiling.values())
    assert values[0] == 0.0 and all(b >= a for a, b in zip(values, values[1:]))
    assert values[-1] == values[-2]  # every cycle fits in 512
    cycles = users_table.column("cycle_length").to_numpy()
    for n, value in ceiling.items():  # each user with C <= n repeats with probability (1 - noise)^2 (or by chance)
        expected = (1 - SMALL.noise_prob) ** 2 * np.mean(cycles <= n)
        assert abs(value - expected) < 0.07, (n, value, expected)


def test_recall_ceiling_by_hand() -> None:
    import pyarrow as pa

    events = pa.table({"user_id": pa.array([1, 1, 1, 1, 2, 2, 2], pa.int64()), "item_id": pa.array([5, 6, 7, 6, 1, 2, 3], pa.int64()),
                       "timestamp": pa.array(range(7), pa.int64())})  # fmt: skip
    users = pa.table({"user_id": pa.array([1, 2], pa.int64()), "cycle_length": pa.array([2, 2], pa.int64())})
    # user 1's last item (6) repeats the item 2 events earlier; user 2's (3) does not
    assert recall_ceiling(Dataset(events, None, {}, users), [1, 2, 3]) == {1: 0.0, 2: 0.5, 3: 0.5}
    with pytest.raises(ValueError, match="cycle_length"):
        recall_ceiling(Dataset(events, None, {}, None), [2])


@pytest.mark.parametrize(
    ("change", "message"),
    [({"cycle_lengths": (32, 8)}, "increasing"), ({"min_seq_len": 10}, "min_seq_len"), ({"noise_prob": 1.0}, "noise_prob"),
     ({"min_repeats": 1.5}, "min_repeats"), ({"num_items": 100}, "num_items")],
)  # fmt: skip
def test_config_problems_are_reported(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(SMALL, **change)


def test_cli_writes_the_dataset(tmp_path) -> None:
    out = tmp_path / "long"
    assert main(["data", "synthetic-long", "--out", str(out), "--users", "6", "--items", "20000",
                 "--median-len", "300", "--max-len", "600"]) == 0  # fmt: skip
    dataset = load_dataset(out)
    meta = json.loads((out / "dataset.json").read_text())
    assert meta["name"] == "synthetic-long" and meta["num_users"] == 6
    assert dataset.users is not None and "cycle_length" in dataset.users.column_names
    assert main(["data", "synthetic-long", "--out", str(out), "--users", "6"]) == 2  # exists: refused
