"""Tests for the synthetic interaction generator."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

from recforge.data import synthetic
from recforge.data.dataset import load_dataset, validate_events
from recforge.data.synthetic import (
    SyntheticConfig,
    action_probabilities,
    build_catalog,
    generate,
    write_synthetic,
)

SMALL = SyntheticConfig(num_users=300, num_items=200, num_clusters=8, mean_seq_len=20, max_seq_len=60, seed=7)


@pytest.fixture(scope="module")
def default_data() -> tuple[SyntheticConfig, pa.Table, pa.Table, float]:
    config = SyntheticConfig()
    start = time.perf_counter()
    events, items = generate(config)
    return config, events, items, time.perf_counter() - start


def _arrays(events: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """0-based user and item indices plus timestamps."""
    return (
        events.column("user_id").to_numpy() - 1,
        events.column("item_id").to_numpy() - 1,
        events.column("timestamp").to_numpy(),
    )


def _leave_one_out_hit_rates(config: SyntheticConfig, events: pa.Table, k: int = 10) -> dict[str, float]:
    """Next-item HR@k on each user's last event for three simple predictors.

    ``popularity``: most frequent training items. ``cluster``: most frequent
    training items in the cluster of the user's previous item. ``markov``: most
    frequent training successors of the previous item, backed off to ``cluster``.
    Items the user already saw are excluded, as in the real evaluation.
    """
    cat = build_catalog(config)
    users, items, _ = _arrays(events)
    n_users, n_items = config.num_users, config.num_items
    last = np.r_[users[1:] != users[:-1], True]
    target = items[last]
    prev = items[np.flatnonzero(last) - 1]
    train = ~last
    seen = np.zeros((n_users, n_items), dtype=bool)
    seen[users[train], items[train]] = True
    pop = np.bincount(items[train], minlength=n_items).astype(np.float64)
    tie = 1e-3 * pop / pop.max()
    same_cluster = cat.cluster[None, :] == cat.cluster[prev][:, None]
    pairs = train[:-1] & train[1:] & (users[1:] == users[:-1])
    transitions = np.bincount(items[:-1][pairs] * n_items + items[1:][pairs], minlength=n_items * n_items)
    transitions = transitions.reshape(n_items, n_items).astype(np.float64)

    def hit_rate(score: np.ndarray) -> float:
        score = np.where(seen, -np.inf, score)
        top = np.argpartition(-score, k, axis=1)[:, :k]
        return float((top == target[:, None]).any(axis=1).mean())

    cluster_score = same_cluster * pop[None, :] + tie
    return {
        "popularity": hit_rate(np.broadcast_to(pop, (n_users, n_items))),
        "cluster": hit_rate(cluster_score),
        "markov": hit_rate(transitions[prev] * 1e6 + cluster_score),
    }


def test_deterministic_for_a_seed_and_different_across_seeds() -> None:
    events_a, items_a = generate(SMALL)
    events_b, items_b = generate(SMALL)
    assert events_a.equals(events_b)
    assert items_a.equals(items_b)
    events_c, items_c = generate(replace(SMALL, seed=8))
    assert not events_a.equals(events_c)
    assert not items_a.equals(items_c)


def test_schema_ids_and_sort_order() -> None:
    events, items = generate(SMALL)
    validate_events(events)
    assert events.schema == pa.schema(
        [("user_id", pa.int64()), ("item_id", pa.int64()), ("timestamp", pa.int64()), ("action", pa.string())]
    )
    assert events.column("timestamp").null_count == 0
    users, item_idx, ts = _arrays(events)
    assert np.array_equal(np.unique(users), np.arange(SMALL.num_users))  # IDs 1..num_users, all present
    assert item_idx.min() >= 0 and item_idx.max() < SMALL.num_items
    order = np.lexsort((ts, users))
    assert np.array_equal(order, np.arange(len(users)))  # sorted by (user_id, timestamp)
    assert set(events.column("action").to_pylist()) == set(SMALL.action_names)

    assert items.schema == pa.schema(
        [
            ("item_id", pa.int64()),
            ("cluster", pa.int64()),
            ("cluster_name", pa.string()),
            ("title", pa.string()),
            ("popularity_rank", pa.int64()),
        ]
    )
    assert items.column("item_id").to_pylist() == list(range(1, SMALL.num_items + 1))
    assert sorted(items.column("popularity_rank").to_pylist()) == list(range(1, SMALL.num_items + 1))
    clusters = items.column("cluster").to_numpy()
    assert set(clusters.tolist()) == set(range(SMALL.num_clusters))
    titles = items.column("title").to_pylist()
    assert len(set(titles)) == len(titles)
    assert all(t.startswith(n + " #") for t, n in zip(titles, items.column("cluster_name").to_pylist()))


def test_titles_number_the_successor_cycle() -> None:
    cat = build_catalog(SMALL)
    _, items = generate(SMALL)
    titles = items.column("title").to_pylist()
    sizes = np.bincount(cat.cluster)
    for i in range(SMALL.num_items):
        name, number = titles[i].rsplit(" #", 1)
        succ_name, succ_number = titles[cat.successor[i]].rsplit(" #", 1)
        assert name == succ_name and cat.cluster[cat.successor[i]] == cat.cluster[i]
        assert int(succ_number) == int(number) % sizes[cat.cluster[i]] + 1
    assert synthetic._cluster_name(0) == "Neon Jazz"
    names = [synthetic._cluster_name(c) for c in range(400)]
    assert len(set(names)) == len(names)


def test_lengths_within_bounds(default_data) -> None:
    config, events, _, _ = default_data
    lengths = np.bincount(_arrays(events)[0])
    assert lengths.min() >= config.min_seq_len and lengths.max() <= config.max_seq_len
    assert 0.8 * config.mean_seq_len < lengths.mean() < 1.2 * config.mean_seq_len
    assert len(np.unique(lengths)) > 50  # lengths vary
    fixed = SyntheticConfig(num_users=50, num_items=100, num_clusters=5, min_seq_len=12, max_seq_len=12)
    assert set(np.bincount(_arrays(generate(fixed)[0])[0]).tolist()) == {12}


def test_no_repeated_items_within_a_user(default_data) -> None:
    config, events, _, _ = default_data
    users, items, _ = _arrays(events)
    keys = users * config.num_items + items
    assert len(np.unique(keys)) == len(keys)


def test_exhausting_the_catalogue_still_never_repeats() -> None:
    # Every user sees every item: exercises the exact unseen-item fallback paths.
    config = SyntheticConfig(num_users=40, num_items=24, num_clusters=4, min_seq_len=24, max_seq_len=24, max_redraws=1)
    events, _ = generate(config)
    users, items, _ = _arrays(events)
    for u in range(config.num_users):
        assert sorted(items[users == u].tolist()) == list(range(config.num_items))


def test_chunked_generation_is_valid(monkeypatch) -> None:
    monkeypatch.setattr(synthetic, "_SEEN_BYTES_BUDGET", 64 * SMALL.num_items)  # chunks of 64 users
    events, _ = generate(SMALL)
    validate_events(events)
    users, items, _ = _arrays(events)
    assert np.array_equal(np.unique(users), np.arange(SMALL.num_users))
    assert len(np.unique(users * SMALL.num_items + items)) == len(items)


def test_timestamps_have_sessions(default_data) -> None:
    config, events, _, _ = default_data
    users, _, ts = _arrays(events)
    same_user = users[1:] == users[:-1]
    gaps = np.diff(ts)[same_user]
    assert (gaps >= 0).all()
    first = ts[np.r_[True, ~same_user]]
    assert (first >= config.start_time).all() and (first < config.start_time + config.start_spread_s).all()
    assert ts.max() < config.start_time + 366 * 86_400
    long = gaps >= config.min_session_gap_s
    assert abs(long.mean() - config.session_break_prob) < 0.02
    assert np.median(gaps[~long]) < 300 and np.median(gaps[long]) > 86_400 / 2


def test_power_law_popularity(default_data) -> None:
    config, events, items, _ = default_data
    counts = np.bincount(_arrays(events)[1], minlength=config.num_items)
    top_share = np.sort(counts)[::-1][: config.num_items // 10].sum() / counts.sum()
    assert top_share > 0.25  # uniform would give 0.10
    # The generating popularity rank predicts the observed counts.
    rank = items.column("popularity_rank").to_numpy()
    assert np.corrcoef(np.argsort(np.argsort(-counts)), rank)[0, 1] > 0.7


def test_sequential_structure(default_data) -> None:
    config, events, _, _ = default_data
    cat = build_catalog(config)
    users, items, _ = _arrays(events)
    same_user = users[1:] == users[:-1]
    prev, nxt = items[:-1][same_user], items[1:][same_user]
    same_cluster = (cat.cluster[prev] == cat.cluster[nxt]).mean()
    assert same_cluster > 5 / config.num_clusters
    assert same_cluster > 0.8
    is_successor = cat.successor[prev] == nxt
    # Unconditionally the rate is a bit below successor_prob (already-seen successors are skipped) ...
    assert 0.7 * config.successor_prob < is_successor.mean() <= config.successor_prob + 0.03
    # ... and close to it among pairs whose successor was still unseen.
    position = np.arange(len(items))
    keys = users * config.num_items + items
    order = np.argsort(keys)
    pair_pos = position[1:][same_user]
    succ_keys = users[1:][same_user] * config.num_items + cat.successor[prev]
    found = np.minimum(np.searchsorted(keys[order], succ_keys), len(keys) - 1)
    seen_before = (keys[order][found] == succ_keys) & (order[found] < pair_pos)
    conditional = is_successor[~seen_before].mean()
    assert abs(conditional - config.successor_prob) < 0.04


def test_successor_and_drift_knobs() -> None:
    base = replace(SMALL, num_users=500)
    cat = build_catalog(SMALL)

    def rates(**overrides: float) -> tuple[float, float]:
        events, _ = generate(replace(base, **overrides))
        users, items, _ = _arrays(events)
        same_user = users[1:] == users[:-1]
        prev, nxt = items[:-1][same_user], items[1:][same_user]
        return (cat.successor[prev] == nxt).mean(), (cat.cluster[prev] == cat.cluster[nxt]).mean()

    succ_off, _ = rates(successor_prob=0.0)
    succ_on, _ = rates(successor_prob=0.6)
    assert succ_off < 0.05 < 0.4 < succ_on
    _, sticky = rates(drift_prob=0.0)
    _, drifty = rates(drift_prob=0.5)
    assert sticky > drifty + 0.2


def test_markov_predictor_beats_popularity(default_data) -> None:
    config, events, _, _ = default_data
    hr = _leave_one_out_hit_rates(config, events)
    assert hr["cluster"] > 3 * hr["popularity"]
    assert hr["markov"] > hr["cluster"] > hr["popularity"] > 0


def test_actions_follow_affinity(default_data) -> None:
    config, events, _, _ = default_data
    probs = action_probabilities(np.array([0.0, 0.5, 1.0]), config)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0)
    np.testing.assert_allclose(probs[0], config.action_probs_low)
    np.testing.assert_allclose(probs[2], config.action_probs_high)
    actions = np.asarray(events.column("action").to_pylist())
    freq = np.array([(actions == a).mean() for a in config.action_names])
    low, high = np.asarray(config.action_probs_low), np.asarray(config.action_probs_high)
    assert (freq > np.minimum(low, high) - 0.01).all() and (freq < np.maximum(low, high) + 0.01).all()
    # Users act more strongly on their favourite cluster: purchases concentrate there.
    cat = build_catalog(config)
    users, items, _ = _arrays(events)
    counts = np.zeros((config.num_users, config.num_clusters))
    np.add.at(counts, (users, cat.cluster[items]), 1)
    favourite = counts.argmax(axis=1)
    on_favourite = cat.cluster[items] == favourite[users]
    purchase = actions == "purchase"
    assert purchase[on_favourite].mean() > purchase[~on_favourite].mean() + 0.01


def test_default_generation_is_fast(default_data) -> None:
    _, events, _, seconds = default_data
    assert events.num_rows > 100_000
    assert seconds < 2.0


def test_write_synthetic_round_trip(tmp_path) -> None:
    out = write_synthetic(tmp_path / "syn", SMALL)
    ds = load_dataset(out)
    events, items = generate(SMALL)
    assert ds.events.equals(events)
    assert ds.items.equals(items)
    assert ds.meta["name"] == "synthetic"
    assert "SyntheticConfig(" in ds.meta["source"] and "seed=7" in ds.meta["source"]
    assert ds.meta["num_users"] == SMALL.num_users and ds.meta["has_timestamps"] and ds.meta["has_actions"]
    assert ds.meta["item_feature_columns"] == ["cluster", "cluster_name", "title", "popularity_rank"]
    with pytest.raises(ValueError, match="already exists"):
        write_synthetic(out, SMALL)
    write_synthetic(out, replace(SMALL, seed=8), overwrite=True)
    assert not load_dataset(out).events.equals(events)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_items": 5, "num_clusters": 10},
        {"min_seq_len": 0},
        {"min_seq_len": 30, "max_seq_len": 20},
        {"max_seq_len": 2000},
        {"drift_prob": 1.5},
        {"successor_prob": -0.1},
        {"user_concentration": 0.0},
        {"action_probs_low": (0.5, 0.5, 0.5, 0.5)},
        {"action_names": ("view", "view", "like", "purchase")},
    ],
)
def test_config_validation(overrides: dict) -> None:
    with pytest.raises(ValueError, match="SyntheticConfig"):
        SyntheticConfig(**overrides)
