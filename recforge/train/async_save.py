"""Checkpoint writes off the training thread: snapshot on the host now, write in the background.

The epoch-end checkpoint of a small model costs about as much as its tensors take to fsync
(tens of milliseconds per epoch, seconds over a run); the training loop only needs the weights
*as they were*. ``host_snapshot`` copies the model's and the optimizer's state to fresh CPU tensors
(one device-to-host copy: the training step may change the device tensors right after), and
``BackgroundWriter`` runs the write (``recforge.checkpoint.save_checkpoint``: atomic, so a crash
mid-write leaves the previous checkpoint in place) on one thread, one write at a time, in order.
A failed write is raised by the next ``submit`` or ``wait``, so it never goes unnoticed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def _host_copy(value):
    if torch.is_tensor(value):
        # a fresh CPU tensor even for CPU training (``.cpu()`` would alias the live parameter)
        return value.detach().to("cpu", copy=True).contiguous()
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_host_copy(v) for v in value]
    return value


def host_snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """(weights, optimizer state): the ``state_dict``s of ``model`` and ``optimizer`` as CPU copies."""
    weights = _host_copy(model.state_dict())
    optimizer_state = _host_copy(optimizer.state_dict()) if optimizer is not None else None
    return weights, optimizer_state


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
