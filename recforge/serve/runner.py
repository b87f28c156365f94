"""The batching worker: one thread that owns the engine, turns queued requests into engine passes
(``Scheduler``) and resolves each request's future.

It collects requests for at most ``max_wait_ms`` (or until the token budget is full), runs
``engine.run`` on each plan and answers the requests that finished. The worker is guarded: a
request that fails fails alone, an unexpected error fails the requests in flight and the loop
goes on, and a dead thread is restarted. Admission is bounded in time: a request is refused
(``OverloadedError``, HTTP 503) when the work queued ahead of it would take longer than
``max_queue_ms`` or than its own deadline. Requests past their deadline or whose future was
cancelled (the client went away) are dropped before every pass. ``check_admission`` asks the same
question from a request's sizes alone (the engine process refuses before decoding); ``stats`` reads
cumulative counters (admissions, refusals, passes, tokens, the worker's CPU, pass and idle seconds).

A reload builds a new engine: ``reload`` loads and probes a complete ``RankEngine`` of the new
model on the calling thread, beside the live one, which it never touches (so a failure changes
nothing); the worker then stops admitting requests, lets those in flight finish on the old engine,
and swaps: the new engine, a new scheduler, the KV-cache pool invalidated for the new version (or
a new pool when the model's key/value shapes changed). The device holds both models (and both
pools, when the shapes changed) from the build until the swap.

Example:
    >>> runner = BatchRunner(engine, SchedulerConfig(token_budget=8192, max_wait_ms=2))
    >>> future = runner.submit(engine.encode("u1", history, candidates, timestamp=now), deadline=time.monotonic() + 1)
    >>> future.result().scores
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import replace
from collections.abc import Callable
from concurrent.futures import Future

import torch

from recforge.serve.cache_manager import successor_pool
from recforge.serve.engine import RankEngine, RankResult
from recforge.serve.kv_pool import KVCachePool
from recforge.serve.layout import EncodedRequest
from recforge.serve.scheduler import OverloadedError, Plan, Scheduler, SchedulerConfig, Sequence, StaleEncoding
from recforge.serve.worker import GuardedWorker, _internal_error, _resolve


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


class BatchRunner(GuardedWorker):
    """The worker thread that batches requests into engine passes (see the module docstring).

    ``on_pass(requests, tokens, seconds)`` is called after every pass (for metrics). ``engine`` is the
    live engine: a reload replaces the object, so read it from here rather than keeping one.
    """

    label, thread_name = "batch worker", "recforge-batch-runner"

    def __init__(self, engine: RankEngine, config: SchedulerConfig | None = None,
                 on_pass: Callable[[int, int, float], None] | None = None) -> None:  # fmt: skip
        super().__init__(config)
        self.engine = engine
        self.scheduler = Scheduler(engine, self.config)
        self.on_pass = on_pass
        self._incoming: deque[Sequence] = deque()
        self._incoming_tokens = 0
        self._wait_per_token = 0.0  # recent requests' wait per token queued ahead of them (queued_seconds)
        self._backlog_tokens = 0  # the scheduler's remaining tokens, published by the worker after each pass
        self._cost = _PassCost()
        self._reload: tuple[RankEngine, KVCachePool | None, Future] | None = None
        self._reload_lock = threading.Lock()  # one reload at a time, from its build to its swap
        # cumulative, for telling where the time goes under load (``stats``): admissions, engine passes, and the
        # worker thread's CPU seconds, idle seconds (no work) and batching seconds (waiting max_wait_ms for more)
        self.counters = {"admitted": 0, "refused": 0, "passes": 0, "pass_requests": 0, "pass_tokens": 0,
                         "pass_s": 0.0, "worker_cpu_s": 0.0, "idle_s": 0.0, "batch_wait_s": 0.0}  # fmt: skip
        self._start_worker()

    # ------------------------------------------------------------------------------- callers' side

    def submit(self, req: EncodedRequest, deadline: float | None = None) -> Future:
        """Queue a validated request; the future resolves to a ``RankResult`` or raises (``DeadlineExceeded``,
        the engine's error). ``deadline``: ``time.monotonic()`` after which the answer is useless.
        Cancelling the future drops the request. Raises ``OverloadedError`` when refused."""
        now = time.monotonic()
        deadline = math.inf if deadline is None else deadline
        with self._cond:
            own = self._tokens_estimate(req.items.numel(), req.num_candidates)
            self._admit_counted(now, deadline, own)
            seq = Sequence(req, Future(), now, deadline, tokens_ahead=self._backlog_tokens + self._incoming_tokens)
            self._incoming.append(seq)
            self._incoming_tokens += own
            self._cond.notify()
        return seq.future

    def check_admission(self, events: int, candidates: int, deadline: float | None = None) -> None:
        """``OverloadedError`` when a request of ``events`` history events and ``candidates`` candidates would be
        refused now: what ``submit`` checks, without the request (a caller can refuse before decoding it).
        ``submit`` checks again, so a request admitted here may still be refused there."""
        with self._cond:
            self._admit_counted(time.monotonic(), math.inf if deadline is None else deadline,
                                self._tokens_estimate(events, candidates))  # fmt: skip

    def _admit_counted(self, now: float, deadline: float, own_tokens: float) -> None:
        try:
            self._admit(now, deadline, self._cost.estimate(own_tokens))
        except OverloadedError:
            self.counters["refused"] += 1
            raise

    def _tokens_estimate(self, events: int, candidates: int) -> float:
        pool = self.engine.pool
        if pool is None:
            return events + candidates
        s = pool.stats  # report()'s token_hit_rate, without building the whole report on every admission
        tokens = s.reused_tokens + s.computed_tokens
        return events * (s.computed_tokens / tokens if tokens else 1.0) + candidates

    def stats(self) -> dict[str, float]:
        """The cumulative ``counters`` (a copy) with ``t``, the ``time.monotonic()`` they were read at: the
        difference of two readings over their ``t`` gives rates and busy shares."""
        with self._cond:
            return {**self.counters, "t": time.monotonic()}

    def queued_seconds(self) -> float:
        """How long a new request would wait before its first pass: the queued tokens times the larger of two
        rates, the passes' measured seconds per token (the cost model) and the wait recent requests actually had
        per token queued ahead of them at admission (which also sees what the cost model misses: per-request
        host work, a busy host). 0 when nothing is queued.

        Per queued token, not the recent wait itself: the recent wait describes the queue those requests met.
        Once refusals let the queue drain, the estimate falls with it, and admission resumes before the worker
        runs dry (with the recent wait alone, a burst alternated between refusing everything and an idle
        worker)."""
        tokens = self._backlog_tokens + self._incoming_tokens
        if not tokens:
            return 0.0
        return max(self._cost.estimate(tokens), self._wait_per_token * max(tokens, self.config.token_budget))

    def _started(self, seq: Sequence) -> None:
        """Fold a request's wait (arrival to its first pass) into the recent queue delay and the wait per
        queued token (less than a pass's tokens ahead of it: it waited about one pass)."""
        wait = seq.first_pass - seq.arrival
        self._waited(seq.first_pass, seq.arrival)
        ahead = max(seq.tokens_ahead, self.config.token_budget)
        self._wait_per_token = 0.8 * self._wait_per_token + 0.2 * wait / ahead

    def pending(self) -> int:
        return len(self._incoming) + len(self.scheduler)

    def _waiting(self) -> list[Sequence]:
        return [*list(self._incoming), *list(self.scheduler.running)]

    def reload(self, run_dir, timeout: float | None = None) -> str:
        """Serve ``run_dir``'s model: build and probe a new engine on this thread (a failure, ``ValueError``,
        changes nothing), then have the worker drain the requests in flight on the old engine (new ones
        wait) and swap. Returns the new model version; ``RuntimeError`` while another reload runs."""
        if not self._reload_lock.acquire(blocking=False):
            raise RuntimeError("another reload is in progress; retry when it has finished")
        try:
            live = self.engine
            engine = RankEngine.load_checked(run_dir, replace(live.config))
            pool = successor_pool(live.pool, engine)
            done: Future = Future()
            with self._cond:
                if self._closing:
                    raise RuntimeError("the server is shutting down; reload refused")
                if self._reload is not None:  # an earlier call timed out waiting; its swap is still to come
                    raise RuntimeError("another reload is in progress; retry when it has finished")
                self._reload = (engine, pool, done)
                self._cond.notify()
            return done.result(timeout=timeout)
        finally:
            self._reload_lock.release()

    # ------------------------------------------------------------------------------- worker

    def _worker_died(self) -> None:
        self._fail_scheduled(RuntimeError("the batch worker died while this request was in flight"))

    def _fail_in_flight(self, err: Exception) -> None:
        self._fail_scheduled(_internal_error(err))

    def _iteration(self) -> bool:
        """One round: wait for work, admit arrivals, run one pass. False when the worker should exit."""
        cpu = time.thread_time()
        try:
            return self._round()
        finally:
            self.counters["worker_cpu_s"] += time.thread_time() - cpu

    def _round(self) -> bool:
        sched, wait_s, counters = self.scheduler, self.config.max_wait_ms / 1e3, self.counters
        with self._cond:
            t0 = time.monotonic()
            while not self._incoming and not len(sched) and self._reload is None and not self._closing:
                self._cond.wait(timeout=1.0)
                self.last_beat = time.monotonic()
            t1 = time.monotonic()
            counters["idle_s"] += t1 - t0
            if self._closing and (t1 > self._drain_until or not (self._incoming or len(sched))):
                return False
            if not len(sched) and self._reload is None:  # a fresh batch: let others join for max_wait
                deadline = t1 + wait_s
                while self._incoming_tokens < self.config.token_budget and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                counters["batch_wait_s"] += time.monotonic() - t1
            # read once under the lock: a reload arriving after this point waits for the next round, so
            # arrivals taken here are always admitted (only the worker clears ``_reload``)
            reloading = self._reload is not None
            arrivals = [] if reloading else list(self._incoming)
            if arrivals:
                counters["admitted"] += len(arrivals)
                self._incoming.clear()
                self._backlog_tokens += self._incoming_tokens  # still queued work, until the scheduler recounts it
                self._incoming_tokens = 0
        now = time.monotonic()
        if reloading and not len(sched):
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
        """False (and the request answered) when it was cancelled, its deadline passed while queued, or it was
        encoded for a model whose vocabulary the live one does not share (a reload happened meanwhile)."""
        if not seq.future.cancelled() and seq.req.encoding and seq.req.encoding != self.engine.encoding:
            _resolve(seq.future, error=StaleEncoding(
                "the model was reloaded with another vocabulary or limits while this request waited; retry it"))
            return False
        return super()._live(seq, now)

    def _resolve_failed(self) -> None:
        failed, self.scheduler.failed = self.scheduler.failed, []
        for seq, err in failed:
            _resolve(seq.future, error=err)

    def _run_alone(self, seq: Sequence) -> None:
        seq.first_pass = time.monotonic()
        self._started(seq)
        t0 = time.perf_counter()
        try:
            result = self.engine.rank_encoded(seq.req)
        except Exception as err:  # noqa: BLE001
            _resolve(seq.future, error=err)
            return
        seconds = time.perf_counter() - t0
        tokens = seq.req.items.numel() + seq.req.num_candidates
        self._cost.observe(tokens, seconds)
        self._count_pass(1, tokens, seconds)
        result.timings_ms["queue_and_compute"] = (time.monotonic() - seq.arrival) * 1e3
        _resolve(seq.future, result)
        if self.on_pass is not None:
            self.on_pass(1, tokens, seconds)

    def _step(self) -> None:
        sched = self.scheduler
        plan = sched.schedule()
        t0 = time.perf_counter()
        try:
            outputs = self.engine.run(plan.items)
        except Exception:  # noqa: BLE001 - isolate: rerun each request's item alone, fail only those that raise
            outputs = []
            for _seq, item in plan.work:
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
                self._started(seq)
        ok = [(pair, out) for pair, out in zip(plan.work, outputs) if not isinstance(out, Exception)]
        for (seq, _), out in zip(plan.work, outputs):
            if isinstance(out, Exception):
                sched.remove(seq)
                _resolve(seq.future, error=out)
        done = sched.update(Plan([pair for pair, _ in ok]), [out for _, out in ok])
        self._resolve_failed()
        requests = len({id(seq) for seq, _ in plan.work})
        self._count_pass(requests, plan.num_tokens, seconds)
        if self.on_pass is not None:
            self.on_pass(requests, plan.num_tokens, seconds)
        for seq in done:
            result = RankResult(torch.cat(seq.scores), self.engine.tasks, seq.reused, seq.state.length - seq.reused,
                                seq.req.truncated, {"queue_and_compute": (time.monotonic() - seq.arrival) * 1e3},
                                seq.state.version)  # fmt: skip
            _resolve(seq.future, result)

    def _count_pass(self, requests: int, tokens: int, seconds: float) -> None:
        counters = self.counters
        counters["passes"] += 1
        counters["pass_requests"] += requests
        counters["pass_tokens"] += tokens
        counters["pass_s"] += seconds

    def _apply_reload(self) -> None:
        """The swap, on the worker with nothing in flight: nothing here can fail halfway."""
        engine, pool, done = self._reload
        old = self.engine
        if pool is not None and pool.version != engine.version:  # the live pool reused: every entry is the old model's
            pool.invalidate(engine.version)
        engine.pool, old.pool = pool, None  # the retired engine keeps no cache (its pages may be the new one's)
        self.engine = engine
        self.scheduler = Scheduler(engine, self.config)
        with self._cond:
            self._reload = None
        _resolve(done, engine.version)

    def _fail_scheduled(self, err: Exception) -> None:
        """Fail every admitted request (after an unexpected error their states cannot be trusted)."""
        sched = self.scheduler
        for seq in [*sched.running, *(s for q in sched.blocked.values() for s in q)]:
            _resolve(seq.future, error=err)
        self.scheduler = Scheduler(self.engine, self.config)
        self._backlog_tokens = 0  # else the failed requests' work stays in queued_seconds: an idle worker refusing all

    def _fail_all(self, err: Exception) -> None:
        with self._cond:
            waiting = list(self._incoming)
            self._incoming.clear()
            self._incoming_tokens = 0
            reload = self._reload
        for seq in waiting:
            _resolve(seq.future, error=err)
        if reload is not None:
            _resolve(reload[2], error=err)
        self._fail_scheduled(err)



__all__ = ["BatchRunner"]
