"""A training run as a user lives it: what the log says, why it stopped, failures, resumes, evaluations."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from recforge.cli import main
from recforge.data.synthetic import SyntheticConfig, write_synthetic

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = SyntheticConfig(num_users=40, num_items=50, num_clusters=4, mean_seq_len=8, min_seq_len=4, max_seq_len=20, seed=3)
    return write_synthetic(tmp_path_factory.mktemp("life") / "synth", config)


def _config(tmp_path: Path, data: Path, protocol: str = "paper", **train) -> Path:
    raw = {
        "name": "life",
        "data": {"path": str(data), "protocol": protocol, "max_seq_len": 16},
        "model": {"kind": "hstu", "dim": 16, "num_blocks": 1, "num_heads": 1, "dqk": 8, "dv": 8, "dropout": 0.0},
        "loss": {"negatives": "per_position", "num_negatives": 8},
        "train": {"epochs": 2, "batch_size": 16, "eval_every": 1, "output_dir": str(tmp_path / "runs" / "{name}"),
                  "device": "cpu", "threads": 1, **train},
        "eval": {"ks": [1, 10], "batch_size": 64},
    }  # fmt: skip
    path = tmp_path / "life.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_log_without_a_terminal_has_lines_not_a_bar(tmp_path: Path, data_dir: Path) -> None:
    """stderr is a pipe (CI, nohup): plain lines, no carriage returns; the flag works after the subcommand."""
    config = _config(tmp_path, data_dir, log_seconds=0.001)
    proc = subprocess.run([sys.executable, "-m", "recforge.cli", "train", str(config)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr
    assert "epoch 1/2  step 1/" in proc.stderr and "tok/s  eta " in proc.stderr
    assert "epoch 1/2 done: step" in proc.stderr and "epoch 2/2 step" in proc.stderr
    assert "training stopped: all 2 epoch(s) done" in proc.stderr
    assert "training stopped: all 2 epoch(s) done" in proc.stdout
    record = json.loads((tmp_path / "runs" / "life" / "run.json").read_text())
    assert record["stop_reason"] == "epochs" and record["epochs_completed"] == 2
    assert record["command"].endswith(f"-m recforge.cli train {config}")


def test_no_progress_after_the_subcommand_still_reports_epochs_and_the_time_cap(
    tmp_path: Path, data_dir: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    config = _config(tmp_path, data_dir, epochs=50, max_minutes=0.0005)
    with caplog.at_level(logging.INFO):
        assert main(["train", str(config), "--no-progress"]) == 0
    messages = [r.getMessage() for r in caplog.records if r.name == "recforge.train"]
    assert not any("tok/s  eta" in m for m in messages)  # no progress lines
    assert any(m.startswith("epoch 1/50 ") and (" done: " in m or " stopped: " in m) for m in messages), messages
    assert any("time budget reached (train.max_minutes=0.0005)" in m for m in messages), messages
    assert "training stopped: time budget reached" in capsys.readouterr().out
    assert json.loads((tmp_path / "runs" / "life" / "run.json").read_text())["stop_reason"] == "max_minutes"


def test_quiet_anywhere(tmp_path: Path, data_dir: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture) -> None:
    config = _config(tmp_path, data_dir, max_steps=2)
    with caplog.at_level(logging.INFO):
        assert main(["train", str(config), "--quiet"]) == 0
    assert not [r for r in caplog.records if r.name.startswith("recforge") and r.levelno < logging.WARNING]
    assert "hr@10" in capsys.readouterr().out  # the result still prints


def test_failed_run_leaves_no_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = _config(tmp_path, tmp_path / "no-such-data")
    assert main(["train", str(config)]) == 2
    assert "recforge data prepare" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "life").exists()


def test_resume_after_changing_the_model_names_the_keys(tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture) -> None:
    config = _config(tmp_path, data_dir, max_steps=2)
    assert main(["--no-progress", "train", str(config)]) == 0
    capsys.readouterr()
    assert main(["--no-progress", "train", str(config), "--resume", "model.dim=32"]) == 2
    err = capsys.readouterr().err
    assert "does not fit the model built from the current config" in err and "model.dim=16 (now 32)" in err
    assert yaml.safe_load((tmp_path / "runs" / "life" / "config.yaml").read_text())["model"]["dim"] == 16
    assert main(["--no-progress", "train", str(config)]) == 2  # refused before training: the record stays
    assert "already holds a run" in capsys.readouterr().err
    assert json.loads((tmp_path / "runs" / "life" / "run.json").read_text())["stop_reason"] == "max_steps"


def test_a_run_that_fails_while_training_records_the_error(tmp_path: Path, data_dir: Path) -> None:
    config = _config(tmp_path, data_dir, max_steps=2)
    with pytest.raises(FloatingPointError):  # a loss that overflows: the loop stops before a checkpoint holds it
        main(["--no-progress", "train", str(config), "optim.lr=1e30", "loss.temperature=1e-30"])
    record = json.loads((tmp_path / "runs" / "life" / "run.json").read_text())
    assert record["stop_reason"] == "error" and "FloatingPointError" in record["stop_message"]


def test_resume_skips_a_truncated_checkpoint_and_a_corrupt_pointer(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path, data_dir, eval_every=0)
    assert main(["--no-progress", "train", str(config)]) == 0  # two epochs: a checkpoint at the end of each
    run = tmp_path / "runs" / "life"
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    assert len(ckpts) == 2
    weights = ckpts[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    assert main(["eval", str(run)]) == 2  # eval names the file and the checkpoint to use instead
    err = capsys.readouterr().err
    assert str(weights) in err and ckpts[0].name in err
    assert main(["--no-progress", "train", str(config), "--resume", "train.epochs=3"]) == 0
    assert any(str(weights) in r.getMessage() and "trying the checkpoint before it" in r.getMessage() for r in caplog.records)
    steps = [json.loads(line)["step"] for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # the epoch of the bad checkpoint was trained again, once

    pointer = run / "checkpoints" / "latest.json"
    pointer.write_text("{not json")
    assert main(["eval", str(run), "--checkpoint", "latest"]) == 2
    assert str(pointer) in capsys.readouterr().err
    caplog.clear()
    assert main(["--no-progress", "train", str(config), "--resume", "train.epochs=4"]) == 0
    assert any(str(pointer) in r.getMessage() for r in caplog.records)


def test_eval_valid_on_a_paper_run_is_refused_and_commands_are_recorded(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, data_dir, max_steps=2)
    run = tmp_path / "runs" / "life"
    monkeypatch.setattr(sys, "argv", ["recforge", "train", str(config), "--no-progress"])
    assert main() == 0
    test_result = json.loads((run / "eval.json").read_text())
    assert test_result["command"] == f"recforge train {config} --no-progress"  # what the user typed
    capsys.readouterr()
    assert main(["eval", str(run), "--split", "valid"]) == 2
    err = capsys.readouterr().err
    assert "data.protocol=paper" in err and "was trained on" in err
    assert json.loads((run / "eval.json").read_text()) == test_result  # untouched


def test_eval_valid_on_a_clean_run_writes_its_own_file(tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture) -> None:
    config = _config(tmp_path, data_dir, protocol="clean", max_steps=2)
    run = tmp_path / "runs" / "life"
    assert main(["--no-progress", "train", str(config)]) == 0
    test_result = json.loads((run / "eval.json").read_text())
    capsys.readouterr()
    assert main(["eval", str(run), "--split", "valid"]) == 0
    assert f"wrote {run / 'eval-valid.json'}" in capsys.readouterr().out
    valid = json.loads((run / "eval-valid.json").read_text())
    assert valid["split"] == "valid" and valid["command"] == f"recforge eval {run} --split valid"
    assert json.loads((run / "eval.json").read_text()) == test_result
