"""Batching: requests share engine passes under a token budget, long histories are prefilled in chunks.

``Scheduler`` is a pure state machine (no threads; the clock is an argument) and the one home of
chunked prefill and KV-cache bookkeeping: ``add`` a request, ``schedule()`` returns the work of
the next engine pass (a ``Plan``), the engine executes it (``engine.run(plan.items)``) and
``update(plan, outputs)`` advances the requests and returns those that finished. Every pass
holds at most ``token_budget`` query tokens (prefix chunk tokens + candidates). A request's
prefix is cut into chunks of at most ``prefill_chunk`` tokens, so a 10,000-event history takes
several passes and short requests ride along in each of them instead of queueing behind it.

The scheduler owns a ``CacheManager`` (``cache_manager.py``): a request starts from its user's
cached prefix (``acquire``) and writes its new tokens back once its prefix is complete
(``release``). Requests for one user are serialised: while one computes the user's prefix, a
later request for the same user waits (``blocked``) and starts once that prefix is written, so
it reuses it and computes only its own new events. The pool's generation check is the second
line: a write-back from a state read before the entry changed is refused.

``BatchRunner`` (runner.py) drives it on the worker thread; ``prefill_alone`` drives a private one
for the engine's synchronous ``rank``.

Example:
    >>> sched = Scheduler(engine, SchedulerConfig(token_budget=8192))
    >>> sched.add(Sequence(engine.encode("u1", history, candidates), Future(), time.monotonic()))
    >>> plan = sched.schedule(); done = sched.update(plan, engine.run(plan.items))
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from recforge.serve.cache_manager import CacheManager
from recforge.serve.layout import EncodedRequest, candidate_tokens, prefix_layout
from recforge.serve.state import PrefixState, WorkItem

if TYPE_CHECKING:
    from recforge.serve.engine import RankEngine

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

    def problems(self) -> list[str]:
        """Every invalid field, each message starting with the field's name."""
        problems = [f"{name}: must be >= 1, got {getattr(self, name)}" for name in ("token_budget", "prefill_chunk", "max_queue")
                    if getattr(self, name) < 1]  # fmt: skip
        problems += [f"{name}: must be >= 0, got {getattr(self, name)}" for name in ("max_wait_ms", "drain_timeout_s")
                     if getattr(self, name) < 0]  # fmt: skip
        problems += [f"{name}: must be > 0, got {getattr(self, name)}" for name in ("max_queue_ms", "stall_seconds")
                     if not getattr(self, name) > 0]  # fmt: skip
        return problems

    def validate(self) -> None:
        if problems := self.problems():
            raise ValueError("SchedulerConfig: " + "; ".join(problems))


class OverloadedError(RuntimeError):
    """The request was refused before any work: the queue is full, or the server is shutting down.

    ``retry_after``: seconds after which a retry has a fair chance (the HTTP ``Retry-After``)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StaleEncoding(OverloadedError):
    """The request was encoded for a model whose vocabulary or limits the live one does not share (a reload came
    in between): encode it again for the live model (front ends do; HTTP 503 only where no one can)."""


class ShuttingDown(OverloadedError):
    """The server stopped before this request was answered (HTTP 503 + ``Retry-After``: another replica, or
    this one once restarted, can serve it)."""


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
    identity: torch.Tensor | None = None  # (n, 4) their token identities (a view of the same memory)
    state: PrefixState | None = None  # given: the caller's own state to extend (never written to the pool)
    reused: int = 0
    scores: list[torch.Tensor] = field(default_factory=list)
    scored: int = 0  # candidates done
    first_pass: float = 0.0  # time.monotonic() of its first engine pass (0: none yet)
    tokens_ahead: float = 0.0  # tokens queued ahead of it when it was admitted (the runner's delay per token)
    own_state: bool = False  # started from the caller's state (not the pool's)
    counted: int = 0  # its share of ``Scheduler.remaining_tokens()``, as last counted

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
    def items(self) -> list[WorkItem]:
        """What the engine executes (``engine.run(plan.items)``), in order."""
        return [item for _, item in self.work]

    @property
    def num_tokens(self) -> int:
        return sum(item.size for _, item in self.work)


class Scheduler:
    """FIFO over running requests; each gets at most one chunk (prefix or candidates) per pass."""

    def __init__(self, engine: RankEngine, config: SchedulerConfig) -> None:
        config.validate()
        self.engine = engine
        self.config = config
        # an engine without a prefix cache (the full forward pass per request) never has its requests scheduled
        self.cache = CacheManager.for_engine(engine) if engine.cached else None
        self.running: deque[Sequence] = deque()
        self.writers: dict[str, Sequence] = {}  # user -> the request computing that user's prefix
        self.blocked: dict[str, deque[Sequence]] = {}  # user -> later requests waiting for the writer
        self.num_blocked = 0  # kept as a count: other threads read len(scheduler) while this one works
        self.failed: list[tuple[Sequence, Exception]] = []  # started from a blocked queue and failed; resolve them
        self._remaining = 0  # the admitted sequences' ``counted`` tokens, kept as they change (remaining_tokens)

    def __len__(self) -> int:
        return len(self.running) + self.num_blocked

    def add(self, seq: Sequence) -> None:
        """Admit a request: it starts now, or after the request computing its user's prefix."""
        if seq.req.user in self.writers:
            self.blocked.setdefault(seq.req.user, deque()).append(seq)
            self.num_blocked += 1
            self._count(seq, seq.req.items.numel() + seq.req.num_candidates)  # before it starts: an upper bound
        else:
            self._start(seq)

    def _start(self, seq: Sequence) -> None:
        seq.tokens, seq.identity = prefix_layout(seq.req, self.engine.action_encoding)
        num_contextual = seq.req.context_ids.numel()
        if seq.state is None:
            seq.state = self.cache.acquire(seq.req.user, seq.tokens, num_contextual, seq.identity)
        else:  # the caller's own state: extended here, never written back (it was not read from the pool)
            seq.state = self.cache.adopt(seq.state, seq.tokens, num_contextual)
            seq.own_state = True
        seq.reused = seq.state.length
        self.running.append(seq)
        self._count(seq, seq.remaining_tokens)
        if seq.prefilled:  # wholly cached: count the reuse, refresh its LRU place
            self._write_back(seq)
        else:
            self.writers[seq.req.user] = seq

    def _write_back(self, seq: Sequence) -> None:
        if not seq.own_state:
            self.cache.release(seq.req.user, seq.state, seq.reused)

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
            self._count(nxt, 0)
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
            self._count(seq, 0)
            self._prefix_done(seq)
            return
        queue = self.blocked.get(seq.req.user)
        if queue is not None and seq in queue:
            queue.remove(seq)
            self.num_blocked -= 1
            self._count(seq, 0)
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
        """Query tokens still to compute for the admitted requests (an upper bound for blocked ones). O(1): kept up
        to date as requests start, advance (``update``) and leave, not summed over every request per pass."""
        return self._remaining

    def _count(self, seq: Sequence, tokens: int) -> None:
        """``seq`` now counts ``tokens`` in ``remaining_tokens`` (0: it left)."""
        self._remaining += tokens - seq.counted
        seq.counted = tokens

    def schedule(self) -> Plan:
        budget, chunk_cap = self.config.token_budget, self.config.prefill_chunk
        work: list[tuple[Sequence, WorkItem]] = []
        used = 0
        for seq in list(self.running):
            left = budget - used
            if left <= 0:
                break
            st = seq.state
            if not seq.prefilled:
                start = st.length
                end = min(seq.prefix_total, start + min(chunk_cap, left))
                if start < st.num_contextual:  # contextual tokens attend both ways: one chunk holds them all
                    end = max(end, min(st.num_contextual, seq.prefix_total))
                feats = {k: v[start:end] for k, v in seq.tokens.items()}
                work.append((seq, WorkItem(st, feats, "prefix", start, seq.identity[start:end])))
                used += end - start
            else:
                try:  # a request whose values do not fit (a bug or a foreign peer) fails alone, not the pass
                    cands = candidate_tokens(seq.req)
                except Exception as err:  # noqa: BLE001 - reported on this request only
                    self.remove(seq)
                    self.failed.append((seq, err))
                    continue
                lo = seq.scored
                hi = min(seq.req.num_candidates, lo + max(left, 1))
                feats = cands if lo == 0 and hi == seq.req.num_candidates else {k: v[lo:hi] for k, v in cands.items()}
                work.append((seq, WorkItem(st, feats, "targets")))
                used += hi - lo
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
            self._count(seq, seq.remaining_tokens)  # its state or scores advanced
        for seq in done:
            self.running.remove(seq)
            self._count(seq, 0)
        return done


def prefill_alone(engine: RankEngine, req: EncodedRequest, state: PrefixState | None = None,
                  execute: Callable[[list[WorkItem]], list] | None = None) -> Sequence:  # fmt: skip
    """Compute ``req``'s prefix on its own, through a private scheduler: from the user's cached prefix in
    ``engine.pool`` (written back when complete), or from ``state`` (extended, not written back), in
    chunks of ``engine.config.prefill_chunk``. ``execute`` runs each pass (default ``engine.run``).
    Returns the sequence (``state``, ``reused``) ready for its candidates."""
    chunk = engine.config.prefill_chunk
    sched = Scheduler(engine, SchedulerConfig(token_budget=chunk, prefill_chunk=chunk))
    seq = Sequence(req, Future(), time.monotonic(), state=state)
    sched.add(seq)
    execute = execute or engine.run
    while not seq.prefilled:
        plan = sched.schedule()
        sched.update(plan, execute(plan.items))
    return seq


__all__ = ["DeadlineExceeded", "OverloadedError", "Plan", "Scheduler", "SchedulerConfig", "Sequence", "ShuttingDown",
           "StaleEncoding", "prefill_alone"]  # fmt: skip
