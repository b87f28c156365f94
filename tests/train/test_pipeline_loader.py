"""The retrieval recipe fed by the sample engine (``train.loader=pipeline``): learning, exactly-once
resume after a crash, token-budget batches and their token-weighted loss."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from recforge.checkpoint import find_checkpoint
from recforge.cli import main
from recforge.config import ConfigError
from recforge.data.dataset import load_dataset
from recforge.data.parquet_source import decode_row_ids
from recforge.data.sequences import UserSequences
from recforge.train import retrieval
from recforge.train.retrieval import train
from tests.train.test_retrieval import _cfg, _steps_log, data_dir  # noqa: F401 - data_dir is a fixture

PIPELINE = ("train.loader=pipeline", "train.loader_workers=1")


def _num_samples(data: Path) -> int:
    return UserSequences.from_dataset(load_dataset(data)).training_samples(1, 20, "last").shape[0]


class StepRecorder:
    """Wraps the recipe's step: records each step's sample rows (and tokens); raises at call ``crash_at``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, crash_at: int = 0) -> None:
        self.rows: list[np.ndarray] = []
        self.tokens: list[int] = []
        self.crash_at = crash_at
        self.real = retrieval._step
        monkeypatch.setattr(retrieval, "_step", self)

    def __call__(self, s, micro, lr_scale):
        batches = [b for b in micro if b is not None]
        if not batches:  # the epoch-end call that finds no data
            return self.real(s, micro, lr_scale)
        if len(self.rows) + 1 == self.crash_at:
            raise RuntimeError("simulated crash")
        _, rows = decode_row_ids(np.concatenate([b.dense["row_ids"].cpu().numpy() for b in batches]))  # one file: row = sample
        self.rows.append(rows)
        self.tokens.append(sum(b.num_tokens for b in batches))
        return self.real(s, micro, lr_scale)


def _assert_each_row_once_per_epoch(rows: list[np.ndarray], run_dir: Path, num_samples: int, epochs: int) -> None:
    epoch_of_step = [epoch for _, epoch, _ in _steps_log(run_dir)]
    assert len(epoch_of_step) == len(rows)
    for epoch in range(epochs):
        seen = np.concatenate([r for r, e in zip(rows, epoch_of_step, strict=True) if e == epoch])
        assert np.array_equal(np.sort(seen), np.arange(num_samples)), f"epoch {epoch}"


def test_pipeline_loader_trains(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    recorder = StepRecorder(monkeypatch)
    cfg = _cfg(tmp_path, data_dir, *PIPELINE, "loss.negatives=full", "model.dropout=0.0", "optim.lr=0.01",
               "train.epochs=5", "train.eval_every=0")  # fmt: skip
    summary = train(cfg, progress=False)
    n = _num_samples(data_dir)
    steps_per_epoch = -(-n // 12)
    log = [json.loads(line) for line in (cfg.run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == list(range(1, 5 * steps_per_epoch + 1))  # as many steps as the memory loader
    assert all(row["data_wait_s"] >= 0.0 and row["step_s"] > 0.0 for row in log)
    losses = [row["loss"] for row in log]
    first, last = np.mean(losses[:steps_per_epoch]), np.mean(losses[-steps_per_epoch:])
    assert last < 0.9 * first, (first, last)
    assert all(np.isfinite(summary[k]) for k in ("hr@10", "ndcg@10", "mrr"))
    _assert_each_row_once_per_epoch(recorder.rows, cfg.run_dir, n, 5)
    assert not (cfg.run_dir / "samples").exists()  # streamed as built: nothing written and read back
    manifest = json.loads((find_checkpoint(cfg.run_dir) / "manifest.json").read_text())
    assert manifest["data_state"]["epoch"] == 4 and manifest["data_state"]["share_done"]


@pytest.mark.parametrize(
    ("checkpoint_every", "crash_at", "resumed_from"),
    [(2, 4, 2), (2, 7, 6), (0, 7, 4), (3, 5, 4)],  # mid epoch 0; mid epoch 1; at an epoch end; epoch end after step 3
)
def test_crash_and_resume_trains_each_row_once_per_epoch(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_every: int, crash_at: int, resumed_from: int  # noqa: F811
) -> None:
    cfg = _cfg(tmp_path, data_dir, *PIPELINE, f"train.checkpoint_every={checkpoint_every}")
    crashed = StepRecorder(monkeypatch, crash_at=crash_at)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(cfg, progress=False)
    assert find_checkpoint(cfg.run_dir).name == f"step_{resumed_from:08d}"

    resumed = StepRecorder(monkeypatch)
    resumed.real = crashed.real
    train(cfg, resume=True, progress=False)  # rebuilds the same rows: the saved state names them
    n = _num_samples(data_dir)
    # steps after the checkpoint were lost with the crash: their rows are trained again, the others are not
    rows = crashed.rows[:resumed_from] + resumed.rows
    assert len(rows) == 2 * -(-n // 12)  # the step count of an uninterrupted run
    _assert_each_row_once_per_epoch(rows, cfg.run_dir, n, 2)


def test_budget_stop_on_an_epochs_last_batch_then_resume(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The state is saved after the epoch's last batch but before the pipeline saw its end."""
    n = _num_samples(data_dir)
    steps_per_epoch = -(-n // 12)
    recorder = StepRecorder(monkeypatch)
    train(_cfg(tmp_path, data_dir, *PIPELINE, f"train.max_steps={steps_per_epoch}"), progress=False)
    cfg = _cfg(tmp_path, data_dir, *PIPELINE)
    train(cfg, resume=True, progress=False)
    _assert_each_row_once_per_epoch(recorder.rows, cfg.run_dir, n, 2)
    assert len(recorder.rows) == 2 * steps_per_epoch


def test_loaders_do_not_mix_on_resume(tmp_path: Path, data_dir: Path) -> None:  # noqa: F811
    train(_cfg(tmp_path, data_dir, "train.max_steps=1"), progress=False)
    with pytest.raises(ValueError, match="written with train.loader=memory"):
        train(_cfg(tmp_path, data_dir, *PIPELINE), resume=True, progress=False)


def test_token_budget_batches(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    recorder = StepRecorder(monkeypatch)
    cfg = _cfg(tmp_path, data_dir, *PIPELINE, "train.token_budget=40")
    train(cfg, progress=False)
    sizes = [len(r) for r in recorder.rows]
    assert len(set(sizes)) > 1  # rows per batch vary...
    assert max(recorder.tokens) <= 40  # ...within the token budget (every sample has <= max_seq_len=20 tokens)
    _assert_each_row_once_per_epoch(recorder.rows, cfg.run_dir, _num_samples(data_dir), 2)


def test_token_weighted_loss_keeps_fixed_batch_semantics(data_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """Every target weighs 1/budget whatever the batch size: two batches' objectives (and gradients)
    add up to those of their union, which a per-batch mean would not."""
    budget = 64
    cfg = _cfg(tmp_path, data_dir, *PIPELINE, f"train.token_budget={budget}", "loss.negatives=full", "model.dropout=0.0")
    s = retrieval.setup(cfg)
    samples = s.seqs.training_samples(1, 20, "last")

    def objective_and_grads(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        batch = s.seqs.training_batch(samples[ids], 20)
        s.model.zero_grad(set_to_none=True)
        objective, mean = retrieval._loss(s, batch)
        objective.backward()
        num_targets = batch.labels["next_item"].numel()
        torch.testing.assert_close(objective, mean * num_targets / budget, rtol=1e-6, atol=0.0)
        return objective.detach(), mean.detach(), [p.grad.clone() for p in s.model.parameters() if p.grad is not None]

    a, mean_a, grads_a = objective_and_grads(torch.arange(0, 3))  # batches of different sizes
    b, mean_b, grads_b = objective_and_grads(torch.arange(3, 10))
    ab, mean_ab, grads_ab = objective_and_grads(torch.arange(0, 10))
    torch.testing.assert_close(a + b, ab, rtol=1e-5, atol=1e-7)
    for ga, gb, gab in zip(grads_a, grads_b, grads_ab, strict=True):
        torch.testing.assert_close(ga + gb, gab, rtol=1e-4, atol=1e-7)
    assert not torch.isclose(mean_a + mean_b, mean_ab)  # the unweighted per-batch mean is not additive


def test_config_checks() -> None:
    from recforge.config import config_from_dict

    with pytest.raises(ConfigError, match="needs train.loader=pipeline"):
        config_from_dict({"data": {"path": "x"}, "train": {"token_budget": 100}})
    ranking = config_from_dict({"recipe": "ranking", "data": {"path": "x"}, "ranking": {"tasks": ["like:rating>=4"]}, "eval": {"select_metric": "like/auc"},
                                "train": {"loader": "pipeline"}})  # fmt: skip
    assert ranking.train.loader == "pipeline"  # both recipes stream from the sample engine
    with pytest.raises(ConfigError, match="is not one of"):
        config_from_dict({"data": {"path": "x"}, "train": {"loader": "stream"}})


@pytest.mark.integration
def test_cli_train_with_pipeline_loader_and_resume(tmp_path: Path, data_dir: Path) -> None:  # noqa: F811
    config = tmp_path / "tiny.yaml"
    cfg = _cfg(tmp_path, data_dir, *PIPELINE)
    config.write_text(json.dumps(cfg.to_dict()))  # JSON is YAML
    assert main(["--no-progress", "train", str(config), "train.max_steps=3", "train.checkpoint_every=2"]) == 0
    assert main(["--no-progress", "train", str(config), "--resume"]) == 0
    assert [step for step, _, _ in _steps_log(cfg.run_dir)] == list(range(1, 2 * -(-_num_samples(data_dir) // 12) + 1))
