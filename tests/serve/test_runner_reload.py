"""Reload builds a new engine and swaps it: the old engine finishes the requests in flight, the new one
gets the cache (or a new one when the shapes change), and nothing encoded for another vocabulary runs."""

from __future__ import annotations

from dataclasses import replace

import json
import threading
import time

import pytest
import torch

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.kv_pool import KVCachePool, PoolConfig
from recforge.serve.runner import BatchRunner
from recforge.serve.scheduler import OverloadedError, SchedulerConfig
from _serve_helpers import build_model, export, random_history

QUEUE_MS = 60_000


def _engine(run) -> RankEngine:
    engine = RankEngine.from_run(run, EngineConfig())
    engine.pool = KVCachePool.for_engine(engine, PoolConfig(device_mb=1, block_size=16))
    return engine


def _request(engine: RankEngine, user: str, events: int, seed: int):
    hist = random_history(events, seed=seed)
    g = torch.Generator().manual_seed(seed)
    cands = (1000 + torch.randint(0, 50, (4,), generator=g)).tolist()
    return engine.encode(user, hist, cands, user_features={"gender": "f"}, timestamp=hist["timestamps"][-1] + 7)


def _weights(engine: RankEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_reload_builds_a_new_engine_and_the_old_one_finishes_the_requests_in_flight(tmp_path) -> None:
    run = export(build_model(max_len=512), tmp_path / "run")
    other = export(build_model(seed=5, max_len=512), tmp_path / "other", step=7)
    old = _engine(run)
    before = _weights(old)
    gate, entered = threading.Event(), threading.Event()
    real_run = old.run

    def gated_run(items):  # the old engine's passes wait at the gate: the request stays in flight
        entered.set()
        gate.wait(30)
        return real_run(items)

    old.run = gated_run
    runner = BatchRunner(old, SchedulerConfig(token_budget=16, prefill_chunk=8, max_wait_ms=1, max_queue_ms=QUEUE_MS))
    in_flight_req = _request(old, "u1", 40, seed=1)
    reloaded: dict = {}
    try:
        in_flight = runner.submit(in_flight_req)
        assert entered.wait(30)
        reloader = threading.Thread(target=lambda: reloaded.update(version=runner.reload(other, timeout=60)))
        reloader.start()
        for _ in range(600):  # until the new engine is built and probed; the swap waits for the request in flight
            if runner._reload is not None:
                break
            time.sleep(0.05)
        assert runner._reload is not None and runner.engine is old and not reloaded
        waiting = runner.submit(_request(old, "u2", 10, seed=2))  # arrives during the drain: served by the new model
        gate.set()
        reloader.join(60)
        first, second = in_flight.result(timeout=60), waiting.result(timeout=60)
    finally:
        gate.set()
        runner.close()
    new = runner.engine
    assert new is not old and reloaded["version"] == new.version != old.version
    assert first.model_version == old.version and second.model_version == new.version
    old.run = real_run
    torch.testing.assert_close(first.scores, RankEngine.from_run(run).rank_encoded(in_flight_req).scores, rtol=1e-5, atol=1e-5)
    after = _weights(old)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the retired engine was never changed


def test_reload_to_other_shapes_gets_a_new_pool_of_the_same_size(tmp_path) -> None:
    run = export(build_model(max_len=512), tmp_path / "run")
    deeper = export(build_model(seed=2, max_len=512, num_blocks=3), tmp_path / "deeper", step=3)
    engine = _engine(run)
    old_pool = engine.pool
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=1, max_queue_ms=QUEUE_MS))
    try:
        runner.submit(_request(engine, "u1", 20, seed=1)).result(timeout=60)
        runner.reload(deeper, timeout=60)
        pool = runner.engine.pool
        req = _request(runner.engine, "u1", 20, seed=1)
        first, again = runner.submit(req).result(timeout=60), runner.submit(req).result(timeout=60)
    finally:
        runner.close()
    assert pool is not old_pool and engine.pool is None
    assert pool.keys.shape[1] == 3 and pool.version == runner.engine.version
    # the same size; its host tier grows as it fills (no second slab pinned beside the old pool's at the reload)
    assert pool.config == replace(old_pool.config, host_prealloc=False) and not pool.host_fixed
    assert first.cached_tokens == 0 and again.cached_tokens == 22 and again.computed_tokens == 0
    torch.testing.assert_close(again.scores, RankEngine.from_run(deeper).rank_encoded(req).scores, rtol=1e-5, atol=1e-5)


def test_a_request_encoded_for_another_vocabulary_never_runs_on_the_new_model(tmp_path) -> None:
    run = export(build_model(max_len=512), tmp_path / "run")
    renamed = export(build_model(seed=3, max_len=512), tmp_path / "renamed", step=4)
    vocab_path = renamed / "model" / "vocab.json"
    vocab = json.loads(vocab_path.read_text())
    vocab["item_ids"] = vocab["item_ids"][::-1]  # the same raw IDs, other codes
    vocab_path.write_text(json.dumps(vocab))
    engine = _engine(run)
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=1, max_queue_ms=QUEUE_MS))
    try:
        stale = _request(engine, "u1", 10, seed=1)  # encoded by the old engine, submitted after the swap
        runner.reload(renamed, timeout=60)
        with pytest.raises(OverloadedError, match="another vocabulary"):
            runner.submit(stale).result(timeout=60)
        fresh = runner.submit(_request(runner.engine, "u1", 10, seed=1)).result(timeout=60)
    finally:
        runner.close()
    assert fresh.model_version == runner.engine.version


def test_a_reload_that_fails_its_probe_leaves_the_engine_in_place(tmp_path) -> None:
    run = export(build_model(max_len=512), tmp_path / "run")
    nan = build_model(seed=4, max_len=512)
    with torch.no_grad():
        nan.postfix.parameters().__next__().fill_(float("nan"))
    broken = export(nan, tmp_path / "nan", step=9)
    engine = _engine(run)
    pool = engine.pool
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=1, max_queue_ms=QUEUE_MS))
    try:
        req = _request(engine, "u1", 20, seed=1)
        before = runner.submit(req).result(timeout=60)
        with pytest.raises(ValueError, match="probe request"):
            runner.reload(broken, timeout=60)
        after = runner.submit(req).result(timeout=60)
    finally:
        runner.close()
    assert runner.engine is engine and engine.pool is pool and pool.version == engine.version
    assert after.cached_tokens == 22 and torch.equal(after.scores, before.scores)


@pytest.mark.gpu
def test_reload_under_load_on_cuda_with_graphs(tmp_path, cuda_device) -> None:
    """On CUDA (CUDA graphs on): the new engine is built and probed beside the live one while requests stream
    in; every answer equals the CPU answer of the model version it names, across a same-shape reload (pool
    reused) and a deeper model (new pool)."""
    run = export(build_model(max_len=512), tmp_path / "run")
    other = export(build_model(seed=6, max_len=512), tmp_path / "other", step=2)
    deeper = export(build_model(seed=7, max_len=512, num_blocks=3), tmp_path / "deeper", step=3)
    engine = RankEngine.from_run(run, EngineConfig(device="cuda", cuda_graphs=16))
    engine.pool = KVCachePool.for_engine(engine, PoolConfig(device_mb=4, block_size=16))
    runner = BatchRunner(engine, SchedulerConfig(token_budget=64, prefill_chunk=32, max_wait_ms=1, max_queue_ms=QUEUE_MS))
    answers, stop = [], threading.Event()

    def caller(k: int) -> None:
        i = 0
        while not stop.is_set():
            live = runner.engine
            req = _request(live, f"u{(k + i) % 5}", 20 + (11 * i + 5 * k) % 60, seed=(k + i) % 5)
            answers.append((req, runner.submit(req).result(timeout=60)))  # one vocabulary: never refused
            i += 1

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    versions = {engine.version: run}
    try:
        for source in (other, deeper, run):
            time.sleep(0.5)
            versions[runner.reload(source, timeout=120)] = source
    finally:
        stop.set()
        for t in threads:
            t.join()
        runner.close()
    assert len({r.model_version for _, r in answers}) >= 2 and runner.engine.pool.keys.shape[1] == 2
    cold = {v: RankEngine.from_run(src, EngineConfig()) for v, src in versions.items()}
    for req, result in answers:
        torch.testing.assert_close(result.scores, cold[result.model_version].rank_encoded(req).scores, rtol=1e-4, atol=1e-4)


def test_a_reload_requested_after_arrivals_were_taken_never_drops_them(tmp_path, monkeypatch) -> None:
    """The worker takes a batch of arrivals, releases its lock, and only then does a reload arrive: the batch
    must still be answered (it used to be dropped, its futures never resolved)."""
    import recforge.serve.runner as runner_mod

    run, other = export(build_model(), tmp_path / "a"), export(build_model(seed=2), tmp_path / "b", step=2)
    engine = RankEngine.from_run(run, EngineConfig())
    runner = BatchRunner(engine, SchedulerConfig(max_wait_ms=1, max_queue_ms=QUEUE_MS))
    armed, reloaded = threading.Event(), {}

    class _Time:  # interleaves the reload right after the worker released its lock with the arrivals taken
        perf_counter, thread_time = staticmethod(time.perf_counter), staticmethod(time.thread_time)

        @staticmethod
        def monotonic() -> float:
            if (armed.is_set() and threading.current_thread().name == "recforge-batch-runner"
                    and not runner._incoming and runner._incoming_tokens == 0 and runner._backlog_tokens):  # fmt: skip
                armed.clear()
                threading.Thread(target=lambda: reloaded.setdefault("v", runner.reload(other, timeout=60))).start()
                while runner._reload is None:
                    time.sleep(0.001)
            return time.monotonic()

    monkeypatch.setattr(runner_mod, "time", _Time)
    try:
        runner._backlog_tokens = 0
        armed.set()
        future = runner.submit(engine.encode("u1", random_history(5, seed=1), [1001], timestamp=10**9))
        result = future.result(timeout=20)
        assert not armed.is_set(), "the interleaving was not exercised"
        assert result.scores.shape[0] == 1
        deadline = time.monotonic() + 20
        while "v" not in reloaded and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reloaded.get("v") == runner.engine.version
    finally:
        runner.close(timeout=1)
