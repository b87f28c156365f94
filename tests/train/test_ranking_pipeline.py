"""The ranking recipe fed by the sample engine (``train.loader=pipeline``): the streamed batches equal the
memory loader's, learning, exactly-once resume after a crash, token-budget batches and their loss weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from recforge.checkpoint import find_checkpoint
from recforge.config import RunConfig, load_config
from recforge.data.ranking_samples import (
    ranking_pipeline,
    ranking_sample_source,
    ranking_source,
    sample_tokens,
    token_reference,
    write_ranking_samples,
)
from recforge.data.token_batching import steps_per_epoch
from recforge.train import ranking
from tests.train.test_ranking_recipe import CONFIG, SMALL, data_dir  # noqa: F401 - data_dir is a fixture

PIPELINE = ("train.loader=pipeline", "train.loader_workers=1")


def _cfg(tmp_path: Path, data: Path, *overrides: str) -> RunConfig:
    base = [f"data.path={data}", f"train.output_dir={tmp_path}/{{name}}", "train.epochs=2", "train.eval_every=0", *SMALL]
    return load_config(CONFIG, [*base, *overrides])


def _train_samples(cfg: RunConfig):
    s = ranking.setup(cfg)
    return s, ranking._samples(s, "train")


def _epochs_of_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


class StepRecorder:
    """Wraps the recipe's step: records each batch's target events (and tokens); raises at call ``crash_at``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, crash_at: int = 0) -> None:
        self.events: list[np.ndarray] = []  # per step: the target event rows (identify the samples of any loader)
        self.samples: list[np.ndarray] = []  # per step: sample ids (pipeline batches only)
        self.tokens: list[int] = []
        self.crash_at = crash_at
        self.real = ranking._step
        monkeypatch.setattr(ranking, "_step", self)

    def __call__(self, s, micro, lr_scale):
        batches = [b for b in micro if b is not None]
        if not batches:  # the epoch-end call that finds no data
            return self.real(s, micro, lr_scale)
        if len(self.events) + 1 == self.crash_at:
            raise RuntimeError("simulated crash")
        self.events.append(np.concatenate([b.labels["events"].cpu().numpy() for b in batches]))
        if all("sample_ids" in b.dense for b in batches):
            self.samples.append(np.concatenate([b.dense["sample_ids"].cpu().numpy() for b in batches]))
        self.tokens.append(sum(b.num_tokens for b in batches))
        return self.real(s, micro, lr_scale)


def _assert_each_sample_once_per_epoch(per_step: list[np.ndarray], run_dir: Path, expected: np.ndarray, epochs: int) -> None:
    epoch_of_step = _epochs_of_steps(run_dir)
    assert len(epoch_of_step) == len(per_step)
    for epoch in range(epochs):
        seen = np.concatenate([r for r, e in zip(per_step, epoch_of_step, strict=True) if e == epoch])
        assert np.array_equal(np.sort(seen), expected), f"epoch {epoch}"


@pytest.mark.parametrize(("action_encoding", "token_budget", "rows"),
                         [("sum", 0, "memory"), ("interleave", 0, "memory"), ("sum", 300, "memory"), ("interleave", 300, "file")])  # fmt: skip
def test_streamed_batches_equal_memory_batches(tmp_path: Path, data_dir: Path, action_encoding: str, token_budget: int,  # noqa: F811
                                               rows: str) -> None:  # fmt: skip
    s, samples = _train_samples(_cfg(tmp_path, data_dir))
    tokens = sample_tokens(s.data, samples, 64, action_encoding)
    every = s.data.batch(samples, torch.arange(len(samples)), 64, action_encoding)
    assert torch.equal(tokens, every.seq_offsets.diff())  # the lengths RankingData.batch makes
    if rows == "file":  # the same rows written as Parquet by write_ranking_samples
        source = write_ranking_samples(s.data, samples, tmp_path / "samples", 64, action_encoding, row_group_size=16)
    else:
        source = ranking_sample_source(s.data, samples, 64, action_encoding)
    pipe = ranking_pipeline(source, 64, 10, action_encoding=action_encoding, num_workers=1, shuffle_rows=50,
                            token_budget=token_budget)  # fmt: skip
    seen, sizes = [], []
    for batch in pipe:
        batch.validate()
        ids = batch.dense["sample_ids"]
        expected = s.data.batch(samples, ids, 64, action_encoding)
        assert torch.equal(batch.seq_offsets, expected.seq_offsets)
        for name in ("item_ids", "actions", "context_ids", "timestamps"):
            assert torch.equal(batch.features[name], expected.features[name]), name
        torch.testing.assert_close(batch.labels["tasks"], expected.labels["tasks"], rtol=0, atol=0, equal_nan=True)
        assert torch.equal(batch.labels["events"], expected.labels["events"])
        assert torch.equal(batch.labels["users"], expected.labels["users"])
        assert torch.equal(batch.mask.num_targets, expected.mask.num_targets)
        assert torch.equal(batch.mask.num_contextual, expected.mask.num_contextual)
        seen.append(ids.numpy())
        sizes.append(ids.numel())
        if token_budget:
            assert batch.num_tokens <= token_budget or ids.numel() == 1
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(len(samples)))
    if token_budget:
        assert len(set(sizes)) > 2  # samples per batch vary with their tokens
    else:
        assert len(sizes) == steps_per_epoch(tokens, 10) and set(sizes[:-1]) == {10}


def test_memory_and_pipeline_train_the_same_samples_per_epoch(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    _, samples = _train_samples(_cfg(tmp_path, data_dir))
    all_events = np.sort(samples.events.numpy())
    runs = {}
    for loader in ("memory", "pipeline"):
        recorder = StepRecorder(monkeypatch)
        cfg = _cfg(tmp_path, data_dir, f"name={loader}", f"train.loader={loader}", "train.loader_workers=1")
        ranking.train(cfg, progress=False)
        _assert_each_sample_once_per_epoch(recorder.events, cfg.run_dir, all_events, 2)
        runs[loader] = [e.size for e in recorder.events]
        monkeypatch.undo()
    assert len(runs["memory"]) == len(runs["pipeline"]) == 2 * -(-len(samples) // 16)  # same steps per epoch
    assert sum(runs["memory"]) == sum(runs["pipeline"])


def test_pipeline_loader_trains(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    recorder = StepRecorder(monkeypatch)
    cfg = _cfg(tmp_path, data_dir, *PIPELINE, "train.epochs=6", "model.dropout=0.0", "optim.lr=0.01",
               "ranking.listwise_weight=0.5")  # fmt: skip
    summary = ranking.train(cfg, progress=False)
    n = len(_train_samples(cfg)[1])
    steps = -(-n // 16)
    losses = [json.loads(line)["loss"] for line in (cfg.run_dir / "train_log.jsonl").read_text().splitlines()]
    assert len(losses) == 6 * steps
    first, last = np.mean(losses[:steps]), np.mean(losses[-steps:])
    assert last < 0.9 * first, (first, last)
    assert 0 <= summary["click/auc"] <= 1
    _assert_each_sample_once_per_epoch(recorder.samples, cfg.run_dir, np.arange(n), 6)
    assert not (cfg.run_dir / "samples").exists()  # streamed as built: nothing written and read back
    manifest = json.loads((find_checkpoint(cfg.run_dir) / "manifest.json").read_text())
    assert manifest["data_state"]["epoch"] == 5 and manifest["data_state"]["share_done"]


@pytest.mark.parametrize(
    ("checkpoint_every", "crash_at", "resumed_from", "extra"),
    # 7 steps per epoch: mid epoch 0; from an epoch end; the epoch's last batch lost; token budget
    [(2, 4, 2, ()), (0, 9, 7, ()), (3, 7, 6, ()), (2, 3, 2, ("train.token_budget=400",))],
)
def test_crash_and_resume_trains_each_sample_once_per_epoch(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, checkpoint_every: int, crash_at: int,  # noqa: F811
    resumed_from: int, extra: tuple[str, ...],
) -> None:  # fmt: skip
    cfg = _cfg(tmp_path, data_dir, *PIPELINE, f"train.checkpoint_every={checkpoint_every}", *extra)
    crashed = StepRecorder(monkeypatch, crash_at=crash_at)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ranking.train(cfg, progress=False)
    assert find_checkpoint(cfg.run_dir).name == f"step_{resumed_from:08d}"

    resumed = StepRecorder(monkeypatch)
    resumed.real = crashed.real
    ranking.train(cfg, resume=True, progress=False)  # rebuilds the same rows: the saved state names them
    n = len(_train_samples(cfg)[1])
    assert -(-n // 16) == 7
    # steps after the checkpoint were lost with the crash: their samples are trained again, the others are not
    _assert_each_sample_once_per_epoch(crashed.samples[:resumed_from] + resumed.samples, cfg.run_dir, np.arange(n), 2)
    if not extra:
        assert len(crashed.samples[:resumed_from] + resumed.samples) == 2 * -(-n // 16)  # an uninterrupted run's steps


def test_token_budget_batches_vary_and_keep_each_sample_once(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    recorder = StepRecorder(monkeypatch)
    cfg = _cfg(tmp_path, data_dir, *PIPELINE, "train.token_budget=300")
    ranking.train(cfg, progress=False)
    sizes = [len(r) for r in recorder.samples]
    assert len(set(sizes)) > 2  # samples per batch vary...
    assert max(recorder.tokens) <= 300  # ...within the budget (every sample has <= max_seq_len=64 tokens)
    _assert_each_sample_once_per_epoch(recorder.samples, cfg.run_dir, np.arange(len(_train_samples(cfg)[1])), 2)


@pytest.mark.parametrize("listwise_weight", [0.0, 0.5])
def test_token_weighted_loss_is_additive_over_batches(tmp_path: Path, data_dir: Path, listwise_weight: float) -> None:  # noqa: F811
    """Every label (and positive list) weighs a constant 1/reference whatever the batch: two batches'
    objectives and gradients add up to those of their union, which per-batch means would not."""
    budget = 512
    cfg = _cfg(tmp_path, data_dir, *PIPELINE, f"train.token_budget={budget}", "model.dropout=0.0",
               f"ranking.listwise_weight={listwise_weight}")  # fmt: skip
    s, samples = _train_samples(cfg)
    tokens = sample_tokens(s.data, samples, 64)
    s.reference = token_reference(s.data, samples, tokens, budget, 0 if listwise_weight else None)
    # a batch of average content gets about the per-batch-mean loss
    num_labels = (~torch.isnan(s.data.labels[samples.events])).sum(0).double()
    torch.testing.assert_close(s.reference.labels, num_labels * budget / tokens.sum(), rtol=1e-12, atol=0.0)

    params = [p for p in s.model.parameters() if p.requires_grad]
    parts = []
    for ids in (torch.arange(0, 3), torch.arange(3, 12), torch.arange(0, 12)):  # batches of different sizes, their union
        objective, mean = ranking._loss(s, ranking._batch(s, samples, ids))
        grads = torch.autograd.grad(objective, params, allow_unused=True)
        parts.append((objective.detach(), mean.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]))
    (a, mean_a, grads_a), (b, mean_b, grads_b), (ab, mean_ab, grads_ab) = parts
    torch.testing.assert_close(a + b, ab, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close([ga + gb for ga, gb in zip(grads_a, grads_b)], grads_ab, rtol=1e-4, atol=1e-6)
    assert not torch.isclose(mean_a + mean_b, mean_ab)  # the unweighted per-batch mean is not additive

    s.reference = None  # without a budget the objective is the per-batch mean (the memory loader's loss)
    objective, mean = ranking._loss(s, ranking._batch(s, samples, torch.arange(0, 12)))
    assert objective is mean
    torch.testing.assert_close(mean.detach(), mean_ab, rtol=1e-6, atol=0.0)


def test_ranking_accepts_the_pipeline_loader(tmp_path: Path, data_dir: Path) -> None:  # noqa: F811
    cfg = _cfg(tmp_path, data_dir, *PIPELINE, "train.token_budget=256")
    assert cfg.train.loader == "pipeline" and cfg.train.token_budget == 256


def test_state_dict_before_the_first_epoch(tmp_path: Path, data_dir: Path) -> None:  # noqa: F811
    with pytest.raises(RuntimeError, match="before the first epoch_iter"):
        ranking_source([tmp_path / "none.parquet"], 64, 16, num_steps_estimate=1).state_dict()


def test_a_state_of_other_samples_is_refused(tmp_path: Path, data_dir: Path) -> None:  # noqa: F811
    """The rows are rebuilt on resume: a state saved for other samples (another dataset or setting) is an
    error naming both, not a silent replay of the wrong rows; one saved for a samples file (an older run)
    is checked by its row count."""
    s, samples = _train_samples(_cfg(tmp_path, data_dir))
    pipe = ranking_pipeline(ranking_sample_source(s.data, samples, 64), 64, 10, num_workers=1)
    next(iter(pipe))
    state = pipe.state_dict()
    assert ranking_pipeline(ranking_sample_source(s.data, samples, 64), 64, 10, state=state).state.num_consumed == 10
    with pytest.raises(ValueError, match="samples differ"):
        ranking_pipeline(ranking_sample_source(s.data, samples, 48), 48, 10, state=state)
    state["files"][0]["path"] = str(tmp_path / "samples" / "train-00000.parquet")  # as an older run saved it
    assert ranking_pipeline(ranking_sample_source(s.data, samples, 48), 48, 10, state=state).state.num_consumed == 10
