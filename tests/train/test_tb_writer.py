"""The TensorBoard writer thread: the scalars torch's SummaryWriter would write, in order, and its errors raised."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recforge.train.tb_writer import BackgroundSummaryWriter


def _read(log_dir: Path) -> dict[str, list]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def test_scalars_written_in_order_with_their_call_times(tmp_path: Path) -> None:
    rng = random.Random()
    rows = [(rng.choice(["train/loss", "test/hr@10"]), rng.uniform(-5, 5), step) for step in range(1, 40)]
    writer = BackgroundSummaryWriter(tmp_path / "tb")
    before = time.time()
    for row in rows:
        writer.add_scalar(*row)
    after = time.time()
    writer.close()
    writer.close()  # idempotent
    got = _read(tmp_path / "tb")
    for tag in {tag for tag, _, _ in rows}:
        want = [(step, value) for t, value, step in rows if t == tag]
        assert [(e.step, e.value) for e in got[tag]] == [(s, pytest.approx(v, rel=1e-6)) for s, v in want]
        assert all(before - 1e-3 <= e.wall_time <= after + 1e-3 for e in got[tag])  # the add_scalar call's time


def test_unwritable_log_dir_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "tb"
    blocker.write_text("a file where the log directory should be")
    with pytest.raises(FileExistsError):
        BackgroundSummaryWriter(blocker)


def test_writer_thread_errors_are_raised(tmp_path: Path, monkeypatch) -> None:
    import torch.utils.tensorboard

    def broken(log_dir: str):
        raise OSError(f"cannot open an event file in {log_dir}")

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", broken)
    writer = BackgroundSummaryWriter(tmp_path / "tb")
    assert writer._imported.wait(60)  # the thread got as far as opening the writer
    with pytest.raises(RuntimeError, match="writing TensorBoard scalars failed: OSError"):
        writer.add_scalar("train/loss", 1.0, 1)
    with pytest.raises(RuntimeError, match="writing TensorBoard scalars failed"):
        writer.close()


def test_add_scalar_after_close_is_refused(tmp_path: Path) -> None:
    writer = BackgroundSummaryWriter(tmp_path / "tb")
    writer.add_scalar("train/loss", 1.0, 1)
    writer.close()
    with pytest.raises(RuntimeError, match="after close"):
        writer.add_scalar("train/loss", 2.0, 2)
    assert [e.value for e in _read(tmp_path / "tb")["train/loss"]] == [1.0]
