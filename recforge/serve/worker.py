"""The lifecycle shared by the serve batching workers (``runner.BatchRunner``, ``retrieve_runner.RetrieveRunner``).

``GuardedWorker`` owns one daemon thread and what keeps it alive and answerable: the guarded loop (an
unexpected error fails the work in flight and the loop goes on), the restart of a dead thread on the next
submit, the heartbeat (``last_beat``) and ``health``, time-bounded admission (``OverloadedError``) and
``close`` (drain for at most ``drain_timeout_s``, then fail what is left with ``ShuttingDown``). A subclass
supplies one round of work (``_iteration``) and says what it holds (``_waiting``, ``pending``,
``_fail_in_flight``, ``_fail_all``); it calls ``_start_worker`` at the end of its ``__init__``.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
import threading
import time
from concurrent.futures import Future, InvalidStateError

from recforge.serve.scheduler import DeadlineExceeded, OverloadedError, SchedulerConfig, ShuttingDown

log = logging.getLogger(__name__)


class GuardedWorker(ABC):
    """One guarded worker thread over a queue of requests (see the module docstring).

    Queued items need ``future``, ``arrival`` and ``deadline`` attributes. ``label`` names the worker in logs.
    """

    label = "worker"
    thread_name = "recforge-worker"

    def __init__(self, config: SchedulerConfig | None) -> None:
        self.config = config or SchedulerConfig()
        self.restarts = 0  # unexpected worker errors survived (each failed the requests in flight)
        self.dropped = {"deadline": 0, "cancelled": 0}  # requests dropped before they were answered
        self.last_beat = time.monotonic()  # the worker's last sign of life
        self._queue_delay = 0.0  # seconds from arrival to first pass, averaged over recent requests
        self._cond = threading.Condition()
        self._closing = False
        self._drain_until = math.inf
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------- subclass hooks

    @abstractmethod
    def pending(self) -> int:
        """Requests waiting or running."""

    @abstractmethod
    def queued_seconds(self) -> float:
        """How long a new request would wait before its first pass; 0 when nothing is queued."""

    @abstractmethod
    def _waiting(self) -> list:
        """Every request waiting or running (for the oldest one's age)."""

    @abstractmethod
    def _iteration(self) -> bool:
        """One round of work; False when the worker should exit."""

    @abstractmethod
    def _fail_in_flight(self, err: Exception) -> None:
        """After the unexpected ``err``: fail the requests in flight (their state cannot be trusted)."""

    @abstractmethod
    def _fail_all(self, err: Exception) -> None:
        """Fail every request still held (at shutdown)."""

    def _worker_died(self) -> None:  # noqa: B027 - an optional hook: nothing to do by default
        """Called before a dead worker thread is replaced."""

    # ------------------------------------------------------------------------------- callers' side

    def _admit(self, now: float, deadline: float, own_seconds: float) -> None:
        """Under ``_cond``: raise ``OverloadedError`` when closing, when ``max_queue`` requests are queued, or
        when the work ahead would take longer than ``max_queue_ms`` or than what ``deadline`` leaves after
        the request's own ``own_seconds``. Restarts a dead worker."""
        if self._closing:
            raise OverloadedError("the server is shutting down", retry_after=1.0)
        self._start_worker()
        if self.pending() >= self.config.max_queue:
            raise OverloadedError(f"{self.config.max_queue} requests already queued; retry later", 1.0)
        ahead = self.queued_seconds()
        limit = min(self.config.max_queue_ms / 1e3, deadline - now - own_seconds)
        if ahead > 0 and ahead > limit:
            raise OverloadedError(
                f"about {ahead * 1e3:.0f} ms of work is queued ahead of this request, over its limit of "
                f"{max(limit, 0) * 1e3:.0f} ms (max_queue_ms, or what its deadline leaves); retry later",
                retry_after=max(1.0, math.ceil(ahead - self.config.max_queue_ms / 1e3)),
            )  # fmt: skip

    def health(self) -> dict:
        """Worker liveness: alive, restarts, seconds since its last sign of life, the oldest waiting request's age."""
        now = time.monotonic()
        waiting = self._waiting()
        oldest = max((now - s.arrival for s in waiting), default=0.0)
        beat_age = now - self.last_beat
        alive = self._thread is not None and self._thread.is_alive()
        stuck = bool(waiting) and beat_age > self.config.stall_seconds
        return {"worker_alive": alive, "worker_stuck": stuck, "worker_restarts": self.restarts,
                "last_pass_age_s": round(beat_age, 3), "queue_depth": self.pending(),
                "oldest_request_age_ms": round(oldest * 1e3, 1), "dropped": dict(self.dropped),
                "healthy": (alive or self._closing) and not stuck}  # fmt: skip

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, let those in flight finish for at most ``timeout`` seconds (default
        ``drain_timeout_s``), then fail what is left and stop the worker."""
        timeout = self.config.drain_timeout_s if timeout is None else timeout
        with self._cond:
            self._closing = True
            self._drain_until = time.monotonic() + timeout
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=timeout + 5)
        self._fail_all(_shut_down())

    # ------------------------------------------------------------------------------- worker

    def _start_worker(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        if self._thread is not None:  # it died (should not happen: the loop is guarded)
            log.error("%s thread had died; restarting it", self.label)
            self.restarts += 1
            self._worker_died()
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.last_beat = time.monotonic()
            try:
                if not self._iteration():
                    break
            except Exception as err:  # noqa: BLE001 - the worker survives anything a request causes
                log.exception("%s: unexpected error; failing the requests in flight and going on", self.label)
                self.restarts += 1
                self._fail_in_flight(err)
        self._fail_all(_shut_down())

    def _live(self, item, now: float) -> bool:
        """False (and the request answered, unless cancelled) when its client left or its deadline passed."""
        if item.future.cancelled():
            self._dropped(item, None)
            return False
        if now > item.deadline:
            self._dropped(item, DeadlineExceeded(f"deadline passed after {(now - item.arrival) * 1e3:.0f} ms in the queue"))
            return False
        return True

    def _dropped(self, item, err: Exception | None) -> None:
        self.dropped["cancelled" if err is None else "deadline"] += 1
        if err is not None:
            _resolve(item.future, error=err)

    def _waited(self, start: float, arrival: float) -> None:
        """Fold one request's wait (arrival to its first pass at ``start``) into the recent queue delay."""
        self._queue_delay = 0.8 * self._queue_delay + 0.2 * (start - arrival)


def _internal_error(err: Exception) -> RuntimeError:
    return RuntimeError(f"internal error while serving this request: {err!r}")


def _shut_down() -> ShuttingDown:
    return ShuttingDown("the server shut down before this request was answered; retry it (on another replica, or "
                        "here once the server is back)", retry_after=1.0)  # fmt: skip


def _resolve(future: Future, result: object = None, error: Exception | None = None) -> None:
    """Set a future's outcome unless it is already done or cancelled (the client went away)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


__all__ = ["GuardedWorker"]
