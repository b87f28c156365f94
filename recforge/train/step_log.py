"""The training log: one ``train_log.jsonl`` row per step, read from the device once per log interval.

A step's loss stays a device scalar until the interval ends (``train.log_every`` steps), before
a checkpoint or an evaluation, and at the end: then all of them are read in one host sync, checked
(a non-finite loss stops the run before any checkpoint could hold the weights it corrupted) and
written. The step itself never waits for the GPU.

The last row of each interval (``log_every`` steps, or fewer before a checkpoint or an evaluation)
also carries the interval's throughput over its wall clock (from the end of the previous interval,
checkpoint or evaluation to the sync that ended it; input waits included): ``tokens_per_s``,
``tflops`` (model FLOPs of the steps, see ``recforge.train.flops``) and ``mfu`` (over the device's
dense peak, when known). Per-step
``step_s`` is the host time of the step call: on a GPU it only bounds the step from below.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from recforge.train.run_files import append_jsonl


class StepLog:
    """Rows and TensorBoard scalars of the training steps (``main``: this process writes them).

    Args:
        path: ``RUN_DIR/train_log.jsonl``.
        writer: a TensorBoard ``SummaryWriter`` (None: no scalars).
        log_every: steps per interval.
        peak_tflops: the device's dense peak for the run's precision (None: no ``mfu``).
        on_interval: called with the interval's last row and its losses after each interval (progress).
    """

    def __init__(self, path: Path, writer: Any, log_every: int, peak_tflops: float | None, main: bool,
                 on_interval: Any = None) -> None:  # fmt: skip
        self.path, self.writer, self.log_every, self.peak, self.main = path, writer, log_every, peak_tflops, main
        self.on_interval = on_interval
        self.pending: list[tuple[dict, Any]] = []  # (row without loss, loss: float or device scalar)
        self.reset()

    def reset(self) -> None:
        """Start a new throughput interval now (after an evaluation or a checkpoint, which it must not count)."""
        self.started = time.perf_counter()
        self.tokens = 0
        self.flops = 0.0

    def add(self, row: dict, loss: Any, tokens: int, flops: float) -> None:
        """One step's row (``step``, ``epoch``, ``lr``, times...) and its loss; ends the interval every ``log_every`` steps."""
        self.pending.append((row, loss))
        self.tokens += tokens
        self.flops += flops
        if row["step"] % self.log_every == 0:
            self.flush()

    def flush(self) -> None:
        """Read the pending losses (one sync), check them, write their rows and close the throughput
        interval (its rates go on the last row). Nothing to do when no step is pending."""
        if not self.pending:
            return
        rows, losses = zip(*self.pending, strict=True)
        self.pending = []
        values = _read(list(losses))
        for i, (row, loss) in enumerate(zip(rows, values, strict=True)):
            if not math.isfinite(loss):
                if self.main:  # the steps before it did train: their rows stay
                    for good, value in zip(rows[:i], values[:i], strict=True):
                        append_jsonl(self.path, {**good, "loss": value})
                raise FloatingPointError(
                    f"training loss is {loss} at step {row['step']} (epoch {row['epoch'] + 1}, lr {row['lr']:.3g}); "
                    f"the run stops here and {self.path.parent}/checkpoints holds only earlier, finite states. Lower "
                    "optim.lr, set optim.grad_clip, or check the data for empty batches and non-finite features; then "
                    "restart, or continue from the last checkpoint with --resume"
                )
        last = dict(rows[-1], loss=values[-1])
        seconds = max(time.perf_counter() - self.started, 1e-9)
        last["tokens_per_s"] = self.tokens / seconds
        if self.flops:
            last["tflops"] = self.flops / seconds / 1e12
            if self.peak:
                last["mfu"] = last["tflops"] / self.peak
        self.reset()
        if self.main:
            for row, loss in zip(rows[:-1], values[:-1], strict=True):
                append_jsonl(self.path, {**row, "loss": loss})
            append_jsonl(self.path, last)
            if self.writer is not None:
                step = last["step"]
                for key in ("loss", "tokens_per_s", "tflops", "mfu", "data_wait_s", "lr"):
                    if key in last:
                        self.writer.add_scalar(f"train/{key}", last[key], step)
        if self.on_interval is not None:
            self.on_interval(last, values)


    def salvage(self) -> None:
        """On an exception in the loop: write the rows of the steps that ran, if they can still be read."""
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - the exception being raised is the one to report
            self.pending = []


def _read(losses: list[Any]) -> list[float]:
    """Floats of a list of floats and device scalars, with one host sync for all the tensors."""
    at = [i for i, v in enumerate(losses) if torch.is_tensor(v)]
    if not at:
        return [float(v) for v in losses]
    read = torch.stack([losses[i].detach().reshape(()).double() for i in at]).tolist()
    out = [float(v) if not torch.is_tensor(v) else 0.0 for v in losses]
    for i, value in zip(at, read, strict=True):
        out[i] = value
    return out
