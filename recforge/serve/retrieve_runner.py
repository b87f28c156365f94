"""The batching worker of `/v1/retrieve`: one thread that owns a ``Retriever`` and serves queued requests
in batches (several requests, one ``Retriever.run``: one encoder pass, one beam search, one host copy).

The design is ``runner.BatchRunner``'s, without its scheduler (a retrieve request is one pass, not a
sequence of prefill chunks): a batch waits at most ``max_wait_ms`` for more requests (or until
``Retriever.config.max_batch`` are queued); admission is bounded in time (``OverloadedError``, HTTP 503,
when the batches queued ahead would take longer than ``max_queue_ms`` or than the request's own
deadline); requests past their deadline (``DeadlineExceeded``, 504) or whose future was cancelled (the
client went away) are dropped before their batch runs. ``reload`` serves another ``Retriever`` from the
next batch on: requests queued before it still run on the model that encoded them (their item indices
are that catalogue's), and the retriever's history cache moves to the new one, emptied and tagged with
its version (a late write of the old model is refused). A batch that raises is rerun one request at a
time, so a failing request fails alone; an unexpected worker error fails the batch and the loop goes on.

Example:
    >>> runner = RetrieveRunner(retriever, SchedulerConfig(max_wait_ms=2))
    >>> future = runner.submit(retriever.encode(RetrieveRequest([12, 7, 99], k=10)), deadline=time.monotonic() + 1)
    >>> future.result().items
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from recforge.generate import EncodedRetrieve, Retriever, RetrieveResult
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.worker import GuardedWorker, _internal_error, _resolve


@dataclass(eq=False)
class Pending:
    """One retrieve request in the queue."""

    req: EncodedRetrieve
    deadline: float  # time.monotonic() after which the answer is useless
    retriever: Retriever  # the model that encoded it (and runs it)
    arrival: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)


class RetrieveRunner(GuardedWorker):
    """The worker thread that batches retrieve requests (see the module docstring).

    Of ``config`` (the serve config's ``scheduler:`` section) it reads ``max_wait_ms``, ``max_queue``,
    ``max_queue_ms``, ``drain_timeout_s`` and ``stall_seconds``; the batch size is the retriever's
    ``config.max_batch``. ``on_pass(requests, seconds)`` is called after every batch (for metrics).
    """

    label, thread_name = "retrieve worker", "recforge-retrieve-runner"

    def __init__(self, retriever: Retriever, config: SchedulerConfig | None = None,
                 on_pass: Callable[[int, float], None] | None = None) -> None:  # fmt: skip
        super().__init__(config)
        self.retriever, self.on_pass = retriever, on_pass
        self.max_batch = retriever.config.max_batch
        self._incoming: deque[Pending] = deque()
        self._running: list[Pending] = []
        self._pass_seconds = 0.0  # seconds per batch, exponentially weighted (0 before the first)
        self._start_worker()

    def submit(self, req: EncodedRetrieve, deadline: float | None = None, retriever: Retriever | None = None) -> Future:
        """Queue an encoded request; the future resolves to a ``RetrieveResult`` or raises (``DeadlineExceeded``,
        the engine's error). Cancelling the future drops the request. ``OverloadedError`` when refused.
        ``retriever``: the one that encoded ``req`` (default: the live one), which runs it."""
        now = time.monotonic()
        deadline = math.inf if deadline is None else deadline
        with self._cond:
            self._admit(now, deadline, self._pass_seconds)
            item = Pending(req, deadline, retriever or self.retriever, now)
            self._incoming.append(item)
            self._cond.notify()
        return item.future

    def reload(self, retriever: Retriever) -> None:
        """Serve ``retriever`` (a new model, with its own ``version``) from the next batch on; the live one's
        history cache moves to it, emptied for the new version (see the module docstring)."""
        with self._cond:
            cache = self.retriever.cache
            if cache is not None and retriever.cache is None:
                cache.invalidate(retriever.version)
                retriever.cache = cache
            self.retriever = retriever

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

    def _waiting(self) -> list[Pending]:
        return [*list(self._incoming), *self._running]

    # ------------------------------------------------------------------------------- worker

    def _fail_in_flight(self, err: Exception) -> None:
        for item in self._running:
            _resolve(item.future, error=_internal_error(err))
        self._running = []

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

    def _run(self, batch: list[Pending]) -> None:
        start = time.monotonic()
        for item in batch:
            self._waited(start, item.arrival)
        t0 = time.perf_counter()
        outcomes: list[RetrieveResult | Exception] = []
        groups: dict[int, list[Pending]] = {}  # one group per model; one group unless a reload came in between
        for item in batch:
            groups.setdefault(id(item.retriever), []).append(item)
        batch = [item for group in groups.values() for item in group]
        for group in groups.values():
            try:
                outcomes += group[0].retriever.run([item.req for item in group])
            except Exception:  # noqa: BLE001 - isolate: rerun each request alone, fail only those that raise
                outcomes += [self._run_alone(item) for item in group]
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
            return item.retriever.run([item.req])[0]
        except Exception as err:  # noqa: BLE001 - reported on this request only
            return err

    def _fail_all(self, err: Exception) -> None:
        with self._cond:
            waiting = [*self._incoming, *self._running]
            self._incoming.clear()
        for item in waiting:
            _resolve(item.future, error=err)


__all__ = ["Pending", "RetrieveRunner"]
