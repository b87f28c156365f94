"""What the training loop tells the person watching: one design for a terminal and for log files.

- ``bar``: on a terminal, a tqdm bar per epoch; log lines (evaluations, epoch summaries) print above it.
- ``lines``: without a terminal (CI, ``nohup``, a cluster job's log file) no carriage returns: a plain
  log line every ``train.log_seconds`` (step, epoch, loss, tokens/s, ETA), plus the lines below.
- ``summary`` (``--no-progress``): only the epoch summaries, evaluations and why the run stopped.

Everything goes through the ``logging`` module (``recforge`` sets it up once, in ``cli.main``), as
``INFO`` records; ``--quiet`` raises the level to ``WARNING``. Epochs are counted from 1 everywhere
(the bar, the lines, the summaries): "epoch 3/40" is the third epoch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger("recforge.train")

STOP_MESSAGES = {
    "epochs": "all {epochs} epoch(s) done",
    "max_steps": "step budget reached (train.max_steps={max_steps})",
    "max_minutes": "time budget reached (train.max_minutes={max_minutes:g}) during epoch {epoch}/{epochs}",
}


def progress_mode(progress: bool, is_main: bool = True) -> str:
    """``bar`` on a terminal, ``lines`` elsewhere, ``summary`` when progress is off (``--no-progress``)."""
    if not is_main:
        return "off"
    if not progress:
        return "summary"
    if not sys.stderr.isatty():
        return "lines"
    try:  # a terminal of no width (a pty nobody sized) shows no bar: lines instead
        return "bar" if os.get_terminal_size(sys.stderr.fileno()).columns > 0 else "lines"
    except OSError:
        return "lines"


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """Reports steps, epochs and evaluations of one training run (see the module docstring).

    Args:
        mode: ``bar`` | ``lines`` | ``summary`` | ``off`` (another torchrun rank: nothing).
        epochs: ``train.epochs``.
        total_steps: steps of the whole run (the learning-rate schedule's), for the ETA.
        log_seconds: seconds between lines in ``lines`` mode.
        max_minutes: ``train.max_minutes`` (0: none): the ETA is at most the time left.
    """

    def __init__(self, mode: str, *, epochs: int, total_steps: int, log_seconds: float, max_minutes: float = 0.0):
        self.mode, self.epochs, self.total_steps, self.log_seconds = mode, epochs, total_steps, log_seconds
        self.deadline = time.monotonic() + max_minutes * 60 if max_minutes else None
        self.bar: tqdm | None = None
        self._redirect: contextlib.AbstractContextManager | None = None
        self._session_start, self._session_steps = time.monotonic(), 0
        self._last_line = float("-inf")
        self._last_loss: float | None = None
        self._last_mfu: float | None = None

    def start_epoch(self, epoch: int, steps: int, done: int, global_step: int) -> None:
        """``epoch`` is 0-based; ``done`` steps of it were trained before (a resume)."""
        self.epoch, self.epoch_steps = epoch, steps
        self._epoch_start, self._epoch_loss, self._epoch_count, self._epoch_tokens = time.monotonic(), 0.0, 0, 0
        self._window_start, self._window_tokens = time.monotonic(), 0
        if self.mode == "bar":
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
            self.bar = tqdm(total=steps, initial=done, desc=f"epoch {epoch + 1}/{self.epochs}", leave=False,
                            dynamic_ncols=True, file=sys.stderr)  # fmt: skip

    def step(self, global_step: int, step_in_epoch: int, tokens: int) -> None:
        """One trained step. Its loss may still be on the device: losses arrive per interval (``interval``)."""
        self._session_steps += 1
        self._epoch_tokens += tokens
        self._window_tokens += tokens
        if self.bar is not None:
            self.bar.update(1)
            return
        now = time.monotonic()
        if self.mode != "lines" or (now - self._last_line < self.log_seconds and self._session_steps > 1):
            return
        window_tok_s = self._window_tokens / max(now - self._window_start, 1e-9)
        self._window_start, self._window_tokens, self._last_line = now, 0, now
        loss = "-" if self._last_loss is None else f"{self._last_loss:.4f}"
        mfu = "" if self._last_mfu is None else f"  mfu {100 * self._last_mfu:.1f}%"
        log.info("epoch %d/%d  step %d/%d (%d/%d in epoch)  loss %s  %s tok/s%s  eta %s", self.epoch + 1, self.epochs,
                 global_step, self.total_steps, step_in_epoch, self.epoch_steps, loss, f"{window_tok_s:,.0f}", mfu,
                 self._eta(global_step))  # fmt: skip

    def interval(self, row: dict, losses: list[float]) -> None:
        """The losses of the steps since the last interval (read from the device in one sync) and the
        interval's last row (``tokens_per_s``, ``mfu`` when known): ``step_log.StepLog``'s callback."""
        self._epoch_loss, self._epoch_count = self._epoch_loss + sum(losses), self._epoch_count + len(losses)
        self._last_loss, self._last_mfu = losses[-1], row.get("mfu")
        if self.bar is not None:
            postfix = {"loss": f"{losses[-1]:.4f}", "tok_s": f"{row.get('tokens_per_s', 0.0):,.0f}"}
            if "mfu" in row:
                postfix["mfu"] = f"{100 * row['mfu']:.1f}%"
            self.bar.set_postfix(postfix)

    def _eta(self, global_step: int) -> str:
        elapsed = time.monotonic() - self._session_start
        left = (self.total_steps - global_step) * elapsed / max(self._session_steps, 1)
        if self.deadline is not None:
            left = min(left, self.deadline - time.monotonic())
        return _duration(left)

    def end_epoch(self, global_step: int, completed: bool) -> None:
        """Close the bar; log the epoch's mean loss, throughput and time (every mode but ``off``)."""
        self.close()
        if self.mode == "off" or not self._epoch_count:
            return
        seconds = time.monotonic() - self._epoch_start
        what = "done" if completed else "stopped"
        log.info("epoch %d/%d %s: step %d/%d, mean loss %.4f, %s tok/s, %s", self.epoch + 1, self.epochs, what,
                 global_step, self.total_steps, self._epoch_loss / self._epoch_count,
                 f"{self._epoch_tokens / max(seconds, 1e-9):,.0f}", _duration(seconds))  # fmt: skip

    def evaluation(self, global_step: int, epochs_completed: int, split: str, text: str) -> None:
        if self.mode == "off":
            return
        partial = "" if epochs_completed > self.epoch else " (part of it)"
        log.info("epoch %d/%d%s step %d %s: %s", self.epoch + 1, self.epochs, partial, global_step, split, text)

    def stopped(self, reason: str, message: str) -> None:
        if self.mode != "off":
            log.info("training stopped: %s", message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
