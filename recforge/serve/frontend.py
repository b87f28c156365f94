"""An HTTP front-end process of a multi-process server: the same FastAPI app as the in-process server
(``server.build_app``: limits, strict parsing, encoding to token codes, load shedding, deadlines,
/health, /metrics, /docs) over a ``RemoteBackend`` that forwards encoded requests to the engine
process (``engine_core.EngineCore``) through ZeroMQ.

The front end never waits on a dead engine: the request socket is monitored (the engine process
exiting closes its ipc connection, and every request in flight gets 503 at once) and the engine's
heartbeat must arrive within ``ServerConfig.engine_timeout_s`` (else, a stopped or wedged process:
new requests get 503 and /health is unhealthy; those in flight get 504 at their deadlines).
Admission uses the queue delay the engine publishes with its heartbeat, checked before a
request's body is read. A request whose client leaves or whose deadline passes is cancelled in
the engine too. After a reload (through any front end) the engine's heartbeat carries the new
model version and every front end fetches the new ``EngineSpec``; a request encoded with the old
vocabulary meanwhile (or one that a swap overtakes in the engine's queue: the engine stamps each request
with its live encoding and the worker refuses it after a swap) is answered ``stale`` by the engine
and encoded again, never scored with codes of another model.

Example (what ``serve.procs`` runs in each front-end process):
    >>> run_frontend(listening_socket, Endpoints("/tmp/rf"), ServerConfig())
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

import zmq
import zmq.asyncio
from fastapi import HTTPException, Request
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from zmq.utils.monitor import recv_monitor_message

from recforge.serve.api import RequestModels
from recforge.serve.engine import RankResult
from recforge.serve.layout import EncodedRequest, RequestError
from recforge.serve.metrics import HttpMetrics
from recforge.serve.scheduler import DeadlineExceeded, OverloadedError
from recforge.serve.server import ServerConfig, StaleModel, await_answer, build_app, serve
from recforge.serve.transport import EngineSpec, Endpoints, WireError, pack, request_to_wire, result_from_wire, unpack

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The engine process is dead, stopped or shutting down (HTTP 503)."""


def fetch_spec(endpoints: Endpoints, timeout_s: float) -> EngineSpec:
    """The engine's current ``EngineSpec``, asked synchronously (before the front end's event loop runs)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoints.requests)
        sock.send(pack({"op": "spec"}))
        if not sock.poll(int(timeout_s * 1e3)):
            raise EngineUnavailable(f"the engine process did not answer within {timeout_s:g} s at {endpoints.requests}")
        return EngineSpec.from_wire(unpack(sock.recv()))
    finally:
        sock.close()
        ctx.term()


class RemoteBackend:
    """The engine in another process (see the module docstring); the app-facing members are ``LocalBackend``'s."""

    # Refuse before reading a request past 80% of max_queue_ms: the queue estimate comes with the engine's
    # heartbeat (up to 20 ms old) and every front end admits on it at once, so at 100% a burst overshoots and
    # the engine refuses what the front ends already read and forwarded (its own check stays at 100%)
    shed_fraction = 0.8

    def __init__(self, endpoints: Endpoints, config: ServerConfig, spec: EngineSpec,
                 multiprocess_metrics: bool = True) -> None:  # fmt: skip
        """``multiprocess_metrics``: HTTP metrics summed over every front-end process (prometheus_client's
        multiprocess mode, which ``serve.procs`` turns on); False keeps them in this process (tests)."""
        self.endpoints, self.config = endpoints, config
        self.spec = spec
        self.models = RequestModels.for_engine(spec, config.max_string_chars)
        self._registry = None if multiprocess_metrics else CollectorRegistry()
        self.http_metrics = HttpMetrics(self._registry)
        self.status: dict[str, Any] = {"queued_s": 0.0, "healthy": True, "version": spec.version, "pid": None}
        self._heard = time.monotonic()
        self._connected = True  # fetch_spec just talked to it
        self._closing: str | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._spec_waiters: list[asyncio.Future] = []
        self._refreshing: asyncio.Task | None = None
        self._next_id = 0
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._sub = self._ctx.socket(zmq.SUB)
        for sock in (self._dealer, self._sub):
            sock.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.SNDHWM, 0)  # sending never waits: admission bounds what is queued
        self._dealer.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = self._dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._dealer.connect(self.endpoints.requests)
        self._sub.connect(self.endpoints.status)
        self._heard = time.monotonic()
        self._parent = os.getppid()
        self._tasks = [asyncio.create_task(f()) for f in (self._read_replies, self._read_status, self._watch)]

    async def close(self) -> None:
        self._closing = "this front end is shutting down"
        self._fail_pending(EngineUnavailable(self._closing))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._dealer.disable_monitor()
        for sock in (self._monitor, self._dealer, self._sub):
            sock.close()
        self._ctx.term()

    # ------------------------------------------------------------------------------- the app's interface

    def unavailable(self) -> str | None:
        """Why no request can be served now (the engine is gone, stopped or closing), else None."""
        if self._closing:
            return f"{self._closing}; retry later"
        if not self._connected:
            return "the engine process is not running (it exited); retry later"
        silent = time.monotonic() - self._heard
        if silent > self.config.engine_timeout_s:
            return f"the engine process has not been heard from for {silent:.1f} s; retry later"
        return None

    def queued_seconds(self) -> float:
        return float(self.status.get("queued_s", 0.0))

    async def rank(self, req: EncodedRequest, version: str, deadline: float, request: Request) -> RankResult:
        down = self.unavailable()
        if down is not None:
            raise HTTPException(503, down, headers={"Retry-After": "1"})
        tasks = self.spec.tasks  # the spec that encoded ``req`` (no await since the route read it)
        rid, answer = self._new_request()
        try:
            await self._dealer.send(pack({"op": "rank", "id": rid, "spec": version, "deadline": float(deadline),
                                          **request_to_wire(req)}))  # fmt: skip
            reply = await await_answer(request, answer, lambda: self._send_nowait({"op": "cancel", "id": rid}), deadline)
        except EngineUnavailable as err:
            raise HTTPException(503, f"{err}; retry later", headers={"Retry-After": "1"}) from None
        finally:
            self._pending.pop(rid, None)
        op = reply["op"]
        if op == "result":  # computed by the model that ``version`` names (else the engine says stale)
            return result_from_wire(reply, tasks)
        if op == "stale":  # fetch the new spec within what the request's deadline leaves, then encode it again
            try:
                await asyncio.wait_for(self.refresh(), max(deadline - time.monotonic(), 0.0))
            except (EngineUnavailable, TimeoutError) as err:
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded("the deadline passed while fetching the reloaded model's spec") from None
                raise HTTPException(503, f"cannot fetch the reloaded model's spec: {err or 'timed out'}; retry later",
                                    headers={"Retry-After": "1"}) from None  # fmt: skip
            raise StaleModel(reply.get("version"))
        status, detail = int(reply.get("status", 500)), str(reply.get("detail", ""))
        if status == 503:
            raise OverloadedError(detail, float(reply.get("retry_after", 1.0)))
        if status == 504:
            raise DeadlineExceeded(detail)
        if status == 422:
            raise RequestError(detail)
        raise HTTPException(status, detail)

    async def health(self) -> dict[str, Any]:
        front = {"pid": os.getpid(), "engine_pid": self.status.get("pid"),
                 "engine_heard_ms_ago": round((time.monotonic() - self._heard) * 1e3, 1)}  # fmt: skip
        down = self.unavailable()
        if down is None:
            try:
                reply = await self._call({"op": "health"}, self.config.engine_timeout_s)
                return {**reply["report"], "frontend": front}
            except (TimeoutError, EngineUnavailable) as err:
                down = f"the engine process did not answer /health: {err or 'timed out'}"
        return {"status": "unhealthy", "detail": down, "model_version": self.spec.version, "frontend": front}

    async def reload(self, source: str) -> str:
        try:
            reply = await self._call({"op": "reload", "run_dir": source}, None)
        except EngineUnavailable as err:
            raise HTTPException(503, f"{err}; the reload may not have happened", headers={"Retry-After": "1"}) from None
        if reply["op"] == "reloaded":
            await self.refresh()
            return str(reply["version"])
        if reply.get("status") == 422:
            raise ValueError(reply.get("detail", ""))
        raise HTTPException(int(reply.get("status", 500)), str(reply.get("detail", "")))

    async def metrics_text(self) -> bytes:
        registry = self._registry
        if registry is None:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        text, up = generate_latest(registry), 0
        engine = b""
        if self.unavailable() is None:
            try:
                engine, up = (await self._call({"op": "metrics"}, self.config.engine_timeout_s))["text"], 1
            except (TimeoutError, EngineUnavailable):
                pass
        return (text + engine + b"# HELP recforge_engine_up 1 when the engine process answered this scrape\n"
                b"# TYPE recforge_engine_up gauge\nrecforge_engine_up %d.0\n" % up)  # fmt: skip

    async def refresh(self) -> None:
        """Fetch the engine's current spec (after a reload); concurrent callers share one fetch."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._fetch_spec())
        await asyncio.shield(self._refreshing)

    # ------------------------------------------------------------------------------- plumbing

    async def _fetch_spec(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._spec_waiters.append(waiter)
        await self._dealer.send(pack({"op": "spec"}))
        message = await asyncio.wait_for(waiter, max(self.config.engine_timeout_s, 10.0))
        spec = EngineSpec.from_wire(message)
        if spec.version != self.spec.version:
            self.models = RequestModels.for_engine(spec, self.config.max_string_chars)
            self.spec = spec

    def _new_request(self) -> tuple[int, asyncio.Future]:
        self._next_id += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        return self._next_id, future

    async def _call(self, message: dict, timeout: float | None) -> dict:
        rid, answer = self._new_request()
        try:
            await self._dealer.send(pack({**message, "id": rid}))
            return await asyncio.wait_for(answer, timeout)
        finally:
            self._pending.pop(rid, None)

    def _send_nowait(self, message: dict) -> None:
        self._dealer.send(pack(message))  # zmq.asyncio sends at once when it can, else when the socket is ready

    def _fail_pending(self, err: Exception) -> None:
        for future in [*self._pending.values(), *self._spec_waiters]:
            if not future.done():
                future.set_exception(err)
        self._spec_waiters.clear()

    async def _read_replies(self) -> None:
        while True:
            try:
                message = unpack(await self._dealer.recv())
            except WireError as err:
                log.error("front end: a malformed reply from the engine (%s); ignored", err)
                continue
            if message["op"] == "spec":
                waiters, self._spec_waiters = self._spec_waiters, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(message)
                continue
            future = self._pending.get(message.get("id"))
            if future is not None and not future.done():
                future.set_result(message)

    async def _read_status(self) -> None:
        while True:
            try:
                message = unpack(await self._sub.recv())
            except WireError as err:
                log.error("front end: a malformed heartbeat from the engine (%s); ignored", err)
                continue
            self.status, self._heard = message, time.monotonic()
            if message.get("closing"):  # new requests are refused; those in flight are drained by the engine
                self._closing = "the engine process is shutting down"
            elif message.get("version") != self.spec.version and (self._refreshing is None or self._refreshing.done()):
                self._refreshing = asyncio.create_task(self._fetch_spec())  # another front end reloaded the model
                self._refreshing.add_done_callback(_log_failure)

    async def _watch(self) -> None:
        """The engine's connection (its exit fails everything in flight at once; a silent engine only stops new
        requests, those in flight keep their deadlines) and our parent."""
        while True:
            try:
                event = await asyncio.wait_for(recv_monitor_message(self._monitor), 0.1)
            except TimeoutError:
                event = None
            if event is not None:
                self._connected = event["event"] == zmq.EVENT_CONNECTED
                if not self._connected:
                    self._fail_pending(EngineUnavailable("the engine process exited while this request was in flight"))
            if os.getppid() != self._parent:  # the supervisor is gone: shut down like on SIGTERM
                os.kill(os.getpid(), signal.SIGTERM)
                return


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("front end: could not fetch the engine's new model spec (%r); retrying on the next heartbeat",
                    task.exception())  # fmt: skip


def run_frontend(sock, endpoints: Endpoints, config: ServerConfig, log_level: str = "warning") -> None:
    """Serve the HTTP API on the shared listening ``sock`` until SIGTERM/SIGINT (uvicorn's graceful shutdown)."""
    import torch

    torch.set_num_threads(1)  # a front end's tensors are tiny: no intra-op thread pool competing for the cores
    spec = fetch_spec(endpoints, timeout_s=max(config.engine_timeout_s, 30.0))
    app = build_app(RemoteBackend(endpoints, config, spec), config)
    serve(app, config, log_level=log_level, sockets=[sock])


__all__ = ["EngineUnavailable", "RemoteBackend", "fetch_spec", "run_frontend"]
