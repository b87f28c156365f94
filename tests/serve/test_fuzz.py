"""Property-based API test against the server's own OpenAPI schema (schemathesis), and a concurrency fuzz
over HTTP: many threads, few users, random history extensions and rewrites, random reloads."""

from __future__ import annotations

import os
import random
import threading

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the test extra (pip install -e '.[test]') brings schemathesis")
from schemathesis import GenerationMode  # noqa: E402
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.kv_pool import PoolConfig
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig, create_app
from _serve_helpers import build_model, export, random_history

QUEUE_MS = LAG_MS = 60_000  # admission and load shedding are tested on their own; a loaded test box must not trip them


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
OPERATIONS = [("/v1/rank", "POST", POSITIVE), ("/v1/rank", "POST", NEGATIVE), ("/v1/reload", "POST", POSITIVE),
              ("/v1/reload", "POST", NEGATIVE), ("/health", "GET", POSITIVE)]  # fmt: skip
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]  # fmt: skip


@pytest.mark.parametrize("path, method, mode", OPERATIONS, ids=lambda v: getattr(v, "value", v))
def test_api_never_fails_on_generated_requests(tmp_path, path, method, mode) -> None:
    """Requests generated from the served schema (valid ones, and ones the schema forbids): no 5xx,
    responses match the documented schema and statuses, and every request the schema forbids is rejected
    with a 4xx (the schema is the validator). Not checked: schema-valid requests are all accepted, since IDs
    outside the model's vocabulary are schema-valid and get a documented 422."""
    run = export(build_model(), tmp_path / "run")
    engine = RankEngine.from_run(run, EngineConfig(max_candidates=20, max_history_events=64))
    config = ServerConfig(max_loop_lag_ms=LAG_MS, scheduler=SchedulerConfig(max_wait_ms=0, max_queue_ms=QUEUE_MS), pool=PoolConfig(device_mb=1, block_size=16),
                          allow_reload=True, run_dir=str(run))  # fmt: skip
    operation = schemathesis.openapi.from_asgi("/openapi.json", create_app(engine, config))[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=int(os.environ.get("RECFORGE_FUZZ_EXAMPLES", 25)), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case) -> None:
        case.call_and_validate(checks=CHECKS)

    check()


def _extend(hist: dict, rng: random.Random, n: int) -> dict:
    """``hist`` plus ``n`` later events."""
    last = hist["timestamps"][-1] if hist["timestamps"] else 1_000_000
    out = {k: list(v) for k, v in hist.items()}
    for _ in range(n):
        last += rng.randint(0, 900)
        out["items"].append(1000 + rng.randrange(50))
        out["timestamps"].append(last)
        out["actions"].append(rng.choice(["pv", "cart", "buy"]))
    return out


@pytest.mark.integration
def test_concurrent_users_histories_and_reloads_fuzz(tmp_path) -> None:
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    runs = [export(build_model(seed=s), tmp_path / f"run{s}", step=s + 1) for s in (0, 1)]
    engine = RankEngine.from_run(runs[0], EngineConfig())
    config = ServerConfig(max_loop_lag_ms=LAG_MS, scheduler=SchedulerConfig(token_budget=rng.choice([16, 40, 4096]), prefill_chunk=rng.choice([8, 24]),
                                                    max_wait_ms=1, max_queue_ms=QUEUE_MS), pool=PoolConfig(device_mb=1, block_size=8),
                          allow_reload=True, request_timeout_ms=60_000)  # fmt: skip
    histories = {f"u{u}": random_history(rng.randint(0, 30), seed=rng.randrange(1000)) for u in range(3)}
    lock = threading.Lock()
    answers, failures = [], []
    with TestClient(create_app(engine, config)) as client:

        def caller(k: int) -> None:
            local = random.Random(seed + k)
            for _ in range(12):
                user = local.choice(list(histories))
                with lock:
                    if local.random() < 0.15:  # the history is rewritten
                        histories[user] = random_history(local.randint(1, 20), seed=local.randrange(1000))
                    else:
                        histories[user] = _extend(histories[user], local, local.randint(0, 6))
                    hist = {k2: list(v) for k2, v in histories[user].items()}
                body = {"user_id": user, "history": hist, "candidates": [1000 + local.randrange(50) for _ in range(3)],
                        "user_features": {"gender": "f"}, "timestamp": (hist["timestamps"] or [0])[-1] + 5}  # fmt: skip
                response = client.post("/v1/rank", json=body)
                (answers if response.status_code == 200 else failures).append((body, response))

        def reloader() -> None:
            local = random.Random(seed - 1)
            for _ in range(3):
                threading.Event().wait(local.uniform(0.05, 0.3))
                response = client.post("/v1/reload", json={"run_dir": str(local.choice(runs))})
                if response.status_code != 200:
                    failures.append(("reload", response))

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(6)] + [threading.Thread(target=reloader)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures, (seed, [(b, r.status_code, r.text) for b, r in failures[:3]])
    cold = {}
    for run in runs:
        e = RankEngine.from_run(run, EngineConfig())
        cold[e.version] = e
    for body, response in answers:
        out = response.json()
        expected = cold[out["model_version"]].rank(body["user_id"], body["history"], body["candidates"],
                                                   user_features=body["user_features"], timestamp=body["timestamp"])  # fmt: skip
        for task, scores in expected.task_scores().items():
            torch.testing.assert_close(torch.tensor(out["scores"][task]), torch.tensor(scores), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"seed {seed}: {m}")  # fmt: skip
