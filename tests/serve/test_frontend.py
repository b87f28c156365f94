"""Front ends over an engine core (``frontend.RemoteBackend`` -> ZeroMQ -> ``engine_core.EngineCore``), both in
this process for speed: same answers as the in-process server, same-user concurrency through two front ends,
cancellation and deadlines reaching the engine, reload through one front end, a gone engine -> 503 at once.
The real multi-process server is tested in ``test_procs.py``."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import shutil
import tempfile
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq
from fastapi.testclient import TestClient

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.engine_core import EngineCore
from recforge.serve.frontend import RemoteBackend, fetch_spec
from recforge.serve.kv_pool import PoolConfig
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig, build_app, create_app
from recforge.serve.transport import Endpoints, pack, request_to_wire, unpack
from _serve_helpers import build_model, export, random_history

QUEUE_MS = LAG_MS = 60_000  # admission and shedding are tested on their own; a loaded test box must not trip them
ENGINE = dict(max_candidates=50, max_history_events=500)


def _config(run, **change) -> ServerConfig:
    base = dict(max_loop_lag_ms=LAG_MS, scheduler=SchedulerConfig(max_wait_ms=1, max_queue_ms=QUEUE_MS),
                pool=PoolConfig(device_mb=1, block_size=16), allow_reload=True, run_dir=str(run), engine_timeout_s=30.0)  # fmt: skip
    base.update(change)
    return ServerConfig(**base)


class _Core:
    """An ``EngineCore`` serving in a thread on private ipc sockets."""

    def __init__(self, run, config: ServerConfig) -> None:
        self.dir = tempfile.mkdtemp(prefix="rf-")  # ipc paths must be short
        self.endpoints = Endpoints(self.dir)
        self.engine = RankEngine.from_run(run, EngineConfig(**ENGINE))
        self.core = EngineCore(self.engine, config, self.endpoints)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.core.serve, args=(self.stop,), daemon=True)
        self.thread.start()

    def frontend(self, config: ServerConfig) -> TestClient:
        backend = RemoteBackend(self.endpoints, config, fetch_spec(self.endpoints, 10), multiprocess_metrics=False)
        return TestClient(build_app(backend, config))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(20)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def run(tmp_path):
    return export(build_model(), tmp_path / "run")


@pytest.fixture
def core(run):
    c = _Core(run, _config(run))
    yield c
    c.close()


def _body(user: str, hist: dict, rng: random.Random) -> dict:
    return {"user_id": user, "history": hist, "candidates": [1000 + rng.randrange(50) for _ in range(rng.randint(1, 6))],
            "user_features": {"user_id": rng.choice(["u1", "u2"]), "gender": "m"},
            "timestamp": (hist["timestamps"] or [0])[-1] + 7}  # fmt: skip


def _grow(hist: dict, rng: random.Random, n: int) -> dict:
    more = random_history(n, seed=rng.randrange(10_000), start=(hist["timestamps"] or [1_000_000])[-1])
    return {k: hist[k] + more[k] for k in hist}


def test_frontend_answers_exactly_as_the_in_process_server(core, run) -> None:
    rng = random.Random(random.randrange(2**31))
    config = _config(run)
    local = RankEngine.from_run(run, EngineConfig(**ENGINE))
    bodies, hist = [], {u: random_history(rng.randint(0, 20), rng.randrange(1000)) for u in ("a", "b", "c")}
    for _ in range(12):  # growing histories: cache hits and misses alike
        user = rng.choice(list(hist))
        hist[user] = _grow(hist[user], rng, rng.randint(0, 5))
        bodies.append(_body(user, hist[user], rng))
    with core.frontend(config) as remote, TestClient(create_app(local, config)) as inproc:
        for body in bodies:
            a, b = remote.post("/v1/rank", json=body), inproc.post("/v1/rank", json=body)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            a, b = a.json(), b.json()
            for key in ("model_version", "cached_tokens", "computed_tokens", "truncated_events"):
                assert a[key] == b[key], key
            for task in b["scores"]:
                torch.testing.assert_close(torch.tensor(a["scores"][task]), torch.tensor(b["scores"][task]), rtol=0, atol=1e-6)
        bad = {"user_id": "a", "candidates": ["10"]}  # lax parsing is refused the same way
        assert remote.post("/v1/rank", json=bad).json() == inproc.post("/v1/rank", json=bad).json()
        assert remote.post("/v1/rank", json={"user_id": "a", "candidates": [99999]}).status_code == 422
        health = remote.get("/health").json()
        assert health["status"] == "ok" and health["worker"]["worker_alive"] and health["frontend"]["engine_pid"]
        metrics = remote.get("/metrics").text
        assert 'recforge_rank_requests_total{status="200"} 12.0' in metrics and "recforge_batch_tokens_bucket" in metrics
        assert "recforge_engine_up 1.0" in metrics
        assert remote.get("/openapi.json").json()["components"]["schemas"]["RankRequestIn"]["examples"]
        assert remote.get("/docs").status_code == 200


def test_same_user_from_many_threads_through_two_frontends(core, run) -> None:
    seed = random.randrange(2**31)
    config = _config(run)
    cold = RankEngine.from_run(run, EngineConfig(**ENGINE))  # no pool: every answer computed from scratch
    histories = {u: random_history(5, seed=s) for s, u in enumerate(("x", "y"))}
    lock, answers, failures = threading.Lock(), [], []
    with core.frontend(config) as one, core.frontend(config) as two:

        def caller(k: int) -> None:
            rng = random.Random(seed + k)
            for _ in range(8):
                user = rng.choice(list(histories))
                with lock:
                    histories[user] = _grow(histories[user], rng, rng.randint(0, 4))
                    body = _body(user, {k2: list(v) for k2, v in histories[user].items()}, rng)
                response = (one if k % 2 else two).post("/v1/rank", json=body)
                (answers if response.status_code == 200 else failures).append((body, response))

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures, (seed, [(r.status_code, r.text) for _, r in failures[:3]])
    assert sum(r.json()["cached_tokens"] > 0 for _, r in answers) > 0  # the cache was used
    for body, response in answers:
        expected = cold.rank(body["user_id"], body["history"], body["candidates"], user_features=body["user_features"],
                             timestamp=body["timestamp"]).task_scores()  # fmt: skip
        for task, scores in expected.items():
            torch.testing.assert_close(torch.tensor(response.json()["scores"][task]), torch.tensor(scores), rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"seed {seed}: {m}")  # fmt: skip


def test_deadline_in_the_frontend_drops_the_request_in_the_engine_uncomputed(core, run) -> None:
    gate, real_run, computed = threading.Event(), core.engine.run, set()

    def gated(items):
        gate.wait(10)
        computed.update(id(item.state) for item in items)
        return real_run(items)

    core.engine.run = gated
    rng = random.Random(0)
    with core.frontend(_config(run)) as client:
        first: list = []
        blocker = threading.Thread(target=lambda: first.append(client.post("/v1/rank", json=_body("a", random_history(3, 1), rng))))
        blocker.start()
        time.sleep(0.3)  # its pass waits on the gate
        t0 = time.monotonic()
        late = client.post("/v1/rank", json=_body("b", random_history(4, 2), rng), headers={"X-Request-Timeout-Ms": "300"})
        assert late.status_code == 504 and time.monotonic() - t0 < 2
        time.sleep(0.2)  # the cancel reaches the engine
        gate.set()
        blocker.join(10)
        assert first[0].status_code == 200
        runner = core.core.runner
        for _ in range(50):
            if sum(runner.dropped.values()):
                break
            time.sleep(0.05)
        assert sum(runner.dropped.values()) == 1  # dropped before any pass: cancelled (or past its deadline)
        assert len(computed) == 1  # only the first request's state ever went through the model
        assert client.post("/v1/rank", json=_body("b", random_history(4, 2), rng)).status_code == 200


def test_reload_through_one_frontend_reaches_every_frontend(core, run, tmp_path) -> None:
    new_run = export(build_model(seed=1), tmp_path / "new", step=2)
    broken = tmp_path / "broken"
    shutil.copytree(new_run, broken)
    (broken / "model" / "manifest.json").write_text("{not json")
    config = _config(run)
    body = _body("a", random_history(6, 3), random.Random(1))
    with core.frontend(config) as one, core.frontend(config) as two:
        before = two.post("/v1/rank", json=body).json()
        failed = one.post("/v1/reload", json={"run_dir": str(broken)})
        assert failed.status_code == 422 and "still serving" in failed.json()["detail"]
        assert two.post("/v1/rank", json=body).json()["scores"] == before["scores"]  # a failed reload changes nothing
        gc.freeze()  # as an engine process does at start (procs._engine_main)
        core.core.froze_at_start = True
        done = one.post("/v1/reload", json={"run_dir": str(new_run)})
        assert done.status_code == 200, done.text
        assert gc.get_freeze_count() == 0  # the old model is collectable again
        version = done.json()["model_version"]
        after = two.post("/v1/rank", json=body).json()  # two may still hold the old spec: stale -> re-encoded
        assert after["model_version"] == version != before["model_version"]
        expected = RankEngine.from_run(new_run, EngineConfig(**ENGINE)).rank(
            body["user_id"], body["history"], body["candidates"], user_features=body["user_features"],
            timestamp=body["timestamp"]).task_scores()  # fmt: skip
        for task, scores in expected.items():
            torch.testing.assert_close(torch.tensor(after["scores"][task]), torch.tensor(scores), rtol=1e-5, atol=1e-5)
        assert two.get("/openapi.json").json()["info"]["version"] == version


def test_engine_refuses_a_request_encoded_for_another_model(core) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(core.endpoints.requests)
    req = core.engine.encode("a", random_history(3, 5), [1001], timestamp=10**7)
    sock.send(pack({"op": "rank", "id": 7, "spec": "some-older-model", "deadline": time.monotonic() + 5, **request_to_wire(req)}))
    assert sock.poll(5000)
    reply = unpack(sock.recv())
    assert reply == {"op": "stale", "id": 7, "version": core.engine.version}
    sock.send(msgpack.packb({"op": "rank", "id": 8, "spec": core.engine.version, "deadline": 1.0, "items": b"123"}))
    assert sock.poll(5000) and unpack(sock.recv())["status"] == 500  # a malformed message is answered, not fatal
    sock.close()
    ctx.term()


def test_overload_and_a_gone_engine_are_refused_before_parsing(run) -> None:
    c = _Core(run, _config(run, scheduler=SchedulerConfig(max_wait_ms=1, max_queue_ms=100)))
    try:
        with c.frontend(_config(run, scheduler=SchedulerConfig(max_wait_ms=1, max_queue_ms=100))) as client:
            backend = client.app.state.backend
            assert client.post("/v1/rank", json=_body("a", random_history(2, 1), random.Random(0))).status_code == 200

            async def stop_listening() -> None:
                backend._tasks[1].cancel()  # the heartbeat reader (else the next heartbeat overwrites the status below)

            async def listen_again() -> None:
                backend._tasks[1] = asyncio.create_task(backend._read_status())

            client.portal.call(stop_listening)
            backend._heard = time.monotonic() + 60.0  # heard just now, for the overload check below
            backend.status = {**backend.status, "queued_s": 5.0}  # as the engine would publish under overload
            refused = client.post("/v1/rank", content=b"not even json")
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
            assert "not been heard" not in refused.text
            # a front end refuses from 80% of max_queue_ms (its estimate is a heartbeat old; the engine's is live)
            backend.status = {**backend.status, "queued_s": 0.085}
            assert client.post("/v1/rank", content=b"not even json").status_code == 503
            backend.status = {**backend.status, "queued_s": 0.075}
            assert client.post("/v1/rank", content=b"not even json").status_code == 422  # admitted, then parsed
            backend.status = {**backend.status, "queued_s": 0.0}
            backend._heard = time.monotonic() - 100.0  # the engine now looks silent (stopped, wedged)
            refused = client.post("/v1/rank", content=b"not even json")
            assert refused.status_code == 503 and "not been heard" in refused.json()["detail"]
            assert client.get("/health").status_code == 503
            client.portal.call(listen_again)
            deadline = time.monotonic() + 10.0  # a heartbeat arrives (every 20 ms; slower on a loaded machine): serving again
            while client.get("/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.get("/health").status_code == 200
            c.stop.set()  # the engine shuts down: it says so, and the front end refuses at once
            c.thread.join(20)
            t0 = time.monotonic()
            gone = client.post("/v1/rank", json=_body("a", random_history(2, 1), random.Random(0)))
            assert gone.status_code == 503 and time.monotonic() - t0 < 1.0, gone.text
            assert client.get("/health").status_code == 503
            assert "recforge_engine_up 0.0" in client.get("/metrics").text
    finally:
        c.close()


@pytest.mark.integration
def test_a_client_that_leaves_is_dropped_in_the_engine_uncomputed(core, run) -> None:
    """A real uvicorn front end on loopback: the client closes its connection while its request is queued."""
    import json
    import socket

    import uvicorn

    gate, real_run, computed = threading.Event(), core.engine.run, set()

    def gated(items):
        gate.wait(10)
        computed.update(id(item.state) for item in items)
        return real_run(items)

    core.engine.run = gated
    config = _config(run)
    app = build_app(RemoteBackend(core.endpoints, config, fetch_spec(core.endpoints, 10), multiprocess_metrics=False), config)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(300):
            if server.started:
                break
            time.sleep(0.02)
        rng = random.Random(0)

        def send(body: dict) -> socket.socket:
            raw = json.dumps(body).encode()
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"POST /v1/rank HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(raw) + raw)  # fmt: skip
            return conn

        first = send(_body("a", random_history(3, 1), rng))
        time.sleep(0.3)  # its pass waits on the gate
        gone = send(_body("b", random_history(4, 2), rng))
        time.sleep(0.3)  # queued in the engine behind the gate
        gone.close()  # the client leaves: the front end cancels it in the engine
        time.sleep(0.3)
        gate.set()
        first.settimeout(10)
        assert b"200" in first.recv(100).split(b"\r\n")[0]
        runner = core.core.runner
        for _ in range(50):
            if runner.dropped["cancelled"]:
                break
            time.sleep(0.05)
        assert runner.dropped["cancelled"] == 1 and len(computed) == 1
        first.close()
    finally:
        server.should_exit = True
        thread.join(10)


class _Router:
    """Records what the engine core sends (its ``_rank``/``_answer`` driven directly, no I/O thread)."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send_multipart(self, frames) -> None:
        self.sent.append(unpack(frames[1]))


def _drive(core: EngineCore, router: _Router, msg: dict, timeout: float = 30.0) -> dict:
    router.sent.clear()
    core._rank(router, b"fe", msg["id"], unpack(pack(msg)))
    deadline = time.monotonic() + timeout
    while not router.sent and time.monotonic() < deadline:
        while core._done:
            core._answer(router, *core._done.popleft())
        time.sleep(0.005)
    assert router.sent, "no reply"
    return router.sent[-1]


def test_a_request_a_swap_overtakes_in_the_engine_is_answered_stale_uncomputed(run, tmp_path) -> None:
    renamed = export(build_model(seed=3), tmp_path / "renamed", step=4)
    vocab_path = renamed / "model" / "vocab.json"
    vocab = json.loads(vocab_path.read_text())
    vocab["item_ids"] = vocab["item_ids"][::-1]  # the same raw IDs, other codes
    vocab_path.write_text(json.dumps(vocab))
    core = EngineCore(RankEngine.from_run(run, EngineConfig(**ENGINE)), _config(run), Endpoints(str(tmp_path)))
    router, passes = _Router(), []
    core.runner.on_pass = lambda n, tokens, s: passes.append(n)
    try:
        old = core.spec.version
        req = core.engine.encode("a", random_history(5, 1), [1001, 1002], timestamp=10**9)
        msg = {"op": "rank", "id": 1, "spec": old, "deadline": time.monotonic() + 30, **request_to_wire(req)}
        submit = core.runner.submit

        def swap_first(r, deadline=None):  # the reload lands between the engine's spec check and the worker
            core.runner.reload(renamed, timeout=60)
            return submit(r, deadline)

        core.runner.submit = swap_first
        assert _drive(core, router, msg) == {"op": "stale", "id": 1, "version": core.runner.engine.version}
        assert not passes, "the old-vocabulary request was computed on the new model"
        core.runner.submit = submit
        assert core.spec.version == core.runner.engine.version != old  # heartbeat and stale check follow the swap
        assert _drive(core, router, {**msg, "id": 2})["op"] == "stale"  # never scored with the old codes
        fresh = core.engine.encode("a", random_history(5, 1), [1001, 1002], timestamp=10**9)
        msg = {**msg, "id": 3, "spec": core.spec.version, **request_to_wire(fresh)}
        assert _drive(core, router, msg)["op"] == "result"
    finally:
        core.runner.close(timeout=1)


@pytest.mark.parametrize("change, message", [
    ({"request_time": 2**63 + 1}, "times must be within"),
    ({"candidates": np.array([10**6], dtype="<i8").tobytes()}, "candidates: codes must be within"),
    ({"items": np.full(5, -1, dtype="<i8").tobytes()}, "items: codes must be within"),
    ({"context_ids": b""}, "context_ids: 0 values"),
    ({"candidates": np.ones(ENGINE["max_candidates"] + 1, dtype="<i8").tobytes()}, "candidates; the limit is"),
])  # fmt: skip
def test_a_wire_request_out_of_range_fails_alone_in_the_engine(run, tmp_path, change, message) -> None:
    core = EngineCore(RankEngine.from_run(run, EngineConfig(**ENGINE)), _config(run), Endpoints(str(tmp_path)))
    router = _Router()
    try:
        good = core.engine.encode("a", random_history(5, 1), [1001, 1002], timestamp=10**9)
        msg = {"op": "rank", "id": 1, "spec": core.spec.version, "deadline": time.monotonic() + 30,
               **request_to_wire(good)}  # fmt: skip
        core._handle(router, b"fe", pack({**msg, **change}))
        assert router.sent[-1]["status"] == 500 and message in router.sent[-1]["detail"], router.sent[-1]
        assert _drive(core, router, {**msg, "id": 2})["op"] == "result"
    finally:
        core.runner.close(timeout=1)


@pytest.mark.parametrize("fetch, status", [("dies", 503), ("hangs", 504)])
def test_an_engine_lost_while_refreshing_a_stale_spec_is_503_or_504_not_500(core, run, fetch, status) -> None:
    from recforge.serve.frontend import EngineUnavailable

    config = _config(run, request_timeout_ms=300)
    body = _body("a", random_history(6, 3), random.Random(1))
    with core.frontend(config) as client:
        spec = fetch_spec(core.endpoints, 10)
        spec.version = "an-older-model"  # every request is answered stale

        async def refresh() -> None:
            if fetch == "dies":
                raise EngineUnavailable("the engine process exited while this request was in flight")
            await asyncio.sleep(10)

        async def keep_the_stale_spec() -> None:  # the 20-ms heartbeat would fetch the real spec back (a race)
            return None

        remote = client.app.state.backend
        remote.spec, remote.refresh, remote._fetch_spec = spec, refresh, keep_the_stale_spec
        started = time.monotonic()
        response = client.post("/v1/rank", json=body)
        took = time.monotonic() - started
    assert response.status_code == status, response.text
    assert took < 5, f"the refresh was not bounded by the request's 300 ms deadline ({took:.1f} s)"
