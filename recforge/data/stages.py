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
import pyarrow.compute as pc

from recforge.data.collate import row_ids_of
from recforge.data.token_batching import token_budget_cuts


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


def _batch(stream: Iterator[Item], spec: tuple, rng: np.random.Generator) -> Iterator[Item]:
    batch_size, token_budget, length_column, max_rows, drop_last = spec
    pending: pa.Table | None = None

    def cut(table: pa.Table, final: bool) -> tuple[list[pa.RecordBatch], pa.Table | None]:
        if batch_size is not None:
            cuts = list(range(0, table.num_rows, batch_size)) + [table.num_rows]
        else:
            col = table.column(length_column)
            # a list column counts its values; an integer column already holds each row's tokens
            lengths = (col if pa.types.is_integer(col.type) else pc.list_value_length(col)).to_numpy()
            cuts = token_budget_cuts(lengths, token_budget, max_rows).tolist()
        out = []
        for a, b in itertools.pairwise(cuts[:-1]):
            out.append(table.slice(a, b - a))
        a = cuts[-2] if len(cuts) > 1 else 0
        rest = table.slice(a)
        full = batch_size is not None and rest.num_rows == batch_size
        if full or (final and rest.num_rows and not drop_last):
            out.append(rest)
            rest = None
        return [t.combine_chunks().to_batches()[0] for t in out if t.num_rows], rest

    for item in stream:
        table = pa.Table.from_batches([item.data]) if pending is None else pa.concat_tables([pending, pa.Table.from_batches([item.data])])
        ready, pending = cut(table, final=False)
        for rb in ready:
            yield Item(rb, row_ids_of(rb))
    if pending is not None and pending.num_rows:
        ready, _ = cut(pending, final=True)
        for rb in ready:
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
