"""KV-cache pool eviction policy: under slru users seen again outlive a burst of users seen once (under lru they do
not), a dropped user that returns starts protected (ghost list), and every bound holds under random churn."""

from __future__ import annotations

import random

import pytest
import torch

from recforge.serve.cache_manager import CacheManager
from recforge.serve.kv_policy import GHOST_OVERHEAD, GhostList, Segments
from recforge.serve.kv_pool import KVCachePool, PoolConfig

LAYERS, HEADS, DQK, DV, CTX, BS = 2, 2, 4, 3, 2, 8
CPU = torch.device("cpu")


def _pool(policy: str, device_mb: float = 0.02, host_mb: float = 0.0, share: float = 0.8) -> KVCachePool:
    return KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, CPU,
                       PoolConfig(device_mb=device_mb, host_mb=host_mb, block_size=BS, policy=policy, protected_share=share))  # fmt: skip


def _identity(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.tensor([[0, 0, 1, 0], [0, 0, 9, 0]])
    events = torch.stack([torch.randint(1, 90, (n,), generator=gen), torch.randint(0, 3, (n,), generator=gen),
                          torch.zeros(n, dtype=torch.int64), torch.randint(1, 50, (n,), generator=gen).cumsum(0)], 1)  # fmt: skip
    return torch.cat([ctx, events])


def _keys(identity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mix = (identity[:, 0] * 7 + identity[:, 1] * 3 + identity[:, 3]).cumsum(0) % 9973  # (n,)
    grid = torch.arange(LAYERS * HEADS * DQK, dtype=torch.float32).view(LAYERS, 1, HEADS, DQK)
    keys = mix.float().view(1, -1, 1, 1) + grid / 64  # (layers, n, H, Dqk)
    return keys, -keys[..., :DV]


def _serve(cache: CacheManager, user: str, identity: torch.Tensor) -> int:
    """One request through the pool (acquire, check the reused keys, compute the rest, release); tokens reused."""
    tokens = dict(zip(("item_ids", "actions", "context_ids", "timestamps"), identity.unbind(1)))
    state = cache.acquire(user, tokens, CTX)
    k, n = state.length, identity.shape[0]
    keys, values = _keys(identity)
    assert torch.equal(state.keys[:, :k], keys[:, :k]) and torch.equal(state.values[:, :k], values[:, :k])
    state.keys[:, k:n], state.values[:, k:n] = keys[:, k:], values[:, k:]
    state.timestamps[k:n], state.tokens[k:n], state.length = identity[k:, 3], identity[k:], n
    cache.release(user, state, k)
    return k


def _cache(pool: KVCachePool) -> CacheManager:
    return CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, CPU, pool.version, pool)


@pytest.mark.parametrize("host_mb", [0.0, 0.03])
@pytest.mark.parametrize("policy", ["slru", "lru"])
def test_a_returning_user_outlives_a_burst_of_one_time_users(policy: str, host_mb: float) -> None:
    """A user served twice, then a burst of new users (each seen once) worth several device tiers: under slru its
    next request is a device hit; under lru it was pushed out (dropped, or to the host tier)."""
    pool = _pool(policy, host_mb=host_mb)
    cache, rng = _cache(pool), random.Random()
    regular = _identity(30, rng.randrange(10**6))  # 32 tokens: 4 pages
    _serve(cache, "regular", regular)
    assert _serve(cache, "regular", regular) == 32  # seen again
    burst = rng.randint(3, 5) * pool.num_blocks // 4
    for i in range(burst):
        _serve(cache, f"new{i}", _identity(rng.randint(20, 30), rng.randrange(10**6)))
    hits = pool.stats.device_hits
    reused = _serve(cache, "regular", regular)
    if policy == "slru":
        assert pool.stats.device_hits == hits + 1 and reused == 32
    else:  # pushed out of the device tier: recomputed, or copied back from the host tier
        assert pool.stats.device_hits == hits and (reused == 0 or pool.stats.host_hits == 1)


def test_a_dropped_user_that_returns_starts_protected() -> None:
    """Seen once, dropped by a burst (probation), then back: its new entry is admitted as protected (the ghost list
    remembered it) and outlives the next burst."""
    pool = _pool("slru", host_mb=0.1)
    cache, rng = _cache(pool), random.Random()
    user = _identity(30, rng.randrange(10**6))
    _serve(cache, "u", user)
    i = 0
    while "u" in pool.entries or "u" in pool.host:  # new users until it is dropped from both tiers
        _serve(cache, f"a{i}", _identity(30, rng.randrange(10**6)))
        i += 1
    assert i > pool.num_blocks // 4 and next(reversed(pool.ghost.keys)) == "u"
    assert _serve(cache, "u", user) == 0
    assert pool.order.is_protected("u") and pool.stats.ghost_admissions == 1 and "u" not in pool.ghost.keys
    for i in range(3 * pool.num_blocks // 4):
        _serve(cache, f"b{i}", _identity(30, rng.randrange(10**6)))
    assert "u" in pool.entries and _serve(cache, "u", user) == 32


def test_the_ghost_list_is_bounded_in_bytes_and_counted_in_the_host_bound() -> None:
    pool = _pool("slru", host_mb=0.03)
    cache, rng = _cache(pool), random.Random()
    assert 0 < pool.ghost.limit == pool.host_limit // 128
    for i in range(300):  # long user keys: each ghost costs its bytes
        _serve(cache, f"user-{i}-" + "x" * rng.randint(0, 60), _identity(rng.randint(5, 30), i))
        assert pool.ghost.bytes <= pool.ghost.limit and pool.host_bytes <= pool.host_limit
        assert pool.ghost.bytes == sum(len(u.encode()) + GHOST_OVERHEAD for u in pool.ghost.keys)
    assert pool.report()["ghost_users"] == len(pool.ghost) > 0 and pool.report()["ghost_bytes"] == pool.ghost.bytes
    assert _pool("lru", host_mb=0.03).ghost.limit == 0  # lru keeps none
    ghosts = GhostList(3 * (GHOST_OVERHEAD + 2))
    for user in ("a1", "b2", "c3", "d4", "b2"):
        ghosts.remember(user)
    assert list(ghosts.keys) == ["c3", "d4", "b2"] and ghosts.bytes == ghosts.limit  # the oldest forgotten first
    assert ghosts.take("d4") and not ghosts.take("d4") and len(ghosts) == 2


def test_segments_cap_the_protected_share_and_evict_probation_first() -> None:
    seg = Segments(0.5, capacity=10)
    seg.add("a", 2)
    seg.add("b", 3)
    seg.hit("a")
    seg.hit("b")  # 5 protected pages: at the cap
    assert not seg.probation and seg.victim() == "a"
    seg.add("c", 1)
    assert seg.victim() == "c"
    seg.hit("c")  # 6 > 5: the least recently used protected ("a") goes back to probation
    assert list(seg.probation) == ["a"] and list(seg.protected) == ["b", "c"] and seg.protected_pages == 4
    lru = Segments(0.0, capacity=10)
    for user in "xyz":
        lru.add(user, 1, protected=True)
    lru.hit("x")
    assert list(lru.probation) == ["y", "z", "x"] and not lru.protected


@pytest.mark.parametrize("policy", ["slru", "lru"])
def test_bounds_and_accounting_hold_under_random_churn(policy: str) -> None:
    seed = random.randrange(2**31)
    print(f"seed {seed}")  # shown when the test fails
    rng = random.Random(seed)
    pool = _pool(policy, device_mb=0.02, host_mb=0.04, share=rng.choice([0.5, 0.8, 1.0]))
    cache = _cache(pool)
    histories: dict[str, torch.Tensor] = {}
    for step in range(500):
        roll = rng.random()
        user = f"r{min(int(rng.paretovariate(1.2)), 60)}" if roll < 0.6 else f"once{step}"
        hist = histories.get(user)
        if hist is None or rng.random() < 0.1:  # new, or rewritten from the start
            hist = _identity(rng.randint(1, 50), rng.randrange(10**6))
        elif rng.random() < 0.7:  # a few new events
            extra = _identity(rng.randint(0, 3), rng.randrange(10**6))[CTX:]
            extra[:, 3] += int(hist[-1, 3])
            hist = torch.cat([hist, extra])
        histories[user] = hist
        _serve(cache, user, hist)
        if rng.random() < 0.01:
            pool.invalidate(f"v{step}")
            cache = _cache(pool)
        _check(pool)
    report = pool.report()
    assert report["dropped"] > 0 and report["host_hits"] > 0 and report["device_hits"] > 0


def _check(pool: KVCachePool) -> None:
    """Every invariant of the pool and its eviction order."""
    used = [b for e in pool.entries.values() for b in e.blocks]
    assert len(used) + len(pool.free) == pool.num_blocks and len(set(used) | set(pool.free)) == pool.num_blocks
    host = [p for e in pool.host.values() for p in e.blocks]
    hp = pool.host_pages
    assert len(host) + len(hp.free) == hp.num_pages and len(set(host) | set(hp.free)) == hp.num_pages
    for order, tier in ((pool.order, pool.entries), (pool.host_order, pool.host)):
        assert set(order.probation) | set(order.protected) == set(tier) and len(order) == len(tier)
        assert all(order.probation.get(u, order.protected.get(u)) == len(e.blocks) for u, e in tier.items())
        assert order.protected_pages == sum(order.protected.values()) <= order.share * order.capacity
    assert pool.host_order.capacity == hp.num_pages and pool.order.capacity == pool.num_blocks
    assert not set(pool.ghost.keys) & (set(pool.entries) | set(pool.host))
    assert pool.ghost.bytes <= pool.ghost.limit and pool.host_bytes <= pool.host_limit
    meta = sum(e.tokens.numel() * 8 + len(e.blocks) * 8 + len(u.encode()) + 512 for u, e in pool.entries.items())
    assert meta == pool.metadata_bytes


def test_the_policy_is_validated() -> None:
    with pytest.raises(ValueError, match=r"policy: 'fifo' is not one of \('lru', 'slru'\)"):
        PoolConfig(policy="fifo").validate()
    with pytest.raises(ValueError, match=r"protected_share: must be in \(0, 1\], got 0"):
        PoolConfig(protected_share=0).validate()


def test_a_reload_keeps_the_users_known() -> None:
    """After ``invalidate`` (a new model) the cached users are on the ghost list: the first one back starts protected."""
    pool = _pool("slru", host_mb=0.03)
    cache, rng = _cache(pool), random.Random()
    hist = _identity(20, rng.randrange(10**6))
    _serve(cache, "u", hist)
    pool.invalidate("v2")
    assert not pool.entries and "u" in pool.ghost.keys
    cache = _cache(pool)
    assert _serve(cache, "u", hist) == 0 and pool.order.is_protected("u")
