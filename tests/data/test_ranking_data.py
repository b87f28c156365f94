"""Ranking samples: task labels, per-user time splits, (user, period) grouping, batch layout."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from recforge.data.dataset import Dataset
from recforge.data.ranking import RankingData, Task

DAY = 86400


def _dataset(events: list[tuple], users: list[tuple] | None = None, items: list[tuple] | None = None) -> Dataset:
    """events: (user, item, timestamp, rating, action)."""
    u, i, t, r, a = zip(*events)
    table = pa.table({
        "user_id": pa.array(u, pa.int64()), "item_id": pa.array(i, pa.int64()), "timestamp": pa.array(t, pa.int64()),
        "rating": pa.array(r, pa.float32()), "action": pa.array(a, pa.string()),
    })  # fmt: skip
    users_t = pa.table({"user_id": pa.array([x[0] for x in users], pa.int64()), "gender": [x[1] for x in users]}) if users else None
    items_t = (
        pa.table({"item_id": pa.array([x[0] for x in items], pa.int64()), "genres": pa.array([x[1] for x in items])})
        if items
        else None
    )
    return Dataset(table, items_t, {"name": "toy", "has_timestamps": True}, users_t)


# user 1: 10 events on days 0, 0, 0, 1, 1, 2, 2, 2, 3, 3;  user 2: 3 events
EVENTS = [(1, 100 + k, day * DAY + k, float(1 + k % 5), "click" if k % 2 else "view")
          for k, day in enumerate([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])]  # fmt: skip
EVENTS += [(2, 105, 5, 4.0, "buy"), (2, 100, 6, 2.0, "view"), (2, 101, DAY + 7, 5.0, "click")]


def test_task_parse_and_labels() -> None:
    ds = _dataset(EVENTS)
    like = Task.parse("like:rating>=4")
    assert (like.kind, like.op, like.value) == ("binary", ">=", "4")
    assert like.labels(ds.events)[:5].tolist() == [0, 0, 0, 1, 1]
    assert Task.parse("buy:action==buy").labels(ds.events)[-3:].tolist() == [1, 0, 0]
    assert Task.parse("rating:rating").kind == "regression"
    for bad in ("like", "like:rating>=x", "1x:rating", "like:rating>4"):
        with pytest.raises(ValueError, match="task"):
            Task.parse(bad)
    with pytest.raises(ValueError, match="no column 'stars'"):
        Task.parse("s:stars").labels(ds.events)
    with pytest.raises(ValueError, match="COLUMN==VALUE"):
        Task.parse("a:action>=1").labels(ds.events)


def test_per_user_time_split_and_period_grouping() -> None:
    data = RankingData.from_dataset(_dataset(EVENTS), ["like:rating>=4"], valid_fraction=0.2, test_fraction=0.3)
    # user 1: ceil(3) test, ceil(2) valid; user 2: ceil(0.9)=1 test, ceil(0.6)=1 valid
    assert data.split.tolist() == [0, 0, 0, 0, 0, 1, 1, 2, 2, 2] + [0, 1, 2]
    train = data.samples("train", DAY, max_targets=2)
    # user 1 day 0 holds 3 impressions -> split in 2 + 1; day 1: 2; user 2 day 0: 1
    assert train.user.tolist() == [0, 0, 0, 1]
    assert train.offsets.tolist() == [0, 2, 3, 5, 6]
    assert train.events.tolist() == [0, 1, 2, 3, 4, 10]
    test = data.samples("test", DAY, max_targets=8)
    assert test.user.tolist() == [0, 0, 1] and test.events.tolist() == [7, 8, 9, 12]
    assert len(data.samples("valid", 10 * DAY, 8)) == 2


def test_batch_layout_sum_and_interleave() -> None:
    ds = _dataset(EVENTS, users=[(1, "M"), (2, "F")], items=[(100, ["a", "b"]), (101, ["b"])])
    data = RankingData.from_dataset(
        ds, ["like:rating>=4"], action_column="action", user_features=["user_id", "gender"], item_features=["genres"],
        valid_fraction=0.2, test_fraction=0.3,
    )  # fmt: skip
    assert data.num_contextual == 2 and data.num_context_values == 4  # 2 user ids + 2 genders
    samples = data.samples("test", DAY, 8)
    batch = data.batch(samples, torch.tensor([1, 2]), max_seq_len=16)
    batch.validate()
    # sample 1: user 0, targets events 8, 9 (day 3); history: every event before the last target,
    # so events 0..8 (event 8 is also a history token, hidden from target 8 by its timestamp)
    # -> 2 + 9 + 2 tokens. Sample 2: user 1, target event 12; history events 10, 11 -> 2 + 2 + 1
    assert batch.seq_offsets.tolist() == [0, 13, 18]
    items = data.items
    expected_items = [0, 0, *items[0:9].tolist(), *items[8:10].tolist(), 0, 0, *items[10:12].tolist(), items[12].item()]
    assert batch.features["item_ids"].tolist() == expected_items
    acts = data.actions
    assert batch.features["actions"].tolist() == [0, 0, *acts[0:9].tolist(), 0, 0, 0, 0, *acts[10:12].tolist(), 0]
    assert batch.features["context_ids"][[0, 1, 13, 14]].tolist() == [1, 4, 2, 3]  # genders sorted: F=3, M=4
    assert batch.mask.num_targets.tolist() == [2, 1] and batch.mask.num_contextual.tolist() == [2, 2]
    assert batch.labels["events"].tolist() == [8, 9, 12] and batch.labels["users"].tolist() == [0, 0, 1]
    assert batch.labels["tasks"].shape == (3, 1)
    # item side features: item 100 has genres a, b; 101 has b
    assert data.item_features[items[0]].tolist() == [1, 2] and data.item_features[items[1]].tolist() == [2, 0]
    assert data.item_features[0].tolist() == [0, 0]

    inter = data.batch(samples, torch.tensor([2]), max_seq_len=16, action_encoding="interleave")
    inter.validate()
    assert inter.features["item_ids"].tolist() == [0, 0, items[10].item(), 0, items[11].item(), 0, items[12].item()]
    assert inter.features["actions"].tolist() == [0, 0, 0, acts[10].item(), 0, acts[11].item(), 0]
    assert inter.features["timestamps"].tolist()[2:] == [5, 5, 6, 6, DAY + 7]


def test_history_is_truncated_to_fit_max_seq_len() -> None:
    data = RankingData.from_dataset(_dataset(EVENTS), ["like:rating>=4"], valid_fraction=0.2, test_fraction=0.3)
    samples = data.samples("test", DAY, 8)
    batch = data.batch(samples, torch.tensor([1]), max_seq_len=5)  # 2 targets -> 3 most recent history events
    assert batch.features["item_ids"].tolist() == data.items[[6, 7, 8, 8, 9]].tolist()
    with pytest.raises(ValueError, match="no room for history"):
        data.batch(samples, torch.tensor([1]), max_seq_len=2)


def test_bad_inputs_are_explained() -> None:
    ds = _dataset(EVENTS)
    with pytest.raises(ValueError, match="at least one task"):
        RankingData.from_dataset(ds, [])
    with pytest.raises(ValueError, match="no user feature 'age'"):
        RankingData.from_dataset(ds, ["like:rating>=4"], user_features=["age"])
    with pytest.raises(ValueError, match="no item feature"):
        RankingData.from_dataset(ds, ["like:rating>=4"], item_features=["genres"])
    with pytest.raises(ValueError, match="distinct"):
        RankingData.from_dataset(ds, ["a:rating>=4", "a:rating"])
    with pytest.raises(ValueError, match="valid_fraction"):
        RankingData.from_dataset(ds, ["a:rating>=4"], test_fraction=0.0)
    no_time = Dataset(ds.events, None, {"name": "x", "has_timestamps": False})
    with pytest.raises(ValueError, match="timestamps"):
        RankingData.from_dataset(no_time, ["a:rating>=4"])


def test_oracle_probabilities_are_picked_up() -> None:
    ds = _dataset(EVENTS)
    events = ds.events.append_column("p_rating", pa.array(np.linspace(0, 1, len(EVENTS)).astype(np.float32)))
    data = RankingData.from_dataset(Dataset(events, None, ds.meta), ["like:rating>=4"])
    assert data.oracle is not None and data.oracle.shape == (len(EVENTS), 1)


def _reference_batch(data: RankingData, samples, ids: torch.Tensor, max_seq_len: int, action_encoding: str) -> dict:
    """The ranking layout written out with torch scatters (no Arrow, no collate): what ``RankingData.batch``
    returned before it was built on ``rows`` + ``RankingCollate``."""
    from recforge.jagged.index import offsets_from_lengths, range_index

    per_event, c = (2 if action_encoding == "interleave" else 1), data.num_contextual
    user = samples.user[ids]
    t_start, t_count, h_start, h_count = data.window(samples, ids, max_seq_len, per_event)
    target_rows, _ = range_index(t_start, t_count)
    target_events = samples.events[target_rows]
    hist_events, _ = range_index(h_start, h_count)
    offsets = offsets_from_lengths(c + per_event * h_count + t_count)
    total = int(offsets[-1])
    out = {name: torch.zeros(total, dtype=torch.int64) for name in ("item_ids", "actions", "context_ids", "timestamps")}
    if c:
        out["context_ids"][(offsets[:-1].view(-1, 1) + torch.arange(c)).flatten()] = data.context[user].flatten()
    h_pos = torch.repeat_interleave(offsets[:-1] + c - per_event * h_start, h_count) + per_event * hist_events
    out["item_ids"][h_pos] = data.items[hist_events]
    out["timestamps"][h_pos] = data.timestamps[hist_events]
    out["actions"][h_pos + per_event - 1] = data.actions[hist_events]
    out["timestamps"][h_pos + per_event - 1] = data.timestamps[hist_events]
    t_pos = torch.repeat_interleave(offsets[:-1] + c + per_event * h_count - t_start, t_count) + target_rows
    out["item_ids"][t_pos] = data.items[target_events]
    out["timestamps"][t_pos] = data.timestamps[target_events]
    out.update(offsets=offsets, num_targets=t_count, tasks=data.labels[target_events], users=data.event_user[target_events],
               events=target_events)  # fmt: skip
    return out


@pytest.mark.parametrize("action_encoding", ["sum", "interleave"])
@pytest.mark.parametrize("seed", [0, 1])
def test_batch_equals_a_direct_scatter_of_the_layout(action_encoding: str, seed: int) -> None:
    from recforge.data.synthetic import SyntheticConfig, generate_impressions

    events, items = generate_impressions(SyntheticConfig(num_users=30, num_items=60, num_clusters=3, mean_seq_len=20,
                                                         max_seq_len=50, seed=seed))  # fmt: skip
    users = [["user_id"], []][seed]
    data = RankingData.from_dataset(Dataset(events, items, {"has_timestamps": True}), ["click:click>=1", "like:like>=1"],
                                    action_column="action" if seed == 0 else "", user_features=users)  # fmt: skip
    samples = data.samples("train", DAY, max_targets=5)
    ids = torch.from_numpy(np.random.default_rng(seed).permutation(len(samples))[:17])
    batch = data.batch(samples, ids, 32, action_encoding)
    batch.validate()
    ref = _reference_batch(data, samples, ids, 32, action_encoding)
    assert torch.equal(batch.seq_offsets, ref["offsets"]) and batch.max_seq_len == 32
    for name in ("item_ids", "actions", "context_ids", "timestamps"):
        assert torch.equal(batch.features[name], ref[name]), name
    torch.testing.assert_close(batch.labels["tasks"], ref["tasks"], rtol=0, atol=0, equal_nan=True)
    for name in ("users", "events"):
        assert torch.equal(batch.labels[name], ref[name]), name
    assert torch.equal(batch.mask.num_targets, ref["num_targets"])
    assert torch.equal(batch.mask.num_contextual, torch.full_like(ref["num_targets"], data.num_contextual))
    assert batch.mask.causal and batch.mask.timestamps is batch.features["timestamps"]
    assert "row_ids" not in batch.dense and "sample_ids" not in batch.dense
