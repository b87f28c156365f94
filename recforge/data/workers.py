"""Reader workers: run the pipeline's per-task work in parallel, hand results back in task order.

A *task* is a group of read units (row groups) that one worker turns into one RecordBatch:
read → map/filter → shuffle → batch cut points (see ``Pipeline``). The consumer receives the
results strictly in task order, so the output does not depend on the number of workers or on
which kind runs them.

Two kinds of workers:

- ``"process"`` (Linux default): forked worker processes (``recforge.data.worker_processes``).
  Everything a task does, including the GIL-holding Python between Arrow calls and the
  shuffle's ``take``, runs outside the consumer's process, so throughput grows with cores. A
  result travels as one Arrow IPC stream in an anonymous shared-memory file (``memfd``) whose
  descriptor is passed over a Unix socket; the consumer maps it and reads the batch zero-copy,
  and the worker reuses the memfd once the consumer has freed its batches. Each worker has at
  most ``depth`` results in flight (credits). Workers exit when the consumer closes its
  sockets, stops, or dies (even by SIGKILL: the socket closes).
- ``"thread"``: a thread pool in the consumer's process (pyarrow releases the GIL while decoding).
  Used where ``fork`` is unavailable, inside daemonic processes, or on request.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from recforge.data.bad_rows import BadRowReport

log = logging.getLogger(__name__)

WORKER_MODES = ("auto", "process", "thread")


@dataclass(frozen=True)
class Task:
    """One unit of worker work: ``units`` index the epoch plan's read units (in shuffled order)."""

    index: int
    units: tuple[int, ...]


@dataclass
class TaskResult:
    """A task's output: its rows (None when all were filtered), and where full batches end.

    Rows ``[cuts[i], cuts[i+1])`` form full batches; rows from ``cuts[-1]`` on are left over
    for the consumer to merge with the next task's leftovers.
    """

    index: int
    batch: pa.RecordBatch | None
    cuts: np.ndarray
    bad_rows: BadRowReport = field(default_factory=BadRowReport)


def resolve_mode(mode: str) -> str:
    """``"auto"`` → ``"process"`` where ``fork`` exists (Linux), else ``"thread"`` (logged once)."""
    if mode not in WORKER_MODES:
        raise ValueError(f"worker_mode must be one of {WORKER_MODES}, got {mode!r}")
    can_fork = "fork" in mp.get_all_start_methods() and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
    if mode == "process" and not can_fork:
        raise ValueError("worker_mode='process' needs fork, memfd_create and send_fds (Linux); use worker_mode='thread'")
    daemonic = mp.current_process().daemon  # e.g. inside a torch DataLoader worker: it may not have children
    if mode == "process" and daemonic:
        raise ValueError("worker_mode='process' cannot start workers from a daemonic process; use worker_mode='thread'")
    if mode == "auto":
        if can_fork and not daemonic:
            return "process"
        if not getattr(resolve_mode, "_logged", False):
            why = "this is a daemonic process" if daemonic else "no fork/memfd here"
            log.info("recforge pipeline: reader workers are threads (%s); decoding scales less with cores", why)
            resolve_mode._logged = True  # type: ignore[attr-defined]
        return "thread"
    return mode


def run_tasks(run: Callable[[Task], TaskResult], tasks: list[Task], num_workers: int, mode: str,
              depth: int = 2) -> Iterator[TaskResult]:  # fmt: skip
    """Run ``run(task)`` for every task on ``num_workers`` workers; yield the results in task order.

    Raises:
        Whatever ``run`` raised for a task (re-raised in the consumer), or ``RuntimeError`` when a
        worker process died without answering (killed, out of memory).
    """
    if not tasks:
        return iter(())
    if resolve_mode(mode) == "thread":
        return _thread_results(run, tasks, num_workers)
    from recforge.data.worker_processes import process_results  # here: that module imports Task from this one

    return process_results(run, tasks, min(num_workers, len(tasks)), depth)


def _thread_results(run: Callable[[Task], TaskResult], tasks: list[Task], num_workers: int) -> Iterator[TaskResult]:
    with ThreadPoolExecutor(num_workers, thread_name_prefix="recforge-read") as pool:
        futures = []
        try:
            for task in tasks:
                futures.append(pool.submit(run, task))
                if len(futures) >= 2 * num_workers:
                    yield futures.pop(0).result()
            while futures:
                yield futures.pop(0).result()
        finally:
            for f in futures:
                f.cancel()
