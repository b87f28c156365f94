"""HTTP server of a generative (semantic-ID) run: ``recforge serve RUN_DIR`` on a ``recipe: generative`` run.

    POST /v1/retrieve  a history of raw item IDs -> top-k items with their SID log-probabilities
    GET  /health       liveness of the batching worker, queue depth, model version, limits
    GET  /metrics      Prometheus: latency, batch sizes and pass times, responses by status
    GET  /docs         OpenAPI documentation (served locally, no CDN; the schema at /openapi.json)

The ranking server's transport and admission rules apply unchanged: ``limits.RequestLimits`` (body
bytes and read time, load shedding before the body is read), strict JSON (``RetrieveModels``: integers
only as JSON integers within int64, bounded strings and lists; 422 naming every problem), the request
checked and mapped against the catalogue (``Retriever.encode``) before it is queued, deadlines
(``X-Request-Timeout-Ms``; 503 + ``Retry-After`` when it cannot be met, 504 when it passes) and
cancellation when the client leaves. Requests arriving together share one ``Retriever.run``
(``retrieve_runner.RetrieveRunner``). A returning ``user_id``'s history encoding is reused from a per-user
cache (``generate.HistoryCache``, ``retrieve.cache_mb``; counted in /health under ``history_cache``). One process: ``--http-workers`` must be 0 (or auto).

Example:
    >>> retriever, version = load_retriever("runs/beauty-sid-tiger", RetrieveSettings(beam=256), device="cuda")
    >>> app = create_retrieve_app(retriever, version, ServerConfig(), RetrieveSettings())
    >>> serve(app, ServerConfig(), port=8000)
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    create_model,
)

from recforge.generate import HistoryCache, Retriever, RetrieveRequest
from recforge.generate.sid_run import read_run
from recforge.models.sid_seq2seq import disable_cudnn_attention
from recforge.serve.api import INT64, STRICT, describe
from recforge.serve.layout import RequestError
from recforge.serve.limits import LoopLag, overload_refusal
from recforge.serve.metrics import LATENCY_BUCKETS
from recforge.serve.retrieve_runner import RetrieveRunner
from recforge.serve.scheduler import DeadlineExceeded, OverloadedError
from recforge.serve.server import ServerConfig, _timeout_ms, await_answer, guarded_app

PATH = "/v1/retrieve"


@dataclass
class RetrieveSettings:
    """The serve config's ``retrieve:`` section: the retrieve engine's limits (generative runs only)."""

    beam: int = 0  # SIDs generated per request (0: the run's generative.beam)
    default_k: int = 10  # items returned when a request gives no k
    max_k: int = 200  # a larger k gets 422
    max_batch: int = 64  # requests per batched search
    max_history: int = 10_000  # history items per request before 422 (the model reads the most recent data.max_seq_len)
    max_allowed: int = 1_000_000  # allowed_items per request before 422
    skip_unknown: bool = False  # items without a SID are dropped from history/allowed_items instead of 422
    checkpoint: str = "auto"  # auto (best for clean runs, else latest) | best | latest | a checkpoint directory
    cache_mb: float = 1024.0  # per-user history encodings reused across requests (LRU, on the device); 0: off
    dense_candidates: int = -1  # the dense side's top items added to the beam's (-1: the run's generative.dense_candidates)
    rescore: float = -1.0  # weight of the dense logits in the items' scores (-1: the run's generative.rescore)
    # a trained retrieval run (e.g. SASRec) scoring in the dense head's place, as `recforge eval RUN
    # generative.dense_scorer=...` does ("": the run's generative.dense_scorer; "none": no scorer, the dense head if
    # any); its dataset must be readable here
    dense_scorer: str = ""

    def problems(self) -> list[str]:
        names = ("default_k", "max_k", "max_batch", "max_history", "max_allowed")
        problems = [f"{name}: must be >= 1, got {getattr(self, name)}" for name in names if getattr(self, name) < 1]
        if self.beam < 0:
            problems.append(f"beam: must be >= 1 (0: the run's generative.beam), got {self.beam}")
        if self.cache_mb < 0:
            problems.append(f"cache_mb: must be >= 0 (0 turns the history cache off), got {self.cache_mb}")
        if self.rescore < 0 and self.rescore != -1:
            problems.append(f"rescore: must be >= 0 (-1: the run's generative.rescore), got {self.rescore}")
        if self.dense_candidates < -1:
            problems.append(f"dense_candidates: must be >= -1 (-1: the run's generative.dense_candidates), "
                            f"got {self.dense_candidates}")  # fmt: skip
        if self.default_k > self.max_k:
            problems.append(f"default_k: {self.default_k} is over max_k {self.max_k}")
        return problems


def _scorer_override(setting: str) -> str | None:
    """``retrieve.dense_scorer`` as ``Retriever.from_run`` takes it: "" the run's own (None), "none" no scorer ("": a
    run trained with one then serves with its dense head, or SID scores alone), else the retrieval run's directory."""
    if setting == "":
        return None
    return "" if setting.lower() == "none" else setting


def load_retriever(run_dir: str | Path, settings: RetrieveSettings, device: str = "auto",
                   dtype: str = "float32") -> tuple[Retriever, str]:  # fmt: skip
    """(the run's ``Retriever`` under ``settings``, its model version), probed with one request; with a
    history cache of ``settings.cache_mb`` (none when 0) tagged with that version."""
    _, ckpt = read_run(run_dir, settings.checkpoint)
    disable_cudnn_attention()  # once per serving process: no per-call flag flips across threads
    candidates = settings.dense_candidates if settings.dense_candidates >= 0 else None
    retriever = Retriever.from_run(run_dir, checkpoint=str(ckpt), device=device, dtype=dtype, dense_candidates=candidates,
                                   rescore=settings.rescore if settings.rescore >= 0 else None,
                                   dense_scorer=_scorer_override(settings.dense_scorer))  # fmt: skip
    base = retriever.config
    retriever.config = replace(base, beam=settings.beam or base.beam, max_k=settings.max_k, max_batch=settings.max_batch,
                               max_history=settings.max_history, max_allowed=settings.max_allowed,
                               skip_unknown=settings.skip_unknown)  # fmt: skip
    retriever.config.validate()
    files = sorted(p for p in [*Path(ckpt).rglob("*"), *(Path(run_dir) / "sids").rglob("*")] if p.is_file())
    stats = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if retriever.dense_scorer is not None:  # another scorer (or its retrained weights) is another served model
        stats += (tuple(sorted(retriever.dense_scorer.provenance.items())),)
    version = f"{Path(ckpt).name}-{hashlib.sha256(repr(stats).encode()).hexdigest()[:10]}"  # stable across restarts
    retriever.version = version
    if settings.cache_mb > 0:
        retriever.cache = HistoryCache(int(settings.cache_mb * 2**20), version)
    probe = int(retriever.item_vocab[1])
    try:  # a model that cannot answer is refused at start, not on the first request
        retriever.run([retriever.encode(RetrieveRequest([probe], k=1, exclude_history=False))])
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{run_dir}: the model fails on a probe request: {type(err).__name__}: {err}") from err
    return retriever, version


class RetrieveResponseOut(BaseModel):
    user_id: StrictInt | StrictStr
    items: list[int] = Field(description="raw item IDs, best first (fewer than k when fewer items are eligible)")
    scores: list[float] = Field(description="SID log-probability of each item, in the same order (a run with "
                                "generative.rescore: plus rescore x its dense logit)")
    model_version: str = Field(description="the model that generated this response")
    latency_ms: float


@dataclass
class RetrieveModels:
    """The request model of one served catalogue (limits, and an example made of its own item IDs)."""

    request: type[BaseModel]

    @classmethod
    def for_retriever(cls, retriever: Retriever, settings: RetrieveSettings, max_string_chars: int = 256) -> RetrieveModels:
        item = Annotated[StrictInt, Field(ge=-INT64, lt=INT64)]
        user = Annotated[StrictInt, Field(ge=-INT64, lt=INT64)] | Annotated[StrictStr, Field(max_length=max_string_chars)]
        items = [int(v) for v in retriever.item_vocab[1:6]]
        example = {"user_id": "u42", "history": items[:3], "k": min(5, settings.max_k), "exclude_history": True}
        if len(items) > 3:
            example["allowed_items"] = items[1:]
        request = create_model(
            "RetrieveRequestIn", __config__=ConfigDict(**STRICT, json_schema_extra={"examples": [example]}),
            __doc__="Generate the top ``k`` items to follow ``history``.",
            user_id=(user, Field(description="the user (echoed back)")),
            history=(list[item], Field(min_length=1, max_length=settings.max_history,
                                       description="raw item IDs, oldest first")),
            k=(Annotated[StrictInt, Field(ge=1, le=settings.max_k)], Field(settings.default_k,
                                                                          description="items to return")),
            allowed_items=(list[item] | None, Field(None, max_length=settings.max_allowed,
                                                    description="only these items may be returned (default: any)")),
            exclude_history=(StrictBool, Field(True, description="never return an item of the history")),
        )  # fmt: skip
        return cls(request)

    def parse(self, raw: bytes) -> BaseModel:
        """The validated request; ``RequestError`` naming every problem otherwise."""
        try:
            return self.request.model_validate_json(raw)
        except ValidationError as err:
            raise RequestError(describe(err)) from None


class RetrieveMetrics:
    """Prometheus metrics of the retrieve server (one process, one registry)."""

    def __init__(self, runner: RetrieveRunner, registry: CollectorRegistry) -> None:
        self.latency = Histogram("recforge_retrieve_latency_seconds", f"POST {PATH} latency (answered requests)",
                                 buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.responses = Counter("recforge_http_responses", "HTTP responses by path and status", ["path", "status"],
                                 registry=registry)  # fmt: skip
        self.batch_requests = Histogram("recforge_retrieve_batch_requests", "requests per batched search",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)  # fmt: skip
        self.pass_seconds = Histogram("recforge_retrieve_pass_seconds", "batched search time (encode + beam + items)",
                                      buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        Gauge("recforge_queue_depth", "requests waiting or running", registry=registry).set_function(runner.pending)
        for name, what in (("hits", "requests whose whole history encoding was cached"),
                           ("extends", "requests that extended a cached history encoding with new events"),
                           ("misses", "requests that encoded their history from scratch"),
                           ("bytes_used", "bytes held by cached history encodings")):  # fmt: skip
            Gauge(f"recforge_retrieve_cache_{name}", what, registry=registry).set_function(
                lambda name=name: _cache_report(runner).get(name, 0))  # fmt: skip
        for reason in ("deadline", "cancelled"):
            Gauge(f"recforge_retrieve_dropped_{reason}", f"requests dropped unanswered ({reason})",
                  registry=registry).set_function(lambda r=reason: runner.dropped[r])  # fmt: skip
        runner.on_pass = self.on_pass

    def on_status(self, path: str, status: int) -> None:
        known = (PATH, "/health", "/metrics", "/docs", "/openapi.json")
        self.responses.labels(path if path in known else "other", str(status)).inc()

    def on_pass(self, requests: int, seconds: float) -> None:
        self.batch_requests.observe(requests)
        self.pass_seconds.observe(seconds)


def _cache_report(runner: RetrieveRunner) -> dict[str, Any]:
    cache = runner.retriever.cache
    return {"enabled": True, **cache.report()} if cache is not None else {"enabled": False}


def create_retrieve_app(retriever: Retriever, version: str, config: ServerConfig | None = None,
                        settings: RetrieveSettings | None = None) -> FastAPI:  # fmt: skip
    """The FastAPI app serving ``retriever`` in this process; the batching worker stops with the app."""
    config, settings = config or ServerConfig(), settings or RetrieveSettings()
    config.validate()
    problems = settings.problems()
    if problems:
        raise ValueError("retrieve settings: " + "; ".join(problems))
    retriever.version = version  # tags the history cache's entries; a reload brings its own
    if retriever.cache is not None and retriever.cache.version != version:
        retriever.cache.invalidate(version)
    runner = RetrieveRunner(retriever, config.scheduler)
    registry = CollectorRegistry()
    metrics = RetrieveMetrics(runner, registry)
    models = RetrieveModels.for_retriever(retriever, settings, config.max_string_chars)
    lag = LoopLag()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        lag.start()
        yield
        lag.stop()
        await asyncio.to_thread(runner.close)  # queued requests finish within drain_timeout_s

    def shed(path: str) -> tuple[float, str] | None:
        """Refuse a retrieve request before reading it when the queue or the event loop is already too late."""
        if path != PATH:
            return None
        queued = runner.queued_seconds()
        return overload_refusal(queued, lag.lag_s, config.scheduler.max_queue_ms, config.max_loop_lag_ms)

    app, errors = guarded_app(
        config, metrics.on_status, shed, lifespan=lifespan, title="recforge retrieve server", version=version,
        description="Generative retrieval over semantic IDs: constrained beam search over the catalogue's SIDs "
        f"(beam {retriever.config.beam}).", busy="overloaded or shutting down",
    )  # fmt: skip
    app.state.runner, app.state.retriever, app.state.loop_lag = runner, retriever, lag

    @app.post(PATH, response_model=RetrieveResponseOut, responses=errors,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/RetrieveRequestIn"}}}}})  # fmt: skip
    async def retrieve(request: Request) -> RetrieveResponseOut:
        started = request.scope.get("state", {}).get("arrival", time.monotonic())
        deadline = started + _timeout_ms(request, config) / 1e3
        body = models.parse(await request.body())
        live = runner.retriever  # encodes and runs this request, even if a reload comes in between
        try:
            encoded = live.encode(RetrieveRequest(body.history, body.k, body.allowed_items, body.exclude_history,
                                                  body.user_id))  # fmt: skip
        except ValueError as err:
            raise RequestError(str(err)) from None
        try:
            future = runner.submit(encoded, deadline=deadline, retriever=live)
        except OverloadedError as err:
            raise HTTPException(503, str(err), headers={"Retry-After": str(int(err.retry_after))}) from err
        try:
            result = await await_answer(request, asyncio.wrap_future(future), future.cancel, deadline)
        except DeadlineExceeded as err:
            raise HTTPException(504, str(err)) from err
        except HTTPException:
            raise
        except Exception as err:  # noqa: BLE001 - an engine failure on this request only
            raise HTTPException(500, f"retrieval failed: {err}") from err
        seconds = time.monotonic() - started
        metrics.latency.observe(seconds)
        return RetrieveResponseOut(user_id=body.user_id, items=result.items, scores=result.scores,
                                   model_version=live.version, latency_ms=seconds * 1e3)  # fmt: skip

    @app.get("/health", responses={503: {"description": "the batching worker is dead or stuck"}})
    async def health() -> JSONResponse:
        worker = runner.health()
        retriever = runner.retriever
        c = retriever.config
        report: dict[str, Any] = {
            "status": "ok" if worker["healthy"] else "unhealthy", "model_version": retriever.version,
            "device": str(retriever.device), "dtype": str(next(retriever.model.parameters()).dtype).removeprefix("torch."),
            "catalogue_items": int(retriever.trie.num_items), "sid_levels": int(retriever.item_codes.shape[1]),
            "queue_depth": worker["queue_depth"], "worker": worker,
            "limits": {"beam": c.beam, "max_k": c.max_k, "max_batch": c.max_batch, "max_history": c.max_history,
                       "model_history_items": retriever.max_items, "max_allowed": c.max_allowed,
                       "request_timeout_ms": config.request_timeout_ms, "max_queue_ms": config.scheduler.max_queue_ms},
            "history_cache": _cache_report(runner),
        }  # fmt: skip
        return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    schema: dict[str, Any] = {}

    def openapi() -> dict:
        if not schema:
            schema.update(get_openapi(title=app.title, version=version, description=app.description, routes=app.routes))
            request_schema = models.request.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(request_schema.pop("$defs", {}))
            components["RetrieveRequestIn"] = request_schema
        return schema

    app.openapi = openapi
    return app


__all__ = ["RetrieveModels", "RetrieveResponseOut", "RetrieveSettings", "create_retrieve_app", "load_retriever"]
