"""What the training loop reports in each mode (recforge/train/progress.py)."""

from __future__ import annotations

import io
import logging

import pytest

from recforge.train import progress as progress_mod
from recforge.train.progress import Progress, progress_mode


def _run(mode: str, caplog: pytest.LogCaptureFixture, steps: int = 5) -> list[str]:
    caplog.clear()
    report = Progress(mode, epochs=3, total_steps=3 * steps, log_seconds=1e-9)
    with caplog.at_level(logging.INFO, logger="recforge.train"):
        report.start_epoch(0, steps, 0, 0)
        for i in range(steps):
            report.interval({"step": i + 1, "tokens_per_s": 1000.0}, [2.0 + i])  # log_every=1: each step's loss
            report.step(i + 1, i + 1, tokens=100)
        report.end_epoch(steps, completed=True)
        report.evaluation(steps, 1, "valid", "hr@10=0.5000")
        report.stopped("max_minutes", "time budget reached")
    return [r.getMessage() for r in caplog.records]


def test_lines_mode_logs_steps_epochs_evaluations_and_the_stop(caplog: pytest.LogCaptureFixture) -> None:
    messages = _run("lines", caplog)
    steps = [m for m in messages if "tok/s  eta" in m]
    assert len(steps) == 5 and steps[0].startswith("epoch 1/3  step 1/15 (1/5 in epoch)  loss 2.0000")
    assert "epoch 1/3 done: step 5/15, mean loss 4.0000" in messages[5]
    assert messages[6] == "epoch 1/3 step 5 valid: hr@10=0.5000"
    assert messages[7] == "training stopped: time budget reached"


def test_summary_mode_has_no_step_lines_and_off_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    messages = _run("summary", caplog)
    assert not any("eta" in m for m in messages) and len(messages) == 3 and "done" in messages[0]
    assert _run("off", caplog) == []


def test_lines_are_spaced_by_log_seconds(caplog: pytest.LogCaptureFixture) -> None:
    report = Progress("lines", epochs=1, total_steps=100, log_seconds=3600)
    with caplog.at_level(logging.INFO, logger="recforge.train"):
        report.start_epoch(0, 100, 0, 0)
        for i in range(100):
            report.step(i + 1, i + 1, 10)
    assert len([r for r in caplog.records if "eta" in r.getMessage()]) == 1  # the first step only


def test_mode_follows_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_mod.sys, "stderr", io.StringIO())  # a pipe or a file: not a terminal
    assert progress_mode(True) == "lines" and progress_mode(False) == "summary" and progress_mode(True, False) == "off"
