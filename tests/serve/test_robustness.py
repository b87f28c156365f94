"""The batching worker under real traffic: same-user concurrency, deadlines, cancellation, admission,
errors that must not kill it, shutdown and reload while requests are in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.kv_pool import KVCachePool, PoolConfig
from recforge.serve.runner import BatchRunner
from recforge.serve.scheduler import DeadlineExceeded, OverloadedError, SchedulerConfig
from _serve_helpers import build_model, export, random_history

FEATURES = {"user_id": "u1", "gender": "f"}
QUEUE_MS = 60_000  # admission control is tested on its own; elsewhere a loaded test machine must not trip it


def _engine(run, pool: bool = True) -> RankEngine:
    engine = RankEngine.from_run(run, EngineConfig())
    if pool:
        engine.pool = KVCachePool.for_engine(engine, PoolConfig(device_mb=1, block_size=16))
    return engine


def _request(engine: RankEngine, user: str, hist: dict, seed: int = 0, count: int = 5):
    g = torch.Generator().manual_seed(seed)
    cands = (1000 + torch.randint(0, 50, (count,), generator=g)).tolist()
    now = (hist["timestamps"][-1] if hist["items"] else 0) + 7
    return engine.encode(user, hist, cands, user_features=FEATURES, timestamp=now)


def _prefix(hist: dict, n: int) -> dict:
    return {k: v[:n] for k, v in hist.items()}


def _cold(run, req) -> torch.Tensor:
    return RankEngine.from_run(run, EngineConfig()).rank_encoded(req).scores


@pytest.fixture
def run(tmp_path):
    return export(build_model(max_len=512), tmp_path / "run")


def test_two_requests_of_one_user_in_flight_later_finishing_first(run) -> None:
    """The old worker died here: the later, shorter request finished first and `running.remove` compared
    tensors. Both must be answered exactly, and the worker must go on serving."""
    engine = _engine(run)
    hist = random_history(300, seed=1)
    long_req = _request(engine, "u", hist, seed=1, count=40)
    short_req = _request(engine, "u", _prefix(hist, 3), seed=2, count=2)
    runner = BatchRunner(engine, SchedulerConfig(token_budget=32, prefill_chunk=16, max_wait_ms=20, max_queue_ms=QUEUE_MS))
    try:
        futures = [runner.submit(long_req), runner.submit(short_req)]
        results = [f.result(timeout=60) for f in futures]
        again = runner.submit(_request(engine, "v", random_history(4, seed=3))).result(timeout=60)
    finally:
        runner.close()
    for req, result in zip((long_req, short_req), results):
        torch.testing.assert_close(result.scores, _cold(run, req), rtol=1e-5, atol=1e-5)
    assert again.scores.shape == (5, 2) and runner.restarts == 0


def test_one_user_hammered_with_interleaved_histories_stays_exact(run) -> None:
    """Many threads, one user, histories that extend and rewrite each other, tiny budgets and chunks: every
    answer equals a cold request, and the cached entry left behind is exact."""
    engine = _engine(run)
    base = random_history(120, seed=7)
    other = random_history(120, seed=8)  # same user, a different (rewritten) history
    runner = BatchRunner(engine, SchedulerConfig(token_budget=24, prefill_chunk=8, max_wait_ms=1, max_queue_ms=QUEUE_MS))
    reqs = [_request(engine, "hot", _prefix(base if i % 3 else other, 10 + (37 * i) % 110), seed=i) for i in range(24)]
    results: dict[int, torch.Tensor] = {}

    def caller(i: int) -> None:
        time.sleep(0.002 * (i % 5))
        try:
            results[i] = runner.submit(reqs[i]).result(timeout=120).scores
        except Exception as err:  # noqa: BLE001 - reported below
            results[i] = err

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(reqs))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        final = runner.submit(reqs[-1]).result(timeout=60)
    finally:
        runner.close()
    cold = RankEngine.from_run(run, EngineConfig())
    assert not [r for r in results.values() if isinstance(r, Exception)], results
    for i, req in enumerate(reqs):
        torch.testing.assert_close(results[i], cold.rank_encoded(req).scores, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.scores, cold.rank_encoded(reqs[-1]).scores, rtol=1e-5, atol=1e-5)
    assert final.cached_tokens > 0 and runner.restarts == 0
    report = engine.pool.report()  # late shorter requests reused their prefix of a newer entry, rewrites the common part
    assert report["older"] + report["diverged"] > 0, report


def test_a_stale_writer_never_overwrites_a_newer_entry(run) -> None:
    """Two states read from the same pool entry: the first write-back wins, the second is refused (its keys
    would otherwise be appended to an entry it did not read)."""
    engine = _engine(run)
    hist = random_history(40, seed=4)
    engine.rank_encoded(_request(engine, "u", _prefix(hist, 20)))  # cached: 22 tokens
    a, b = _request(engine, "u", _prefix(hist, 30)), _request(engine, "u", _prefix(hist, 25))
    from recforge.serve.cache_manager import CacheManager
    from recforge.serve.layout import prefix_tokens

    cache = CacheManager.for_engine(engine)
    state_a = cache.acquire("u", prefix_tokens(a, "sum"), 2)
    state_b = cache.acquire("u", prefix_tokens(b, "sum"), 2)
    assert state_a.length == state_b.length == 22
    state_a, state_b = engine.prefix_state(a, state_a), engine.prefix_state(b, state_b)  # extended, not written back
    assert engine.pool.report()["stale_writes"] == 0 and engine.pool.entries["u"].length == 22
    assert cache.release("u", state_a, 22) and not cache.release("u", state_b, 22)
    assert engine.pool.report()["stale_writes"] == 1
    cached = engine.rank_encoded(a)
    assert cached.cached_tokens == 32 and cached.computed_tokens == 0
    torch.testing.assert_close(cached.scores, _cold(run, a), rtol=1e-5, atol=1e-5)


def test_requests_past_their_deadline_or_cancelled_are_not_computed(run) -> None:
    engine = _engine(run)
    passes = []
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=200, max_queue_ms=QUEUE_MS), on_pass=lambda r, t, s: passes.append(r))
    try:
        expired = runner.submit(_request(engine, "a", random_history(10, seed=1)), deadline=time.monotonic() + 0.01)
        cancelled = runner.submit(_request(engine, "b", random_history(10, seed=2)))
        assert cancelled.cancel()
        live = runner.submit(_request(engine, "c", random_history(10, seed=3)))
        assert live.result(timeout=30).scores.shape == (5, 2)
        with pytest.raises(DeadlineExceeded, match="deadline"):
            expired.result(timeout=30)
    finally:
        runner.close()
    assert runner.dropped == {"deadline": 1, "cancelled": 1}
    assert sum(passes) == 2  # only the live request: one prefix pass and one candidates pass


def _slow(engine: RankEngine, seconds: float, gate: threading.Event | None = None) -> None:
    run = engine.run

    def slow_run(items):
        if gate is not None:
            gate.wait(30)
        time.sleep(seconds)
        return run(items)

    engine.run = slow_run


def test_admission_is_bounded_in_time_and_says_when_to_retry(run) -> None:
    engine = _engine(run, pool=False)
    _slow(engine, 0.05)
    runner = BatchRunner(engine, SchedulerConfig(max_queue_ms=150, max_wait_ms=0, token_budget=64))
    try:
        runner.submit(_request(engine, "warm", random_history(30, seed=0))).result(timeout=30)  # measures the cost
        accepted, refused = [], []
        for i in range(40):
            try:
                accepted.append(runner.submit(_request(engine, f"u{i}", random_history(30, seed=i))))
            except OverloadedError as err:
                refused.append(err)
        assert refused and len(accepted) < 40
        assert refused[0].retry_after >= 1 and "ms of work is queued" in str(refused[0])
        for f in accepted:
            f.result(timeout=60)
        with pytest.raises(OverloadedError, match="deadline"):  # a deadline shorter than the queue is refused at once
            for i in range(10):
                runner.submit(_request(engine, f"d{i}", random_history(30, seed=i)), deadline=time.monotonic() + 0.02)
    finally:
        runner.close()


def test_the_queue_estimate_falls_as_the_queue_drains(run) -> None:
    """Requests that waited long behind a deep queue do not keep the estimate up once the queue is short: the
    observed wait counts per token queued ahead at admission, so admission resumes before the worker runs dry."""
    engine = _engine(run, pool=False)
    _slow(engine, 0.05)
    runner = BatchRunner(engine, SchedulerConfig(max_queue_ms=400, max_wait_ms=0, token_budget=64))
    try:
        gate = threading.Event()
        real = engine.run
        engine.run = lambda items: (gate.wait(30), real(items))[1]
        futures = [runner.submit(_request(engine, f"u{i}", random_history(30, seed=i))) for i in range(12)]
        time.sleep(0.3)  # every request waits behind the gate: the later ones had many tokens ahead
        gate.set()
        for f in futures:
            f.result(timeout=60)
        per_token = runner._wait_per_token
        assert per_token > 0 and runner._queue_delay > 0.1  # the last ones waited long
        with runner._cond:
            runner._backlog_tokens, runner._incoming_tokens = 0, 0
            assert runner.queued_seconds() == 0.0
            runner._backlog_tokens = 64 * 8  # eight passes queued, then two
            deep = runner.queued_seconds()
            runner._backlog_tokens = 64 * 2
            short = runner.queued_seconds()
        assert deep >= per_token * 64 * 8 * (1 - 1e-9)
        assert short < deep / 2 and short < runner._queue_delay  # not held up at the last requests' long wait
    finally:
        runner.close()


def test_an_unexpected_worker_error_fails_only_the_requests_in_flight(run) -> None:
    engine = _engine(run)
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=1, max_queue_ms=QUEUE_MS))
    original = runner.scheduler.schedule
    calls = {"n": 0}

    def broken_schedule():
        calls["n"] += 1
        raise RuntimeError("bug in the scheduler")

    runner.scheduler.schedule = broken_schedule
    try:
        with pytest.raises(RuntimeError, match="internal error"):
            runner.submit(_request(engine, "a", random_history(10, seed=1))).result(timeout=30)
        assert runner.restarts == 1 and calls["n"] == 1
        assert runner.scheduler.schedule != broken_schedule  # a fresh scheduler
        assert runner.scheduler.schedule.__func__ is type(runner.scheduler).schedule  # the real one, bound to it
        ok = runner.submit(_request(engine, "b", random_history(10, seed=2))).result(timeout=30)
        assert ok.scores.shape == (5, 2) and runner.health()["healthy"]
    finally:
        runner.close()
    assert original is not None and original.__self__ is not runner.scheduler  # the broken one was replaced


def test_after_a_worker_error_an_idle_runner_admits_again(run) -> None:
    """The requests an unexpected error failed leave no queued work behind: an idle runner does not keep refusing."""
    engine = _engine(run)
    gate = threading.Event()
    _slow(engine, 0.02, gate)
    calls = {"n": 0}

    def on_pass(requests: int, tokens: int, seconds: float) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # with work still queued behind this pass
            raise RuntimeError("a metrics hook failed once")

    runner = BatchRunner(engine, SchedulerConfig(max_queue_ms=300, max_wait_ms=0, token_budget=64, prefill_chunk=32),
                         on_pass=on_pass)  # fmt: skip
    try:
        futures = [runner.submit(_request(engine, "first", random_history(100, seed=0)))]
        time.sleep(0.1)
        futures += [runner.submit(_request(engine, f"v{i}", random_history(100, seed=100 + i))) for i in range(10)]
        gate.set()
        for f in futures:
            try:
                f.result(timeout=60)
            except RuntimeError:
                pass
        assert runner.restarts == 1
        deadline = time.monotonic() + 10
        while runner.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.pending() == 0 and runner.queued_seconds() == 0.0
        runner.submit(_request(engine, "w", random_history(10, seed=999))).result(timeout=30)  # admitted, answered
    finally:
        runner.close()


def test_a_dead_worker_thread_is_restarted_and_a_stuck_one_is_reported(run) -> None:
    engine = _engine(run)
    gate = threading.Event()
    _slow(engine, 0.0, gate)
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=0, stall_seconds=0.2, max_queue_ms=QUEUE_MS))
    try:
        stuck = runner.submit(_request(engine, "a", random_history(5, seed=1)))
        time.sleep(0.5)
        health = runner.health()
        assert health["worker_stuck"] and not health["healthy"] and health["oldest_request_age_ms"] > 300
        gate.set()
        stuck.result(timeout=30)
        assert runner.health()["healthy"]
    finally:
        runner.close()


def test_shutdown_is_bounded_even_with_a_stuck_pass(run) -> None:
    engine = _engine(run)
    gate = threading.Event()
    _slow(engine, 0.0, gate)
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=0, max_queue_ms=QUEUE_MS))
    future = runner.submit(_request(engine, "a", random_history(5, seed=1)))
    time.sleep(0.1)
    t0 = time.monotonic()
    runner.close(timeout=0.3)
    assert time.monotonic() - t0 < 8
    with pytest.raises(RuntimeError, match="shut down"):
        future.result(timeout=1)
    with pytest.raises(OverloadedError, match="shutting down"):
        runner.submit(_request(engine, "b", random_history(5, seed=2)))
    gate.set()


def test_shutdown_finishes_the_requests_in_flight(run) -> None:
    engine = _engine(run)
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=50, token_budget=16, prefill_chunk=8, max_queue_ms=QUEUE_MS))
    futures = [runner.submit(_request(engine, f"u{i}", random_history(60, seed=i))) for i in range(4)]
    runner.close(timeout=30)
    assert all(f.result(timeout=1).scores.shape == (5, 2) for f in futures)


def test_a_failed_reload_changes_nothing(run, tmp_path) -> None:
    engine = _engine(run)
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=1, max_queue_ms=QUEUE_MS))
    req = _request(engine, "u", random_history(20, seed=1))
    try:
        before = runner.submit(req).result(timeout=30)
        broken = export(build_model(seed=3, max_len=512), tmp_path / "broken", step=9)
        weights = broken / "model" / "encoder" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
        with pytest.raises(ValueError, match="cannot load"):
            runner.reload(broken)
        other = export(build_model(seed=3, max_len=1024), tmp_path / "bigger", step=9)
        (other / "model" / "manifest.json").write_text('{"format": "recforge-ranking-slices"}')  # unusable manifest
        with pytest.raises(ValueError):
            runner.reload(other)
        after = runner.submit(req).result(timeout=30)
    finally:
        runner.close()
    assert after.model_version == before.model_version == engine.version
    assert after.cached_tokens == 22  # the cache survived
    torch.testing.assert_close(after.scores, before.scores, rtol=0, atol=0)


def test_reload_under_load_never_mixes_models(run, tmp_path) -> None:
    """Requests stream in while the model is swapped back and forth: every answer equals the cold answer of
    the model version it reports, cache entries included."""
    engine = _engine(run)
    other = export(build_model(seed=11, max_len=512), tmp_path / "other", step=5)
    versions = {engine.version: run}
    runner = BatchRunner(engine, SchedulerConfig(token_budget=48, prefill_chunk=16, max_wait_ms=1, max_queue_ms=QUEUE_MS))
    hists = [random_history(90, seed=20 + u) for u in range(4)]
    answers = []
    stop = threading.Event()

    def caller(k: int) -> None:
        i = 0
        while not stop.is_set():
            u = (k + i) % 4
            req = _request(engine, f"u{u}", _prefix(hists[u], 20 + (13 * i + 7 * k) % 70), seed=i)
            answers.append((req, runner.submit(req).result(timeout=60)))
            i += 1

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for source in (other, run, other):
            time.sleep(0.3)
            versions[runner.reload(source, timeout=60)] = source
    finally:
        stop.set()
        for t in threads:
            t.join()
        runner.close()
    assert len(versions) == 2 and len({r.model_version for _, r in answers}) == 2
    cold = {v: RankEngine.from_run(src, EngineConfig()) for v, src in versions.items()}
    for req, result in answers:
        torch.testing.assert_close(result.scores, cold[result.model_version].rank_encoded(req).scores, rtol=1e-5, atol=1e-5)
