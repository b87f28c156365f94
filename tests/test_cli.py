"""End-to-end tests of the `recforge` command (data prepare, train, eval, demo)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from recforge.cli import main
from recforge.data.dataset import load_dataset
from recforge.data.synthetic import SyntheticConfig, write_synthetic

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
GROUPLENS = REPO / "tests" / "fixtures" / "grouplens"


@pytest.fixture(autouse=True)
def _restore_threads():
    """`train.threads=1` below calls torch.set_num_threads; leave the process as we found it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = SyntheticConfig(num_users=50, num_items=60, num_clusters=5, mean_seq_len=10, min_seq_len=3, max_seq_len=30, seed=2)
    return write_synthetic(tmp_path_factory.mktemp("cli") / "synth", config)


def _config_file(tmp_path: Path, data: Path, **sections) -> Path:
    raw = {
        "name": "cli-tiny",
        "data": {"path": str(data), "protocol": "paper", "max_seq_len": 20},
        "model": {"kind": "hstu", "dim": 16, "num_blocks": 1, "num_heads": 1, "dqk": 8, "dv": 8, "dropout": 0.1},
        "loss": {"negatives": "per_position", "num_negatives": 16},
        "train": {"epochs": 2, "batch_size": 16, "eval_every": 1, "output_dir": str(tmp_path / "runs" / "{name}"),
                  "device": "cpu", "threads": 1},
        "eval": {"ks": [1, 10, 50], "batch_size": 64},
    }  # fmt: skip
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_help_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "recforge.cli", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for word in ("demo", "data", "train", "eval", "--no-progress"):
        assert word in proc.stdout


def test_data_prepare_grouplens(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "gl"
    assert main(["data", "prepare", "grouplens", str(GROUPLENS), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    ds = load_dataset(out)
    meta = ds.meta
    assert f"wrote {out}: {meta['num_users']:,} users, {meta['num_items']:,} items, {meta['num_events']:,} events" in stdout
    ratings = [line for line in (GROUPLENS / "ratings.dat").read_text().splitlines() if line.strip()]
    assert ds.events.num_rows == meta["num_events"] == len(ratings)
    assert ds.has_timestamps

    # an existing output is refused, then replaced with --overwrite
    assert main(["data", "prepare", "grouplens", str(GROUPLENS), "--out", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["data", "prepare", "grouplens", str(GROUPLENS), "--out", str(out), "--overwrite"]) == 0


def test_data_prepare_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "never"
    assert main(["data", "prepare", "grouplens", str(tmp_path / "missing"), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ")
    assert "does not exist" in captured.err and str(tmp_path / "missing") in captured.err
    assert captured.out == ""
    assert not out.exists()

    assert main(["data", "prepare", "no-such-format", str(GROUPLENS), "--out", str(out)]) == 2
    assert "unknown data format 'no-such-format'" in capsys.readouterr().err
    assert not out.exists()

    with pytest.raises(SystemExit) as exit_info:  # argparse usage error: --out is required
        main(["data", "prepare", "grouplens", str(GROUPLENS)])
    assert exit_info.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_train_then_eval(tmp_path: Path, synthetic_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config_file(tmp_path, synthetic_dir)
    run_dir = tmp_path / "runs" / "cli-tiny"
    assert main(["--no-progress", "train", str(config), "train.max_steps=3"]) == 0
    stdout = capsys.readouterr().out
    assert f"run {run_dir}: test metrics (paper protocol, checkpoint step_00000003)" in stdout
    assert "hr@10" in stdout and "mrr" in stdout
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [1, 2, 3]

    # a second start of the same run is refused; --resume continues it to the end
    assert main(["--no-progress", "train", str(config)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["--no-progress", "train", str(config), "--resume"]) == 0
    capsys.readouterr()

    # `recforge eval RUN_DIR`, as the console script runs it (sys.argv holds the command line)
    monkeypatch.setattr(sys, "argv", ["recforge", "eval", str(run_dir), "--checkpoint", "latest"])
    assert main() == 0
    stdout = capsys.readouterr().out
    assert f"wrote {run_dir / 'eval.json'}" in stdout
    result = json.loads((run_dir / "eval.json").read_text())
    for key in ("hr@10", "ndcg@10", "mrr", "command", "split", "protocol", "model", "dataset", "checkpoint", "num_users"):
        assert key in result, key
    assert 0.0 <= result["hr@10"] <= 1.0 and 0.0 <= result["ndcg@10"] <= result["hr@10"]
    assert result["split"] == "test" and result["protocol"] == "paper" and result["model"] == "hstu"
    assert result["command"] == f"recforge eval {run_dir} --checkpoint latest"


def test_train_and_eval_errors(tmp_path: Path, synthetic_dir: Path, capsys: pytest.CaptureFixture) -> None:
    config = _config_file(tmp_path, synthetic_dir, model={"kind": "bert"})
    assert main(["train", str(config), "train.epochs=0", "wat=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "wat: unknown key" in err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", str(tmp_path)]) == 2
    assert "not a recforge run directory" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(_config_file(tmp_path, synthetic_dir).read_text())
    assert main(["eval", str(tmp_path / "run"), "train.epochs=3"]) == 2
    assert "overrides (train.epochs=3) are for generative runs" in capsys.readouterr().err
    missing_data = _config_file(tmp_path, tmp_path / "no-data")
    assert main(["train", str(missing_data)]) == 2
    assert "recforge data prepare" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "cli-tiny").exists()  # a failed run leaves no empty run directory


def test_eval_records_the_argv_given_to_main(tmp_path: Path, synthetic_dir: Path, capsys: pytest.CaptureFixture) -> None:
    config = _config_file(tmp_path, synthetic_dir)
    assert main(["--no-progress", "train", str(config), "train.max_steps=1"]) == 0
    run_dir = tmp_path / "runs" / "cli-tiny"
    assert main(["eval", str(run_dir)]) == 0
    capsys.readouterr()
    assert json.loads((run_dir / "eval.json").read_text())["command"] == f"recforge eval {run_dir}"


def test_demo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "demo"
    overrides = [
        "train.max_steps=3", "train.threads=1", "model.dim=16", "model.num_blocks=1", "model.num_heads=1",
        "model.dqk=8", "model.dv=8", "data.max_seq_len=20", "loss.num_negatives=16", "eval.batch_size=512",
    ]  # fmt: skip
    assert main(["--no-progress", "demo", "--minutes", "0.05", "--out", str(out), *overrides]) == 0
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["model"])
    assert header.split() == ["model", "hr@10", "ndcg@10", "hr@50", "ndcg@50", "mrr"]
    for name in ("popularity", "HSTU"):
        row = next(line for line in lines if line.split()[:1] == [name])
        values = [float(v) for v in row.split()[1:]]
        assert len(values) == 5 and all(0.0 <= v <= 1.0 for v in values), row
    assert "[4/4] top-10 recommendations" in stdout
    assert [int(m.group(1)) for line in lines if (m := re.match(r"\s*(\d+)\. ", line))] == list(range(1, 11))
    assert (out / "data" / "dataset.json").is_file()
    assert (out / "demo" / "eval.json").is_file()
    log = (out / "demo" / "train_log.jsonl").read_text().splitlines()
    assert 1 <= len(log) <= 3
    report = out / "demo" / "report" / "index.html"
    assert f"run report (plots, tables, config; open in a browser): {report}" in stdout
    assert 'id="plot-loss"' in report.read_text()


def test_demo_rejects_bad_override(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--out", str(tmp_path / "d"), "model.kind=gpt"]) == 2
    assert "model.kind: 'gpt' is not one of" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # the config is checked before any data is generated


def test_data_synthetic_impressions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "imp"
    assert main(["data", "synthetic", "--impressions", "--users", "20", "--items", "200", "--out", str(out)]) == 0
    assert "20 users" in capsys.readouterr().out
    ds = load_dataset(out)
    assert {"click", "like", "purchase", "p_click", "p_like", "p_purchase", "action"} <= set(ds.events.column_names)
    assert main(["data", "synthetic", "--out", str(out)]) == 2  # exists, no --overwrite
    assert "already exists" in capsys.readouterr().err
