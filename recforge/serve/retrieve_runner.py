"""The batching worker of `/v1/retrieve`: one thread that owns a ``Retriever`` and serves queued requests
in batches (several requests, one ``Retriever.run``: one encoder pass, one beam search, one host copy).

The design is ``runner.BatchRunner``'s, without its scheduler (a retrieve request is one pass, not a
sequence of prefill chunks): a batch waits at most ``max_wait_ms`` for more requests (or until
``Retriever.config.max_batch`` are queued); admission is bounded in time (``OverloadedError``, HTTP 503,
when the batches queued ahead would take longer than ``max_queue_ms`` or than the request's own
deadline); requests past their deadline (``DeadlineExceeded``, 504) or whose future was cancelled (the
client went away) are dropped before their batch runs. A batch that raises is rerun one request at a
time, so a failing request fails alone; an unexpected worker error fails the batch and the loop goes on.

Example:
    >>> runner = RetrieveRunner(retriever, SchedulerConfig(max_wait_ms=2))
    >>> future = runner.submit(retriever.encode(RetrieveRequest([12, 7, 99], k=10)), deadline=time.monotonic() + 1)
    >>> future.result().items
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from recforge.generate import EncodedRetrieve, Retriever, RetrieveResult
from recforge.serve.runner import _resolve, _shut_down
from recforge.serve.scheduler import DeadlineExceeded, OverloadedError, SchedulerConfig

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Pending:
    """One retrieve request in the queue."""

    req: EncodedRetrieve
    deadline: float  # time.monotonic() after which the answer is useless
    arrival: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)


class RetrieveRunner:
    """The worker thread that batches retrieve requests (see the module docstring).

    Of ``config`` (the serve config's ``scheduler:`` section) it reads ``max_wait_ms``, ``max_queue``,
    ``max_queue_ms``, ``drain_timeout_s`` and ``stall_seconds``; the batch size is the retriever's
    ``config.max_batch``. ``on_pass(requests, seconds)`` is called after every batch (for metrics).
    """

    def __init__(self, retriever: Retriever, config: SchedulerConfig | None = None,
                 on_pass: Callable[[int, float], None] | None = None) -> None:  # fmt: skip
        self.retriever, self.config, self.on_pass = retriever, config or SchedulerConfig(), on_pass
        self.max_batch = retriever.config.max_batch
        self.restarts = 0  # unexpected worker errors survived (each failed its batch)
        self.dropped = {"deadline": 0, "cancelled": 0}
        self.last_beat = time.monotonic()
        self._incoming: deque[Pending] = deque()
        self._running: list[Pending] = []
        self._pass_seconds = 0.0  # seconds per batch, exponentially weighted (0 before the first)
        self._queue_delay = 0.0  # seconds from arrival to the batch's start, over recent requests
        self._cond = threading.Condition()
        self._closing = False
        self._drain_until = math.inf
        self._thread: threading.Thread | None = None
        self._start_worker()

    def submit(self, req: EncodedRetrieve, deadline: float | None = None) -> Future:
        """Queue an encoded request; the future resolves to a ``RetrieveResult`` or raises (``DeadlineExceeded``,
        the engine's error). Cancelling the future drops the request. ``OverloadedError`` when refused."""
        now = time.monotonic()
        deadline = math.inf if deadline is None else deadline
        with self._cond:
            if self._closing:
                raise OverloadedError("the server is shutting down", retry_after=1.0)
            self._start_worker()
            if self.pending() >= self.config.max_queue:
                raise OverloadedError(f"{self.config.max_queue} requests already queued; retry later", 1.0)
            ahead = self.queued_seconds()
            limit = min(self.config.max_queue_ms / 1e3, deadline - now - self._pass_seconds)
            if ahead > 0 and ahead > limit:
                raise OverloadedError(
                    f"about {ahead * 1e3:.0f} ms of work is queued ahead of this request, over its limit of "
                    f"{max(limit, 0) * 1e3:.0f} ms (max_queue_ms, or what its deadline leaves); retry later",
                    retry_after=max(1.0, math.ceil(ahead - self.config.max_queue_ms / 1e3)),
                )  # fmt: skip
            item = Pending(req, deadline, now)
            self._incoming.append(item)
            self._cond.notify()
        return item.future

    def pending(self) -> int:
        """Requests waiting or running."""
        return len(self._incoming) + len(self._running)

    def queued_seconds(self) -> float:
        """How long a new request would wait before its batch starts: the larger of the queued batches' estimated
        time and the wait recent requests actually had; 0 when nothing is queued."""
        waiting = len(self._incoming) + len(self._running)
        if not waiting:
            return 0.0
        return max(math.ceil(waiting / self.max_batch) * self._pass_seconds, self._queue_delay)

    def health(self) -> dict:
        """Worker liveness: alive, restarts, seconds since its last sign of life, the oldest waiting request's age."""
        now = time.monotonic()
        waiting = [*list(self._incoming), *self._running]
        oldest = max((now - p.arrival for p in waiting), default=0.0)
        beat_age = now - self.last_beat
        alive = self._thread is not None and self._thread.is_alive()
        stuck = bool(waiting) and beat_age > self.config.stall_seconds
        return {"worker_alive": alive, "worker_stuck": stuck, "worker_restarts": self.restarts,
                "last_pass_age_s": round(beat_age, 3), "queue_depth": self.pending(),
                "oldest_request_age_ms": round(oldest * 1e3, 1), "dropped": dict(self.dropped),
                "healthy": (alive or self._closing) and not stuck}  # fmt: skip

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, let those queued finish for at most ``timeout`` seconds (default
        ``drain_timeout_s``), then fail what is left and stop the worker."""
        timeout = self.config.drain_timeout_s if timeout is None else timeout
        with self._cond:
            self._closing = True
            self._drain_until = time.monotonic() + timeout
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=timeout + 5)
        self._fail_waiting(_shut_down())

    # ------------------------------------------------------------------------------- worker

    def _start_worker(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        if self._thread is not None:  # it died (should not happen: the loop is guarded)
            log.error("retrieve worker thread had died; restarting it")
            self.restarts += 1
        self._thread = threading.Thread(target=self._loop, name="recforge-retrieve-runner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.last_beat = time.monotonic()
            try:
                if not self._iteration():
                    break
            except Exception as err:  # noqa: BLE001 - the worker survives anything a request causes
                log.exception("retrieve worker: unexpected error; failing the batch in flight and going on")
                self.restarts += 1
                for item in self._running:
                    _resolve(item.future, error=RuntimeError(f"internal error while serving this request: {err!r}"))
                self._running = []
        self._fail_waiting(_shut_down())

    def _iteration(self) -> bool:
        """Wait for a request, let others join for ``max_wait_ms``, run one batch. False when the worker should exit."""
        with self._cond:
            while not self._incoming and not self._closing:
                self._cond.wait(timeout=1.0)
                self.last_beat = time.monotonic()
            if self._closing and (time.monotonic() > self._drain_until or not self._incoming):
                return False
            wait_until = time.monotonic() + self.config.max_wait_ms / 1e3
            while len(self._incoming) < self.max_batch and not self._closing:
                left = wait_until - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._running = [self._incoming.popleft() for _ in range(min(self.max_batch, len(self._incoming)))]
        now = time.monotonic()
        batch = [item for item in self._running if self._live(item, now)]
        if batch:
            self._run(batch)
        self._running = []
        return True

    def _live(self, item: Pending, now: float) -> bool:
        """False (and the request answered, unless cancelled) when its client left or its deadline passed."""
        if item.future.cancelled():
            self.dropped["cancelled"] += 1
            return False
        if now > item.deadline:
            self.dropped["deadline"] += 1
            _resolve(item.future, error=DeadlineExceeded(f"deadline passed after {(now - item.arrival) * 1e3:.0f} ms "
                                                         "in the queue"))  # fmt: skip
            return False
        return True

    def _run(self, batch: list[Pending]) -> None:
        start = time.monotonic()
        for item in batch:
            self._queue_delay = 0.8 * self._queue_delay + 0.2 * (start - item.arrival)
        t0 = time.perf_counter()
        try:
            outcomes: list[RetrieveResult | Exception] = list(self.retriever.run([item.req for item in batch]))
        except Exception:  # noqa: BLE001 - isolate: rerun each request alone, fail only those that raise
            outcomes = [self._run_alone(item) for item in batch]
        seconds = time.perf_counter() - t0
        self.last_beat = time.monotonic()
        self._pass_seconds = seconds if not self._pass_seconds else 0.8 * self._pass_seconds + 0.2 * seconds
        for item, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, Exception):
                _resolve(item.future, error=outcome)
            else:
                _resolve(item.future, outcome)
        if self.on_pass is not None:
            self.on_pass(len(batch), seconds)

    def _run_alone(self, item: Pending) -> RetrieveResult | Exception:
        try:
            return self.retriever.run([item.req])[0]
        except Exception as err:  # noqa: BLE001 - reported on this request only
            return err

    def _fail_waiting(self, err: Exception) -> None:
        with self._cond:
            waiting = [*self._incoming, *self._running]
            self._incoming.clear()
        for item in waiting:
            _resolve(item.future, error=err)


__all__ = ["Pending", "RetrieveRunner"]
