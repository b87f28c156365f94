"""Checkpoint writes off the training thread: snapshot on the host now, write in the background.

The epoch-end checkpoint of a small model costs about as much as its tensors take to fsync
(tens of milliseconds per epoch, seconds over a run); the training loop only needs the weights
*as they were*. ``host_snapshot`` copies the model's and the optimizer's state to CPU tensors
(the training step may change the device tensors right after), and ``BackgroundWriter`` runs the
write (``recforge.checkpoint.save_checkpoint``: atomic, so a crash mid-write leaves the previous
checkpoint in place) on one thread, one write at a time, in order. A failed write is raised by the
next ``submit`` or ``wait``, so it never goes unnoticed.

The snapshot waits for the device once, not once per tensor: a model's and AdamW's state is hundreds
of tensors (ML-1M's 8-block d128 HSTU: 304), and a plain ``.to("cpu")`` of each blocks until the GPU is idle and
stages the bytes through pageable memory. ``HostBuffers`` keeps one pinned host tensor per state entry
across checkpoints; every device tensor is copied into its buffer with ``non_blocking=True`` on the
current stream (after the step that wrote it), then one event is waited for. The copies are exact
(same dtype and shape: the saved bytes equal a ``.cpu()`` copy's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class HostBuffers:
    """Host tensors reused by ``host_snapshot`` across checkpoints, one per state entry (by its path in the
    state dicts); pinned for device tensors (held for the whole run: about 3x the dense model's size with AdamW;
    pageable where pinning fails). A snapshot's tensors are these buffers: valid until the next
    snapshot into the same ``HostBuffers`` (the caller waits for the write of the previous one first)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pin = True  # off after the first failed pinned allocation

    def like(self, path: tuple, value: torch.Tensor) -> torch.Tensor:
        """The buffer of ``path``, (re)allocated when ``value``'s shape or dtype differs from the last one's."""
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            # pinned: a device tensor's copy into it runs asynchronously (pageable memory would block per copy);
            # page-locked host memory the system cannot give (a large model) falls back to pageable: slower, same bytes
            buffer = None
            if value.device.type == "cuda" and self._pin:
                try:
                    buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                except RuntimeError:
                    self._pin = False
            if buffer is None:
                buffer = torch.empty(value.shape, dtype=value.dtype)
            self._buffers[path] = buffer
        return buffer

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _host_copy(value, path: tuple, buffers: HostBuffers, devices: set) -> object:
    if torch.is_tensor(value):
        out = buffers.like(path, value)
        if value.device.type == "cuda":
            devices.add(value.device)
            out.copy_(value.detach(), non_blocking=True)  # queued after the step that wrote it; waited for once
        else:  # a copy even for CPU training (``.cpu()`` would alias the live parameter)
            out.copy_(value.detach())
        return out
    if isinstance(value, dict):
        return {k: _host_copy(v, (*path, k), buffers, devices) for k, v in value.items()}
    if isinstance(value, list):
        return [_host_copy(v, (*path, i), buffers, devices) for i, v in enumerate(value)]
    return value


def host_snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  buffers: HostBuffers | None = None) -> tuple[dict, dict | None]:  # fmt: skip
    """(weights, optimizer state): the ``state_dict``s of ``model`` and ``optimizer`` as CPU copies, taken with one
    wait for the device (see the module doc). ``buffers``: reused host tensors (the copies are then those buffers';
    None: fresh ones)."""
    buffers = buffers if buffers is not None else HostBuffers()
    devices: set = set()
    with torch.no_grad():
        weights = _host_copy(model.state_dict(), ("model",), buffers, devices)
        optimizer_state = None
        if optimizer is not None:
            optimizer_state = _host_copy(optimizer.state_dict(), ("optimizer",), buffers, devices)
    for device in devices:  # one wait per device (one in a single-process run), not one per tensor
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()
    return weights, optimizer_state


def host_snapshot_reference(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """``host_snapshot`` as it was before ``HostBuffers``: one blocking ``.to("cpu", copy=True)`` per tensor (the
    oracle of its tests and the baseline of ``benchmarks/checkpoint_snapshot.py``)."""

    def copy(value):
        if torch.is_tensor(value):
            return value.detach().to("cpu", copy=True).contiguous()
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        return [copy(v) for v in value] if isinstance(value, list) else value

    return copy(model.state_dict()), copy(optimizer.state_dict()) if optimizer is not None else None


class BackgroundWriter:
    """Runs write functions on a background thread, at most one at a time, in submission order."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as err:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = err

    def submit(self, write: Callable[[], None]) -> None:
        """Start ``write`` once the previous one has finished (raising its error, if it failed)."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name="recforge-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {type(err).__name__}: {err}") from err
