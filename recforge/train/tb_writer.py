"""TensorBoard scalars written off the training thread.

``torch.utils.tensorboard`` takes ~0.15-0.2 s to import (TensorBoard's protobufs, absl) and every
``add_scalar`` encodes and queues an event. ``BackgroundSummaryWriter`` starts one thread that imports
and opens torch's ``SummaryWriter`` while the run goes on, then writes the scalars handed to it in order;
each keeps the wall time of its ``add_scalar`` call, so the event file is what torch's writer would have
written. ``close`` writes everything still queued; a failure is raised by the next ``add_scalar`` or by
``close`` (the log directory is created at construction, so an unwritable one fails at once). A fork (the
data pipeline's worker processes) waits until the thread's imports are done: a child must not inherit a
module lock the thread held mid-import.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

_DONE = object()


class BackgroundSummaryWriter:
    """The ``add_scalar`` / ``close`` of ``torch.utils.tensorboard.SummaryWriter(log_dir)``, run on a thread."""

    def __init__(self, log_dir: str | Path) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)  # an unwritable place fails here, not minutes later
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self._imported = threading.Event()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=self._imported.wait)  # only the Event is kept by the hook
        self._thread = threading.Thread(target=self._run, args=(str(log_dir),), name="recforge-tensorboard", daemon=True)
        self._thread.start()

    def _run(self, log_dir: str) -> None:
        writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread by add_scalar / close
            self._error = err
        finally:
            self._imported.set()
        while (item := self._queue.get()) is not _DONE:
            if writer is not None and self._error is None:
                try:
                    writer.add_scalar(*item)
                except BaseException as err:  # noqa: BLE001 - as above
                    self._error = err
        if writer is not None:
            try:
                writer.close()
            except BaseException as err:  # noqa: BLE001 - as above
                self._error = self._error or err

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing TensorBoard scalars failed: {type(self._error).__name__}: {self._error}") from self._error

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Queue one scalar (written with this call's wall time)."""
        if self._closed:
            raise RuntimeError("add_scalar after close: this TensorBoard writer is closed")
        self._raise()
        self._queue.put((tag, value, step, time.time()))

    def close(self) -> None:
        """Write what is queued, close the event file and stop the thread (idempotent)."""
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()
        self._raise()
