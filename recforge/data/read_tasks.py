"""How one epoch of a rank's share is split into worker tasks, what a task does, and how the
consumer turns task results back into a stream of items.

::

    plan: units (row groups, shuffled order) ──group to >= window rows──► tasks
    worker, per task: read units → map/filter → shuffle rows (seeded by task) → full-batch cuts
    consumer: full batches as zero-copy slices, in task order; each task's under-full rest goes
              through one ``Batcher`` (so batch counts per epoch stay as with one stream)

The leading ``map``/``filter`` stages, the first ``shuffle`` right after them and the first
``batch`` right after those run in the workers; the rest of the chain runs in the consumer.
A task's shuffle is seeded by ``(seed, epoch, resumes, rank, task index)``: the order does not
depend on the number or kind of workers. So is its ``task_rng()`` (``recforge.data.stages``) for
map/filter functions and, in worker processes, the global ``random``/``numpy.random``/``torch``
generators: a forked worker would otherwise start every epoch from the parent's state and draw
the same "random" augmentation every epoch, and in every worker.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from recforge.data.bad_rows import BadRowReport, RowRules, check_rows
from recforge.data.collate import row_ids_of
from recforge.data.parquet_source import ParquetSource, ReadUnit, one_batch
from recforge.data.stages import CURRENT_TASK, Batcher, Item, Stage, apply_row_stages, full_batch_cuts
from recforge.data.workers import Task, TaskResult

DEFAULT_TASK_ROWS = 8192  # without a shuffle window, tasks still group row groups to amortise hand-over costs


@dataclass(frozen=True)
class WorkerPlan:
    """The part of a stage chain that runs inside the workers, and the rest."""

    row_stages: tuple[Stage, ...]  # leading map/filter stages
    shuffle_rows: int | None  # the first shuffle's window, when it directly follows them
    batch_spec: tuple | None  # the first batch's spec, when it directly follows those
    consumer_stages: tuple[Stage, ...]
    fused_collate: Any = None  # a collate right after that batch, with ``collate_slices`` (e.g. JaggedCollate)

    @staticmethod
    def split(stages: tuple[Stage, ...]) -> WorkerPlan:
        n = 0
        while n < len(stages) and stages[n].kind in ("map", "filter"):
            n += 1
        row_stages, shuffle_rows, batch_spec = stages[:n], None, None
        if n < len(stages) and stages[n].kind == "shuffle":
            shuffle_rows, n = stages[n].arg, n + 1
        if n < len(stages) and stages[n].kind == "batch":
            batch_spec, n = stages[n].arg, n + 1
            if n < len(stages) and stages[n].kind == "collate" and hasattr(stages[n].arg, "collate_slices"):
                return WorkerPlan(row_stages, shuffle_rows, batch_spec, stages[n + 1 :], stages[n].arg)
        return WorkerPlan(row_stages, shuffle_rows, batch_spec, stages[n:])

    @property
    def task_rows(self) -> int:
        return self.shuffle_rows if self.shuffle_rows is not None else DEFAULT_TASK_ROWS


def make_tasks(keep: list[np.ndarray], task_rows: int) -> list[Task]:
    """Group consecutive units until each group holds at least ``task_rows`` rows to read."""
    tasks, current, rows = [], [], 0
    for i, k in enumerate(keep):
        current.append(i)
        rows += int(k.sum())
        if rows >= task_rows:
            tasks.append(Task(len(tasks), tuple(current)))
            current, rows = [], 0
    if current:
        tasks.append(Task(len(tasks), tuple(current)))
    return tasks


@dataclass
class TaskRunner:
    """Runs one task (in a worker thread or a forked worker process). Picklable-free by design:
    process workers inherit it through ``fork``, so map/filter functions may be lambdas."""

    source: ParquetSource
    units: list[ReadUnit]
    keep: list[np.ndarray]
    rules: RowRules | None
    plan: WorkerPlan
    shuffle_seed: tuple[int, ...]  # (seed, epoch, resumes, rank); the task index is appended
    use_threads: bool = True  # Arrow's decode threads; off in worker processes (one core each)
    seed_globals: bool = False  # in a worker process: seed random, numpy.random and torch per task too

    def __call__(self, task: Task) -> TaskResult:
        seeds = np.random.SeedSequence([*self.shuffle_seed, task.index, 1])  # apart from the shuffle's stream
        CURRENT_TASK.rng = np.random.default_rng(seeds)
        if self.seed_globals:
            a, b = (int(x) for x in seeds.generate_state(2))
            random.seed(a << 32 | b)
            np.random.seed(a)  # noqa: NPY002 - maps written against the legacy global generator
            if "torch" in sys.modules:  # the CPU generator only: CUDA is never touched in a forked worker
                sys.modules["torch"].default_generator.manual_seed(a << 32 | b)
        try:
            return self._run(task)
        finally:
            CURRENT_TASK.rng = None

    def _run(self, task: Task) -> TaskResult:
        report = BadRowReport()
        parts = []
        for i in task.units:
            rb = self.source.read(self.units[i], self.use_threads)
            if not self.keep[i].all():
                rb = rb.filter(pa.array(self.keep[i]))
            if self.rules is not None:
                rb = check_rows(rb, self.rules, report, self.source.paths)
            rb = apply_row_stages(rb, self.plan.row_stages)
            if rb.num_rows:
                parts.append(rb)
        if not parts:
            return TaskResult(task.index, None, np.zeros(1, np.int64), report)
        table = pa.Table.from_batches(parts)
        if self.plan.shuffle_rows is not None:
            table = table.take(np.random.default_rng([*self.shuffle_seed, task.index]).permutation(table.num_rows))
        rb = one_batch(table)
        row_ids_of(rb)  # a map that dropped the row ids fails here, in the task, with a clear message
        if self.plan.batch_spec is not None:
            cuts = full_batch_cuts(rb, self.plan.batch_spec)
        else:
            cuts = np.array([0, rb.num_rows], np.int64)
        return TaskResult(task.index, rb, cuts, report)


def task_items(results: Iterator[TaskResult], plan: WorkerPlan, bad_rows: BadRowReport, done: list) -> Iterator[Item]:
    """Task results (in task order) → items: full batches as slices, the rests merged by one ``Batcher``."""
    batcher = Batcher(plan.batch_spec) if plan.batch_spec is not None else None
    collate = plan.fused_collate
    for result in results:
        bad_rows.merge(result.bad_rows)
        rb = result.batch
        if rb is None:
            continue
        cuts = result.cuts[np.r_[True, np.diff(result.cuts) > 0]]  # no empty batches
        if collate is not None:  # every full batch of the task collated in one pass over its columns
            row_ids = row_ids_of(rb)
            for a, b, data in zip(cuts[:-1].tolist(), cuts[1:].tolist(), collate.collate_slices(rb, cuts), strict=True):
                yield Item(data, row_ids[a:b])
        else:
            for a, b in itertools.pairwise(cuts.tolist()):
                part = rb.slice(a, b - a)
                yield Item(part, row_ids_of(part))
        rest = int(cuts[-1])
        if batcher is not None and rest < rb.num_rows:
            for part in batcher.push(rb.slice(rest)):
                yield Item(collate(part) if collate is not None else part, row_ids_of(part))
    if batcher is not None:
        for part in batcher.finish():
            yield Item(collate(part) if collate is not None else part, row_ids_of(part))
    done.append(True)
