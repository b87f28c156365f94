"""HTTP server: FastAPI app over the batching runner.

    POST /v1/rank     score candidates for a user (JSON in, per-task scores out)
    POST /v1/reload   load a newly exported model in place (when started with allow_reload)
    GET  /health      liveness of the batching worker, queue depth and age, model version, cache report
    GET  /metrics     Prometheus: latency and batch histograms, cache hit rates, responses by status
    GET  /docs        OpenAPI documentation (served locally, no CDN; the schema at /openapi.json)

Every request is validated before it reaches the worker: bytes, read times and JSON by
``limits.RequestLimits`` and ``api.RequestModels`` (strict types, the model's own feature names),
IDs by ``RankEngine.encode``. A bad request gets a 4xx saying what is wrong and never enters a batch.

Deadlines: every request has one (``ServerConfig.request_timeout_ms``, or the client's
``X-Request-Timeout-Ms`` header, at most ``max_request_timeout_ms``). A request that cannot be
served in time is refused at once with 503 and ``Retry-After`` (admission control), one whose
deadline passes in the queue gets 504, and one whose client disconnects is dropped before it
is computed.

Example:
    >>> app = create_app(RankEngine.from_run("runs/ranking-taobao-hstu"), ServerConfig())
    >>> serve(app, ServerConfig(), port=8000)          # what `recforge serve RUN_DIR` does
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError

from recforge.serve.api import ErrorOut, RankResponseOut, ReloadIn, RequestModels, describe
from recforge.serve.engine import RankEngine
from recforge.serve.kv_pool import KVCachePool, PoolConfig
from recforge.serve.layout import RequestError
from recforge.serve.limits import LoopLag, RequestLimits, http_protocol
from recforge.serve.runner import BatchRunner
from recforge.serve.scheduler import DeadlineExceeded, OverloadedError, SchedulerConfig

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
TIMEOUT_HEADER = "x-request-timeout-ms"


@dataclass
class ServerConfig:
    """Server-level settings (engine and batching limits live in their own configs)."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pool: PoolConfig | None = field(default_factory=PoolConfig)  # None: no KV-cache pool
    max_body_bytes: int = 16 * 2**20  # larger request bodies get 413, whatever their transfer encoding
    max_string_chars: int = 256  # user_id, raw IDs and feature values longer than this get 422
    request_timeout_ms: float = 2000.0  # default deadline of a request (504 after it)
    max_request_timeout_ms: float = 60000.0  # cap on the client's X-Request-Timeout-Ms
    header_timeout_s: float = 10.0  # a connection must send a request's headers within this (else closed)
    body_timeout_s: float = 30.0  # ... and its body within this (else 408)
    max_connections: int = 4096  # open connections beyond this get 503 from uvicorn
    max_loop_lag_ms: float = 250.0  # refuse new rank requests (503) while the event loop runs this late
    gil_switch_interval_ms: float = 0.5  # serve(): sys.setswitchinterval, so the event loop gets the GIL in time
    allow_reload: bool = False  # expose POST /v1/reload
    run_dir: str | None = None  # default reload source

    def validate(self) -> None:
        problems = [f"{name} must be > 0, got {getattr(self, name)}" for name in
                    ("max_body_bytes", "max_string_chars", "request_timeout_ms", "max_request_timeout_ms",
                     "header_timeout_s", "body_timeout_s", "max_connections", "max_loop_lag_ms", "gil_switch_interval_ms")
                    if not getattr(self, name) > 0]  # fmt: skip
        if problems:
            raise ValueError("ServerConfig: " + "; ".join(problems))
        self.scheduler.validate()


class Metrics:
    """Prometheus metrics of one app (own registry, so several apps can live in one process)."""

    def __init__(self, runner: BatchRunner) -> None:
        self.registry = registry = CollectorRegistry()
        self.latency = Histogram("recforge_rank_latency_seconds", "POST /v1/rank latency (answered requests)",
                                 buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.responses = Counter("recforge_http_responses", "HTTP responses by path and status (every response, "
                                 "the framework's own too)", ["path", "status"], registry=registry)  # fmt: skip
        self.requests = Counter("recforge_rank_requests", "POST /v1/rank responses by HTTP status", ["status"],
                                registry=registry)  # fmt: skip
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
                         ("metadata_bytes", "KV-cache per-user metadata in host memory (tokens, keys)"),
                         ("users_device", "users cached on the device tier"),
                         ("users_host", "users cached on the host tier")):  # fmt: skip
            Gauge(f"recforge_kv_cache_{key}", doc, registry=registry).set_function(pool_value(key))
        Gauge("recforge_queue_depth", "requests waiting or running", registry=registry).set_function(runner.pending)
        for reason in ("deadline", "cancelled"):
            Gauge(f"recforge_rank_dropped_{reason}", f"requests dropped unanswered ({reason})",
                  registry=registry).set_function(lambda r=reason: runner.dropped[r])  # fmt: skip
        Gauge("recforge_worker_restarts", "unexpected batch-worker errors survived",
              registry=registry).set_function(lambda: runner.restarts)  # fmt: skip

    def on_status(self, path: str, status: int) -> None:
        self.responses.labels(path if path in KNOWN_PATHS else "other", str(status)).inc()
        if path == "/v1/rank":
            self.requests.labels(str(status)).inc()

    def on_pass(self, requests: int, tokens: int, seconds: float) -> None:
        self.batch_requests.observe(requests)
        self.batch_tokens.observe(tokens)
        self.pass_seconds.observe(seconds)


KNOWN_PATHS = ("/v1/rank", "/v1/reload", "/health", "/metrics", "/docs", "/openapi.json")


def create_app(engine: RankEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; the batching worker starts with the app and stops with it."""
    config = config or ServerConfig()
    config.validate()
    if config.pool is not None and engine.cached and engine.pool is None:
        engine.pool = KVCachePool.for_engine(engine, config.pool)
    runner = BatchRunner(engine, config.scheduler)
    metrics = Metrics(runner)
    runner.on_pass = metrics.on_pass
    models = RequestModels.for_engine(engine, config.max_string_chars)
    reload_lock = asyncio.Lock()
    lag = LoopLag()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        lag.start()
        yield
        lag.stop()
        await asyncio.to_thread(runner.close)  # in-flight requests finish within drain_timeout_s

    def shed(path: str) -> tuple[float, str] | None:
        """Refuse a rank request before reading it when the queue or the event loop is already too late."""
        if path != "/v1/rank":
            return None
        queued = runner.queued_seconds()
        if queued * 1e3 > config.scheduler.max_queue_ms:
            return max(1.0, math.ceil(queued - config.scheduler.max_queue_ms / 1e3)), (
                f"overloaded: about {queued * 1e3:.0f} ms of work is queued (max_queue_ms "
                f"{config.scheduler.max_queue_ms:g}); retry later")  # fmt: skip
        if lag.lag_s * 1e3 > config.max_loop_lag_ms:
            return 1.0, f"overloaded: the server is {lag.lag_s * 1e3:.0f} ms behind reading requests; retry later"
        return None

    app = FastAPIOffline(
        lifespan=lifespan,
        title="recforge ranking server",
        version=engine.version,
        description="Prefix-cached multi-task ranking with a recforge HSTU model. Scores come back per task, "
        "in candidate order. Every request has a deadline (default "
        f"{config.request_timeout_ms:g} ms; header `X-Request-Timeout-Ms`): 503 with `Retry-After` when it cannot "
        "be met, 504 when it passes.",
    )  # fmt: skip
    # handlers read the live engine from the runner: a reload replaces the engine object
    app.state.runner, app.state.metrics, app.state.loop_lag = runner, metrics, lag
    app.add_middleware(RequestLimits, max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s,
                       on_status=metrics.on_status, shed=shed)  # fmt: skip

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=422)

    errors = {408: {"model": ErrorOut, "description": "the body did not arrive within body_timeout_s"},
              413: {"model": ErrorOut, "description": "the body is larger than max_body_bytes"},
              422: {"model": ErrorOut, "description": "invalid request (the message says what to fix)"},
              503: {"model": ErrorOut, "description": "overloaded or shutting down; retry after `Retry-After` s"},
              504: {"model": ErrorOut, "description": "the request's deadline passed before the answer was ready"}}  # fmt: skip

    @app.post("/v1/rank", response_model=RankResponseOut, responses=errors,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/RankRequestIn"}}}}})  # fmt: skip
    async def rank(request: Request) -> RankResponseOut:
        started = request.scope.get("state", {}).get("arrival", time.monotonic())
        timeout_ms = _timeout_ms(request, config)
        body = models.parse(await request.body())
        req = runner.engine.encode(body.user_id, body.history.model_dump(), body.candidates,
                            user_features=models.user_features(body), timestamp=body.timestamp)  # fmt: skip
        try:
            future = runner.submit(req, deadline=started + timeout_ms / 1e3)
        except OverloadedError as err:
            raise HTTPException(503, str(err), headers={"Retry-After": str(int(err.retry_after))}) from err
        result = await _answer(request, future, timeout_ms / 1e3 - (time.monotonic() - started))
        seconds = time.monotonic() - started
        metrics.latency.observe(seconds)
        return RankResponseOut(
            user_id=body.user_id, model_version=result.model_version, scores=result.task_scores(),
            cached_tokens=result.cached_tokens, computed_tokens=result.computed_tokens,
            truncated_events=result.truncated_events, latency_ms=seconds * 1e3,
        )  # fmt: skip

    @app.get("/health", responses={503: {"description": "the batching worker is dead or stuck"}})
    def health() -> JSONResponse:
        worker, engine = runner.health(), runner.engine
        report: dict[str, Any] = {
            "status": "ok" if worker["healthy"] else "unhealthy",
            "model_version": engine.version,
            "tasks": [t.get("name") for t in engine.tasks],
            "device": str(engine.device),
            "dtype": engine.config.dtype,
            "queue_depth": worker["queue_depth"],
            "worker": worker,
            "limits": {"max_candidates": engine.config.max_candidates,
                       "max_history_events": engine.config.max_history_events,
                       "model_history_events": engine.max_events,
                       "request_timeout_ms": config.request_timeout_ms,
                       "max_queue_ms": config.scheduler.max_queue_ms},  # fmt: skip
            "kv_cache": engine.pool.report() if engine.pool is not None else None,
            "cuda_graphs": engine.graphs.report() if engine.graphs is not None else None,
        }
        return JSONResponse(report, status_code=200 if worker["healthy"] else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if config.allow_reload:

        @app.post("/v1/reload", responses={409: {"model": ErrorOut}, 422: {"model": ErrorOut}},
                  openapi_extra={"requestBody": {"content": {"application/json": {
                      "schema": {"$ref": "#/components/schemas/ReloadIn"}}}}})  # fmt: skip
        async def reload(request: Request) -> dict[str, str]:
            nonlocal models
            try:
                body = ReloadIn.model_validate_json(await request.body() or b"{}")
            except ValidationError as err:
                raise RequestError(describe(err)) from None
            source = body.run_dir or config.run_dir
            if source is None or not Path(source).exists():
                raise HTTPException(422, f"run_dir {source!r} does not exist")
            if reload_lock.locked():
                raise HTTPException(409, "another reload is in progress; retry when it has finished")
            async with reload_lock:
                old = runner.engine.version
                try:  # loads and checks the new model first: a failure changes nothing
                    await asyncio.to_thread(runner.reload, source)
                except ValueError as err:
                    raise HTTPException(422, f"reload refused, still serving {old}: {err}") from err
                models = RequestModels.for_engine(runner.engine, config.max_string_chars)
                app.openapi_schema = None  # the new model's features and example
            return {"previous_version": old, "model_version": runner.engine.version}

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=runner.engine.version, description=app.description, routes=app.routes)
            request_schema = models.rank.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(request_schema.pop("$defs", {}))
            components["RankRequestIn"] = request_schema
            components["ReloadIn"] = ReloadIn.model_json_schema()
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def _timeout_ms(request: Request, config: ServerConfig) -> float:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return config.request_timeout_ms
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= config.max_request_timeout_ms:
        raise RequestError(f"X-Request-Timeout-Ms: {raw!r} must be a number of milliseconds in (0, "
                           f"{config.max_request_timeout_ms:g}]")  # fmt: skip
    return value


async def _answer(request: Request, future, timeout_s: float):
    """The runner's result, or: 504 when the deadline passes, nothing computed when the client leaves."""
    answer = asyncio.wrap_future(future)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({answer, gone}, timeout=max(timeout_s, 0) + 0.05,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    finally:
        gone.cancel()
    if answer not in done:
        future.cancel()  # the worker drops it (or ignores its result)
        answer.cancel()
        if gone in done:
            raise HTTPException(499, "client closed the request")
        raise HTTPException(504, "the request's deadline passed before the answer was ready")
    try:
        return answer.result()
    except DeadlineExceeded as err:
        raise HTTPException(504, str(err)) from err
    except RequestError:
        raise
    except Exception as err:  # noqa: BLE001 - an engine failure on this request only
        raise HTTPException(500, f"ranking failed: {err}") from err


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (after the body, ``receive`` waits for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def serve(app: FastAPI, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Run ``app`` with uvicorn under ``config``'s transport limits (header/keep-alive timeouts, connection cap,
    a bounded graceful shutdown)."""
    import sys

    import uvicorn

    # the batching worker thread holds the GIL between torch calls; with the default 5 ms switch interval the
    # event loop waits that long for each turn and cannot even read (and refuse) requests at high rates
    sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)
    uvicorn.run(app, host=host, port=port, log_level=log_level, http=http_protocol(config.header_timeout_s),
                limit_concurrency=config.max_connections, timeout_keep_alive=5,
                timeout_graceful_shutdown=math.ceil(config.scheduler.drain_timeout_s) + 1)  # fmt: skip


__all__ = ["RankResponseOut", "ServerConfig", "create_app", "serve"]
