"""The HTTP layer under hostile or unlucky traffic: strict input, byte limits for every transfer encoding,
read timeouts, deadlines, overload, a stuck worker, disconnects, failed reloads, offline docs."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.kv_pool import PoolConfig
from recforge.serve.limits import http_protocol
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig, create_app
from _serve_helpers import build_model, export, random_history

QUEUE_MS = LAG_MS = 60_000  # admission and load shedding are tested on their own; a loaded test box must not trip them


@pytest.fixture
def run(tmp_path):
    return export(build_model(), tmp_path / "run")


def _config(run, **change) -> ServerConfig:
    base = dict(max_loop_lag_ms=LAG_MS, scheduler=SchedulerConfig(max_wait_ms=1, max_queue_ms=QUEUE_MS), pool=PoolConfig(device_mb=1, block_size=16), allow_reload=True,
                run_dir=str(run), max_body_bytes=200_000)  # fmt: skip
    base.update(change)
    return ServerConfig(**base)


@pytest.fixture
def client(run):
    engine = RankEngine.from_run(run, EngineConfig(max_candidates=50, max_history_events=500))
    with TestClient(create_app(engine, _config(run))) as c:
        yield c


def _body(n=10, seed=0, **change) -> dict:
    hist = random_history(n, seed)
    body = {"user_id": "u9", "history": hist, "candidates": [1001, 1007, 1020],
            "user_features": {"user_id": "u1", "gender": "x"}, "timestamp": hist["timestamps"][-1] + 60}  # fmt: skip
    body.update(change)
    return body


def _post_raw(client, raw: bytes, **headers):
    return client.post("/v1/rank", content=raw, headers={"content-type": "application/json", **headers})


@pytest.mark.parametrize(
    "raw, message",
    [
        (json.dumps(_body()).replace('"gender": "x"', '"gender": NaN'), "finite"),
        (json.dumps(_body()).replace('"gender": "x"', '"gender": Infinity'), "finite"),
        (json.dumps(_body()).replace('"gender": "x"', '"gender": 1e400'), "finite"),
        (json.dumps(_body(timestamp=2**63)), "timestamp"),
        (json.dumps(_body(history={"items": [1001], "timestamps": [-(2**63) - 1]})), "history.timestamps"),
        (json.dumps(_body(user_id="x")).replace('"x"', '"\\ud800"'), "not valid JSON"),
        (json.dumps(_body(user_id="u" * 300)), "at most 256"),
        (json.dumps(_body(candidates=["\u0663"])), "unknown candidate items"),  # Arabic-Indic 3 is not item 3
        (json.dumps(_body(candidates=["1001"])), "unknown candidate items"),  # a string is not an integer ID
        (json.dumps(_body(candidates=[1001.0])), "candidates.0"),
        (json.dumps(_body(candidates=[True])), "candidates.0"),
        (json.dumps(_body(candidates=[2**64])), "candidates.0"),
    ],
)
def test_hostile_values_get_422_with_a_message(client, raw, message) -> None:
    response = _post_raw(client, raw.encode())
    assert response.status_code == 422, response.text
    assert message in response.text
    assert client.post("/v1/rank", json=_body()).status_code == 200


def test_invalid_utf8_is_a_422(client) -> None:
    raw = json.dumps(_body(user_id="ab")).encode().replace(b'"ab"', b'"a\xff"')
    assert _post_raw(client, raw).status_code == 422


def test_a_chunked_body_cannot_pass_the_byte_limit(client) -> None:
    def chunks():
        for _ in range(100):
            yield b" " * 10_000  # 1 MB of whitespace, no Content-Length

    response = client.post("/v1/rank", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and "exceeds" in response.text
    assert client.post("/v1/rank", json=_body()).status_code == 200


def test_every_status_is_counted_in_the_metrics(client) -> None:
    client.post("/v1/rank", json=_body())
    _post_raw(client, b"{not json")
    client.post("/v1/rank", content=b" " * 300_000, headers={"content-type": "application/json"})
    metrics = client.get("/metrics").text
    for status in ("200", "413", "422"):
        assert f'recforge_rank_requests_total{{status="{status}"}} 1.0' in metrics, metrics
    assert 'recforge_http_responses_total{path="/v1/rank",status="413"} 1.0' in metrics


def test_docs_need_no_cdn_and_the_schema_is_the_validating_model(client) -> None:
    html = client.get("/docs").text
    assert "cdn" not in html.lower() and "https://" not in html
    script = [part.split('"')[0] for part in html.split('src="')[1:]]
    assert script and all(client.get(src).status_code == 200 for src in script)
    schema = client.get("/openapi.json").json()
    request = schema["components"]["schemas"]["RankRequestIn"]
    features = schema["components"]["schemas"]["UserFeaturesIn"]
    assert set(features["properties"]) == {"user_id", "gender"} and features["additionalProperties"] is False
    example = request["examples"][0]
    answer = client.post("/v1/rank", json=example)
    assert answer.status_code == 200, answer.text
    assert client.post("/v1/rank", json={**example, "user_features": {"shoe": 1}}).status_code == 422


def test_deadline_header_is_checked_and_enforced(run) -> None:
    engine = RankEngine.from_run(run, EngineConfig())
    gate = threading.Event()
    real_run = engine.run
    engine.run = lambda items: (gate.wait(5), real_run(items))[1]
    with TestClient(create_app(engine, _config(run))) as client:
        assert client.post("/v1/rank", json=_body(), headers={"x-request-timeout-ms": "soon"}).status_code == 422
        assert client.post("/v1/rank", json=_body(), headers={"x-request-timeout-ms": "-5"}).status_code == 422
        t0 = time.monotonic()
        late = client.post("/v1/rank", json=_body(), headers={"x-request-timeout-ms": "200"})
        assert late.status_code == 504 and time.monotonic() - t0 < 3
        health = client.get("/health").json()
        gate.set()
        assert health["worker"]["dropped"] == {"deadline": 0, "cancelled": 0}  # dropped once the pass returns
        assert client.post("/v1/rank", json=_body(seed=3)).status_code == 200
        # the timed-out request was dropped after its blocked pass, its candidates never computed
        assert sum(client.app.state.runner.dropped.values()) == 1


def test_overload_gets_503_with_retry_after(run) -> None:
    engine = RankEngine.from_run(run, EngineConfig())
    real_run = engine.run
    engine.run = lambda items: (time.sleep(0.05), real_run(items))[1]
    config = _config(run, pool=None, scheduler=SchedulerConfig(max_wait_ms=0, max_queue_ms=100))
    with TestClient(create_app(engine, config)) as client:
        assert client.post("/v1/rank", json=_body()).status_code == 200  # the cost of a pass is measured
        statuses, headers = [], []

        def caller(i):
            r = client.post("/v1/rank", json=_body(seed=i, user_id=f"u{i}"))
            statuses.append(r.status_code)
            headers.append(r.headers.get("retry-after"))

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert 503 in statuses and 200 in statuses and set(statuses) <= {200, 503}
    assert all(h is not None and int(h) >= 1 for s, h in zip(statuses, headers) if s == 503)


def test_a_late_event_loop_sheds_rank_requests_before_reading_them(run) -> None:
    engine = RankEngine.from_run(run, EngineConfig())
    with TestClient(create_app(engine, _config(run, max_loop_lag_ms=250))) as client:
        assert client.post("/v1/rank", json=_body()).status_code == 200
        client.app.state.loop_lag.lag_s = 100.0  # as if the loop had been 100 s late (the monitor decays it)
        refused = client.post("/v1/rank", json=_body())
        assert refused.status_code == 503 and "behind reading requests" in refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert client.get("/health").status_code == 200  # only rank requests are shed


def test_health_turns_unhealthy_when_the_worker_is_stuck(run) -> None:
    engine = RankEngine.from_run(run, EngineConfig())
    gate = threading.Event()
    real_run = engine.run
    engine.run = lambda items: (gate.wait(10), real_run(items))[1]
    config = _config(run, scheduler=SchedulerConfig(max_wait_ms=0, stall_seconds=0.2, max_queue_ms=QUEUE_MS))
    with TestClient(create_app(engine, config)) as client:
        assert client.get("/health").status_code == 200
        waiter = threading.Thread(target=client.post, args=("/v1/rank",), kwargs={"json": _body()})
        waiter.start()
        time.sleep(0.6)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["worker"]["worker_stuck"]
        gate.set()
        waiter.join()
        assert client.get("/health").status_code == 200


def test_a_failed_reload_is_a_422_and_changes_nothing(client, run, tmp_path) -> None:
    before = client.post("/v1/rank", json=_body()).json()
    broken = export(build_model(seed=5), tmp_path / "broken", step=7)
    (broken / "model" / "postfix" / "config.json").write_text('{"class": "os:system", "kwargs": {}}')
    response = client.post("/v1/reload", json={"run_dir": str(broken)})
    assert response.status_code == 422 and "still serving" in response.text
    after = client.post("/v1/rank", json=_body()).json()
    assert after["model_version"] == before["model_version"] and after["cached_tokens"] == 12
    assert after["scores"] == before["scores"]
    assert client.post("/v1/reload", content=b'{"run_dir": 5}').status_code == 422


class _Server:
    """A real uvicorn server on loopback in a thread, with recforge's transport limits."""

    def __init__(self, app, config: ServerConfig, base=None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    http=http_protocol(config.header_timeout_s, base)))  # fmt: skip
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.02)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.mark.integration
@pytest.mark.parametrize("base", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def test_slow_headers_and_bodies_are_cut_off_and_gone_clients_cost_nothing(run, base) -> None:
    engine = RankEngine.from_run(run, EngineConfig())
    gate = threading.Event()
    real_run = engine.run
    engine.run = lambda items: (gate.wait(10), real_run(items))[1]
    config = _config(run, header_timeout_s=0.5, body_timeout_s=0.5, scheduler=SchedulerConfig(max_wait_ms=0, max_queue_ms=QUEUE_MS))
    app = create_app(engine, config)
    with _Server(app, config, base) as srv:
        slow = socket.create_connection(("127.0.0.1", srv.port))
        slow.sendall(b"POST /v1/rank HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        slow.settimeout(5)
        t0 = time.monotonic()
        assert slow.recv(100) == b"" and time.monotonic() - t0 < 3  # closed by the server
        body = json.dumps(_body()).encode()
        trickle = socket.create_connection(("127.0.0.1", srv.port))
        trickle.sendall(b"POST /v1/rank HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n" % len(body) + body[:10])  # fmt: skip
        trickle.settimeout(5)
        assert b"408" in trickle.recv(1000).split(b"\r\n")[0]
        gone = socket.create_connection(("127.0.0.1", srv.port))
        gone.sendall(b"POST /v1/rank HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
        time.sleep(0.3)  # admitted; its first pass is waiting on the gate
        second = socket.create_connection(("127.0.0.1", srv.port))
        body2 = json.dumps(_body(user_id="other", seed=2)).encode()
        second.sendall(b"POST /v1/rank HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n" % len(body2) + body2)  # fmt: skip
        time.sleep(0.3)  # queued behind the gate
        second.close()  # this client leaves before its request is computed
        time.sleep(0.3)
        gate.set()
        gone.settimeout(10)
        assert b"200" in gone.recv(100).split(b"\r\n")[0]
        for _ in range(50):
            if app.state.runner.dropped["cancelled"]:
                break
            time.sleep(0.1)
        assert app.state.runner.dropped["cancelled"] == 1
        assert httpx.post(f"http://127.0.0.1:{srv.port}/v1/rank", json=_body(seed=4), timeout=10).status_code == 200
    for s in (slow, trickle, gone):
        s.close()
