"""KV-cache pool: reuse and incremental extension are exact; LRU, memory bound, host tier, invalidation."""

from __future__ import annotations

import pytest
import torch

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.kv_pool import KVCachePool, PoolConfig
from recforge.serve.layout import prefix_tokens
from _serve_helpers import build_model, export, random_history

CANDS = [1001, 1002, 1010, 1033, 1049]


def _engine(tmp_path, pool: PoolConfig, **config) -> RankEngine:
    engine = RankEngine.from_run(export(build_model(), tmp_path / "run"), EngineConfig(**config))
    engine.pool = KVCachePool.for_engine(engine, pool)
    return engine


def _scratch(engine: RankEngine, req) -> torch.Tensor:
    pool, engine.pool = engine.pool, None
    try:
        return engine.rank_encoded(req).scores
    finally:
        engine.pool = pool


def test_incremental_extension_equals_encoding_from_scratch(tmp_path) -> None:
    engine = _engine(tmp_path, PoolConfig(device_mb=1, block_size=8), prefill_chunk=16)
    hist = random_history(90, seed=1)
    now = hist["timestamps"][-1] + 5
    for n, expect_reused in ((40, 0), (40, 42), (57, 42), (90, 59)):  # cold, warm, then two extensions
        req = engine.encode("u7", {k: v[:n] for k, v in hist.items()}, CANDS, user_features={"user_id": "u1"}, timestamp=now)
        result = engine.rank_encoded(req)
        assert result.cached_tokens == expect_reused
        assert result.computed_tokens == 2 + n - expect_reused
        torch.testing.assert_close(result.scores, _scratch(engine, req), rtol=1e-5, atol=1e-5)
    report = engine.pool.report()
    assert report["device_hits"] == 3 and report["misses"] == 1 and report["hit_rate"] == 0.75
    assert report["token_hit_rate"] == (42 + 42 + 59) / (42 + 42 + 59 + 42 + 0 + 17 + 33)


def test_a_changed_history_is_recomputed_and_a_later_request_reuses_the_cache(tmp_path) -> None:
    engine = _engine(tmp_path, PoolConfig(device_mb=1, block_size=8))
    hist = random_history(30, seed=2)
    now = hist["timestamps"][-1] + 5
    engine.rank_encoded(engine.encode("u1", hist, CANDS, timestamp=now))
    rewritten = {**hist, "actions": ["buy"] * 30}
    req = engine.encode("u1", rewritten, CANDS, timestamp=now)
    assert engine.rank_encoded(req).cached_tokens == 2  # only the contextual tokens are still the same
    assert engine.pool.report()["diverged"] == 1
    other = engine.encode("u1", rewritten, CANDS, user_features={"user_id": "u1"}, timestamp=now)
    assert engine.rank_encoded(other).cached_tokens == 0  # other contextual tokens: nothing is reusable
    assert engine.pool.report()["stale"] == 1
    engine.rank_encoded(req)  # back to the features of ``later`` below
    later = engine.encode("u1", rewritten, CANDS, timestamp=now + 86400)  # the same user a day later
    result = engine.rank_encoded(later)
    assert result.cached_tokens == prefix_tokens(later, engine.action_encoding)["item_ids"].numel()  # the whole prefix
    torch.testing.assert_close(result.scores, _scratch(engine, later), rtol=1e-5, atol=1e-5)


def test_an_older_request_reuses_its_prefix_of_a_newer_entry_and_leaves_it(tmp_path) -> None:
    """Same user, out of order: the request for the first 30 events arrives after the one for 45 was cached.
    It reuses its own 32-token prefix of the entry (nothing computed), scores as a cold request, and the
    newer entry stays (same length and generation), so the next newer request is a full hit again."""
    engine = _engine(tmp_path, PoolConfig(device_mb=1, block_size=8), prefill_chunk=16)
    hist = random_history(45, seed=int(torch.randint(0, 1000, ())))
    now = hist["timestamps"][-1] + 5
    newer = engine.encode("u3", hist, CANDS, user_features={"user_id": "u1"}, timestamp=now)
    older = engine.encode("u3", {k: v[:30] for k, v in hist.items()}, CANDS, user_features={"user_id": "u1"},
                          timestamp=hist["timestamps"][29] + 5)  # fmt: skip
    engine.rank_encoded(newer)
    generation = engine.pool.generation_of("u3")
    result = engine.rank_encoded(older)
    assert result.cached_tokens == 32 and result.computed_tokens == 0
    torch.testing.assert_close(result.scores, _scratch(engine, older), rtol=1e-5, atol=1e-5)
    assert engine.pool.generation_of("u3") == generation and engine.pool.entries["u3"].length == 47
    assert engine.pool.report()["older"] == 1 and engine.pool.report()["stale"] == 0
    again = engine.rank_encoded(newer)
    assert again.cached_tokens == 47 and again.computed_tokens == 0


def test_a_diverged_history_reuses_the_common_prefix_exactly(tmp_path) -> None:
    """The cached history and the request's agree on their first 20 events only: those 22 tokens are reused,
    the rest computed, the scores are a cold request's, and the entry is now the request's history."""
    engine = _engine(tmp_path, PoolConfig(device_mb=1, block_size=8), prefill_chunk=16)
    hist = random_history(40, seed=int(torch.randint(0, 1000, ())))
    engine.rank_encoded(engine.encode("u4", hist, CANDS, timestamp=hist["timestamps"][-1] + 5))
    rewritten = {k: v[:20] + v[25:] for k, v in hist.items()}  # five events removed from the middle
    req = engine.encode("u4", rewritten, CANDS, timestamp=hist["timestamps"][-1] + 5)
    result = engine.rank_encoded(req)
    assert result.cached_tokens == 22 and result.computed_tokens == 15
    torch.testing.assert_close(result.scores, _scratch(engine, req), rtol=1e-5, atol=1e-5)
    assert engine.pool.report()["diverged"] == 1 and engine.pool.entries["u4"].length == 37
    assert engine.rank_encoded(req).cached_tokens == 37


def _history(seed: int, events: int = 50) -> tuple[dict, int]:
    """The first ``events`` of a 55-event history, and a request time after all 55."""
    hist = random_history(55, seed)
    return {k: v[:events] for k, v in hist.items()}, hist["timestamps"][-1] + 1


def _fill(engine: RankEngine, users: list[str], events: int = 50) -> None:
    for i, user in enumerate(users):
        hist, now = _history(10 + i, events)
        engine.rank_encoded(engine.encode(user, hist, CANDS, timestamp=now))


def test_lru_eviction_respects_the_memory_bound_and_drops_without_host_tier(tmp_path) -> None:
    engine = _engine(tmp_path, PoolConfig(device_mb=0.05, host_mb=0, block_size=16))
    pool = engine.pool
    per_user = 4 * pool.block_bytes  # 52 tokens -> 4 pages of 16
    assert pool.num_blocks * pool.block_bytes <= 0.05 * 2**20
    capacity_users = pool.num_blocks // 4
    _fill(engine, [f"u{i}" for i in range(capacity_users + 2)])
    report = pool.report()
    assert report["device_bytes_used"] <= report["device_bytes_capacity"]
    assert report["users_device"] == capacity_users and report["users_host"] == 0 and report["dropped"] == 2
    assert "u0" not in pool.entries and "u1" not in pool.entries  # least recently used went first
    assert report["device_bytes_used"] == capacity_users * per_user


def test_host_tier_keeps_evicted_users_and_serves_them_exactly(tmp_path) -> None:
    engine = _engine(tmp_path, PoolConfig(device_mb=0.05, host_mb=1, block_size=16))
    pool = engine.pool
    users = [f"u{i}" for i in range(pool.num_blocks // 4 + 2)]
    _fill(engine, users)
    assert set(pool.host) == {"u0", "u1"} and pool.report()["evicted_to_host"] == 2
    more, now = _history(10, 55)  # u0's history again, with 5 new events
    req = engine.encode("u0", more, CANDS, timestamp=now)
    result = engine.rank_encoded(req)
    assert pool.stats.host_hits == 1 and result.cached_tokens == 52 and result.computed_tokens == 5
    torch.testing.assert_close(result.scores, _scratch(engine, req), rtol=1e-5, atol=1e-5)
    assert "u0" in pool.entries and "u0" not in pool.host


def test_host_tier_is_bounded(tmp_path) -> None:
    engine = _engine(tmp_path, PoolConfig(device_mb=0.05, host_mb=0.02, block_size=16))
    _fill(engine, [f"u{i}" for i in range(engine.pool.num_blocks // 4 + 6)])
    report = engine.pool.report()
    assert 0 < report["host_bytes_used"] <= report["host_bytes_capacity"]
    assert report["dropped"] > 0


def test_new_model_version_invalidates_every_cache(tmp_path) -> None:
    from recforge.serve.runner import BatchRunner

    engine = _engine(tmp_path, PoolConfig(device_mb=1, block_size=8))
    pool = engine.pool
    _fill(engine, ["a", "b"])
    assert pool.report()["users_device"] == 2
    export(build_model(seed=1), tmp_path / "next", step=2)
    runner = BatchRunner(engine)
    try:
        version = runner.reload(tmp_path / "next")
        assert runner.engine.pool is pool and engine.pool is None  # same shapes: the pages are reused
        report = pool.report()
        assert pool.version == version and report["users_device"] == 0 and report["device_bytes_used"] == 0
        hist, now = _history(10)
        req = runner.engine.encode("a", hist, CANDS, timestamp=now)
        result = runner.submit(req).result(timeout=60)
    finally:
        runner.close()
    assert result.cached_tokens == 0 and result.model_version == version
    fresh = RankEngine.from_run(tmp_path / "next")
    torch.testing.assert_close(result.scores, fresh.rank_encoded(req).scores, rtol=1e-5, atol=1e-5)


def test_a_retired_engine_never_reads_or_writes_the_new_models_entries(tmp_path) -> None:
    """Entries are tagged with their model version: an engine whose pool now serves another version (a
    reload retired it) neither reuses that version's entry for its user nor writes over it."""
    engine = _engine(tmp_path, PoolConfig(device_mb=1, block_size=8))
    pool = engine.pool
    hist, now = _history(10)
    req = engine.encode("a", hist, CANDS, timestamp=now)
    state = engine.prefix_state(req)  # a prefix matching req exactly, filed under the newer model below
    pool.invalidate("newer")
    state.version, state.generation = "newer", 0
    assert pool.put("a", state, 0)
    generation, lookups = pool.generation_of("a"), pool.report()["lookups"]
    result = engine.rank_encoded(req)
    assert result.cached_tokens == 0 and result.computed_tokens == 52
    assert pool.generation_of("a") == generation and pool.report()["lookups"] == lookups


@pytest.mark.gpu
def test_cuda_engine_and_host_tier_round_trip(tmp_path, cuda_device) -> None:
    """On CUDA: scores match the CPU engine, and a user evicted to pinned host memory (side-stream
    copy) comes back exact."""
    engine = _engine(tmp_path, PoolConfig(device_mb=0.05, host_mb=1, block_size=16), device="cuda")
    cpu = RankEngine.from_run(tmp_path / "run")
    _fill(engine, [f"u{i}" for i in range(engine.pool.num_blocks // 4 + 2)])
    assert "u0" in engine.pool.host
    more, now = _history(10, 55)
    req = engine.encode("u0", more, CANDS, timestamp=now)
    result = engine.rank_encoded(req)
    assert engine.pool.stats.host_hits == 1 and result.cached_tokens == 52
    torch.testing.assert_close(result.scores, cpu.rank_encoded(req).scores, rtol=1e-4, atol=1e-4)


def _random_state(pool: KVCachePool, n: int, capacity: int, seed: int):
    from recforge.serve.state import PrefixState

    g = torch.Generator().manual_seed(seed)
    layers, _, heads, dqk = pool.keys.shape[1:]
    state = PrefixState(layers, capacity, heads, dqk, pool.values.shape[4], 1, pool.keys.dtype, pool.device)
    state.keys.copy_(torch.randn(state.keys.shape, generator=g))  # drawn on the CPU, copied to the pool's device
    state.values.copy_(torch.randn(state.values.shape, generator=g))
    state.timestamps.copy_(torch.randint(0, 10**9, (capacity,), generator=g))
    state.tokens.copy_(torch.randint(1, 50, (capacity, 4), generator=g))
    state.length, state.version = n, pool.version
    return state


@pytest.mark.parametrize("scattered", [False, True])
def test_pages_read_and_written_exactly_in_one_run_or_scattered(scattered: bool) -> None:
    """Pages in one run are read as a slice, others gathered; extensions of one or two pages are written by slices,
    longer writes scattered: every way gives back exactly the tokens written."""
    _check_pages(torch.device("cpu"), scattered)


@pytest.mark.gpu
@pytest.mark.parametrize("scattered", [False, True])
def test_pages_read_and_written_exactly_on_cuda(cuda_device, scattered: bool) -> None:
    _check_pages(cuda_device, scattered)


def _check_pages(device: torch.device, scattered: bool) -> None:
    pool = KVCachePool(2, 2, 4, 3, torch.float32, device, PoolConfig(device_mb=0.05, host_mb=0, block_size=4))
    if scattered:  # only every other page free: an entry's pages never in one run
        pool.free = list(range(0, pool.num_blocks, 2))
    src = _random_state(pool, 9, 40, seed=3)
    steps = [(0, 9), (9, 10), (10, 13), (13, 26)]  # a first write, extensions in one and two pages, a long one
    for start, n in steps:
        src.length = n
        src.generation = pool.generation_of("u")
        assert pool.put("u", src, start)
        got = pool.lookup("u", src.tokens[:n], num_contextual=1, capacity=n)
        assert got.length == n and got.capacity >= n
        entry = pool.entries["u"]
        consecutive = entry.blocks == list(range(entry.blocks[0], entry.blocks[0] + len(entry.blocks)))
        assert consecutive != scattered
        torch.testing.assert_close(got.keys[:, :n], src.keys[:, :n], rtol=0, atol=0)
        torch.testing.assert_close(got.values[:, :n], src.values[:, :n], rtol=0, atol=0)
        assert torch.equal(got.timestamps[:n], src.timestamps[:n]) and torch.equal(got.tokens[:n], src.tokens[:n])
