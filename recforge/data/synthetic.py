"""A built-in synthetic interaction generator with learnable sequential structure.

Used by ``recforge demo`` and by tests. The generated data look like a small media
catalogue: items belong to latent taste clusters ("Neon Jazz", "Cosmic Opera", ...),
users like a few clusters, and their sequences mix three signals a sequential
recommender can learn and a popularity baseline cannot:

* **Cluster persistence.** Each user has an *active* cluster that only moves, with
  probability ``drift_prob`` per step, to another of the user's preferred clusters.
  Consecutive items therefore mostly share a cluster.
* **Series structure.** Every item has one fixed *successor* inside its cluster (the
  clusters' items form cycles, like numbered episodes: the successor of
  "Neon Jazz #17" is "Neon Jazz #18", and the last one wraps to "#1"). With
  probability ``successor_prob`` the next item is the current item's successor.
* **Power-law popularity.** Otherwise the item is drawn from the active cluster with
  probability proportional to ``rank ** -popularity_exponent`` (rank within the
  cluster), and clusters themselves differ in popularity.

Generative process for one user (vectorised across users, one loop over time steps):

1. Choose ``k`` preferred clusters (``1 + Poisson(clusters_per_user - 1)``, clipped),
   without replacement, favouring popular clusters; weight them by
   ``Dirichlet(user_concentration)``. The sequence length is lognormal with mean
   about ``mean_seq_len``, clipped to ``[min_seq_len, max_seq_len]``.
2. The first active cluster is drawn from the user's weights; the first item from
   that cluster's power law.
3. At each later step: with ``successor_prob`` take the previous item's successor if
   the user has not seen it yet. Otherwise, with ``drift_prob`` move the active
   cluster to another of the user's clusters (by weight), then draw an item from the
   active cluster's power law *restricted to items the user has not seen*.

Items never repeat within a user's sequence: candidates already seen are redrawn
(rejection sampling, which is exactly the power law renormalised over unseen
items); after ``max_redraws`` rejections the draw is made directly from the unseen
items of the active cluster, or, when that cluster is exhausted, from the unseen
items of the user's other clusters, then of any cluster (the active cluster moves to
the drawn item's cluster). ``max_seq_len <= num_items`` guarantees an unseen item.

Timestamps are unix seconds starting around 2024-01-01 UTC, grouped into sessions:
with probability ``session_break_prob`` an event starts a new session after a long
gap (hours to days); otherwise it follows the previous one after a short gap
(seconds to minutes). Every event carries one ``action`` ("view", "click", "like",
"purchase") drawn from probabilities that grow with the user's affinity for the
item's cluster (see :func:`action_probabilities`).

The catalogue (clusters, popularity, successors, titles) depends only on
``seed``, ``num_items``, ``num_clusters``, ``popularity_exponent`` and
``cluster_popularity_exponent``; :func:`build_catalog` returns it with the ground
truth (e.g. the successor map) that the items table deliberately leaves out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from recforge.data.dataset import write_dataset

__all__ = [
    "SyntheticCatalog",
    "SyntheticConfig",
    "action_probabilities",
    "build_catalog",
    "generate",
    "generate_impressions",
    "impression_probabilities",
    "write_synthetic",
]

# 2024-01-01T00:00:00Z.
_EPOCH_2024 = 1_704_067_200
# Upper bound on the per-chunk "already seen" matrix (users x items booleans).
_SEEN_BYTES_BUDGET = 64 << 20

_ADJECTIVES = (
    "Neon", "Midnight", "Golden", "Velvet", "Electric", "Cosmic",
    "Rustic", "Silver", "Crimson", "Quiet", "Wild", "Lucky",
)  # fmt: skip
_GENRES = (
    "Jazz", "Noir", "Sci-Fi", "Cooking", "Thriller", "Romance", "Documentary", "Anime",
    "Western", "Comedy", "Opera", "Fantasy", "Horror", "Travel", "Poetry", "Mystery",
)  # fmt: skip


# ----------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of the synthetic generator (the defaults suit ``recforge demo``).

    Attributes:
        num_users: number of users; user IDs are ``1..num_users``.
        num_items: number of items; item IDs are ``1..num_items``.
        num_clusters: number of latent taste clusters (items are split evenly).
        mean_seq_len: approximate mean sequence length (lognormal, before clipping).
        min_seq_len: shortest sequence.
        max_seq_len: longest sequence; must not exceed ``num_items``.
        popularity_exponent: Zipf exponent of item popularity within a cluster.
        drift_prob: chance per step that the active cluster moves to another of the
            user's clusters (only on steps that do not follow a successor).
        successor_prob: chance per step that the next item is the current item's
            fixed successor (when the user has not seen it yet).
        seed: random seed; equal configs give identical data.
        (the remaining fields are documented where they are declared)
    """

    num_users: int = 3000
    num_items: int = 1500
    num_clusters: int = 20
    mean_seq_len: int = 50
    min_seq_len: int = 5
    max_seq_len: int = 200
    popularity_exponent: float = 1.1
    drift_prob: float = 0.1
    successor_prob: float = 0.3
    seed: int = 0
    seq_len_sigma: float = 0.6  # spread of the lognormal sequence lengths
    clusters_per_user: float = 2.5  # mean number of preferred clusters per user
    max_clusters_per_user: int = 5  # cap on preferred clusters per user
    user_concentration: float = 1.0  # Dirichlet concentration of cluster weights
    cluster_popularity_exponent: float = 0.7  # Zipf exponent of cluster popularity
    max_redraws: int = 8  # rejection rounds before the exact unseen-item draw
    session_break_prob: float = 0.15  # chance an event starts a new session (~7 events/session)
    within_session_gap_s: float = 90.0  # mean seconds between events of a session
    between_session_gap_s: float = 2 * 86_400.0  # mean seconds between sessions (on top of the minimum)
    min_session_gap_s: int = 3_600  # at least an hour between sessions
    start_time: int = _EPOCH_2024  # 2024-01-01 UTC
    start_spread_s: int = 14 * 86_400  # first events spread over two weeks
    action_names: tuple[str, ...] = ("view", "click", "like", "purchase")  # action vocabulary
    action_probs_low: tuple[float, ...] = (0.75, 0.20, 0.04, 0.01)  # at affinity 0 (outside the user's clusters)
    action_probs_high: tuple[float, ...] = (0.35, 0.35, 0.20, 0.10)  # at affinity 1; linear in between

    def __post_init__(self) -> None:
        problems = []
        if self.num_users < 1:
            problems.append("num_users must be >= 1")
        if self.num_clusters < 1:
            problems.append("num_clusters must be >= 1")
        if self.num_items < self.num_clusters:
            problems.append("num_items must be >= num_clusters (every cluster needs an item)")
        if not 1 <= self.min_seq_len <= self.max_seq_len:
            problems.append("need 1 <= min_seq_len <= max_seq_len")
        if self.max_seq_len > self.num_items:
            problems.append("max_seq_len must be <= num_items (items never repeat within a user)")
        if self.mean_seq_len <= 0 or self.seq_len_sigma < 0:
            problems.append("mean_seq_len must be > 0 and seq_len_sigma >= 0")
        for name in ("drift_prob", "successor_prob", "session_break_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems.append(f"{name} must be in [0, 1]")
        if self.popularity_exponent < 0 or self.cluster_popularity_exponent < 0:
            problems.append("popularity exponents must be >= 0")
        if self.clusters_per_user < 1 or self.max_clusters_per_user < 1:
            problems.append("clusters_per_user and max_clusters_per_user must be >= 1")
        if self.user_concentration <= 0:
            problems.append("user_concentration must be > 0")
        if self.max_redraws < 0:
            problems.append("max_redraws must be >= 0")
        if min(self.within_session_gap_s, self.between_session_gap_s, self.min_session_gap_s, self.start_spread_s) < 0:
            problems.append("time gaps must be >= 0")
        k = len(self.action_names)
        if k == 0 or len(set(self.action_names)) != k:
            problems.append("action_names must be non-empty and distinct")
        for name in ("action_probs_low", "action_probs_high"):
            probs = np.asarray(getattr(self, name), dtype=np.float64)
            if len(probs) != k or (probs < 0).any() or abs(probs.sum() - 1.0) > 1e-6:
                problems.append(f"{name} must have one non-negative probability per action, summing to 1")
        if problems:
            raise ValueError("SyntheticConfig: " + "; ".join(problems))


# --------------------------------------------------------------------------------------- catalogue


@dataclass(frozen=True)
class SyntheticCatalog:
    """The item catalogue and its ground truth (0-based item indices; item ID = index + 1).

    Attributes:
        cluster: ``(num_items,)`` cluster of each item.
        successor: ``(num_items,)`` index of each item's successor (same cluster).
        series_pos: ``(num_items,)`` 1-based position in the cluster's successor cycle.
        within_prob: ``(num_items,)`` popularity probability within the item's cluster.
        cluster_popularity: ``(num_clusters,)`` prior weight of each cluster (sums to 1).
        popularity: ``(num_items,)`` global popularity weight,
            ``cluster_popularity[cluster] * within_prob`` (sums to 1).
        cluster_names: ``(num_clusters,)`` human-readable cluster names.
        sorted_items: items ordered by cluster, then by decreasing popularity.
        offset_cum: ``cluster + cumulative within_prob`` along ``sorted_items``; one
            ``searchsorted`` of ``cluster + u`` draws from a cluster's power law.
        cluster_end: ``(num_clusters,)`` end index of each cluster in ``sorted_items``.
    """

    cluster: np.ndarray
    successor: np.ndarray
    series_pos: np.ndarray
    within_prob: np.ndarray
    cluster_popularity: np.ndarray
    popularity: np.ndarray
    cluster_names: list[str]
    sorted_items: np.ndarray
    offset_cum: np.ndarray
    cluster_end: np.ndarray

    def draw(self, clusters: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Draw one item per entry of ``clusters`` from that cluster's power law.

        Args:
            clusters: cluster index per draw.
            rng: random generator.

        Returns:
            Item indices, one per entry of ``clusters``.
        """
        target = clusters + rng.random(len(clusters))
        pos = np.searchsorted(self.offset_cum, target, side="right")
        return self.sorted_items[np.minimum(pos, self.cluster_end[clusters] - 1)]


def _cluster_name(c: int) -> str:
    g = c % len(_GENRES)
    m = c // len(_GENRES)
    # 5 is coprime with 12, so (genre, adjective) pairs are distinct for c < 192.
    name = f"{_ADJECTIVES[(5 * m + 7 * g) % len(_ADJECTIVES)]} {_GENRES[g]}"
    rounds = c // (len(_GENRES) * len(_ADJECTIVES))
    return f"{name} {rounds + 1}" if rounds else name


def _rngs(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    catalog_seq, user_seq = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(catalog_seq), np.random.default_rng(user_seq)


def build_catalog(config: SyntheticConfig) -> SyntheticCatalog:
    """Build the item catalogue used by :func:`generate` for ``config``.

    Items are shuffled and split evenly into clusters (so IDs reveal nothing);
    within a cluster a random permutation gives popularity ranks and another the
    successor cycle.

    Args:
        config: generator configuration.

    Returns:
        The catalogue, identical to the one :func:`generate` uses.
    """
    rng, _ = _rngs(config.seed)
    n, c_count = config.num_items, config.num_clusters
    cluster = np.empty(n, dtype=np.int64)
    successor = np.empty(n, dtype=np.int64)
    series_pos = np.empty(n, dtype=np.int64)
    within_prob = np.empty(n, dtype=np.float64)
    sorted_parts, cum_parts, ends = [], [], []
    end = 0
    for c, members in enumerate(np.array_split(rng.permutation(n), c_count)):
        cluster[members] = c
        by_pop = rng.permutation(members)  # by_pop[r] has within-cluster popularity rank r + 1
        weights = np.arange(1, len(members) + 1, dtype=np.float64) ** -config.popularity_exponent
        weights /= weights.sum()
        within_prob[by_pop] = weights
        cycle = rng.permutation(members)
        successor[cycle] = np.roll(cycle, -1)
        series_pos[cycle] = np.arange(1, len(members) + 1)
        cum = np.cumsum(weights)
        cum[-1] = 1.0
        sorted_parts.append(by_pop)
        cum_parts.append(c + cum)
        end += len(members)
        ends.append(end)
    cluster_weights = np.arange(1, c_count + 1, dtype=np.float64) ** -config.cluster_popularity_exponent
    cluster_popularity = rng.permutation(cluster_weights)
    cluster_popularity /= cluster_popularity.sum()
    return SyntheticCatalog(
        cluster=cluster,
        successor=successor,
        series_pos=series_pos,
        within_prob=within_prob,
        cluster_popularity=cluster_popularity,
        popularity=cluster_popularity[cluster] * within_prob,
        cluster_names=[_cluster_name(c) for c in range(c_count)],
        sorted_items=np.concatenate(sorted_parts),
        offset_cum=np.concatenate(cum_parts),
        cluster_end=np.asarray(ends, dtype=np.int64),
    )


# ------------------------------------------------------------------------------------ action model


def action_probabilities(affinity: np.ndarray, config: SyntheticConfig) -> np.ndarray:
    """Per-event action probabilities given user–item affinity.

    The affinity of a user for an item is the user's weight on the item's cluster
    divided by the user's largest cluster weight (1 for the favourite cluster, 0
    outside the user's clusters). Probabilities interpolate linearly between
    ``config.action_probs_low`` (affinity 0) and ``config.action_probs_high``
    (affinity 1).

    Args:
        affinity: ``(n,)`` affinities in ``[0, 1]``.
        config: generator configuration.

    Returns:
        ``(n, len(config.action_names))`` probabilities; each row sums to 1.
    """
    a = np.clip(np.asarray(affinity, dtype=np.float64), 0.0, 1.0)[:, None]
    low = np.asarray(config.action_probs_low, dtype=np.float64)
    high = np.asarray(config.action_probs_high, dtype=np.float64)
    return (1.0 - a) * low + a * high


# ---------------------------------------------------------- vectorised simulation of the sequences


def _sample_rows(weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sample one column index per row with probability proportional to ``weights`` (rows sum > 0)."""
    cum = np.cumsum(weights, axis=1)
    u = rng.random(len(weights)) * cum[:, -1]
    return np.minimum((cum <= u[:, None]).sum(axis=1), weights.shape[1] - 1)


def _user_cluster_weights(
    n: int, config: SyntheticConfig, cat: SyntheticCatalog, rng: np.random.Generator
) -> np.ndarray:
    """``(n, num_clusters)`` cluster weights: a few clusters per user, Dirichlet-weighted."""
    c_count = config.num_clusters
    k = 1 + rng.poisson(config.clusters_per_user - 1.0, size=n)
    k = np.clip(k, 1, min(c_count, config.max_clusters_per_user))
    # Gumbel top-k: k distinct clusters per user, favouring popular ones.
    keys = np.log(cat.cluster_popularity)[None, :] + rng.gumbel(size=(n, c_count))
    rank = np.argsort(np.argsort(-keys, axis=1), axis=1)
    weights = rng.gamma(config.user_concentration, size=(n, c_count)) * (rank < k[:, None])
    weights = np.maximum(weights, 1e-12 * (rank < k[:, None]))  # gamma may underflow to 0
    return weights / weights.sum(axis=1, keepdims=True)


def _simulate_chunk(
    lengths: np.ndarray, config: SyntheticConfig, cat: SyntheticCatalog, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Simulate the item sequences of one chunk of users.

    Args:
        lengths: ``(n,)`` sequence length per user.
        config: generator configuration.
        cat: item catalogue.
        rng: random generator.

    Returns:
        ``(items, affinity)``, both ``(n, max(lengths))``; entries past a user's
        length are -1 / 0.
    """
    n, steps = len(lengths), int(lengths.max())
    weights = _user_cluster_weights(n, config, cat, rng)
    top_weight = weights.max(axis=1)
    seen = np.zeros((n, config.num_items), dtype=bool)
    items = np.full((n, steps), -1, dtype=np.int64)
    affinity = np.zeros((n, steps), dtype=np.float64)
    active = _sample_rows(weights, rng)
    prev = np.full(n, -1, dtype=np.int64)
    for t in range(steps):
        rows = np.flatnonzero(lengths > t)
        chosen = np.full(len(rows), -1, dtype=np.int64)
        if t > 0:
            succ = cat.successor[prev[rows]]
            follow = (rng.random(len(rows)) < config.successor_prob) & ~seen[rows, succ]
            chosen[follow] = succ[follow]
            drift = rows[~follow & (rng.random(len(rows)) < config.drift_prob)]
            if len(drift):
                w = weights[drift].copy()
                w[np.arange(len(drift)), active[drift]] = 0.0
                movable = w.sum(axis=1) > 0  # users with a single cluster stay put
                active[drift[movable]] = _sample_rows(w[movable], rng)
        pending = np.flatnonzero(chosen < 0)
        for _ in range(config.max_redraws):
            if not len(pending):
                break
            cand = cat.draw(active[rows[pending]], rng)
            fresh = ~seen[rows[pending], cand]
            chosen[pending[fresh]] = cand[fresh]
            pending = pending[~fresh]
        if len(pending):
            chosen[pending] = _exact_unseen_draw(rows[pending], active, weights, seen, cat, rng)
        seen[rows, chosen] = True
        active[rows] = cat.cluster[chosen]
        prev[rows] = chosen
        items[rows, t] = chosen
        affinity[rows, t] = weights[rows, cat.cluster[chosen]] / top_weight[rows]
    return items, affinity


def _exact_unseen_draw(
    users: np.ndarray,
    active: np.ndarray,
    weights: np.ndarray,
    seen: np.ndarray,
    cat: SyntheticCatalog,
    rng: np.random.Generator,
) -> np.ndarray:
    """Draw from unseen items: active cluster first, then the user's clusters, then any."""
    unseen = ~seen[users]
    in_active = cat.cluster[None, :] == active[users][:, None]
    w = cat.within_prob[None, :] * unseen * in_active
    empty = w.sum(axis=1) <= 0
    if empty.any():
        w[empty] = weights[users[empty]][:, cat.cluster] * cat.within_prob[None, :] * unseen[empty]
        empty = w.sum(axis=1) <= 0
        if empty.any():
            w[empty] = cat.popularity[None, :] * unseen[empty]
    return _sample_rows(w, rng)


# ------------------------------------------------------------------------------------ interactions


def generate(config: SyntheticConfig) -> tuple[pa.Table, pa.Table]:
    """Generate a synthetic interaction dataset.

    Args:
        config: generator configuration (see the module docstring for the process).

    Returns:
        ``(events, items)`` in the canonical layout of ``recforge.data.dataset``.
        ``events`` has int64 ``user_id``, ``item_id``, ``timestamp`` (unix seconds)
        and a string ``action``, sorted by ``(user_id, timestamp)``. ``items`` has
        int64 ``item_id``, int64 ``cluster``, string ``cluster_name``, string
        ``title`` (e.g. "Neon Jazz #17"; #18 is its successor) and int64
        ``popularity_rank`` (1 = highest generating popularity weight).
    """
    events, items, _, _ = _simulate(config)
    return events, items


def _simulate(config: SyntheticConfig) -> tuple[pa.Table, pa.Table, np.ndarray, np.ndarray]:
    """``generate``'s tables plus each event's user-item affinity and each item's cluster."""
    cat = build_catalog(config)
    _, rng = _rngs(config.seed)
    u_count = config.num_users

    mu = np.log(config.mean_seq_len) - config.seq_len_sigma**2 / 2
    lengths = np.rint(rng.lognormal(mu, config.seq_len_sigma, size=u_count)).astype(np.int64)
    lengths = np.clip(lengths, config.min_seq_len, config.max_seq_len)

    chunk = max(1, _SEEN_BYTES_BUDGET // config.num_items)
    item_parts, aff_parts = [], []
    for lo in range(0, u_count, chunk):
        items, affinity = _simulate_chunk(lengths[lo : lo + chunk], config, cat, rng)
        valid = items >= 0
        item_parts.append(items[valid])  # row-major: by user, then step
        aff_parts.append(affinity[valid])
    item_idx = np.concatenate(item_parts)
    affinity = np.concatenate(aff_parts)
    user_id = np.repeat(np.arange(1, u_count + 1, dtype=np.int64), lengths)
    n_events = len(item_idx)

    # Sessions and timestamps.
    first = np.zeros(n_events, dtype=bool)
    first[np.cumsum(lengths)[:-1]] = True
    first[0] = True
    new_session = rng.random(n_events) < config.session_break_prob
    short = 1 + np.floor(rng.exponential(config.within_session_gap_s, size=n_events))
    long = config.min_session_gap_s + np.floor(rng.exponential(config.between_session_gap_s, size=n_events))
    gaps = np.where(new_session, long, short).astype(np.int64)
    start = config.start_time + np.floor(rng.random(u_count) * config.start_spread_s).astype(np.int64)
    gaps[first] = start
    timestamp = np.cumsum(gaps)
    user_offset = np.repeat(timestamp[first] - start, lengths)
    timestamp -= user_offset

    # Actions.
    probs = action_probabilities(affinity, config)
    cum = np.cumsum(probs, axis=1)
    draws = rng.random(n_events)
    codes = np.minimum((cum <= draws[:, None]).sum(axis=1), len(config.action_names) - 1).astype(np.int32)
    action = pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(list(config.action_names))).cast(pa.string())

    events = pa.table(
        {
            "user_id": pa.array(user_id, type=pa.int64()),
            "item_id": pa.array(item_idx + 1, type=pa.int64()),
            "timestamp": pa.array(timestamp, type=pa.int64()),
            "action": action,
        }
    )

    rank = np.empty(config.num_items, dtype=np.int64)
    rank[np.argsort(-cat.popularity, kind="stable")] = np.arange(1, config.num_items + 1)
    names = np.asarray(cat.cluster_names, dtype=object)
    item_names = names[cat.cluster]
    titles = [f"{name} #{pos}" for name, pos in zip(item_names, cat.series_pos.tolist())]
    items_table = pa.table(
        {
            "item_id": pa.array(np.arange(1, config.num_items + 1, dtype=np.int64)),
            "cluster": pa.array(cat.cluster, type=pa.int64()),
            "cluster_name": pa.array(item_names.tolist(), type=pa.string()),
            "title": pa.array(titles, type=pa.string()),
            "popularity_rank": pa.array(rank, type=pa.int64()),
        }
    )
    return events, items_table, affinity, cat.cluster


# Impression label model: logit = bias + w_affinity * affinity + w_same * (same cluster as the
# user's previous item). Labels are independent Bernoulli draws from these probabilities.
IMPRESSION_LOGITS = {"click": (-2.6, 2.4, 0.8), "like": (-3.4, 2.2, 0.8), "purchase": (-4.4, 2.6, 1.0)}


# ---------------------------------------------------------------------- impressions (ranking data)


def impression_probabilities(affinity: np.ndarray, same_cluster: np.ndarray) -> np.ndarray:
    """(n, 3) click / like / purchase probabilities of impressions (see ``IMPRESSION_LOGITS``)."""
    a = np.asarray(affinity, dtype=np.float64)
    s = np.asarray(same_cluster, dtype=np.float64)
    logits = np.stack([b + wa * a + ws * s for b, wa, ws in IMPRESSION_LOGITS.values()], axis=1)
    return 1.0 / (1.0 + np.exp(-logits))


def generate_impressions(config: SyntheticConfig) -> tuple[pa.Table, pa.Table]:
    """Synthetic ranking data: every event is an impression with known label probabilities.

    Each event gets independent ``click``, ``like`` and ``purchase`` labels (float32 0/1)
    drawn from :func:`impression_probabilities` of the user's affinity for the item's
    cluster and whether the item continues the previous item's cluster, the generating
    probabilities as ``p_click``, ``p_like``, ``p_purchase`` (so the Bayes-optimal AUC is
    computable), and an ``action`` naming the strongest positive label ("view" if none),
    which is what a history token can show later impressions.
    """
    events, items, affinity, cluster = _simulate(config)
    item_cluster = cluster[events.column("item_id").to_numpy() - 1]
    users = events.column("user_id").to_numpy()
    same = np.zeros(len(users), dtype=bool)
    same[1:] = (item_cluster[1:] == item_cluster[:-1]) & (users[1:] == users[:-1])
    probs = impression_probabilities(affinity, same)
    rng = np.random.default_rng([config.seed, 7])
    labels = rng.random(probs.shape) < probs
    names = list(IMPRESSION_LOGITS)
    strongest = np.where(labels[:, 2], 3, np.where(labels[:, 1], 2, np.where(labels[:, 0], 1, 0)))
    action = np.asarray(["view", *names], dtype=object)[strongest]
    columns = {name: events.column(name) for name in ("user_id", "item_id", "timestamp")}
    columns["action"] = pa.array(action.tolist(), type=pa.string())
    for k, name in enumerate(names):
        columns[name] = pa.array(labels[:, k].astype(np.float32))
    for k, name in enumerate(names):
        columns[f"p_{name}"] = pa.array(probs[:, k].astype(np.float32))
    return pa.table(columns), items


# ------------------------------------------------------------------------------- writing a dataset


def write_synthetic(
    out_dir: str | os.PathLike, config: SyntheticConfig | None = None, *, overwrite: bool = False, impressions: bool = False
) -> Path:
    """Generate a synthetic dataset and write it in the canonical layout.

    Args:
        out_dir: target directory; must not exist unless ``overwrite``.
        config: generator configuration; defaults to ``SyntheticConfig()``.
        overwrite: replace an existing dataset directory.
        impressions: write ranking data with labels and their generating probabilities
            (:func:`generate_impressions`) instead of plain interactions.

    Returns:
        The path written. ``dataset.json`` records ``name="synthetic"`` (or
        ``"synthetic-impressions"``) and the config's repr as ``source``.
    """
    config = config or SyntheticConfig()
    events, items = generate_impressions(config) if impressions else generate(config)
    source = f"recforge.data.synthetic {config!r}"
    name = "synthetic-impressions" if impressions else "synthetic"
    return write_dataset(out_dir, events, items, name=name, source=source, overwrite=overwrite)
