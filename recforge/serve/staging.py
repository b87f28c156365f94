"""A pass's host <-> device traffic in a fixed number of copies, whatever its batch size.

An engine pass needs, per work item, a few small integer inputs (token features, where the item
starts, its contextual count) and gives back, per candidates item, a few float scores. Copying
each of them alone costs one transfer apiece, and on CUDA a blocking copy (a pageable
host -> device copy, any device -> host copy) waits for every kernel queued before it: a pass of
B items would synchronise ~5B times. Instead:

- ``HostStaging.take(n)`` gives a reusable host buffer (page-locked on CUDA, viewed as NumPy for
  cheap element writes); the caller writes every item's inputs into it, and ``upload`` sends
  them in one ``non_blocking`` copy into a reusable device buffer. Device-side copies then place
  each item's slice (device -> device: queued, no wait). Two host buffers alternate; a buffer is
  written again only once the device has read it (a CUDA event, normally long done).
- ``ResultBuffer`` collects every candidates item's rows on the device (one queued copy each) and
  ``download`` reads them back in one copy: the pass's one synchronisation.

``counters``: the copies made (``uploads``, ``downloads``) and the times a host buffer was still
being read when it was wanted again (``staging_waits``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def _capacity(n: int) -> int:
    return max(1024, 1 << max(n - 1, 0).bit_length())


def host_numpy(t: Tensor) -> np.ndarray:
    """``t``'s values as NumPy, for writing into a staging buffer (work items' features are host tensors,
    ``layout.py``; one on a device is read back, which waits for it)."""
    return t.numpy() if t.is_cpu else t.cpu().numpy()


class HostStaging:
    """Reusable int64 input buffers of a device: host (pinned on CUDA) and device; see the module docstring."""

    def __init__(self, device: torch.device, counters: dict[str, int]) -> None:
        self.device, self.counters = torch.device(device), counters
        self.pin = self.device.type == "cuda"
        self._host: list[tuple[Tensor, np.ndarray] | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._device: Tensor | None = None

    def take(self, n: int) -> np.ndarray:
        """A host buffer of at least ``n`` int64 (contents undefined) to fill before ``upload``."""
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None and not event.query():  # the device is two passes behind: wait for its read
            self.counters["staging_waits"] += 1
            event.synchronize()
        held = self._host[self._turn]
        if held is None or held[0].numel() < n:
            buf = torch.empty(_capacity(n), dtype=torch.int64, pin_memory=self.pin)
            held = self._host[self._turn] = (buf, buf.numpy())
        return held[1]

    def upload(self, n: int) -> Tensor:
        """Copy the first ``n`` values of the buffer ``take`` gave into the device buffer (one copy); returns it."""
        if self._device is None or self._device.numel() < n:
            self._device = torch.empty(_capacity(n), dtype=torch.int64, device=self.device)
        dev = self._device[:n]
        dev.copy_(self._host[self._turn][0][:n], non_blocking=self.pin)
        if self.pin:
            event = self._events[self._turn] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.counters["uploads"] += 1
        return dev


class ResultBuffer:
    """A device float32 buffer the pass's score rows are copied into, read back once (``download``)."""

    def __init__(self, device: torch.device, counters: dict[str, int]) -> None:
        self.device, self.counters = torch.device(device), counters
        self._buf: Tensor | None = None

    def reserve(self, rows: int, tail: tuple[int, ...]) -> Tensor:
        """A (rows, *tail) float32 device view to write the pass's scores into (contents undefined)."""
        n = rows * math.prod(tail)
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(_capacity(n), dtype=torch.float32, device=self.device)
        return self._buf[:n].view(rows, *tail)

    def download(self, rows: Tensor) -> Tensor:
        """``rows`` (a view of ``reserve``'s buffer) as a new CPU tensor: one copy, the pass's one wait."""
        self.counters["downloads"] += 1
        return rows.to("cpu", copy=True)  # a copy on the CPU too: the buffer is the next pass's


__all__ = ["HostStaging", "ResultBuffer", "host_numpy"]
