"""A step's inputs, prepared ahead: fetch -> build -> host-to-device copy on a side stream.

``StepInputs`` turns an iterator of raw micro-batch lists (sample ids of the memory loader, or
the sample engine's CPU batches) into device batches. With ``prefetch=True`` (``dist.pipeline``)
a background thread prepares step i+1 while step i computes: it pulls the raw inputs, builds the
batches and copies them to the device on a side CUDA stream; the training stream waits on that
copy's event only when it uses the batch. On CPU the same thread runs without streams.

Exactly-once: pulling a batch from the sample engine marks its rows consumed, and the thread
pulls one step ahead, so each prepared step carries ``data_state``, the source's state *right
after its own batches were pulled*; a checkpoint after step i saves step i's ``data_state``,
never the state of batches only prefetched.

Per-stage times of each step (``fetch_s``, ``build_s``, ``h2d_s``) go to ``train_log.jsonl``; with
the pipeline on they are hidden behind compute unless ``data_wait_s`` (the time the training
loop waited for the step) is as large.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

Micro = list[Any | None]  # one step's micro-batches on this rank; None: this rank has no data for it


@dataclass
class StepInput:
    micro: Micro  # device batches (or None)
    data_state: dict | None  # the source's state after these batches were handed out (None: memory loader)
    times: dict[str, float] = field(default_factory=dict)  # fetch_s, build_s, h2d_s of this step
    flops: float = 0.0  # model FLOPs of the step's batches (``count``), counted on the host from the CPU batches


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor inside a batch (dataclass fields, dicts, lists), for ``record_stream``."""
    if torch.is_tensor(obj):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, depth + 1)
    elif depth < 4 and hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            yield from _tensors(value, depth + 1)


class StepInputs:
    """Iterator of ``StepInput``; ``close()`` stops the prefetch thread.

    Args:
        raw: yields each step's raw micro-batch lists (forever: ``[None] * K`` once this rank's data ends).
        build: raw input -> CPU batch (``JaggedBatch``).
        device: the training device.
        snapshot: the source's ``state_dict`` (pipeline loader), None for the memory loader.
        prefetch: prepare the next step in a background thread (``dist.pipeline``).
        count: CPU batch -> its step FLOPs (``recforge.train.flops``), counted while the batch is built.

    Example:
        >>> inputs = StepInputs(raw, build=lambda ids: seqs.training_batch(samples[ids], 200), device=dev,
        ...                     snapshot=None, prefetch=True)
        >>> step_input = next(inputs); runner(step_input.micro)
    """

    def __init__(self, raw: Iterator[Micro], *, build: Callable[[Any], Any], device: torch.device,
                 snapshot: Callable[[], dict] | None, prefetch: bool, count: Callable[[Any], float] | None = None) -> None:  # fmt: skip
        self.raw, self.build, self.device, self.snapshot, self.count = raw, build, device, snapshot, count
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda and prefetch else None
        self._queue: queue.Queue | None = None
        self._peeked: StepInput | None = None
        self._stop = threading.Event()
        if prefetch:
            self._queue = queue.Queue(maxsize=1)  # one step ahead: the next step's data, no more
            self._thread = threading.Thread(target=self._work, name="recforge-step-prefetch", daemon=True)
            self._thread.start()

    def _prepare(self) -> tuple[StepInput, Any]:
        t0 = time.perf_counter()
        raw = next(self.raw)
        state = self.snapshot() if self.snapshot is not None else None
        t1 = time.perf_counter()
        cpu = [self.build(r) if r is not None else None for r in raw]
        flops = sum(self.count(b) for b in cpu if b is not None) if self.count is not None else 0.0
        t2 = time.perf_counter()
        event = None
        if self.stream is not None:  # side stream: the copy overlaps the training stream's kernels
            with torch.cuda.stream(self.stream):
                micro = [b.to(self.device, non_blocking=True) if b is not None else None for b in cpu]
                event = torch.cuda.Event()
                event.record(self.stream)
            event.synchronize()  # blocks this thread only; makes h2d_s the copy's real duration
        else:
            micro = [b.to(self.device) if b is not None else None for b in cpu]
        times = {"fetch_s": t1 - t0, "build_s": t2 - t1, "h2d_s": time.perf_counter() - t2}
        return StepInput(micro, state, times, flops), event

    def _work(self) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)  # a new thread starts on cuda:0, whatever this rank's GPU
            while not self._stop.is_set():
                item = self._prepare()
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # surfaces in the training thread at its next step
            self._queue.put((err, None))

    def __iter__(self) -> StepInputs:
        return self

    def peek(self) -> Micro:
        """The next step's device micro-batches, without handing the step out (prefetch only)."""
        if self._peeked is None:
            self._peeked = self._receive()
        return self._peeked.micro

    def __next__(self) -> StepInput:
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
            return item
        if self._queue is None:
            return self._prepare()[0]
        return self._receive()

    def _receive(self) -> StepInput:
        item, event = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if event is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(event)
            for batch in item.micro:  # memory made on the side stream is now used on the training stream
                for t in _tensors(batch):
                    if t.is_cuda:
                        t.record_stream(main)
        return item

    def close(self) -> None:
        """Stop the prefetch thread (if any) and close the raw inputs (a source's read-ahead thread stops);
        raw inputs pulled but not handed out stay unconsumed. Safe to call twice."""
        self._stop.set()
        if self._queue is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
        if hasattr(self.raw, "close"):
            self.raw.close()
