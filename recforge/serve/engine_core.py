"""The engine process of a multi-process server: one ``BatchRunner`` (model, KV pool, batching worker) behind
ZeroMQ sockets that the HTTP front ends talk to (message formats in ``transport.py``).

Its I/O thread (``EngineCore.serve``) receives already-validated, encoded requests and submits them to
the runner, whose admission control (``OverloadedError`` -> the front end's 503) and per-user
scheduling are the in-process server's own. Admission is asked first, from the message's sizes
(``BatchRunner.check_admission``), so a request refused under overload costs no decoding or range
checks (work that would take the GIL from the batching worker); finished futures are answered from the same thread
(ZeroMQ sockets belong to one thread; the worker only appends to a deque and wakes it through a pipe).
A ``cancel`` cancels the request's future, so the worker drops it before it is computed; a request
whose deadline passes in the queue is dropped by the worker (504). Every ``STATUS_INTERVAL_S`` the
engine publishes its heartbeat, estimated queue delay and model version, which the front ends use
to refuse requests before parsing them and to notice a dead or stuck engine. ``/health`` carries the
cumulative ``counters`` of the worker (``BatchRunner.stats``) and of the I/O thread (``EngineCore.io``),
which ``benchmarks/serve_overload.py`` differences per phase to show where the engine's time goes.

Example:
    >>> core = EngineCore(RankEngine.from_run("runs/rank"), ServerConfig(), Endpoints("/tmp/rf"))
    >>> core.serve(stop_event)   # until stop_event is set, then drains the runner
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

import zmq
from prometheus_client import CollectorRegistry, generate_latest

from recforge.serve.engine import RankEngine
from recforge.serve.kv_pool import KVCachePool
from recforge.serve.layout import RequestError
from recforge.serve.metrics import EngineMetrics
from recforge.serve.runner import BatchRunner
from recforge.serve.scheduler import DeadlineExceeded, OverloadedError, StaleEncoding
from recforge.serve.transport import (
    STATUS_INTERVAL_S,
    EngineSpec,
    Endpoints,
    WireError,
    check_ranges,
    pack,
    request_from_wire,
    result_to_wire,
    unpack,
    wire_sizes,
)

if TYPE_CHECKING:
    from recforge.serve.server import ServerConfig

log = logging.getLogger(__name__)


def engine_report(engine: RankEngine, runner: BatchRunner, config: ServerConfig,
                  io: dict[str, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """The ``/health`` body: worker liveness and queue, model, limits, KV cache, CUDA graphs, the eager pass's
    ``transfers`` (uploads, downloads, staging waits; ``staging.py``) and the cumulative ``counters`` of the
    batching worker (``BatchRunner.stats``) and of the engine's I/O thread (``io``). Like the KV cache's and the
    graphs', the transfers are the serving engine's: a reload starts a new engine, and them, at zero."""
    worker = runner.health()
    return {
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
        "transfers": dict(engine.transfers),
        "counters": {**runner.stats(), **(io or {})},
    }


def attach_pool(engine: RankEngine, config: ServerConfig) -> None:
    if config.pool is not None and engine.cached and engine.pool is None:
        engine.pool = KVCachePool.for_engine(engine, config.pool)


class EngineCore:
    """Serves ``engine`` to the front ends connected to ``endpoints`` (see the module docstring)."""

    def __init__(self, engine: RankEngine, config: ServerConfig, endpoints: Endpoints) -> None:
        config.validate()
        attach_pool(engine, config)
        self.config, self.endpoints = config, endpoints
        self.runner = BatchRunner(engine, config.scheduler)
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.runner, self.registry)
        self._spec_cache: tuple[RankEngine, EngineSpec, bytes] | None = None  # (engine, its spec, the spec reply)
        self._inflight: dict[tuple[bytes, int], Future] = {}
        self._done: deque[tuple[bytes, int, Any]] = deque()  # (front end, request id, outcome) to answer
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_pending = threading.Event()
        self._reloading = False
        self.froze_at_start = False  # set by the engine process, which gc.freeze()s what start-up made
        # the I/O thread's cumulative work (in /health's counters): rank messages, those refused before decoding
        # them, seconds spent decoding/checking, and its busy (not polling) wall and CPU seconds
        self.io = {"io_rank_messages": 0, "io_refused_before_decode": 0, "io_refused_at_submit": 0,
                   "io_decode_s": 0.0, "io_busy_s": 0.0, "io_cpu_s": 0.0}  # fmt: skip

    @property
    def engine(self) -> RankEngine:
        """The live engine: a reload swaps in a new engine object (``BatchRunner.reload``)."""
        return self.runner.engine

    def _live_spec(self) -> tuple[RankEngine, EngineSpec, bytes]:
        """The live engine with its spec and packed spec reply, rebuilt when a reload swapped the engine (so the
        heartbeat, the stale check and the spec reply never lag the swap)."""
        live, engine = self._spec_cache, self.runner.engine
        if live is None or live[0] is not engine:
            spec = EngineSpec.of(engine)
            live = self._spec_cache = (engine, spec, pack({"op": "spec", **spec.to_wire(engine.vocab_json)}))
        return live

    @property
    def spec(self) -> EngineSpec:
        return self._live_spec()[1]

    # ------------------------------------------------------------------------------- I/O thread

    def serve(self, stop: threading.Event) -> None:
        """Answer front ends until ``stop`` is set; then refuse new work, drain the runner and return."""
        ctx = zmq.Context()
        router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
        for sock in (router, pub):
            sock.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a front end that has gone is dropped
        # no high-water marks: a ROUTER drops replies past its HWM (the request would wait for its deadline);
        # memory stays bounded by admission control (max_queue, max_queue_ms) instead
        router.setsockopt(zmq.SNDHWM, 0)
        router.setsockopt(zmq.RCVHWM, 0)
        router.bind(self.endpoints.requests)
        pub.bind(self.endpoints.status)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_status = 0.0
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_status:
                    pub.send(pack(self._status(now)))
                    next_status = now + STATUS_INTERVAL_S
                events = dict(poller.poll(max(1, int((next_status - time.monotonic()) * 1e3) + 1)))
                busy, cpu = time.perf_counter(), time.thread_time()
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                    self._wake_pending.clear()
                while self._done:
                    ident, rid, outcome = self._done.popleft()
                    self._answer(router, ident, rid, outcome)
                if router in events:
                    for _ in range(256):  # bounded, so replies and heartbeats keep flowing under a flood
                        try:
                            ident, frame = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(router, ident, frame)
                self.io["io_busy_s"] += time.perf_counter() - busy
                self.io["io_cpu_s"] += time.thread_time() - cpu
        finally:
            pub.send(pack({**self._status(time.monotonic()), "closing": True}))
            self.runner.close()  # in-flight requests finish within drain_timeout_s, the rest fail
            while self._done:
                self._answer(router, *self._done.popleft())
            router.close()
            pub.close()
            ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _status(self, now: float) -> dict[str, Any]:
        healthy = self.runner.health()["healthy"]
        return {"op": "status", "t": now, "queued_s": self.runner.queued_seconds(), "pending": self.runner.pending(),
                "healthy": healthy, "version": self.spec.version, "pid": os.getpid()}  # fmt: skip

    def _handle(self, router: zmq.Socket, ident: bytes, frame: bytes) -> None:
        rid = -1
        try:
            msg = unpack(frame)
            op, rid = msg["op"], msg.get("id", -1)
            if op == "rank":
                self._rank(router, ident, rid, msg)
            elif op == "cancel":
                future = self._inflight.pop((ident, rid), None)
                if future is not None:
                    future.cancel()
            elif op == "spec":
                router.send_multipart([ident, self._live_spec()[2]])
            elif op == "health":
                report = engine_report(self.engine, self.runner, self.config, dict(self.io))
                router.send_multipart([ident, pack({"op": "health", "id": rid, "report": report})])
            elif op == "metrics":
                router.send_multipart([ident, pack({"op": "metrics", "id": rid, "text": generate_latest(self.registry)})])
            elif op == "reload":
                self._reload(router, ident, rid, msg.get("run_dir"))
            else:
                raise WireError(f"unknown op {op!r}")
        except Exception as err:  # noqa: BLE001 - one bad message (or a bug it hits) must not end the engine
            log.exception("engine: cannot handle a message from a front end")
            router.send_multipart([ident, pack({"op": "error", "id": rid, "status": 500, "detail": f"engine: {err}"})])

    def _rank(self, router: zmq.Socket, ident: bytes, rid: int, msg: dict) -> None:
        io = self.io
        io["io_rank_messages"] += 1
        engine, spec, _ = self._live_spec()
        if msg.get("spec") != spec.version:
            router.send_multipart([ident, pack({"op": "stale", "id": rid, "version": spec.version})])
            return
        deadline = msg.get("deadline")
        if not isinstance(deadline, float):
            raise WireError("deadline: expected a float (time.monotonic() of this host)")
        try:  # admission first, from the message's sizes: a refused request costs no decoding
            self.runner.check_admission(*wire_sizes(msg), deadline=deadline)
        except OverloadedError as err:
            io["io_refused_before_decode"] += 1
            self._refuse(router, ident, rid, err)
            return
        t0 = time.perf_counter()
        req = request_from_wire(msg)
        check_ranges(req, spec)  # a malformed message fails alone here, never inside a shared engine pass
        io["io_decode_s"] += time.perf_counter() - t0
        req.encoding = engine.encoding  # encoded for this engine: the worker refuses it if a swap comes first
        try:
            future = self.runner.submit(req, deadline=deadline)
        except OverloadedError as err:
            io["io_refused_at_submit"] += 1
            self._refuse(router, ident, rid, err)
            return
        self._inflight[(ident, rid)] = future
        future.add_done_callback(partial(self._finished, ident, rid, msg["spec"]))

    @staticmethod
    def _refuse(router: zmq.Socket, ident: bytes, rid: int, err: OverloadedError) -> None:
        router.send_multipart([ident, pack({"op": "error", "id": rid, "status": 503, "detail": str(err),
                                            "retry_after": err.retry_after})])  # fmt: skip

    def _reload(self, router: zmq.Socket, ident: bytes, rid: int, run_dir: Any) -> None:
        if self._reloading:
            router.send_multipart([ident, pack({"op": "error", "id": rid, "status": 409,
                                                "detail": "another reload is in progress; retry when it has finished"})])  # fmt: skip
            return
        self._reloading = True

        def work() -> None:  # stage_reload loads from disk: off the I/O thread
            try:
                outcome: tuple = ("reloaded", self.runner.reload(str(run_dir)))
                if self.froze_at_start:  # the old model was frozen with the rest (procs): let the collector reach it
                    gc.unfreeze()
            except Exception as err:  # noqa: BLE001 - reported to the caller
                outcome = ("reload_failed", err)
            self._push(ident, rid, outcome)

        threading.Thread(target=work, name="recforge-reload", daemon=True).start()

    # ------------------------------------------------------------------------------- completions

    def _finished(self, ident: bytes, rid: int, spec: str, future: Future) -> None:
        """Runs on the worker thread (or here, on cancel): queue the outcome for the I/O thread."""
        if future.cancelled():
            self._inflight.pop((ident, rid), None)  # the front end gave up: nothing to send
            return
        err = future.exception()
        self._push(ident, rid, ("error", err) if err is not None else ("result", spec, future.result()))

    def _push(self, ident: bytes, rid: int, outcome: tuple) -> None:
        self._done.append((ident, rid, outcome))
        if not self._wake_pending.is_set():
            self._wake_pending.set()
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # the pipe is full: the I/O thread is awake anyway
                pass

    def _answer(self, router: zmq.Socket, ident: bytes, rid: int, outcome: tuple) -> None:
        """Send one finished outcome: ("result", spec, RankResult) | ("error", exc) | ("reloaded", version) |
        ("reload_failed", exc)."""
        self._inflight.pop((ident, rid), None)
        kind = outcome[0]
        if kind == "result":
            _, spec, result = outcome
            if result.model_version != spec:  # a reload happened while it was queued: its codes may be stale
                reply = {"op": "stale", "id": rid, "version": result.model_version}
            else:
                reply = {"op": "result", "id": rid, **result_to_wire(result)}
        elif kind == "reloaded":
            self._reloading = False
            reply = {"op": "reloaded", "id": rid, "version": outcome[1]}
        elif kind == "reload_failed":
            self._reloading = False
            err = outcome[1]
            status = 422 if isinstance(err, ValueError) else 409 if isinstance(err, RuntimeError) else 500
            reply = {"op": "error", "id": rid, "status": status, "detail": str(err)}
        elif isinstance(outcome[1], StaleEncoding):  # a swap overtook it in the queue: the front end re-encodes
            reply = {"op": "stale", "id": rid, "version": self.spec.version}
        else:
            err = outcome[1]
            status = 504 if isinstance(err, DeadlineExceeded) else 503 if isinstance(err, OverloadedError) else 500
            if isinstance(err, RequestError):
                status = 422
            reply = {"op": "error", "id": rid, "status": status, "detail": str(err)}
        router.send_multipart([ident, pack(reply)])


__all__ = ["EngineCore", "attach_pool", "engine_report"]
