"""The engine process under load: a rank message the runner would refuse is refused from its sizes, before it is
decoded, and the engine's cumulative counters (``/health``'s ``counters``) account for passes, admissions and
refusals. The engine core is driven directly (``_handle``/``_answer``), without sockets or threads of its own."""

from __future__ import annotations

import random
import time

import pytest

import recforge.serve.engine_core as engine_core
from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.engine_core import EngineCore, engine_report
from recforge.serve.kv_pool import PoolConfig
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig
from recforge.serve.transport import Endpoints, pack, request_to_wire, unpack
from _serve_helpers import NUM_ITEMS, build_model, export, random_history


class _Router:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send_multipart(self, frames) -> None:
        self.sent.append(unpack(frames[1]))


@pytest.fixture
def core(tmp_path):
    run = export(build_model(), tmp_path / "run")
    config = ServerConfig(scheduler=SchedulerConfig(max_wait_ms=1, max_queue_ms=500),
                          pool=PoolConfig(device_mb=1, block_size=16))  # fmt: skip
    core = EngineCore(RankEngine.from_run(run, EngineConfig(max_candidates=50)), config, Endpoints(str(tmp_path)))
    yield core
    core.runner.close(timeout=1)


def _message(core: EngineCore, rid: int, rng: random.Random) -> bytes:
    req = core.engine.encode(f"u{rng.randrange(3)}", random_history(rng.randint(1, 20), rng.randrange(10**6)),
                             [rng.randint(1000, 999 + NUM_ITEMS) for _ in range(rng.randint(1, 5))], timestamp=10**9)  # fmt: skip
    return pack({"op": "rank", "id": rid, "spec": core.spec.version, "deadline": time.monotonic() + 30,
                 **request_to_wire(req)})  # fmt: skip


def _answers(core: EngineCore, router: _Router, count: int, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while len(router.sent) < count and time.monotonic() < deadline:
        while core._done:
            core._answer(router, *core._done.popleft())
        time.sleep(0.005)
    assert len(router.sent) == count, router.sent
    return router.sent


def test_counters_account_for_every_request_and_pass(core) -> None:
    rng, router = random.Random(), _Router()
    n = rng.randint(3, 8)
    for rid in range(n):
        core._handle(router, b"fe", _message(core, rid, rng))
    assert all(reply["op"] == "result" for reply in _answers(core, router, n))
    counters = engine_report(core.engine, core.runner, core.config, dict(core.io))["counters"]
    assert counters["admitted"] == n and counters["refused"] == 0
    assert counters["io_rank_messages"] == n and counters["io_refused_before_decode"] == 0
    assert counters["passes"] >= 2 and counters["pass_requests"] >= n  # a prefix pass and a candidates pass each
    assert counters["pass_tokens"] > 0 and 0 < counters["pass_s"] <= counters["t"]
    assert counters["worker_cpu_s"] > 0 and counters["io_decode_s"] > 0


def test_a_request_the_runner_would_refuse_is_refused_before_it_is_decoded(core, monkeypatch) -> None:
    rng, router = random.Random(), _Router()
    decoded = []
    real = engine_core.request_from_wire
    monkeypatch.setattr(engine_core, "request_from_wire", lambda msg: decoded.append(msg["id"]) or real(msg))
    runner = core.runner
    with runner._cond:  # about 10 s of work queued ahead (the worker is idle: nothing recounts it)
        runner._cost.observe(1000, 1.0)
        runner._backlog_tokens = 10_000
    core._handle(router, b"fe", _message(core, 1, rng))
    reply = router.sent[-1]
    assert reply["op"] == "error" and reply["status"] == 503 and reply["retry_after"] >= 1, reply
    assert decoded == [] and core.io["io_refused_before_decode"] == 1 and runner.stats()["refused"] == 1
    with runner._cond:
        runner._backlog_tokens = 0  # the queue drained: the next request is decoded and answered
    core._handle(router, b"fe", _message(core, 2, rng))
    assert _answers(core, router, 2)[-1]["op"] == "result" and decoded == [2]


def test_a_malformed_message_still_fails_alone(core) -> None:
    router = _Router()
    core._handle(router, b"fe", pack({"op": "rank", "id": 7, "spec": core.spec.version, "deadline": time.monotonic() + 30,
                                      "items": "not bytes", "candidates": b""}))  # fmt: skip
    assert router.sent[-1]["status"] == 500 and "items" in router.sent[-1]["detail"]
