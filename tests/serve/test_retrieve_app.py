"""`/v1/retrieve` over a tiny trained generative run: the same items as ``Retriever``, batching, validation,
deadlines, /health, /metrics, /docs, and `recforge serve` on a generative run."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from recforge.cli import main
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.generate import RetrieveRequest
from recforge.serve.retrieve_app import (
    RetrieveSettings,
    create_retrieve_app,
    load_retriever,
)
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig

TINY = ["model.dim=16", "model.num_blocks=1", "generative.decoder_blocks=1", "model.num_heads=2", "model.ffn_dim=32",
        "optim.warmup_steps=0", "train.batch_size=64", "train.threads=1", "eval.batch_size=64", "data.max_seq_len=8",
        "generative.beam=12", "eval.ks=[1,5,10]", "train.epochs=1"]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retrieve")
    data = write_synthetic(root / "data", SyntheticConfig(num_users=40, num_items=30, seed=5, mean_seq_len=10, max_seq_len=20))
    assert main(["sid", "fit", str(data), "--out", str(data / "sids"), "--codebook-size", "4", "--levels", "2"]) == 0
    run = root / "run"
    assert main(["--no-progress", "train", "configs/beauty-sid-tiger.yaml", f"data.path={data}",
                 f"generative.sids={data / 'sids'}", f"train.output_dir={run}", *TINY]) == 0  # fmt: skip
    return run


@pytest.fixture(scope="module")
def loaded(run_dir: Path):
    settings = RetrieveSettings(max_k=20, max_batch=8, max_history=50, max_allowed=40)
    retriever, version = load_retriever(run_dir, settings, device="cpu")
    return retriever, version, settings


def _client(loaded, **scheduler) -> TestClient:
    retriever, version, settings = loaded
    # no shedding: building /openapi.json or a loaded CI machine can hold the loop past the default 250 ms, or
    # queue past the default 500 ms of estimated work, and the next request would read 503 (shedding is tested
    # in tests/serve/test_server_hardening.py)
    config = ServerConfig(max_loop_lag_ms=60_000,
                          scheduler=SchedulerConfig(**{"max_wait_ms": 1.0, "max_queue_ms": 60_000, **scheduler}))
    return TestClient(create_retrieve_app(retriever, version, config, settings))


def _catalogue(loaded) -> list[int]:
    return [int(v) for v in loaded[0].item_vocab[1:]]


def _random_body(items: list[int], g: torch.Generator, allowed: bool) -> dict:
    history = [items[j] for j in torch.randint(len(items), (int(torch.randint(1, 15, (1,), generator=g)),), generator=g)]
    body = {"user_id": f"u{int(torch.randint(100, (1,), generator=g))}", "history": history,
            "k": int(torch.randint(1, 15, (1,), generator=g)), "exclude_history": bool(torch.rand(1, generator=g) < 0.7)}
    if allowed:
        body["allowed_items"] = [items[j] for j in torch.randperm(len(items), generator=g)[:10]]
    return body


def test_retrieve_equals_the_retriever_and_respects_allowed_items(loaded) -> None:
    retriever, version, settings = loaded
    items, g = _catalogue(loaded), torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    with _client(loaded) as client:
        for i in range(8):
            body = _random_body(items, g, allowed=i % 2 == 1)
            got = client.post("/v1/retrieve", json=body)
            assert got.status_code == 200, got.text
            out = got.json()
            want = retriever.retrieve([body["history"]], k=body["k"], beam=retriever.config.beam,
                                      allowed_items=[body.get("allowed_items")],
                                      exclude_history=body["exclude_history"])[0]  # fmt: skip
            assert out["items"] == want[0] and len(out["items"]) <= body["k"]
            torch.testing.assert_close(torch.tensor(out["scores"]), torch.tensor(want[1]), rtol=1e-5, atol=1e-5)
            assert out["model_version"] == version and out["user_id"] == body["user_id"] and out["latency_ms"] > 0
            if "allowed_items" in body:
                assert set(out["items"]) <= set(body["allowed_items"])
            if body["exclude_history"]:
                assert not set(out["items"]) & set(body["history"])
        default = client.post("/v1/retrieve", json={"user_id": 7, "history": items[:3]}).json()
        assert len(default["items"]) == settings.default_k


def test_concurrent_requests_share_batches_and_get_their_own_answers(loaded) -> None:
    retriever = loaded[0]
    items, g = _catalogue(loaded), torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    bodies = [_random_body(items, g, allowed=i % 3 == 0) for i in range(16)]
    alone = [r.items for r in retriever.retrieve_requests([RetrieveRequest(b["history"], b["k"], b.get("allowed_items"),
                                                                           b["exclude_history"]) for b in bodies])]  # fmt: skip
    calls: list[int] = []
    original = retriever.run

    def counted(batch, **kw):
        calls.append(len(batch))
        time.sleep(0.02)  # the next requests queue meanwhile and form the next batch
        return original(batch, **kw)

    retriever.run = counted
    try:
        with _client(loaded, max_wait_ms=20.0) as client, ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda b: client.post("/v1/retrieve", json=b), bodies))
            metrics = client.get("/metrics").text
    finally:
        del retriever.run
    assert [a.status_code for a in answers] == [200] * 16
    assert [a.json()["items"] for a in answers] == alone
    assert sum(calls) == 16 and max(calls) > 1 and max(calls) <= retriever.config.max_batch
    assert "recforge_retrieve_batch_requests_count" in metrics and 'path="/v1/retrieve",status="200"' in metrics


def test_bad_requests_get_422_saying_what_is_wrong(loaded) -> None:
    items = _catalogue(loaded)
    h = items[:2]
    cases = {
        '{"user_id": "u", "history": []}': "history",
        f'{{"user_id": "u", "history": {h}, "k": 0}}': "k",
        f'{{"user_id": "u", "history": {h}, "k": 21}}': "k",
        f'{{"user_id": "u", "history": {h}, "k": "5"}}': "k",
        f'{{"user_id": "u", "history": {h}, "k": 5.0}}': "k",
        f'{{"user_id": "u", "history": {h}, "k": true}}': "k",
        '{"user_id": "u", "history": ["1"]}': "history.0",
        '{"user_id": "u", "history": [1.5]}': "history.0",
        '{"user_id": "u", "history": [9223372036854775808]}': "history.0",
        f'{{"user_id": "u", "history": {list(range(51))}}}': "history",
        '{"user_id": "u", "history": [1000000000]}': "unknown item IDs",
        f'{{"user_id": "u", "history": {h}, "allowed_items": [1000000000]}}': "allowed_items: unknown item IDs",
        f'{{"user_id": "u", "history": {h}, "allowed_items": {items[:41] if len(items) > 40 else list(range(41))}}}':
            "allowed_items",
        f'{{"user_id": "u", "history": {h}, "exclude_history": 1}}': "exclude_history",
        f'{{"user_id": "{"x" * 300}", "history": {h}}}': "user_id",
        f'{{"history": {h}}}': "user_id",
        f'{{"user_id": "u", "history": {h}, "beam": 8}}': "beam",
        '{"user_id": "u", "history": [1, NaN]}': "history",
        "not json": "not valid JSON",
    }  # fmt: skip
    with _client(loaded) as client:
        for raw, where in cases.items():
            got = client.post("/v1/retrieve", content=raw, headers={"content-type": "application/json"})
            assert got.status_code == 422, (raw, got.text)
            assert where in got.json()["detail"], (raw, got.json())
        bad_timeout = client.post("/v1/retrieve", json={"user_id": "u", "history": h}, headers={"X-Request-Timeout-Ms": "x"})
        assert bad_timeout.status_code == 422 and "X-Request-Timeout-Ms" in bad_timeout.json()["detail"]
        assert client.post("/v1/retrieve", content=b"x" * (17 * 2**20)).status_code == 413


def test_deadline_gives_504_and_a_full_queue_503(loaded) -> None:
    retriever = loaded[0]
    original = retriever.run
    started = threading.Event()

    def slow(batch, **kw):
        started.set()
        time.sleep(0.4)
        return original(batch, **kw)

    retriever.run = slow
    body = {"user_id": "u", "history": _catalogue(loaded)[:3]}
    try:
        with _client(loaded) as client:
            late = client.post("/v1/retrieve", json=body, headers={"X-Request-Timeout-Ms": "100"})
            assert late.status_code == 504 and "deadline" in late.json()["detail"]
            runner = client.app.state.runner
            while runner.pending():  # the abandoned batch finishes
                time.sleep(0.01)
            # one measured pass of 0.4 s: a request whose deadline leaves less is refused at once with Retry-After
            started.clear()
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(client.post, "/v1/retrieve", json=body)
                started.wait(5)
                crowded = client.post("/v1/retrieve", json=body, headers={"X-Request-Timeout-Ms": "200"})
                assert first.result().status_code == 200
            assert crowded.status_code == 503 and crowded.headers["retry-after"] == "1"
            assert runner.health()["dropped"]["deadline"] + runner.health()["dropped"]["cancelled"] <= 1
    finally:
        del retriever.run


def test_health_metrics_and_docs_example(loaded) -> None:
    retriever, version, _ = loaded
    with _client(loaded) as client:
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["model_version"] == version
        assert health["catalogue_items"] == retriever.trie.num_items and health["limits"]["max_k"] == 20
        assert client.get("/docs").status_code == 200
        schema = client.get("/openapi.json").json()
        request = schema["components"]["schemas"]["RetrieveRequestIn"]
        assert request["properties"]["k"]["maximum"] == 20 and request["additionalProperties"] is False
        example = request["examples"][0]
        answer = client.post("/v1/retrieve", json=example)
        assert answer.status_code == 200 and set(answer.json()["items"]) <= set(example["allowed_items"])
        metrics = client.get("/metrics").text
        assert "recforge_retrieve_latency_seconds_count 1.0" in metrics and "recforge_queue_depth 0.0" in metrics


def test_load_retriever_attaches_a_history_cache_unless_cache_mb_is_zero(run_dir: Path) -> None:
    retriever, version = load_retriever(run_dir, RetrieveSettings(cache_mb=2), device="cpu")
    assert retriever.version == version and retriever.cache.version == version
    assert retriever.cache.max_bytes == 2 << 20 and not retriever.cache.entries  # the probe names no user
    assert load_retriever(run_dir, RetrieveSettings(cache_mb=0), device="cpu")[0].cache is None


def test_cli_serves_a_generative_run_in_one_process(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    from recforge.serve import server

    served = {}
    monkeypatch.setattr(server, "serve", lambda app, config, **kw: served.update(app=app, config=config, **kw))
    assert main(["serve", str(run_dir), "--device", "cpu", "--http-workers", "0", "retrieve.beam=6", "retrieve.default_k=3",
                 "retrieve.max_k=5", "--port", "9123"]) == 0  # fmt: skip
    assert served["port"] == 9123 and "POST /v1/retrieve" in capsys.readouterr().out
    with TestClient(served["app"]) as client:
        assert client.get("/health").json()["limits"]["beam"] == 6
        assert client.post("/v1/retrieve", json={"user_id": "u", "history": [1], "k": 6}).status_code == 422
    assert main(["serve", str(run_dir), "--http-workers", "2"]) == 2
    assert "one process" in capsys.readouterr().err
    assert main(["serve", str(run_dir), "retrieve.default_k=9", "retrieve.max_k=5"]) == 2
    assert "retrieve.default_k" in capsys.readouterr().err


def _gate(retriever) -> tuple[threading.Event, list[int]]:
    """Holds every batch of ``retriever`` until the event is set; the list gets each batch's size as it starts.
    The caller removes the patch (``del retriever.run``)."""
    gate, seen = threading.Event(), []
    original = retriever.run

    def gated(batch, **kw):
        seen.append(len(batch))
        gate.wait(5)
        return original(batch, **kw)

    retriever.run = gated
    return gate, seen


def test_runner_drops_cancelled_requests_before_their_batch(loaded) -> None:
    """A request whose client left (its future cancelled) is never computed; the others are answered."""
    from recforge.serve.retrieve_runner import RetrieveRunner

    retriever, items = loaded[0], _catalogue(loaded)
    gate, seen = _gate(retriever)
    runner = RetrieveRunner(retriever, SchedulerConfig(max_wait_ms=0.0))
    try:
        first = runner.submit(retriever.encode(RetrieveRequest(items[:2], k=3)))
        while not seen:  # the first batch is running: the next requests queue behind it
            time.sleep(0.005)
        gone = runner.submit(retriever.encode(RetrieveRequest(items[2:4], k=3)))
        kept = runner.submit(retriever.encode(RetrieveRequest(items[4:6], k=3)))
        assert gone.cancel()
        gate.set()
        assert len(first.result(5).items) == 3 and len(kept.result(5).items) == 3
        assert seen == [1, 1] and runner.dropped == {"deadline": 0, "cancelled": 1}
    finally:
        runner.close()
        del retriever.run


def test_requests_left_at_shutdown_are_refused_as_overloaded(loaded) -> None:
    """What the drain leaves is failed with ``OverloadedError`` (the routes' 503 + Retry-After), not a 500."""
    from recforge.serve.retrieve_runner import RetrieveRunner
    from recforge.serve.scheduler import OverloadedError

    retriever, items = loaded[0], _catalogue(loaded)
    gate, seen = _gate(retriever)
    runner = RetrieveRunner(retriever, SchedulerConfig(max_wait_ms=0.0))
    try:
        first = runner.submit(retriever.encode(RetrieveRequest(items[:2], k=3)))
        while not seen:
            time.sleep(0.005)
        left = runner.submit(retriever.encode(RetrieveRequest(items[2:4], k=3)))
        threading.Timer(0.2, gate.set).start()
        runner.close(timeout=0.0)
        assert len(first.result(5).items) == 3
        with pytest.raises(OverloadedError, match="shut down"):
            left.result(5)
    finally:
        gate.set()
        del retriever.run
