"""KV-cache pool under churn: many users through a small device tier and a small host tier, requests out of
order and rewritten histories; every reused prefix holds exactly the keys/values written for it."""

from __future__ import annotations

import random

import pytest
import torch

from recforge.serve.cache_manager import CacheManager
from recforge.serve.kv_host import HostPages
from recforge.serve.kv_pool import KVCachePool, PoolConfig

LAYERS, HEADS, DQK, DV, CTX = 2, 2, 4, 3, 2


def _keys_values(identity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for a prefix's keys/values: token i's depend on tokens 0..i (a prefix sum), as real ones do."""
    mix = (identity[:, 0] * 7 + identity[:, 1] * 3 + identity[:, 3]).cumsum(0) % 9973  # (n,)
    grid = torch.arange(LAYERS * HEADS * DQK, dtype=torch.float32).view(LAYERS, 1, HEADS, DQK)
    keys = mix.float().view(1, -1, 1, 1) + grid / 64  # (layers, n, H, Dqk)
    values = -mix.float().view(1, -1, 1, 1) - grid[..., :DV] / 32
    return keys, values


def _tokens(identity: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(zip(("item_ids", "actions", "context_ids", "timestamps"), identity.unbind(1)))


def _serve(cache: CacheManager, user: str, identity: torch.Tensor) -> tuple[int, bool]:
    """One request: acquire, check what was reused, compute the rest, release. (reused, written)."""
    state = cache.acquire(user, _tokens(identity), CTX)
    k, n = state.length, identity.shape[0]
    keys, values = _keys_values(identity)
    torch.testing.assert_close(state.keys[:, :k].cpu(), keys[:, :k], rtol=0, atol=0)
    torch.testing.assert_close(state.values[:, :k].cpu(), values[:, :k], rtol=0, atol=0)
    assert torch.equal(state.timestamps[:k].cpu(), identity[:k, 3]) and torch.equal(state.tokens[:k], identity[:k])
    device = state.keys.device
    state.keys[:, k:n], state.values[:, k:n] = keys[:, k:].to(device), values[:, k:].to(device)
    state.timestamps[k:n], state.tokens[k:n], state.length = identity[k:, 3].to(device), identity[k:], n
    return k, cache.release(user, state, k)


def _history(rng: random.Random, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.tensor([[0, 0, seed % 5 + 1, 0], [0, 0, 9, 0]])
    events = torch.stack([torch.randint(1, 90, (n,), generator=gen), torch.randint(0, 3, (n,), generator=gen),
                          torch.zeros(n, dtype=torch.int64), torch.randint(1, 50, (n,), generator=gen).cumsum(0)], 1)  # fmt: skip
    return torch.cat([ctx, events])


def test_churn_reuses_exact_prefixes_and_keeps_every_bound() -> None:
    _churn(torch.device("cpu"))


@pytest.mark.gpu
def test_churn_on_cuda_with_pinned_pages_and_asynchronous_copies(cuda_device) -> None:
    _churn(cuda_device)


def _churn(device: torch.device) -> None:
    seed = random.randrange(2**31)
    print(f"seed {seed}")  # shown when the test fails
    rng = random.Random(seed)
    pool = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, device,
                       PoolConfig(device_mb=0.02, host_mb=0.04, block_size=8))  # fmt: skip
    cache = CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, device, "0", pool)
    histories: dict[str, torch.Tensor] = {}
    seen: dict[str, list[torch.Tensor]] = {}  # every request a user made: older ones are resent out of order
    for step in range(600):
        user = f"u{rng.randrange(40)}" if rng.random() > 0.1 else f"new{step}"
        full = histories.get(user)
        if full is None:
            full = histories[user] = _history(rng, rng.randrange(5, 40), step)
        roll = rng.random()
        if roll < 0.2 and seen.get(user):  # an older request arriving late
            identity = rng.choice(seen[user])
        elif roll < 0.3:  # a rewritten tail: the history diverges after a common prefix
            cut = rng.randrange(CTX, full.shape[0] + 1)
            tail = _history(rng, rng.randrange(1, 6), step + 10_000)[CTX:]
            tail[:, 3] += int(full[cut - 1, 3])
            identity = histories[user] = torch.cat([full[:cut], tail])
        else:  # 0-2 new events
            extra = _history(rng, 2, step + 20_000)[CTX : CTX + rng.randrange(0, 3)]
            extra[:, 3] += int(full[-1, 3])
            identity = histories[user] = torch.cat([full, extra])
        seen.setdefault(user, []).append(identity)
        entry_before = pool.entries.get(user) or pool.host.get(user)
        longer = entry_before is not None and entry_before.length > identity.shape[0]
        generation = pool.generation_of(user)
        reused, written = _serve(cache, user, identity)
        assert written or identity.shape[0] > pool.num_blocks * 8
        if longer and reused == identity.shape[0]:  # an older request: the newer entry stays as it was
            assert pool.generation_of(user) == generation
        used = sum(len(e.blocks) for e in pool.entries.values())
        assert used + len(pool.free) == pool.num_blocks and len(set(pool.free)) == len(pool.free)
        host = sum(len(e.blocks) for e in pool.host.values())
        assert host + len(pool.host_pages.free) == pool.host_pages.num_pages
        assert pool.host_bytes <= pool.host_limit
    report = pool.report()
    assert report["older"] > 0 and report["diverged"] > 0 and report["host_hits"] > 0 and report["dropped"] > 0
    for user in list(pool.entries) + list(pool.host):  # every entry still cached serves its user exactly
        if user in pool.entries or user in pool.host:  # (serving one may have dropped another)
            reused, _ = _serve(cache, user, histories[user])
            assert reused >= CTX


def test_host_pages_are_reused_not_reallocated() -> None:
    pool = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"),
                       PoolConfig(device_mb=0.01, host_mb=0.05, block_size=8))  # fmt: skip
    cache = CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"), "0", pool)
    rng = random.Random(0)
    for i in range(60):  # fill both tiers
        _serve(cache, f"u{i}", _history(rng, 20, i))
    chunks, allocated = len(pool.host_pages.chunks), pool.host_pages.allocated_bytes
    assert pool.report()["evicted_to_host"] > 0 and allocated <= pool.host_limit
    for i in range(60, 200):
        _serve(cache, f"u{i}", _history(rng, 20, i))
    assert len(pool.host_pages.chunks) == chunks and pool.host_pages.allocated_bytes == allocated


def test_host_pages_round_trip_and_runs() -> None:
    pages = HostPages(((LAYERS, 4, HEADS, DQK), (LAYERS, 4, HEADS, DV)), torch.float32, pin=False)
    assert pages.grow(10 * pages.page_bytes + 3) and pages.num_pages == 10 and not pages.grow(pages.page_bytes - 1)
    times = torch.randint(0, 100, (6, 4))
    keys, values = torch.randn(6, LAYERS, 4, HEADS, DQK), torch.randn(6, LAYERS, 4, HEADS, DV)
    held = pages.take(4)
    pages.store(held, times, keys, values, [5, 1, 2, 3])
    out = torch.zeros_like(times), torch.zeros_like(keys), torch.zeros_like(values)
    pages.load(held, *out, [0, 4, 3, 2])
    for got, want in zip(out, (times, keys, values)):
        assert torch.equal(got[[0, 4, 3, 2]], want[[5, 1, 2, 3]])


def test_a_refused_host_allocation_loses_no_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page-locked memory refused while the host tier grows: evicted users are dropped, no device page is lost, and
    serving goes on (the pool's block accounting stays whole)."""
    pool = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"),
                       PoolConfig(device_mb=0.01, host_mb=0.05, block_size=8, host_prealloc=False))  # fmt: skip
    cache = CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"), "0", pool)
    real_empty = torch.empty

    def refusing_empty(*args, **kwargs):
        if kwargs.get("dtype") is torch.uint8:  # the slab's chunks
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", refusing_empty)
    rng = random.Random(1)
    for i in range(40):  # many more users than the device tier holds: every eviction needs the host tier
        _serve(cache, f"u{i}", _history(rng, 20, i))
        used = sum(len(e.blocks) for e in pool.entries.values())
        assert used + len(pool.free) == pool.num_blocks and len(set(pool.free)) == len(pool.free)
    report = pool.report()
    assert report["dropped"] > 0 and report["evicted_to_host"] == 0 and pool.host_pages.num_pages == 0


def test_an_empty_prefix_is_evicted_without_error() -> None:
    """A user whose cached prefix is empty (no contextual tokens, no events) has no pages; evicting it under a tight
    host bound must not fail (it once divided by its page count)."""
    pool = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"),
                       PoolConfig(device_mb=0.01, host_mb=0.002, block_size=8))  # fmt: skip
    from recforge.serve.kv_pool import _Entry

    entry = _Entry([], 0, torch.zeros(0, 4, dtype=torch.int64), 0, pool.version, 1)
    half = pool.host_limit // 2
    pool.host_metadata_bytes = half  # other users' metadata: this one's does not fit beside it (spare < 0)
    assert pool._host_room(0, pool.host_limit - half + 1) is False  # nothing to drop: refused, no ZeroDivisionError
    pool.host_metadata_bytes = 0
    pool._evict("empty-user", entry)
    assert len(pool.free) == pool.num_blocks


def test_a_page_larger_than_a_chunk_still_gets_host_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A big model's page can exceed the slab's chunk size: the chunk then holds one page (the host tier used to stay
    empty and drop every evicted user)."""
    import recforge.serve.kv_host as kv_host

    monkeypatch.setattr(kv_host, "CHUNK_BYTES", 256)
    pages = HostPages(((LAYERS, 4, HEADS, DQK), (LAYERS, 4, HEADS, DV)), torch.float32, pin=False)
    assert pages.page_bytes > kv_host.CHUNK_BYTES
    assert pages.grow(3 * pages.page_bytes) and pages.num_pages == 1 and pages.allocated_bytes == pages.page_bytes
    assert not pages.grow(pages.page_bytes - 1)  # the bound still holds


def test_the_host_slab_is_allocated_up_front_and_never_while_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """``host_prealloc`` (the default): the pool allocates its host slab when made, within the host bound, and
    serving (evictions to the host tier, promotions, drops) never allocates another chunk; ``host_prealloc=False``
    pins nothing until the tier fills; a refused allocation at start leaves a pool that serves without a host tier."""
    config = PoolConfig(device_mb=0.01, host_mb=0.05, block_size=8)
    pool = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"), config)
    hp = pool.host_pages
    # tiny pages (960 bytes, 8 tokens): about half the bound stays for the entries' token identities
    assert 0.5 * pool.host_limit < hp.allocated_bytes <= pool.host_limit and hp.num_pages == len(hp.free)
    allocated, chunks = hp.allocated_bytes, len(hp.chunks)

    def no_growth(*args, **kwargs):
        raise AssertionError("the host slab grew while serving")

    monkeypatch.setattr(hp, "grow", no_growth)
    cache = CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"), "0", pool)
    rng = random.Random(3)
    users = {f"u{i}": _history(rng, rng.randint(5, 40), i) for i in range(80)}
    for step in range(300):  # new users and returning ones: evictions, host hits (promotions), drops
        user = f"u{rng.randrange(80)}" if step > 80 else f"u{step % 80}"
        _serve(cache, user, users[user])
        assert pool.host_bytes <= pool.host_limit
    report = pool.report()
    assert report["evicted_to_host"] > 0 and report["host_hits"] > 0
    assert (hp.allocated_bytes, len(hp.chunks)) == (allocated, chunks)
    lazy = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"),
                       PoolConfig(device_mb=0.01, host_mb=0.05, block_size=8, host_prealloc=False))  # fmt: skip
    assert lazy.host_pages.allocated_bytes == 0
    monkeypatch.undo()
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("cudaHostAlloc failed"))
                        if k.get("dtype") is torch.uint8 else real_empty(*a, **k))  # fmt: skip
    refused = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"), config)
    assert refused.host_pages.num_pages == 0
    refused_cache = CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"), "0", refused)
    for i in range(30):
        _serve(refused_cache, f"u{i}", users[f"u{i}"])
    assert refused.report()["dropped"] > 0 and refused.report()["evicted_to_host"] == 0


def test_a_preallocation_refused_part_way_grows_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned memory short at start (e.g. a reload's old pool still holds its slab): the partial slab serves,
    and the tier grows to its bound as it fills once memory is free again (it is not stuck small)."""
    from recforge.serve import kv_host

    monkeypatch.setattr(kv_host, "CHUNK_BYTES", 4096)  # several chunks for a small slab (as 64 MiB for 1 GiB)
    real_empty, calls = torch.empty, [0]

    def short(*args, **kwargs):
        if kwargs.get("dtype") is torch.uint8:
            calls[0] += 1
            if calls[0] > 2:
                raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", short)
    pool = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"),
                       PoolConfig(device_mb=0.02, host_mb=0.05, block_size=8))  # fmt: skip
    monkeypatch.setattr(torch, "empty", real_empty)
    partial = pool.host_pages.num_pages
    assert partial > 0 and not pool.host_fixed
    cache = CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"), "0", pool)
    rng = random.Random(1)
    users = {f"u{i}": _history(rng, rng.randint(5, 40), i) for i in range(60)}
    for _ in range(200):
        user = f"u{rng.randrange(60)}"
        _serve(cache, user, users[user])
        assert pool.host_bytes <= pool.host_limit
    assert pool.host_pages.num_pages > 2 * partial


def test_an_entry_larger_than_the_slab_does_not_empty_the_host_tier() -> None:
    """A preallocated slab never grows: an evicted entry with more pages than the whole slab is dropped at once,
    and the host entries already there stay (they used to be dropped one by one first, for nothing)."""
    pool = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"),
                       PoolConfig(device_mb=0.05, host_mb=0.05, block_size=8))  # fmt: skip
    cache = CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, torch.device("cpu"), "0", pool)
    rng = random.Random(int(torch.randint(1 << 30, (1,))))
    small = {f"s{i}": _history(rng, 14, i) for i in range(30)}  # 16 tokens: 2 pages each
    big = _history(rng, 270, 999)  # 272 tokens: 34 pages, more than the slab holds
    assert pool.host_fixed and 34 > pool.host_pages.num_pages
    for user in list(small)[:5]:
        _serve(cache, user, small[user])
    _serve(cache, "big", big)
    for user in list(small)[5:]:
        _serve(cache, user, small[user])
        if "big" not in pool.entries:
            break
    assert "big" not in pool.entries and "big" not in pool.host
    assert {"s0", "s1", "s2", "s3", "s4"} <= set(pool.host)
