"""Batching: requests share engine passes under a token budget, long histories are prefilled in chunks.

``Scheduler`` is a pure state machine (no threads, no clocks): ``add`` a request,
``schedule()`` returns the work of the next engine pass, ``update(outputs)`` advances the
requests and returns those that finished. Every pass holds at most ``token_budget`` query
tokens (prefix chunk tokens + candidates). A request's prefix is cut into chunks of at most
``prefill_chunk`` tokens, so a 10,000-event history takes several passes and short requests
ride along in each of them instead of queueing behind it (chunked prefill).

``BatchRunner`` owns the engine on one worker thread: it collects requests for at most
``max_wait_ms`` (or until the budget is full), runs ``engine.run`` on the plan, and resolves
each request's future. Pool lookups and write-backs happen on that thread only.

Example:
    >>> runner = BatchRunner(engine, SchedulerConfig(token_budget=8192, max_wait_ms=2))
    >>> future = runner.submit(engine.encode("u1", history, candidates, timestamp=now))
    >>> future.result().scores
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from recforge.serve.engine import RankEngine, RankResult
from recforge.serve.layout import EncodedRequest, candidate_tokens, prefix_tokens
from recforge.serve.state import PrefixState, WorkItem, copy_state


@dataclass
class SchedulerConfig:
    """Batching limits."""

    token_budget: int = 8192  # query tokens (prefix chunks + candidates) per engine pass
    max_wait_ms: float = 2.0  # how long a pass waits for more requests when its budget is not full
    prefill_chunk: int = 1024  # most prefix tokens of one request in one pass
    max_queue: int = 1024  # requests waiting or running; more are refused (HTTP 503)

    def validate(self) -> None:
        if self.token_budget < 1 or self.prefill_chunk < 1 or self.max_wait_ms < 0 or self.max_queue < 1:
            raise ValueError(f"SchedulerConfig: budgets must be >= 1 and max_wait_ms >= 0; got {self}")


@dataclass
class Sequence:
    """One request in flight."""

    req: EncodedRequest
    future: Future
    arrival: float
    tokens: dict[str, torch.Tensor] | None = None  # prefix tokens
    state: PrefixState | None = None
    reused: int = 0
    scores: list[torch.Tensor] = field(default_factory=list)
    scored: int = 0  # candidates done
    started: float = 0.0

    @property
    def prefix_total(self) -> int:
        return self.tokens["item_ids"].numel()

    @property
    def prefilled(self) -> bool:
        return self.state.length >= self.prefix_total


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

    def add(self, seq: Sequence) -> None:
        """Admit a request: find its cached prefix (if any) and allocate its working state."""
        engine = self.engine
        seq.tokens = prefix_tokens(seq.req, engine.action_encoding)
        state = engine.acquire(seq.req, seq.tokens) if engine.pool is not None else None
        seq.reused = state.length if state is not None else 0
        if state is None or state.capacity < seq.prefix_total:
            fresh = engine.new_state(seq.req, seq.prefix_total)
            if state is not None:
                copy_state(state, fresh)
            state = fresh
        seq.state = state
        if seq.prefilled and engine.pool is not None:  # wholly cached: count the reuse, refresh its LRU place
            engine.release(seq.req, state, seq.reused)
        self.running.append(seq)

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
            elif seq.prefilled and self.engine.pool is not None:
                self.engine.release(seq.req, seq.state, seq.reused)
        for seq in done:
            self.running.remove(seq)
        return done

    def fail(self, seq: Sequence) -> None:
        self.running.remove(seq)


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
        self._incoming: deque[Sequence] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._paused = threading.Lock()  # held by reload(): no pass runs while weights change
        self._thread = threading.Thread(target=self._loop, name="recforge-batch-runner", daemon=True)
        self._thread.start()

    def submit(self, req: EncodedRequest) -> Future:
        """Queue a validated request; the future resolves to a ``RankResult`` (or raises)."""
        future: Future = Future()
        with self._cond:
            if len(self._incoming) + len(self.scheduler.running) >= self.config.max_queue:
                raise OverloadedError(f"{self.config.max_queue} requests already queued; retry later")
            self._incoming.append(Sequence(req, future, time.perf_counter()))
            self._cond.notify()
        return future

    def pending(self) -> int:
        return len(self._incoming) + len(self.scheduler.running)

    def reload(self, run_dir) -> None:
        """Swap in a newly exported model between passes (caches are invalidated by the version)."""
        with self._paused:
            self.engine.reload(run_dir)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _incoming_tokens(self) -> int:
        return sum(s.req.items.numel() + s.req.num_candidates for s in self._incoming)

    def _loop(self) -> None:
        sched, wait_s = self.scheduler, self.config.max_wait_ms / 1e3
        while True:
            with self._cond:
                while not self._stop and not self._incoming and not sched.running:
                    self._cond.wait()
                if self._stop:
                    break
                if not sched.running:  # a fresh batch: give others max_wait to join unless the budget is full
                    deadline = time.perf_counter() + wait_s
                    while self._incoming_tokens() < self.config.token_budget and not self._stop:
                        left = deadline - time.perf_counter()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                arrivals = list(self._incoming)
                self._incoming.clear()
            with self._paused:
                if not self.engine.cached:  # no prefix cache to share: the full forward pass per request
                    for seq in arrivals:
                        if seq.future.set_running_or_notify_cancel():
                            try:
                                seq.future.set_result(self.engine.rank_encoded(seq.req))
                            except Exception as err:  # noqa: BLE001
                                seq.future.set_exception(err)
                    continue
                for seq in arrivals:
                    if seq.future.set_running_or_notify_cancel():
                        try:
                            sched.add(seq)
                        except Exception as err:  # noqa: BLE001 - reported on this request only
                            seq.future.set_exception(err)
                if sched.running:
                    self._step()
        for seq in list(sched.running) + list(self._incoming):
            if not seq.future.done():
                seq.future.set_exception(RuntimeError("server shutting down"))

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
        ok = [(pair, out) for pair, out in zip(plan.work, outputs) if not isinstance(out, Exception)]
        for (seq, _), out in zip(plan.work, outputs):
            if isinstance(out, Exception):
                sched.fail(seq)
                seq.future.set_exception(out)
        done = sched.update(Plan([pair for pair, _ in ok]), [out for _, out in ok])
        if self.on_pass is not None:
            self.on_pass(len({id(seq) for seq, _ in plan.work}), plan.num_tokens, seconds)
        for seq in done:
            result = RankResult(torch.cat(seq.scores), self.engine.tasks, seq.reused, seq.state.length - seq.reused,
                                seq.req.truncated, {"queue_and_compute": (time.perf_counter() - seq.arrival) * 1e3})  # fmt: skip
            seq.future.set_result(result)


class OverloadedError(RuntimeError):
    """The queue is full."""


__all__ = ["BatchRunner", "OverloadedError", "Plan", "Scheduler", "SchedulerConfig", "Sequence"]
