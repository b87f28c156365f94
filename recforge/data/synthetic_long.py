"""Long-history synthetic data: heavy-tailed user lengths and a signal only a long history reveals.

No public long-history dataset ships with recforge; this generator stands in for one to test
training on 10K-100K-event users. Lengths follow a clipped lognormal, heavy-tailed like
KuaiRand-27K (tens of thousands of users averaging ~12K events each, a long tail of far more).

The signal is **periodic re-consumption**: every user ``u`` has a private *playlist* of ``C_u``
distinct items (drawn uniformly from the catalogue, so popularity says nothing about them) that
they go through in a fixed cyclic order, again and again. Each event is, with probability
``noise_prob``, a draw from a Zipf popularity over the catalogue instead (the playlist still
advances, so the cycle keeps its phase). So, for a playlist event at position t::

    item[t] == item[t - C_u]        (unless one of the two is noise)

and nothing in the last ``C_u - 1`` events tells which item comes next: the playlist order is
private to the user and every playlist item in that window differs from the next one. A model
that reads the last ``L`` events can predict a playlist event only when ``C_u <= L``: by attending
to the event ``C_u - 1`` positions back (a relative-position pattern, the cycle lengths being few)
or by finding the previous occurrence of the current item and copying what followed it (an
induction head). Every user draws ``C_u`` uniformly from ``cycle_lengths`` (those that fit
``min_repeats`` times into the user's length), so the share of predictable users, and HR@10, rises
in steps with the history length a model reads; :func:`recall_ceiling` computes that share from
the data for any ``L`` (the hit rate of an oracle that knows the rule) from the ground truth that
:func:`write_long_synthetic` stores in ``users.parquet`` (``cycle_length``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from recforge.data.dataset import Dataset, write_dataset

_EPOCH_2024 = 1_704_067_200  # 2024-01-01T00:00:00Z


@dataclass(frozen=True)
class LongSyntheticConfig:
    """Parameters of the long-history generator (the defaults: ~2.5M events, lengths up to 100K)."""

    num_users: int = 250
    num_items: int = 50_000
    median_seq_len: int = 5_000  # lognormal median of the events per user
    seq_len_sigma: float = 1.2  # lognormal spread: the heavy tail (mean ~ median * exp(sigma^2 / 2))
    min_seq_len: int = 64
    max_seq_len: int = 100_000
    # playlist (cycle) lengths users draw from, uniformly among those <= length / min_repeats
    cycle_lengths: tuple[int, ...] = (16, 64, 256, 1024, 4096, 16_384)
    min_repeats: float = 2.0  # every user goes round their playlist at least this often
    noise_prob: float = 0.2  # chance an event is a popularity draw instead of the next playlist item
    popularity_exponent: float = 1.0  # Zipf exponent of the noise items' popularity
    mean_gap_s: float = 600.0  # mean seconds between a user's events (exponential)
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.num_users < 1:
            problems.append("num_users must be >= 1")
        cycles = self.cycle_lengths
        if not cycles or sorted(set(cycles)) != list(cycles) or cycles[0] < 2 or cycles[-1] > self.num_items:
            problems.append("cycle_lengths must be increasing, >= 2 and <= num_items (a playlist holds distinct items)")
        if self.min_repeats < 2:
            problems.append("min_repeats must be >= 2 (the test item needs an earlier occurrence)")
        if cycles and not cycles[0] * self.min_repeats <= self.min_seq_len <= self.max_seq_len:
            problems.append("need cycle_lengths[0] * min_repeats <= min_seq_len <= max_seq_len")
        if self.median_seq_len <= 0 or self.seq_len_sigma < 0 or self.mean_gap_s < 0 or self.popularity_exponent < 0:
            problems.append("median_seq_len must be > 0; seq_len_sigma, mean_gap_s, popularity_exponent >= 0")
        if not 0.0 <= self.noise_prob < 1.0:
            problems.append("noise_prob must be in [0, 1)")
        if problems:
            raise ValueError("LongSyntheticConfig: " + "; ".join(problems))


def generate_long(config: LongSyntheticConfig) -> tuple[pa.Table, pa.Table, pa.Table]:
    """``(events, items, users)``: events sorted by user then time (int64 user_id, item_id, timestamp),
    items with their noise ``popularity_rank``, users with their ground-truth ``cycle_length``."""
    rng = np.random.default_rng(config.seed)
    users = config.num_users
    mu = np.log(config.median_seq_len)
    lengths = np.clip(np.rint(rng.lognormal(mu, config.seq_len_sigma, users)), config.min_seq_len, config.max_seq_len)
    lengths = lengths.astype(np.int64)
    choices = np.asarray(config.cycle_lengths, dtype=np.int64)
    fits = np.searchsorted(choices, lengths / config.min_repeats, side="right")  # >= 1 by the config checks
    cycles = choices[np.floor(rng.random(users) * fits).astype(np.int64)]

    # each user's playlist: C_u distinct items in a random order, all users' back to back
    playlists = np.concatenate([rng.choice(config.num_items, size=c, replace=False) for c in cycles.tolist()])
    playlist_start = np.r_[0, np.cumsum(cycles)[:-1]]
    owner = np.repeat(np.arange(users), lengths)  # (T,) user of each event
    event_start = np.r_[0, np.cumsum(lengths)[:-1]]
    position = np.arange(len(owner)) - event_start[owner]  # (T,) index in the user's sequence
    phase = rng.integers(0, cycles)  # where in the cycle each user starts
    items = playlists[playlist_start[owner] + (position + phase[owner]) % cycles[owner]]

    noise = rng.random(len(items)) < config.noise_prob
    popularity = np.arange(1, config.num_items + 1, dtype=np.float64) ** -config.popularity_exponent
    popular_items = rng.permutation(config.num_items)  # popularity rank r -> item popular_items[r]
    ranks = np.searchsorted(np.cumsum(popularity / popularity.sum()), rng.random(int(noise.sum())), side="right")
    items[noise] = popular_items[np.minimum(ranks, config.num_items - 1)]

    gaps = 1 + np.floor(rng.exponential(config.mean_gap_s, len(items))).astype(np.int64)
    gaps[event_start] = _EPOCH_2024 + rng.integers(0, 14 * 86_400, users)  # each user's first event
    timestamp = np.cumsum(gaps)
    timestamp -= np.repeat(timestamp[event_start] - gaps[event_start], lengths)  # restart the sum per user

    user_ids = np.arange(1, users + 1, dtype=np.int64)
    events = pa.table({"user_id": pa.array(user_ids[owner]), "item_id": pa.array(items.astype(np.int64) + 1),
                       "timestamp": pa.array(timestamp)})  # fmt: skip
    rank = np.empty(config.num_items, dtype=np.int64)
    rank[popular_items] = np.arange(1, config.num_items + 1)
    items_table = pa.table({"item_id": pa.array(np.arange(1, config.num_items + 1, dtype=np.int64)),
                            "popularity_rank": pa.array(rank)})  # fmt: skip
    users_table = pa.table({"user_id": pa.array(user_ids), "cycle_length": pa.array(cycles)})
    return events, items_table, users_table


def recall_ceiling(dataset: Dataset, history_lengths: list[int]) -> dict[int, float]:
    """Per history length ``L``: the share of users whose last event repeats the item ``cycle_length``
    events before it and lies within the last ``L`` events before it (HR@1 of an oracle that knows
    the rule and reads ``L`` events; held-out last event as in the ``paper`` protocol)."""
    if dataset.users is None or "cycle_length" not in dataset.users.column_names:
        raise ValueError("recall_ceiling: the dataset has no users.parquet cycle_length; make it with "
                         "`recforge data synthetic-long`")  # fmt: skip
    users = dataset.events.column("user_id").to_numpy()
    items = dataset.events.column("item_id").to_numpy()
    ends = np.r_[np.flatnonzero(users[1:] != users[:-1]), len(users) - 1]  # each user's last event
    cycle_by_user = dict(zip(dataset.users.column("user_id").to_numpy().tolist(),
                             dataset.users.column("cycle_length").to_numpy().tolist()))  # fmt: skip
    cycles = np.asarray([cycle_by_user[u] for u in users[ends].tolist()], dtype=np.int64)
    starts = np.r_[0, ends[:-1] + 1]
    earlier = ends - cycles
    repeats = (earlier >= starts) & (items[np.maximum(earlier, 0)] == items[ends])
    return {int(n): float(np.mean(repeats & (cycles <= n))) for n in history_lengths}


def write_long_synthetic(out_dir: str | os.PathLike, config: LongSyntheticConfig | None = None, *,
                         overwrite: bool = False) -> Path:  # fmt: skip
    """Generate and atomically write a long-history dataset (``dataset.json`` name ``synthetic-long``)."""
    config = config or LongSyntheticConfig()
    events, items, users = generate_long(config)
    return write_dataset(out_dir, events, items, name="synthetic-long", source=f"recforge.data.synthetic_long {config!r}",
                         overwrite=overwrite, users=users)  # fmt: skip


__all__ = ["LongSyntheticConfig", "generate_long", "recall_ceiling", "write_long_synthetic"]
