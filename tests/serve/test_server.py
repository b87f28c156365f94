"""HTTP server: /v1/rank scores equal the engine's, validation gives clear 4xx, /health, /metrics, OpenAPI, reload."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.kv_pool import PoolConfig
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig, create_app
from _serve_helpers import build_model, export, random_history

QUEUE_MS = LAG_MS = 60_000  # admission and load shedding are tested on their own; a loaded test box must not trip them


@pytest.fixture
def run(tmp_path):
    return export(build_model(), tmp_path / "run")


@pytest.fixture
def client(run):
    engine = RankEngine.from_run(run, EngineConfig(max_candidates=50, max_history_events=500))
    config = ServerConfig(max_loop_lag_ms=LAG_MS, scheduler=SchedulerConfig(max_wait_ms=1, max_queue_ms=QUEUE_MS), pool=PoolConfig(device_mb=1, block_size=16),
                          allow_reload=True, run_dir=str(run), max_body_bytes=200_000)  # fmt: skip
    with TestClient(create_app(engine, config)) as c:
        yield c


def _body(n=30, seed=0, **change):
    hist = random_history(n, seed)
    body = {"user_id": "u9", "history": hist, "candidates": [1001, 1007, 1020],
            "user_features": {"user_id": "u1", "gender": "x"}, "timestamp": hist["timestamps"][-1] + 60}  # fmt: skip
    body.update(change)
    return body


def test_rank_returns_the_engine_scores_and_reuses_the_cache(client, run) -> None:
    body = _body()
    first = client.post("/v1/rank", json=body)
    assert first.status_code == 200, first.text
    out = first.json()
    assert list(out["scores"]) == ["click", "rating"] and len(out["scores"]["click"]) == 3
    assert out["cached_tokens"] == 0 and out["computed_tokens"] == 32
    engine = RankEngine.from_run(run)
    expected = engine.rank("u9", body["history"], body["candidates"], user_features=body["user_features"],
                           timestamp=body["timestamp"]).task_scores()  # fmt: skip
    for task in expected:
        torch.testing.assert_close(torch.tensor(out["scores"][task]), torch.tensor(expected[task]), rtol=1e-5, atol=1e-5)
    second = client.post("/v1/rank", json=body).json()
    assert second["cached_tokens"] == 32 and second["computed_tokens"] == 0
    assert second["scores"]["click"] == pytest.approx(out["scores"]["click"], abs=1e-6)


@pytest.mark.parametrize(
    "change, status, message",
    [
        (dict(candidates=[]), 422, "at least 1"),
        (dict(candidates=[1001] * 51), 422, "at most 50 items"),
        (dict(candidates=[1001, 77]), 422, "unknown candidate items"),
        (dict(candidates=[1.5]), 422, "candidates"),
        (dict(timestamp="soon"), 422, "timestamp"),
        (dict(history={"items": [1001], "timestamps": [1, 2]}), 422, "same length"),
        (dict(history={"items": [1001] * 501, "timestamps": [1] * 501}), 422, "at most 500 items"),
        (dict(history={"items": [1001, 1002], "timestamps": [9, 3]}), 422, "non-decreasing"),
        (dict(user_features={"shoe_size": 3}), 422, "unknown user feature"),
        (dict(surprise=1), 422, "surprise"),
        (dict(candidates=list(range(100_000, 160_000))), 413, "exceeds"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_do_not_disturb_others(client, change, status, message) -> None:
    bad = client.post("/v1/rank", json=_body(**change))
    assert bad.status_code == status
    assert message in bad.text
    good = client.post("/v1/rank", json=_body())
    assert good.status_code == 200


def test_malformed_json_is_a_4xx(client) -> None:
    response = client.post("/v1/rank", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422


def test_health_metrics_and_openapi(client) -> None:
    client.post("/v1/rank", json=_body())
    client.post("/v1/rank", json=_body())
    client.post("/v1/rank", json=_body(candidates=[]))
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["tasks"] == ["click", "rating"]
    assert health["kv_cache"]["hit_rate"] == 0.5
    metrics = client.get("/metrics").text
    assert 'recforge_rank_requests_total{status="200"} 2.0' in metrics
    assert "recforge_rank_latency_seconds_bucket" in metrics and "recforge_batch_tokens_bucket" in metrics
    assert "recforge_kv_cache_hit_rate 0.5" in metrics
    kv = health["kv_cache"]  # the pool's counters and the engine's copies, as /health reports them
    assert f"recforge_kv_cache_lookups {float(kv['lookups'])}" in metrics and kv["lookups"] == 2
    assert f"recforge_kv_cache_device_hits {float(kv['device_hits'])}" in metrics
    assert f"recforge_kv_cache_misses {float(kv['misses'])}" in metrics and kv["misses"] >= 1
    assert "recforge_engine_uploads " in metrics and "recforge_engine_uploads 0.0" not in metrics
    assert "recforge_rank_refused 0.0" in metrics
    schema = client.get("/openapi.json").json()
    assert "/v1/rank" in schema["paths"] and "RankRequestIn" in schema["components"]["schemas"]
    assert client.get("/docs").status_code == 200


def test_reload_swaps_the_model_and_invalidates_caches(client, run) -> None:
    body = _body()
    before = client.post("/v1/rank", json=body).json()
    export(build_model(seed=5), run, step=7)
    response = client.post("/v1/reload", json={})
    assert response.status_code == 200, response.text
    assert response.json()["model_version"].startswith("step7")
    after = client.post("/v1/rank", json=body).json()
    assert after["cached_tokens"] == 0 and after["model_version"].startswith("step7")
    assert after["scores"]["click"] != pytest.approx(before["scores"]["click"])
    expected = RankEngine.from_run(run).rank("u9", body["history"], body["candidates"],
                                             user_features=body["user_features"], timestamp=body["timestamp"])  # fmt: skip
    assert after["scores"]["click"] == pytest.approx(expected.task_scores()["click"], abs=1e-5)
    assert client.post("/v1/reload", json={"run_dir": "/nonexistent"}).status_code == 422


def test_a_reload_that_overtakes_a_queued_request_re_encodes_it_uncomputed(client, run, tmp_path) -> None:
    runner = client.app.state.runner
    new_run = export(build_model(seed=5), tmp_path / "new", step=9)
    vocab_path = new_run / "model" / "vocab.json"
    vocab = json.loads(vocab_path.read_text())
    vocab["item_ids"] = vocab["item_ids"][::-1]  # the same raw IDs, other codes
    vocab_path.write_text(json.dumps(vocab))
    engines, submit = [], runner.submit

    def swap_first(req, deadline=None):  # the reload lands after the route encoded the request, before the worker
        if not engines:
            runner.reload(new_run, timeout=60)
        engines.append(req.encoding)
        return submit(req, deadline)

    runner.submit = swap_first
    response = client.post("/v1/rank", json=_body())
    assert response.status_code == 200, response.text
    assert response.json()["model_version"].startswith("step9")
    assert engines == [engines[0], runner.engine.encoding] and engines[0] != runner.engine.encoding


def test_a_reload_refused_by_the_runner_is_409_as_with_front_ends(client) -> None:
    runner = client.app.state.runner
    assert runner._reload_lock.acquire(blocking=False)  # a reload started on the runner itself (not through HTTP)
    try:
        response = client.post("/v1/reload", json={})
    finally:
        runner._reload_lock.release()
    assert response.status_code == 409 and "another reload is in progress" in response.json()["detail"], response.text
