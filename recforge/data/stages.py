"""The stages behind ``Pipeline``: each turns a stream of items (RecordBatch + its row ids) into another.

Kept apart from ``pipeline.py`` (the public chain and the reader) so each file holds one job.
Every stage works on whole batches; none loops over rows in Python.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from recforge.data.arrow import pc  # pyarrow.compute, imported on first use
from recforge.data.collate import row_ids_of
from recforge.data.token_batching import token_budget_cuts


CURRENT_TASK = threading.local()  # the random generator of the task running in this thread (see ``task_rng``)


def task_rng() -> np.random.Generator:
    """The random generator of the reader task running now, for randomness in ``map``/``filter`` functions
    (augmentation, sampling). Seeded by ``(seed, epoch, resumes, rank, task index)``: different every
    epoch, the same for the same seed and resumed state, whatever the number or kind of workers.

    Raises:
        RuntimeError: called outside a pipeline's map or filter function.
    """
    rng = getattr(CURRENT_TASK, "rng", None)
    if rng is None:
        raise RuntimeError("task_rng() is only available inside a Pipeline map/filter function while it runs in a reader task")
    return rng


@dataclass
class Item:
    """What flows between stages: the payload and the row ids it carries (for exactly-once marking)."""

    data: Any  # a RecordBatch until collate, then whatever collate returns
    row_ids: np.ndarray


@dataclass(frozen=True)
class Stage:
    """One link of the chain: its kind and its argument (function, buffer size, batch spec...)."""

    kind: str  # map | filter | shuffle | batch | collate | prefetch | take
    arg: Any = None
    token_lengths: Any = None  # a map's effect on per-row list lengths (see ``Pipeline.map``), for rank shares


def apply_row_stages(rb: pa.RecordBatch, stages: tuple[Stage, ...]) -> pa.RecordBatch:
    """Run ``map``/``filter`` stages on one RecordBatch (in a reader thread or a Ray task)."""
    for stage in stages:
        if stage.kind == "map":
            rb = stage.arg(rb)
            if not isinstance(rb, pa.RecordBatch):
                raise ValueError(f"map function {stage.arg!r} returned {type(rb).__name__}, expected a pyarrow.RecordBatch")
        else:
            mask = stage.arg(rb)
            rb = rb.filter(mask if isinstance(mask, (pa.Array, pa.ChunkedArray)) else pa.array(np.asarray(mask, bool)))
    return rb


def _row_stage(kind: str) -> Callable:
    def run(stream: Iterator[Item], fn: Any, rng: np.random.Generator) -> Iterator[Item]:
        for item in stream:
            rb = apply_row_stages(item.data, (Stage(kind, fn),))
            if rb.num_rows:
                yield Item(rb, row_ids_of(rb))

    return run


def _shuffle(stream: Iterator[Item], buffer_rows: int, rng: np.random.Generator) -> Iterator[Item]:
    pending: list[pa.RecordBatch] = []
    rows = 0

    def flush() -> Item:
        table = pa.Table.from_batches(pending)
        rb = table.take(pa.array(rng.permutation(table.num_rows))).combine_chunks().to_batches()[0]
        return Item(rb, row_ids_of(rb))

    for item in stream:
        pending.append(item.data)
        rows += item.data.num_rows
        if rows >= buffer_rows:
            yield flush()
            pending, rows = [], 0
    if rows:
        yield flush()


def _lengths(table: pa.Table | pa.RecordBatch, length_column: str) -> np.ndarray:
    col = table.column(length_column)
    # a list column counts its values; an integer column already holds each row's tokens
    return (col if pa.types.is_integer(col.type) else pc.list_value_length(col)).to_numpy()


def full_batch_cuts(rb: pa.RecordBatch, spec: tuple) -> np.ndarray:
    """Cut points of the full batches in ``rb`` (the ``batch`` stage's spec): rows ``[cuts[i], cuts[i+1])``
    are batches; rows from ``cuts[-1]`` on are left over (an under-full batch, to merge with others)."""
    batch_size, token_budget, length_column, max_rows, _ = spec
    n = rb.num_rows
    if batch_size is not None:
        return np.arange(0, n - n % batch_size + 1, batch_size, dtype=np.int64)
    return token_budget_cuts(_lengths(rb, length_column), token_budget, max_rows)[:-1]


class Batcher:
    """Groups incoming RecordBatches into batches of ``batch_size`` rows or ``token_budget`` tokens,
    carrying the under-full rest over to the next ``push`` (``finish`` flushes it)."""

    def __init__(self, spec: tuple) -> None:
        self.batch_size, self.token_budget, self.length_column, self.max_rows, self.drop_last = spec
        self.pending: pa.Table | None = None

    def _cut(self, table: pa.Table, final: bool) -> list[pa.RecordBatch]:
        if self.batch_size is not None:
            cuts = list(range(0, table.num_rows, self.batch_size)) + [table.num_rows]
        else:
            cuts = token_budget_cuts(_lengths(table, self.length_column), self.token_budget, self.max_rows).tolist()
        out = [table.slice(a, b - a) for a, b in itertools.pairwise(cuts[:-1])]
        rest = table.slice(cuts[-2] if len(cuts) > 1 else 0)
        full = self.batch_size is not None and rest.num_rows == self.batch_size
        if full or (final and rest.num_rows and not self.drop_last):
            out.append(rest)
            rest = None
        self.pending = rest if rest is not None and rest.num_rows else None
        return [t.combine_chunks().to_batches()[0] for t in out if t.num_rows]

    def push(self, rb: pa.RecordBatch) -> list[pa.RecordBatch]:
        table = pa.Table.from_batches([rb])
        return self._cut(table if self.pending is None else pa.concat_tables([self.pending, table]), final=False)

    def finish(self) -> list[pa.RecordBatch]:
        if self.pending is None:
            return []
        return self._cut(self.pending, final=True)


def _batch(stream: Iterator[Item], spec: tuple, rng: np.random.Generator) -> Iterator[Item]:
    batcher = Batcher(spec)
    for item in stream:
        for rb in batcher.push(item.data):
            yield Item(rb, row_ids_of(rb))
    for rb in batcher.finish():
        yield Item(rb, row_ids_of(rb))


def _collate(stream: Iterator[Item], fn: Callable, rng: np.random.Generator) -> Iterator[Item]:
    for item in stream:
        yield replace(item, data=fn(item.data))


def _take(stream: Iterator[Item], n: int, rng: np.random.Generator) -> Iterator[Item]:
    if n <= 0:
        return
    for i, item in enumerate(stream):
        yield item
        if i + 1 == n:  # stop before pulling one more item from upstream
            return


_END = object()


def _prefetch(stream: Iterator[Item], depth: int, rng: np.random.Generator) -> Iterator[Item]:
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in stream:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_END)
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer thread
            q.put(err)

    thread = threading.Thread(target=produce, name="recforge-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # the producer thread owns the upstream generator; it returns at its next put


STAGES = {"map": _row_stage("map"), "filter": _row_stage("filter"), "shuffle": _shuffle, "batch": _batch,
           "collate": _collate, "take": _take, "prefetch": _prefetch}  # fmt: skip
