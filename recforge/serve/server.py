"""HTTP server: one FastAPI app (``build_app``) over a backend: ``LocalBackend`` (the batching runner in this
process, ``create_app``) or ``frontend.RemoteBackend`` (an engine process, ``recforge serve --http-workers N``).

    POST /v1/rank     score candidates for a user (JSON in, per-task scores out)
    POST /v1/reload   load a newly exported model in place (when started with allow_reload)
    GET  /health      liveness of the batching worker, queue depth and age, model version, cache report
    GET  /metrics     Prometheus: latency and batch histograms, cache hit rates, responses by status
    GET  /docs        OpenAPI documentation (served locally, no CDN; the schema at /openapi.json)

Every request is validated before it reaches the worker: bytes, read times and JSON by
``limits.RequestLimits`` and ``api.RequestModels`` (strict types, the model's own feature names),
IDs by ``layout.encode_request``. A bad request gets a 4xx saying what is wrong and never enters a batch.

Deadlines: every request has one (``ServerConfig.request_timeout_ms``, or the client's
``X-Request-Timeout-Ms`` header, at most ``max_request_timeout_ms``). A request that cannot be
served in time is refused at once with 503 and ``Retry-After`` (admission control), one whose
deadline passes in the queue gets 504, and one whose client disconnects is dropped before it
is computed.

Example:
    >>> app = create_app(RankEngine.from_run("runs/ranking-taobao-hstu"), ServerConfig())
    >>> serve(app, ServerConfig(), port=8000)          # what `recforge serve RUN_DIR --http-workers 0` does
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from recforge.serve.api import ErrorOut, RankResponseOut, ReloadIn, RequestModels, describe
from recforge.serve.engine import RankEngine, RankResult
from recforge.serve.engine_core import attach_pool, engine_report
from recforge.serve.kv_pool import PoolConfig
from recforge.serve.layout import EncodedRequest, RequestError, encode_request
from recforge.serve.limits import LoopLag, RequestLimits, http_protocol, overload_refusal
from recforge.serve.metrics import EngineMetrics, HttpMetrics
from recforge.serve.runner import BatchRunner
from recforge.serve.scheduler import DeadlineExceeded, OverloadedError, SchedulerConfig, StaleEncoding

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
    max_connections: int = 4096  # open connections beyond this get 503 from uvicorn; per HTTP process (front end)
    max_loop_lag_ms: float = 250.0  # refuse new rank requests (503) while the event loop runs this late
    gil_switch_interval_ms: float = 0.5  # serve(): sys.setswitchinterval, so the event loop gets the GIL in time
    engine_timeout_s: float = 2.0  # front-end processes: the engine process is down when silent this long (503)
    allow_reload: bool = False  # expose POST /v1/reload
    run_dir: str | None = None  # default reload source

    def validate(self) -> None:
        problems = [f"{name} must be > 0, got {getattr(self, name)}" for name in
                    ("max_body_bytes", "max_string_chars", "request_timeout_ms", "max_request_timeout_ms",
                     "header_timeout_s", "body_timeout_s", "max_connections", "max_loop_lag_ms", "gil_switch_interval_ms",
                     "engine_timeout_s")
                    if not getattr(self, name) > 0]  # fmt: skip
        if problems:
            raise ValueError("ServerConfig: " + "; ".join(problems))
        self.scheduler.validate()


class StaleModel(Exception):
    """The model was reloaded after this request was encoded (its codes may mean other items): encode it again."""


class LocalBackend:
    """The engine in this process: requests go straight to a ``BatchRunner`` thread (``--http-workers 0``).

    The app talks to every backend through the same few members: ``spec`` and ``models`` (what validates and
    encodes requests), ``unavailable()``, ``queued_seconds()``, ``rank()``, ``health()``, ``reload()``,
    ``metrics_text()``, ``start()`` and ``close()``; ``frontend.RemoteBackend`` is the other one."""

    shed_fraction = 1.0  # refuse past this share of max_queue_ms before reading a request (its queue is live here)

    def __init__(self, engine: RankEngine, config: ServerConfig) -> None:
        attach_pool(engine, config)
        self.config = config
        self.runner = BatchRunner(engine, config.scheduler)
        self.registry = CollectorRegistry()
        self.http_metrics = HttpMetrics(self.registry)
        self.engine_metrics = EngineMetrics(self.runner, self.registry)
        self.models = RequestModels.for_engine(engine, config.max_string_chars)

    @property
    def engine(self) -> RankEngine:
        """The live engine: a reload swaps in a new engine object (``BatchRunner.reload``)."""
        return self.runner.engine

    @property
    def spec(self) -> RankEngine:
        return self.runner.engine

    def unavailable(self) -> str | None:
        return None

    def queued_seconds(self) -> float:
        return self.runner.queued_seconds()

    async def rank(self, req: EncodedRequest, version: str, deadline: float, request: Request) -> RankResult:
        """``req`` was encoded with model ``version``'s vocabulary; ``StaleModel`` if a reload came in between."""
        engine = self.engine
        if engine.version != version:
            raise StaleModel(engine.version)
        req.encoding = engine.encoding  # the worker refuses it (StaleEncoding) if a swap comes first
        future = self.runner.submit(req, deadline=deadline)
        try:
            result = await await_answer(request, asyncio.wrap_future(future), future.cancel, deadline)
        except StaleEncoding:
            raise StaleModel(self.engine.version) from None
        if result.model_version != version:
            raise StaleModel(result.model_version)
        return result

    async def health(self) -> dict[str, Any]:
        return engine_report(self.engine, self.runner, self.config)

    async def reload(self, source: str) -> str:
        await asyncio.to_thread(self.runner.reload, source)  # loads and checks first: a failure changes nothing
        self.models = RequestModels.for_engine(self.engine, self.config.max_string_chars)
        return self.engine.version

    async def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        await asyncio.to_thread(self.runner.close)  # in-flight requests finish within drain_timeout_s


def create_app(engine: RankEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` in this process; the batching worker starts with the app and stops with it."""
    config = config or ServerConfig()
    config.validate()
    backend = LocalBackend(engine, config)
    app = build_app(backend, config)
    app.state.runner, app.state.metrics = backend.runner, backend.http_metrics  # the live engine: runner.engine
    return app


def guarded_app(config: ServerConfig, on_status: Callable[[str, int], None], shed: Callable[[str], tuple[float, str] | None], *,
                lifespan, title: str, version: str, description: str, busy: str) -> tuple[FastAPI, dict]:
    """A serving app's common part (ranking and retrieval): docs served offline, the request limits and
    load shedding (``RequestLimits``), 422 for ``RequestError``; with the error responses its routes document
    (``busy``: what a 503 means for this server)."""
    app = FastAPIOffline(
        lifespan=lifespan, title=title, version=version,
        description=f"{description} Every request has a deadline (default {config.request_timeout_ms:g} ms; header "
        "`X-Request-Timeout-Ms`): 503 with `Retry-After` when it cannot be met, 504 when it passes.",
    )  # fmt: skip
    app.add_middleware(RequestLimits, max_body_bytes=config.max_body_bytes, body_timeout_s=config.body_timeout_s,
                       on_status=on_status, shed=shed)  # fmt: skip

    @app.exception_handler(RequestError)
    async def _bad_request(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=422)

    errors = {408: {"model": ErrorOut, "description": "the body did not arrive within body_timeout_s"},
              413: {"model": ErrorOut, "description": "the body is larger than max_body_bytes"},
              422: {"model": ErrorOut, "description": "invalid request (the message says what to fix)"},
              503: {"model": ErrorOut, "description": f"{busy}; retry after `Retry-After` s"},
              504: {"model": ErrorOut, "description": "the request's deadline passed before the answer was ready"}}  # fmt: skip
    return app, errors


def build_app(backend, config: ServerConfig) -> FastAPI:
    """The HTTP API over ``backend`` (``LocalBackend`` or ``frontend.RemoteBackend``): limits, validation,
    encoding, load shedding, deadlines, cancellation, /health, /metrics, /docs."""
    metrics: HttpMetrics = backend.http_metrics
    reload_lock = asyncio.Lock()
    lag = LoopLag()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        lag.start()
        await backend.start()
        yield
        lag.stop()
        await backend.close()

    def shed(path: str) -> tuple[float, str] | None:
        """Refuse a rank request before reading it when the engine is down, or the queue or the event loop is
        already too late."""
        if path != "/v1/rank":
            return None
        down = backend.unavailable()
        if down is not None:
            return 1.0, down
        queued = backend.queued_seconds()
        return overload_refusal(queued, lag.lag_s, config.scheduler.max_queue_ms * backend.shed_fraction,
                                config.max_loop_lag_ms)  # fmt: skip

    app, errors = guarded_app(
        config, metrics.on_status, shed, lifespan=lifespan, title="recforge ranking server", version=backend.spec.version,
        description="Prefix-cached multi-task ranking with a recforge HSTU model. Scores come back per task, "
        "in candidate order.", busy="overloaded, shutting down or the engine is down",
    )  # fmt: skip
    app.state.backend, app.state.loop_lag = backend, lag

    @app.post("/v1/rank", response_model=RankResponseOut, responses=errors,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/RankRequestIn"}}}}})  # fmt: skip
    async def rank(request: Request) -> RankResponseOut:
        started = request.scope.get("state", {}).get("arrival", time.monotonic())
        deadline = started + _timeout_ms(request, config) / 1e3
        raw = await request.body()
        for attempt in range(3):  # a reload that overtakes the request: encode it again for the new model
            spec, models = backend.spec, backend.models
            version = spec.version  # before encoding: a reload may change the vocabulary meanwhile
            body = models.parse(raw)
            req = encode_request(spec.vocab, spec.config, spec.max_events, body.user_id, body.history.model_dump(),
                                 body.candidates, user_features=models.user_features(body), timestamp=body.timestamp)  # fmt: skip
            try:
                result = await backend.rank(req, version, deadline, request)
                break
            except StaleModel:
                if attempt == 2:
                    raise HTTPException(503, "the model was reloaded three times while this request waited; retry",
                                        headers={"Retry-After": "1"}) from None  # fmt: skip
            except OverloadedError as err:
                raise HTTPException(503, str(err), headers={"Retry-After": str(int(err.retry_after))}) from err
            except DeadlineExceeded as err:
                raise HTTPException(504, str(err)) from err
            except (RequestError, HTTPException):
                raise
            except Exception as err:  # noqa: BLE001 - an engine failure on this request only
                raise HTTPException(500, f"ranking failed: {err}") from err
        seconds = time.monotonic() - started
        metrics.latency.observe(seconds)
        return RankResponseOut(
            user_id=body.user_id, model_version=result.model_version, scores=result.task_scores(),
            cached_tokens=result.cached_tokens, computed_tokens=result.computed_tokens,
            truncated_events=result.truncated_events, latency_ms=seconds * 1e3,
        )  # fmt: skip

    @app.get("/health", responses={503: {"description": "the batching worker or the engine process is dead or stuck"}})
    async def health() -> JSONResponse:
        report = await backend.health()
        return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(await backend.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    if config.allow_reload:

        @app.post("/v1/reload", responses={409: {"model": ErrorOut}, 422: {"model": ErrorOut}},
                  openapi_extra={"requestBody": {"content": {"application/json": {
                      "schema": {"$ref": "#/components/schemas/ReloadIn"}}}}})  # fmt: skip
        async def reload(request: Request) -> dict[str, str]:
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
                old = backend.spec.version
                try:  # the engine loads and checks the new model first: a failure changes nothing
                    new = await backend.reload(source)
                except ValueError as err:
                    raise HTTPException(422, f"reload refused, still serving {old}: {err}") from err
                except RuntimeError as err:  # another reload (e.g. straight on the runner), or shutting down: as front ends
                    raise HTTPException(409, f"reload refused, still serving {old}: {err}") from err
            return {"previous_version": old, "model_version": new}

    schemas: dict[str, dict] = {}  # model version -> OpenAPI schema (the request model is the model's own)

    def openapi() -> dict:
        version = backend.spec.version
        if version not in schemas:
            schema = get_openapi(title=app.title, version=version, description=app.description, routes=app.routes)
            request_schema = backend.models.rank.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(request_schema.pop("$defs", {}))
            components["RankRequestIn"] = request_schema
            components["ReloadIn"] = ReloadIn.model_json_schema()
            schemas.clear()
            schemas[version] = schema
        return schemas[version]

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


async def await_answer(request: Request, answer: asyncio.Future, cancel: Callable[[], object], deadline: float):
    """``answer``'s outcome, or: 504 when ``deadline`` (``time.monotonic()``) passes, 499 when the client leaves;
    either way ``cancel()`` tells the engine, which drops the request uncomputed if it has not started."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({answer, gone}, timeout=max(deadline - time.monotonic(), 0) + 0.05,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    finally:
        gone.cancel()
    if answer not in done:
        cancel()
        answer.cancel()
        if gone in done:
            raise HTTPException(499, "client closed the request")
        raise HTTPException(504, "the request's deadline passed before the answer was ready")
    return answer.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (after the body, ``receive`` waits for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def serve(app: FastAPI, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          sockets: list | None = None) -> None:
    """Run ``app`` with uvicorn under ``config``'s transport limits (header/keep-alive timeouts, connection cap,
    a bounded graceful shutdown); on ``sockets`` (already bound, shared by several front ends) when given."""
    import sys

    import uvicorn

    # the batching worker thread holds the GIL between torch calls; with the default 5 ms switch interval the
    # event loop waits that long for each turn and cannot even read (and refuse) requests at high rates
    sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level=log_level, http=http_protocol(config.header_timeout_s),
        limit_concurrency=config.max_connections, timeout_keep_alive=5,
        timeout_graceful_shutdown=math.ceil(config.scheduler.drain_timeout_s) + 1))  # fmt: skip
    server.run(sockets=sockets)


__all__ = ["LocalBackend", "RankResponseOut", "ServerConfig", "StaleModel", "await_answer", "build_app", "create_app", "serve"]
