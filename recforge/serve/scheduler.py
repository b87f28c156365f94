"""Batching: requests share engine passes under a token budget, long histories are prefilled in chunks.

``Scheduler`` is a pure state machine (no threads; the clock is an argument): ``add`` a request,
``schedule()`` returns the work of the next engine pass, ``update(outputs)`` advances the
requests and returns those that finished. Every pass holds at most ``token_budget`` query
tokens (prefix chunk tokens + candidates). A request's prefix is cut into chunks of at most
``prefill_chunk`` tokens, so a 10,000-event history takes several passes and short requests
ride along in each of them instead of queueing behind it (chunked prefill).

Requests for one user are serialised: while one computes the user's prefix, a later request
for the same user waits (``blocked``) and starts once that prefix is written to the KV-cache
pool, so it reuses it and computes only its own new events. The pool's generation check is the
second line: a write-back from a state read before the entry changed is refused.

``BatchRunner`` owns the engine on one worker thread: it collects requests for at most
``max_wait_ms`` (or until the budget is full), runs ``engine.run`` on the plan, and resolves
each request's future. The worker is guarded: a request that fails fails alone, an unexpected
error fails the requests in flight and the loop goes on, and a dead thread is restarted.
Admission is bounded in time: a request is refused (``OverloadedError``, HTTP 503) when the
work queued ahead of it would take longer than ``max_queue_ms`` or than its own deadline.
Requests past their deadline or whose future was cancelled (the client went away) are dropped
before every pass. Reloads drain: requests in flight finish on the model they started with.

Example:
    >>> runner = BatchRunner(engine, SchedulerConfig(token_budget=8192, max_wait_ms=2))
    >>> future = runner.submit(engine.encode("u1", history, candidates, timestamp=now), deadline=time.monotonic() + 1)
    >>> future.result().scores
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from recforge.serve.engine import RankEngine, RankResult
from recforge.serve.layout import EncodedRequest, candidate_tokens, prefix_tokens
from recforge.serve.state import PrefixState, WorkItem

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    """Batching and admission limits."""

    token_budget: int = 8192  # query tokens (prefix chunks + candidates) per engine pass
    max_wait_ms: float = 2.0  # how long a pass waits for more requests when its budget is not full
    prefill_chunk: int = 1024  # most prefix tokens of one request in one pass
    max_queue: int = 1024  # requests waiting or running; more are refused (HTTP 503)
    max_queue_ms: float = 500.0  # refuse a request when the work queued ahead of it would take longer (HTTP 503)
    drain_timeout_s: float = 10.0  # shutdown: how long requests in flight may take to finish
    stall_seconds: float = 30.0  # /health turns unhealthy when work waits and no pass ran for this long

    def validate(self) -> None:
        problems = [f"{name} must be >= 1, got {getattr(self, name)}" for name in ("token_budget", "prefill_chunk", "max_queue")
                    if getattr(self, name) < 1]  # fmt: skip
        problems += [f"{name} must be >= 0, got {getattr(self, name)}" for name in ("max_wait_ms", "drain_timeout_s")
                     if getattr(self, name) < 0]  # fmt: skip
        problems += [f"{name} must be > 0, got {getattr(self, name)}" for name in ("max_queue_ms", "stall_seconds")
                     if not getattr(self, name) > 0]  # fmt: skip
        if problems:
            raise ValueError("SchedulerConfig: " + "; ".join(problems))


class OverloadedError(RuntimeError):
    """The request was refused before any work: the queue is full, or the server is shutting down.

    ``retry_after``: seconds after which a retry has a fair chance (the HTTP ``Retry-After``)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before it was answered (HTTP 504)."""


@dataclass(eq=False)  # identity, not field-wise equality: sequences hold tensors
class Sequence:
    """One request in flight."""

    req: EncodedRequest
    future: Future
    arrival: float  # time.monotonic()
    deadline: float = math.inf  # time.monotonic() after which the answer is useless
    tokens: dict[str, torch.Tensor] | None = None  # prefix tokens
    state: PrefixState | None = None
    reused: int = 0
    scores: list[torch.Tensor] = field(default_factory=list)
    scored: int = 0  # candidates done
    first_pass: float = 0.0  # time.monotonic() of its first engine pass (0: none yet)

    @property
    def prefix_total(self) -> int:
        return self.tokens["item_ids"].numel()

    @property
    def prefilled(self) -> bool:
        return self.state.length >= self.prefix_total

    @property
    def remaining_tokens(self) -> int:
        prefix = self.prefix_total - self.state.length if self.state is not None else self.req.items.numel()
        return prefix + self.req.num_candidates - self.scored


@dataclass
class Plan:
    """One engine pass: (sequence, work item) pairs, in order."""

    work: list[tuple[Sequence, WorkItem]]

    @property
    def num_tokens(self) -> int:
        return sum(item.size for _, item in self.work)


class Scheduler:
    """FIFO over running requests; each gets at most one chunk (prefix or candidates) per pass."""

    def __init__(self, engine: RankEngine, config: SchedulerConfig) -> None:
        config.validate()
        self.engine = engine
        self.config = config
        self.running: deque[Sequence] = deque()
        self.writers: dict[str, Sequence] = {}  # user -> the request computing that user's prefix
        self.blocked: dict[str, deque[Sequence]] = {}  # user -> later requests waiting for the writer
        self.num_blocked = 0  # kept as a count: other threads read len(scheduler) while this one works
        self.failed: list[tuple[Sequence, Exception]] = []  # started from a blocked queue and failed; resolve them

    def __len__(self) -> int:
        return len(self.running) + self.num_blocked

    def add(self, seq: Sequence) -> None:
        """Admit a request: it starts now, or after the request computing its user's prefix."""
        if seq.req.user in self.writers:
            self.blocked.setdefault(seq.req.user, deque()).append(seq)
            self.num_blocked += 1
        else:
            self._start(seq)

    def _start(self, seq: Sequence) -> None:
        seq.tokens = prefix_tokens(seq.req, self.engine.action_encoding)
        seq.state = self.engine.acquire(seq.req, seq.tokens)
        seq.reused = seq.state.length
        self.running.append(seq)
        if seq.prefilled:  # wholly cached: count the reuse, refresh its LRU place
            self._write_back(seq)
        else:
            self.writers[seq.req.user] = seq

    def _write_back(self, seq: Sequence) -> None:
        if self.engine.pool is not None:
            self.engine.release(seq.req, seq.state, seq.reused)

    def _prefix_done(self, seq: Sequence) -> None:
        """``seq``'s prefix is complete (or abandoned): its user's next request may start."""
        user = seq.req.user
        if self.writers.get(user) is not seq:
            return
        del self.writers[user]
        queue = self.blocked.get(user)
        while queue and user not in self.writers:
            nxt = queue.popleft()
            self.num_blocked -= 1
            try:
                self._start(nxt)
            except Exception as err:  # noqa: BLE001 - reported on that request only
                self.failed.append((nxt, err))
        if queue is not None and not queue:
            del self.blocked[user]

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out (failed, expired or cancelled); its partial prefix is never written back."""
        if seq in self.running:
            self.running.remove(seq)
            self._prefix_done(seq)
            return
        queue = self.blocked.get(seq.req.user)
        if queue is not None and seq in queue:
            queue.remove(seq)
            self.num_blocked -= 1
            if not queue:
                del self.blocked[seq.req.user]

    fail = remove

    def expire(self, now: float) -> list[tuple[Sequence, Exception | None]]:
        """Remove requests past their deadline (with the error to report) or cancelled (None)."""
        out: list[tuple[Sequence, Exception | None]] = []
        for seq in [*self.running, *(s for q in self.blocked.values() for s in q)]:
            if seq.future.cancelled():
                out.append((seq, None))
            elif now > seq.deadline:
                waited = (now - seq.arrival) * 1e3
                out.append((seq, DeadlineExceeded(f"deadline passed after {waited:.0f} ms, before the answer was ready")))
        for seq, _ in out:
            self.remove(seq)
        return out

    def remaining_tokens(self) -> int:
        """Query tokens still to compute for the admitted requests (an upper bound for blocked ones)."""
        return sum(s.remaining_tokens for s in self.running) + sum(s.remaining_tokens for q in self.blocked.values() for s in q)

    def schedule(self) -> Plan:
        budget, chunk_cap = self.config.token_budget, self.config.prefill_chunk
        work: list[tuple[Sequence, WorkItem]] = []
        for seq in self.running:
            left = budget - sum(item.size for _, item in work)
            if left <= 0:
                break
            st = seq.state
            if not seq.prefilled:
                start = st.length
                end = min(seq.prefix_total, start + min(chunk_cap, left))
                if start < st.num_contextual:  # contextual tokens attend both ways: one chunk holds them all
                    end = max(end, min(st.num_contextual, seq.prefix_total))
                feats = {k: v[start:end] for k, v in seq.tokens.items()}
                work.append((seq, WorkItem(st, feats, "prefix", start)))
            else:
                cands = candidate_tokens(seq.req)
                lo = seq.scored
                hi = min(seq.req.num_candidates, lo + max(left, 1))
                work.append((seq, WorkItem(st, {k: v[lo:hi] for k, v in cands.items()}, "targets")))
        return Plan(work)

    def update(self, plan: Plan, outputs: list[torch.Tensor | None]) -> list[Sequence]:
        """Advance after a pass; returns the sequences whose every candidate is scored."""
        done = []
        for (seq, item), out in zip(plan.work, outputs):
            if item.kind == "targets":
                seq.scores.append(out)
                seq.scored += item.size
                if seq.scored >= seq.req.num_candidates:
                    done.append(seq)
            elif seq.prefilled:
                self._write_back(seq)
                self._prefix_done(seq)
        for seq in done:
            self.running.remove(seq)
        return done


class _PassCost:
    """Seconds per query token over recent passes (exponentially weighted), for admission control."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay, self.seconds, self.tokens = decay, 0.0, 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self.seconds = self.decay * self.seconds + seconds
        self.tokens = self.decay * self.tokens + max(tokens, 1)

    def estimate(self, tokens: float) -> float:
        """Seconds to compute ``tokens`` query tokens; 0 before any pass was measured."""
        return tokens * self.seconds / self.tokens if self.tokens else 0.0


class BatchRunner:
    """The worker thread that batches requests into engine passes (see the module docstring).

    ``on_pass(requests, tokens, seconds)`` is called after every pass (for metrics).
    """

    def __init__(self, engine: RankEngine, config: SchedulerConfig | None = None,
                 on_pass: Callable[[int, int, float], None] | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.scheduler = Scheduler(engine, self.config)
        self.on_pass = on_pass
        self.restarts = 0  # unexpected worker errors survived (each failed the requests in flight)
        self.dropped = {"deadline": 0, "cancelled": 0}  # requests dropped before they were answered
        self.last_beat = time.monotonic()  # the worker's last sign of life
        self._incoming: deque[Sequence] = deque()
        self._incoming_tokens = 0
        self._backlog_tokens = 0  # the scheduler's remaining tokens, published by the worker after each pass
        self._cost = _PassCost()
        self._queue_delay = 0.0  # seconds from arrival to first pass, averaged over recent requests
        self._cond = threading.Condition()
        self._closing = False
        self._drain_until = math.inf
        self._reload: tuple[RankEngine, Future] | None = None
        self._thread: threading.Thread | None = None
        self._start_worker()

    # ------------------------------------------------------------------------------- callers' side

    def submit(self, req: EncodedRequest, deadline: float | None = None) -> Future:
        """Queue a validated request; the future resolves to a ``RankResult`` or raises (``DeadlineExceeded``,
        the engine's error). ``deadline``: ``time.monotonic()`` after which the answer is useless.
        Cancelling the future drops the request. Raises ``OverloadedError`` when refused."""
        now = time.monotonic()
        deadline = math.inf if deadline is None else deadline
        with self._cond:
            if self._closing:
                raise OverloadedError("the server is shutting down", retry_after=1.0)
            self._start_worker()
            if len(self._incoming) + len(self.scheduler) >= self.config.max_queue:
                raise OverloadedError(f"{self.config.max_queue} requests already queued; retry later", 1.0)
            own = self._tokens_estimate(req)
            ahead = self.queued_seconds()
            limit = min(self.config.max_queue_ms / 1e3, deadline - now - self._cost.estimate(own))
            if ahead > 0 and ahead > limit:
                raise OverloadedError(
                    f"about {ahead * 1e3:.0f} ms of work is queued ahead of this request, over its limit of "
                    f"{max(limit, 0) * 1e3:.0f} ms (max_queue_ms, or what its deadline leaves); retry later",
                    retry_after=max(1.0, math.ceil(ahead - self.config.max_queue_ms / 1e3)),
                )  # fmt: skip
            seq = Sequence(req, Future(), now, deadline)
            self._incoming.append(seq)
            self._incoming_tokens += own
            self._cond.notify()
        return seq.future

    def _tokens_estimate(self, req: EncodedRequest) -> float:
        pool = self.engine.pool
        miss = 1.0 - (pool.report()["token_hit_rate"] if pool is not None else 0.0)
        return req.items.numel() * miss + req.num_candidates

    def queued_seconds(self) -> float:
        """How long a new request would wait before its first pass: the larger of the queued work's estimated
        time (tokens x measured seconds per token) and the wait recent requests actually had (which also
        sees what the cost model misses: per-request overheads, a busy host). 0 when nothing is queued."""
        if not (self._backlog_tokens or self._incoming_tokens):
            return 0.0
        return max(self._cost.estimate(self._backlog_tokens + self._incoming_tokens), self._queue_delay)

    def pending(self) -> int:
        return len(self._incoming) + len(self.scheduler)

    def health(self) -> dict:
        """Worker liveness: alive, restarts, seconds since its last sign of life, the oldest waiting request's age."""
        now = time.monotonic()
        waiting = [*list(self._incoming), *list(self.scheduler.running)]
        oldest = max((now - s.arrival for s in waiting), default=0.0)
        beat_age = now - self.last_beat
        alive = self._thread is not None and self._thread.is_alive()
        stuck = bool(waiting) and beat_age > self.config.stall_seconds
        return {"worker_alive": alive, "worker_stuck": stuck, "worker_restarts": self.restarts,
                "last_pass_age_s": round(beat_age, 3), "queue_depth": self.pending(),
                "oldest_request_age_ms": round(oldest * 1e3, 1), "dropped": dict(self.dropped),
                "healthy": (alive or self._closing) and not stuck}  # fmt: skip

    def reload(self, run_dir, timeout: float | None = None) -> str:
        """Load ``run_dir``'s model and swap it in once the requests in flight have finished on the old one
        (new requests wait meanwhile). Loading and checking happen first, on the calling thread, so a
        failure (``ValueError``) changes nothing. Returns the new model version."""
        staged = self.engine.stage_reload(run_dir)
        done: Future = Future()
        with self._cond:
            if self._reload is not None:
                raise RuntimeError("another reload is in progress; retry when it has finished")
            self._reload = (staged, done)
            self._cond.notify()
        return done.result(timeout=timeout)

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
        self._fail_all(RuntimeError("the server shut down before this request was answered"))

    # ------------------------------------------------------------------------------- worker

    def _start_worker(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        if self._thread is not None:  # it died (should not happen: the loop is guarded)
            log.error("batch worker thread had died; restarting it")
            self.restarts += 1
            self._fail_scheduled(RuntimeError("the batch worker died while this request was in flight"))
        self._thread = threading.Thread(target=self._loop, name="recforge-batch-runner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.last_beat = time.monotonic()
            try:
                if not self._iteration():
                    break
            except Exception as err:  # noqa: BLE001 - the worker survives anything a request causes
                log.exception("batch worker: unexpected error; failing the requests in flight and going on")
                self.restarts += 1
                self._fail_scheduled(RuntimeError(f"internal error while serving this request: {err!r}"))
        self._fail_all(RuntimeError("the server shut down before this request was answered"))

    def _iteration(self) -> bool:
        """One round: wait for work, admit arrivals, run one pass. False when the worker should exit."""
        sched, wait_s = self.scheduler, self.config.max_wait_ms / 1e3
        with self._cond:
            while not self._incoming and not len(sched) and self._reload is None and not self._closing:
                self._cond.wait(timeout=1.0)
                self.last_beat = time.monotonic()
            if self._closing and (time.monotonic() > self._drain_until or not (self._incoming or len(sched))):
                return False
            if not len(sched) and self._reload is None:  # a fresh batch: let others join for max_wait
                deadline = time.monotonic() + wait_s
                while self._incoming_tokens < self.config.token_budget and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            arrivals = [] if self._reload is not None else list(self._incoming)
            if arrivals:
                self._incoming.clear()
                self._backlog_tokens += self._incoming_tokens  # still queued work, until the scheduler recounts it
                self._incoming_tokens = 0
        now = time.monotonic()
        if self._reload is not None and not len(sched):
            self._apply_reload()
            return True
        arrivals = [seq for seq in arrivals if self._live(seq, now)]
        if not self.engine.cached:  # no prefix cache to share: the full forward pass per request
            for i, seq in enumerate(arrivals):
                self._backlog_tokens = sum(s.req.items.numel() + s.req.num_candidates for s in arrivals[i:])
                if self._live(seq, time.monotonic()):
                    self._run_alone(seq)
            self._backlog_tokens = 0
            return True
        for seq in arrivals:
            try:
                sched.add(seq)
            except Exception as err:  # noqa: BLE001 - reported on this request only
                _resolve(seq.future, error=err)
        for seq, err in sched.expire(time.monotonic()):
            self._dropped(seq, err)
        self._resolve_failed()
        if sched.running:
            self._step()
        self._backlog_tokens = sched.remaining_tokens()
        return True

    def _live(self, seq: Sequence, now: float) -> bool:
        """False (and the request answered) when it was cancelled or its deadline passed while queued."""
        if seq.future.cancelled():
            self._dropped(seq, None)
            return False
        if now > seq.deadline:
            self._dropped(seq, DeadlineExceeded(f"deadline passed after {(now - seq.arrival) * 1e3:.0f} ms in the queue"))
            return False
        return True

    def _dropped(self, seq: Sequence, err: Exception | None) -> None:
        self.dropped["cancelled" if err is None else "deadline"] += 1
        if err is not None:
            _resolve(seq.future, error=err)

    def _resolve_failed(self) -> None:
        failed, self.scheduler.failed = self.scheduler.failed, []
        for seq, err in failed:
            _resolve(seq.future, error=err)

    def _run_alone(self, seq: Sequence) -> None:
        seq.first_pass = time.monotonic()
        self._queue_delay = 0.8 * self._queue_delay + 0.2 * (seq.first_pass - seq.arrival)
        t0 = time.perf_counter()
        try:
            result = self.engine.rank_encoded(seq.req)
        except Exception as err:  # noqa: BLE001
            _resolve(seq.future, error=err)
            return
        seconds = time.perf_counter() - t0
        tokens = seq.req.items.numel() + seq.req.num_candidates
        self._cost.observe(tokens, seconds)
        result.timings_ms["queue_and_compute"] = (time.monotonic() - seq.arrival) * 1e3
        _resolve(seq.future, result)
        if self.on_pass is not None:
            self.on_pass(1, tokens, seconds)

    def _step(self) -> None:
        sched = self.scheduler
        plan = sched.schedule()
        t0 = time.perf_counter()
        try:
            outputs = self.engine.run([item for _, item in plan.work])
        except Exception:  # noqa: BLE001 - isolate: rerun each request's item alone, fail only those that raise
            outputs = []
            for seq, item in plan.work:
                try:
                    outputs.append(self.engine.run([item])[0])
                except Exception as err:  # noqa: BLE001
                    outputs.append(err)
        seconds = time.perf_counter() - t0
        self.last_beat = now = time.monotonic()
        self._cost.observe(plan.num_tokens, seconds)
        for seq, _ in plan.work:
            if not seq.first_pass:
                seq.first_pass = now
                self._queue_delay = 0.8 * self._queue_delay + 0.2 * (now - seq.arrival)
        ok = [(pair, out) for pair, out in zip(plan.work, outputs) if not isinstance(out, Exception)]
        for (seq, _), out in zip(plan.work, outputs):
            if isinstance(out, Exception):
                sched.remove(seq)
                _resolve(seq.future, error=out)
        done = sched.update(Plan([pair for pair, _ in ok]), [out for _, out in ok])
        self._resolve_failed()
        if self.on_pass is not None:
            self.on_pass(len({id(seq) for seq, _ in plan.work}), plan.num_tokens, seconds)
        for seq in done:
            result = RankResult(torch.cat(seq.scores), self.engine.tasks, seq.reused, seq.state.length - seq.reused,
                                seq.req.truncated, {"queue_and_compute": (time.monotonic() - seq.arrival) * 1e3},
                                seq.state.version)  # fmt: skip
            _resolve(seq.future, result)

    def _apply_reload(self) -> None:
        staged, done = self._reload
        try:
            self.engine.apply_reload(staged)
        except Exception as err:  # noqa: BLE001 - reported to the caller of reload()
            _resolve(done, error=err)
        else:
            _resolve(done, self.engine.version)
        finally:
            with self._cond:
                self._reload = None
            self.scheduler = Scheduler(self.engine, self.config)

    def _fail_scheduled(self, err: Exception) -> None:
        """Fail every admitted request (after an unexpected error their states cannot be trusted)."""
        sched = self.scheduler
        for seq in [*sched.running, *(s for q in sched.blocked.values() for s in q)]:
            _resolve(seq.future, error=err)
        self.scheduler = Scheduler(self.engine, self.config)

    def _fail_all(self, err: Exception) -> None:
        with self._cond:
            waiting = list(self._incoming)
            self._incoming.clear()
            self._incoming_tokens = 0
            reload = self._reload
        for seq in waiting:
            _resolve(seq.future, error=err)
        if reload is not None:
            _resolve(reload[1], error=err)
        self._fail_scheduled(err)


def _resolve(future: Future, result: object = None, error: Exception | None = None) -> None:
    """Set a future's outcome unless it is already done or cancelled (the client went away)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


__all__ = ["BatchRunner", "DeadlineExceeded", "OverloadedError", "Plan", "Scheduler", "SchedulerConfig", "Sequence"]
