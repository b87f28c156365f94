"""HTTP server: FastAPI app over the batching runner.

    POST /v1/rank     score candidates for a user (JSON in, per-task scores out)
    POST /v1/reload   load a newly exported model in place (when started with allow_reload)
    GET  /health      model version, queue depth, cache report
    GET  /metrics     Prometheus: latency and batch histograms, cache hit rates, request counts
    GET  /docs        OpenAPI documentation (the schema at /openapi.json)

Every request is validated before it reaches the worker: JSON types and sizes by the pydantic
models below, IDs and limits by ``RankEngine.encode``. A bad request gets a 4xx with a message
saying what is wrong and never enters a batch, so it cannot affect other requests.

Example:
    >>> app = create_app(RankEngine.from_run("runs/ranking-taobao-hstu"), ServerConfig())
    >>> uvicorn.run(app, port=8000)          # what `recforge serve RUN_DIR` does
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from recforge.serve.engine import RankEngine
from recforge.serve.kv_pool import KVCachePool, PoolConfig
from recforge.serve.layout import RequestError
from recforge.serve.scheduler import BatchRunner, OverloadedError, SchedulerConfig

RawId = StrictInt | StrictStr
FeatureValue = StrictInt | StrictStr | float | bool | None
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)


class HistoryIn(BaseModel):
    """The user's events, oldest first."""

    model_config = ConfigDict(extra="forbid")
    items: list[RawId] = Field(default_factory=list, description="raw item IDs, oldest first")
    timestamps: list[StrictInt] = Field(default_factory=list, description="event times (seconds), non-decreasing")
    actions: list[RawId | None] | None = Field(None, description="action value per event (e.g. 'click', 4)")


class RankRequestIn(BaseModel):
    """Score ``candidates`` for ``user_id`` after ``history``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{
            "user_id": "u42", "history": {"items": [101, 205], "timestamps": [1700000000, 1700000360],
                                          "actions": ["click", "buy"]},
            "candidates": [7, 301, 12], "user_features": {"gender": "f"}, "timestamp": 1700000400,
        }]},
    )  # fmt: skip
    user_id: Annotated[RawId, Field(description="the user; keys the KV cache")]
    history: HistoryIn = Field(default_factory=HistoryIn)
    candidates: list[RawId] = Field(..., min_length=1, description="raw item IDs to score")
    user_features: dict[str, FeatureValue] = Field(default_factory=dict, description="contextual features by name")
    timestamp: StrictInt | None = Field(None, description="request time (seconds); default: now. Candidates see "
                                        "only events strictly before it")  # fmt: skip


class RankResponseOut(BaseModel):
    user_id: RawId
    model_version: str
    scores: dict[str, list[float]] = Field(description="per task: probabilities (binary) or values (regression), "
                                           "in candidate order")  # fmt: skip
    cached_tokens: int = Field(description="prefix tokens reused from the user's KV cache")
    computed_tokens: int = Field(description="prefix tokens computed for this request")
    truncated_events: int = Field(description="oldest events dropped to fit the model's max_seq_len")
    latency_ms: float


class ReloadIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_dir: str | None = Field(None, description="run or model directory; default: the one the server started with")


@dataclass
class ServerConfig:
    """Server-level settings (engine and batching limits live in their own configs)."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pool: PoolConfig | None = field(default_factory=PoolConfig)  # None: no KV-cache pool
    max_body_bytes: int = 16 * 2**20  # larger request bodies get 413
    allow_reload: bool = False  # expose POST /v1/reload
    run_dir: str | None = None  # default reload source


class Metrics:
    """Prometheus metrics of one app (own registry, so several apps can live in one process)."""

    def __init__(self, runner: BatchRunner) -> None:
        self.registry = registry = CollectorRegistry()
        self.latency = Histogram("recforge_rank_latency_seconds", "POST /v1/rank latency (accepted requests)",
                                 buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.requests = Counter("recforge_rank_requests", "rank requests by HTTP status", ["status"], registry=registry)
        self.batch_requests = Histogram("recforge_batch_requests", "requests per engine pass",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)  # fmt: skip
        self.batch_tokens = Histogram("recforge_batch_tokens", "query tokens per engine pass",
                                      buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=registry)  # fmt: skip
        self.pass_seconds = Histogram("recforge_pass_seconds", "engine pass time", buckets=LATENCY_BUCKETS,
                                      registry=registry)  # fmt: skip
        pool_value = lambda key: lambda: float(runner.engine.pool.report()[key]) if runner.engine.pool else 0.0  # noqa: E731
        for key, doc in (("hit_rate", "share of lookups whose cached prefix was reused"),
                         ("token_hit_rate", "share of prefix tokens reused from the cache"),
                         ("device_bytes_used", "KV-cache device tier bytes in use"),
                         ("host_bytes_used", "KV-cache host tier bytes in use"),
                         ("users_device", "users cached on the device tier"),
                         ("users_host", "users cached on the host tier")):  # fmt: skip
            Gauge(f"recforge_kv_cache_{key}", doc, registry=registry).set_function(pool_value(key))
        Gauge("recforge_queue_depth", "requests waiting or running", registry=registry).set_function(runner.pending)

    def on_pass(self, requests: int, tokens: int, seconds: float) -> None:
        self.batch_requests.observe(requests)
        self.batch_tokens.observe(tokens)
        self.pass_seconds.observe(seconds)


def create_app(engine: RankEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; the batching worker starts with the app and stops with it."""
    config = config or ServerConfig()
    if config.pool is not None and engine.cached and engine.pool is None:
        engine.pool = KVCachePool.for_engine(engine, config.pool)
    runner = BatchRunner(engine, config.scheduler)
    metrics = Metrics(runner)
    runner.on_pass = metrics.on_pass
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        runner.close()

    app = FastAPI(
        lifespan=lifespan,
        title="recforge ranking server",
        version=engine.version,
        description="Prefix-cached multi-task ranking with a recforge HSTU model. Scores come back per task, "
        "in candidate order.",
    )
    app.state.engine, app.state.runner, app.state.metrics = engine, runner, metrics

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            return JSONResponse({"detail": f"request body of {length} bytes exceeds {config.max_body_bytes}"}, 413)
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, err: RequestError) -> JSONResponse:
        metrics.requests.labels("422").inc()
        return JSONResponse({"detail": str(err)}, status_code=422)

    @app.post("/v1/rank", response_model=RankResponseOut, responses={422: {"description": "invalid request"},
                                                                    503: {"description": "queue full"}})  # fmt: skip
    async def rank(body: RankRequestIn) -> RankResponseOut:
        started = time.perf_counter()
        req = engine.encode(body.user_id, body.history.model_dump(), body.candidates, user_features=body.user_features,
                            timestamp=body.timestamp)  # fmt: skip
        try:
            future = runner.submit(req)
        except OverloadedError as err:
            metrics.requests.labels("503").inc()
            raise HTTPException(503, str(err)) from err
        try:
            result = await asyncio.wrap_future(future)
        except RequestError:
            raise
        except Exception as err:  # noqa: BLE001 - an engine failure on this request only
            metrics.requests.labels("500").inc()
            raise HTTPException(500, f"ranking failed: {err}") from err
        seconds = time.perf_counter() - started
        metrics.latency.observe(seconds)
        metrics.requests.labels("200").inc()
        return RankResponseOut(
            user_id=body.user_id, model_version=engine.version, scores=result.task_scores(),
            cached_tokens=result.cached_tokens, computed_tokens=result.computed_tokens,
            truncated_events=result.truncated_events, latency_ms=seconds * 1e3,
        )  # fmt: skip

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model_version": engine.version,
            "tasks": [t.get("name") for t in engine.tasks],
            "device": str(engine.device),
            "dtype": engine.config.dtype,
            "queue_depth": runner.pending(),
            "limits": {"max_candidates": engine.config.max_candidates,
                       "max_history_events": engine.config.max_history_events,
                       "model_history_events": engine.max_events},  # fmt: skip
            "kv_cache": engine.pool.report() if engine.pool is not None else None,
            "cuda_graphs": engine.graphs.report() if engine.graphs is not None else None,
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if config.allow_reload:

        @app.post("/v1/reload")
        async def reload(body: ReloadIn) -> dict[str, str]:
            source = body.run_dir or config.run_dir
            if source is None or not Path(source).exists():
                raise HTTPException(422, f"run_dir {source!r} does not exist")
            old = engine.version
            try:
                await asyncio.to_thread(runner.reload, source)
            except ValueError as err:
                raise HTTPException(422, str(err)) from err
            return {"previous_version": old, "model_version": engine.version}

    return app


__all__ = ["RankRequestIn", "RankResponseOut", "ServerConfig", "create_app"]
