"""Tests for the retrieval training recipe: resume equivalence, run-directory rules, evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recforge.checkpoint import find_checkpoint
from recforge.config import RunConfig, config_from_dict
from recforge.data.dataset import load_dataset
from recforge.data.sequences import UserSequences
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train import retrieval
from recforge.train.evaluate import evaluate_ranking, popularity_scorer
from recforge.train.retrieval import evaluate_run, train
from recforge.train.step import StepResult


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 users, 50 items: about 4 steps per epoch at batch size 12."""
    config = SyntheticConfig(num_users=40, num_items=50, num_clusters=5, mean_seq_len=10, min_seq_len=3, max_seq_len=30, seed=11)
    return write_synthetic(tmp_path_factory.mktemp("retrieval") / "synth", config)


def _cfg(out: Path, data: Path, *overrides: str) -> RunConfig:
    raw = {
        "name": "run",
        "data": {"path": str(data), "protocol": "paper", "max_seq_len": 20},
        "model": {"kind": "hstu", "dim": 16, "num_blocks": 1, "num_heads": 1, "dqk": 8, "dv": 8, "dropout": 0.2},
        "loss": {"negatives": "per_position", "num_negatives": 16, "temperature": 0.05},
        "train": {
            "epochs": 2, "batch_size": 12, "eval_every": 1, "output_dir": str(out / "{name}"), "device": "cpu",
            "keep_checkpoints": 50, "threads": 1, "seed": 5,
        },
        "eval": {"ks": [1, 10], "batch_size": 16},
    }  # fmt: skip
    return config_from_dict(raw, list(overrides))


def _steps_log(run_dir: Path) -> list[tuple[int, int, float]]:
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return [(r["step"], r["epoch"], r["loss"]) for r in rows]


def _final_tensors(run_dir: Path) -> tuple[dict, dict, dict]:
    ckpt = find_checkpoint(run_dir)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return load_file(ckpt / "model.safetensors"), load_file(ckpt / "optimizer.safetensors"), manifest


def _assert_tensors_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """An uninterrupted run of two epochs."""
    cfg = _cfg(tmp_path_factory.mktemp("reference"), data_dir)
    train(cfg, progress=False)
    return cfg.run_dir


def test_reference_run_layout(reference_run: Path, data_dir: Path) -> None:
    seqs = UserSequences.from_dataset(load_dataset(data_dir))
    samples = seqs.training_samples(1, 20, "last")
    steps_per_epoch = -(-samples.shape[0] // 12)
    log = _steps_log(reference_run)
    assert [s for s, _, _ in log] == list(range(1, 2 * steps_per_epoch + 1))
    assert [e for _, e, _ in log] == [0] * steps_per_epoch + [1] * steps_per_epoch
    assert all(torch.isfinite(torch.tensor(loss)) for _, _, loss in log)
    evals = [json.loads(line) for line in (reference_run / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [steps_per_epoch, 2 * steps_per_epoch]
    assert all(e["split"] == "test" for e in evals)
    for name in ("config.yaml", "eval.json", "tb", "checkpoints/latest.json"):
        assert (reference_run / name).exists(), name
    _, _, manifest = _final_tensors(reference_run)
    assert manifest["step"] == 2 * steps_per_epoch
    assert manifest["train_state"]["epoch"] == 2 and manifest["train_state"]["step_in_epoch"] == 0


def _crash_at_step(cfg: RunConfig, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Train ``cfg`` until step ``n`` raises (a simulated crash), then restore the real step."""
    real_step = retrieval._step
    calls = {"n": 0}

    def crashing_step(s, micro, lr_scale):
        if any(batch is not None for batch in micro):  # not the epoch-end call that finds no data
            calls["n"] += 1
            if calls["n"] == n:
                raise RuntimeError("simulated crash")
        return real_step(s, micro, lr_scale)

    monkeypatch.setattr(retrieval, "_step", crashing_step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(cfg, progress=False)
    monkeypatch.setattr(retrieval, "_step", real_step)


@pytest.mark.parametrize(("stop_after", "checkpoint_every"), [(3, 0), (4, 1), (5, 2)])
def test_resume_equals_uninterrupted(
    tmp_path: Path, data_dir: Path, reference_run: Path, stop_after: int, checkpoint_every: int
) -> None:
    first = _cfg(tmp_path, data_dir, f"train.max_steps={stop_after}", f"train.checkpoint_every={checkpoint_every}")
    train(first, progress=False)
    assert _steps_log(first.run_dir)[-1][0] == stop_after
    assert find_checkpoint(first.run_dir).name == f"step_{stop_after:08d}"

    rest = _cfg(tmp_path, data_dir, f"train.checkpoint_every={checkpoint_every}")
    summary = train(rest, resume=True, progress=False)

    reference = _steps_log(reference_run)
    assert _steps_log(rest.run_dir) == reference  # same per-step losses, bit for bit
    assert summary["step"] == reference[-1][0]
    model_a, optim_a, manifest_a = _final_tensors(reference_run)
    model_b, optim_b, manifest_b = _final_tensors(rest.run_dir)
    _assert_tensors_equal(model_a, model_b)
    _assert_tensors_equal(optim_a, optim_b)
    assert manifest_a["train_state"]["global_step"] == manifest_b["train_state"]["global_step"]
    assert manifest_a["train_state"]["epoch"] == manifest_b["train_state"]["epoch"]


def test_resume_after_crash_replays_lost_steps(
    tmp_path: Path, data_dir: Path, reference_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after the step-4 checkpoint: rows logged after it are dropped and replayed."""
    cfg = _cfg(tmp_path, data_dir, "train.checkpoint_every=4")
    _crash_at_step(cfg, 6, monkeypatch)
    logged = [s for s, _, _ in _steps_log(cfg.run_dir)]
    assert logged == [1, 2, 3, 4, 5]
    assert find_checkpoint(cfg.run_dir).name == "step_00000004"

    train(cfg, resume=True, progress=False)
    assert _steps_log(cfg.run_dir) == _steps_log(reference_run)
    _assert_tensors_equal(_final_tensors(reference_run)[0], _final_tensors(cfg.run_dir)[0])


def test_existing_run_refuses_to_start_without_resume(tmp_path: Path, data_dir: Path) -> None:
    cfg = _cfg(tmp_path, data_dir, "train.max_steps=1", "train.eval_every=0")
    train(cfg, progress=False)
    before = (cfg.run_dir / "train_log.jsonl").read_text()
    with pytest.raises(ValueError, match="already holds a run; pass --resume"):
        train(cfg, progress=False)
    assert (cfg.run_dir / "train_log.jsonl").read_text() == before  # nothing was touched


def test_resume_without_checkpoint_raises(tmp_path: Path, data_dir: Path) -> None:
    cfg = _cfg(tmp_path, data_dir)
    with pytest.raises(ValueError, match="no checkpoint to resume from"):
        train(cfg, resume=True, progress=False)


def test_evaluate_run_writes_eval_json(reference_run: Path, data_dir: Path) -> None:
    result = evaluate_run(reference_run, split="test", checkpoint="latest")
    written = json.loads((reference_run / "eval.json").read_text())
    assert written == result
    assert result["split"] == "test"
    with pytest.raises(ValueError, match="data.protocol=paper"):  # the paper protocol trained on the valid item
        evaluate_run(reference_run, split="valid")
    assert result["protocol"] == "paper"
    assert result["model"] == "hstu"
    assert result["dataset"] == data_dir.name
    assert result["checkpoint"] == find_checkpoint(reference_run).name
    for key in ("hr@1", "hr@10", "ndcg@1", "ndcg@10", "mrr"):
        assert 0.0 <= result[key] <= 1.0, key
    seqs = UserSequences.from_dataset(load_dataset(data_dir))
    assert result["num_users"] == seqs.evaluable_users(2).numel()
    test = evaluate_run(reference_run)
    assert test["split"] == "test" and test["num_users"] == seqs.evaluable_users(1).numel()
    # evaluation is deterministic
    assert evaluate_run(reference_run)["mrr"] == test["mrr"]


def test_evaluate_run_errors(tmp_path: Path, reference_run: Path) -> None:
    with pytest.raises(ValueError, match="not a recforge run directory"):
        evaluate_run(tmp_path)
    with pytest.raises(ValueError, match="split='train'"):
        evaluate_run(reference_run, split="train")


def test_checkpoint_choice_by_protocol(tmp_path: Path, data_dir: Path) -> None:
    """auto = best for the clean protocol (chosen on validation), latest for the paper protocol."""
    cfg = _cfg(tmp_path, data_dir, "data.protocol=clean", "train.epochs=3")
    summary = train(cfg, progress=False)
    evals = [json.loads(line) for line in (cfg.run_dir / "evals.jsonl").read_text().splitlines()]
    assert len(evals) == 3 and all(e["split"] == "valid" for e in evals)
    best_row = max(evals, key=lambda e: e["ndcg@10"])  # first maximum wins, as in training
    best = find_checkpoint(cfg.run_dir, "best")
    assert best.name == f"step_{best_row['step']:08d}"
    assert summary["checkpoint"] == best.name and summary["split"] == "test"

    # point `best` at the first epoch's checkpoint: clean-protocol evaluation must follow it
    first = f"step_{evals[0]['step']:08d}"
    (cfg.run_dir / "checkpoints" / "best.json").write_text(json.dumps({"step_dir": first}))
    result = evaluate_run(cfg.run_dir)
    assert result["checkpoint"] == first and result["step"] == evals[0]["step"]
    assert evaluate_run(cfg.run_dir, checkpoint="latest")["checkpoint"] == find_checkpoint(cfg.run_dir).name
    explicit = evaluate_run(cfg.run_dir, checkpoint=str(cfg.run_dir / "checkpoints" / first))
    assert explicit["hr@10"] == result["hr@10"] and explicit["mrr"] == result["mrr"]

    # the paper protocol ignores `best` and evaluates the latest checkpoint
    paper = _cfg(tmp_path / "paper", data_dir, "train.epochs=2", "train.max_steps=5")
    train(paper, progress=False)
    (paper.run_dir / "checkpoints" / "best.json").write_text(json.dumps({"step_dir": "step_00000004"}))
    assert evaluate_run(paper.run_dir)["checkpoint"] == find_checkpoint(paper.run_dir).name == "step_00000005"


def test_clean_protocol_never_trains_on_validation_or_test_items(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen_labels = []
    real_loss = retrieval.sampled_softmax_loss

    def spy(user, targets, *args, **kwargs):
        seen_labels.append(targets.clone())
        return real_loss(user, targets, *args, **kwargs)

    monkeypatch.setattr(retrieval, "sampled_softmax_loss", spy)
    cfg = _cfg(tmp_path, data_dir, "data.protocol=clean", "train.epochs=1", "train.eval_every=0", "data.train_windows=all")
    train(cfg, progress=False)
    seqs = UserSequences.from_dataset(load_dataset(data_dir))
    samples = seqs.training_samples(2, 20, "all")
    expected = seqs.training_batch(samples, 20).labels["next_item"]
    got = torch.cat(seen_labels)
    # the epoch trains on exactly the training transitions (in some order)
    assert torch.equal(torch.sort(got).values, torch.sort(expected).values)


@pytest.fixture(scope="module")
def learnable_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = SyntheticConfig(num_users=300, num_items=80, num_clusters=8, mean_seq_len=20, min_seq_len=5, max_seq_len=40, seed=3)
    return write_synthetic(tmp_path_factory.mktemp("learnable") / "synth", config)


def test_tiny_hstu_beats_popularity(tmp_path: Path, learnable_data: Path) -> None:
    cfg = _cfg(
        tmp_path, learnable_data, "loss.negatives=full", "optim.lr=0.01", "model.dropout=0.0",
        "train.epochs=5", "train.batch_size=32", "train.eval_every=0", "train.keep_checkpoints=1",
        "model.dqk=16", "model.dv=16", f"train.seed={int(torch.randint(0, 1000, ()).item())}",
    )  # fmt: skip
    model = train(cfg, progress=False)
    seqs = UserSequences.from_dataset(load_dataset(learnable_data))
    pop, _ = evaluate_ranking(
        seqs, popularity_scorer(seqs.item_counts(1)), target_from_end=1, max_seq_len=20, ks=[10], batch_size=512
    )
    assert model["num_users"] == pop["num_users"] == 300
    assert model["hr@10"] > pop["hr@10"] + 0.2, (model, pop)
    assert model["ndcg@10"] > pop["ndcg@10"] + 0.1, (model, pop)


def _config_or_none(out: Path, data: Path, *overrides: str) -> RunConfig | None:
    """The config, or None when validation rejects it (an acceptable fix for the cases below)."""
    from recforge.config import ConfigError

    try:
        return _cfg(out, data, *overrides)
    except ConfigError:
        return None


def test_log_every_zero_is_rejected_or_works(tmp_path: Path, data_dir: Path) -> None:
    cfg = _config_or_none(tmp_path, data_dir, "train.log_every=0", "train.max_steps=2")
    if cfg is not None:
        train(cfg, progress=False)


def test_select_metric_missing_from_ks_is_rejected_or_works(tmp_path: Path, data_dir: Path) -> None:
    cfg = _config_or_none(tmp_path, data_dir, "eval.ks=[1, 5]", "train.epochs=1")
    if cfg is not None:
        train(cfg, progress=False)


def test_lr_schedule_shapes() -> None:
    from recforge.train.loop import lr_at

    def conf(**optim):
        return config_from_dict({"data": {"path": "unused"}, "optim": optim})

    cfg = conf(lr=0.01, schedule="cosine", warmup_steps=4, min_lr_fraction=0.1)
    lrs = [lr_at(cfg, s, 24) for s in range(24)]
    assert lrs[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01], rel=1e-12)  # linear warm-up
    assert lrs[4] == pytest.approx(0.01, rel=1e-12)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # then non-increasing
    assert lr_at(cfg, 24, 24) == pytest.approx(0.001, rel=1e-12)  # ends at lr * min_lr_fraction
    assert lr_at(cfg, 14, 24) == pytest.approx(0.001 + 0.009 * 0.5, rel=1e-12)  # half way: the mean
    linear = conf(lr=0.01, schedule="linear")
    assert [lr_at(linear, s, 4) for s in range(5)] == pytest.approx([0.01, 0.0075, 0.005, 0.0025, 0.0], abs=1e-15)
    assert lr_at(conf(), 1000, 10) == 1e-3  # constant by default
    with pytest.raises(ValueError, match="optim.schedule"):
        conf(schedule="step")
    with pytest.raises(ValueError, match="min_lr_fraction"):
        conf(min_lr_fraction=1.5)


def test_scheduled_run_resumes_exactly(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The learning rate is a function of the global step: a crash and resume follow the same schedule."""
    sched = ("optim.schedule=cosine", "optim.warmup_steps=3", "train.checkpoint_every=4")
    reference = _cfg(tmp_path / "ref", data_dir, *sched)
    train(reference, progress=False)
    cfg = _cfg(tmp_path / "crash", data_dir, *sched)
    _crash_at_step(cfg, 6, monkeypatch)
    train(cfg, resume=True, progress=False)
    assert _steps_log(cfg.run_dir) == _steps_log(reference.run_dir)
    _assert_tensors_equal(_final_tensors(reference.run_dir)[0], _final_tensors(cfg.run_dir)[0])
    constant = _cfg(tmp_path / "const", data_dir, "train.max_steps=6")
    train(constant, progress=False)
    assert _steps_log(constant.run_dir)[5][2] != _steps_log(reference.run_dir)[5][2]  # the schedule changed training


def test_non_finite_loss_stops_the_run_before_a_checkpoint(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN loss raises naming the step; no checkpoint is written from the corrupted weights."""
    real_step, calls = retrieval._step, []

    def step(s, micro, lr_scale):
        result = real_step(s, micro, lr_scale)
        if result is None:  # the epoch-end call that finds no data
            return None
        calls.append(1)
        return StepResult(float("nan") if len(calls) == 6 else result.loss, result.tokens)  # epoch 2 (about 4 steps per epoch)

    monkeypatch.setattr(retrieval, "_step", step)
    cfg = _cfg(tmp_path, data_dir)
    with pytest.raises(FloatingPointError, match="training loss is nan at step 6"):
        train(cfg, progress=False)
    steps = [json.loads((d / "manifest.json").read_text())["step"] for d in (cfg.run_dir / "checkpoints").iterdir()
             if (d / "manifest.json").is_file()]  # fmt: skip
    assert steps and max(steps) < 6


@pytest.mark.parametrize("kind", ["hstu", "sasrec"])
def test_bfloat16_precision_trains_in_bf16_with_float32_weights(tmp_path: Path, data_dir: Path, kind: str) -> None:
    """train.precision=bfloat16: the encoder's matmuls run in bf16 under autocast, the loss is finite and
    close to float32's on the same first batch, and weights and optimizer state stay float32."""
    overrides = [f"model.kind={kind}", "model.dropout=0.0", "train.epochs=1", "train.max_steps=3"]
    seen: list[torch.dtype] = []
    first_losses = {}
    for precision in ("float32", "bfloat16"):
        cfg = _cfg(tmp_path / precision, data_dir, *overrides, f"train.precision={precision}")
        s = retrieval.setup(cfg)
        linear = next(m for m in s.model.encoder.modules() if isinstance(m, torch.nn.Linear))
        hook = linear.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
        samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
        first_losses[precision] = retrieval._train_step(s, s.seqs.training_batch(samples[:12], cfg.data.max_seq_len))[0]
        hook.remove()
        assert all(p.dtype == torch.float32 for p in s.model.parameters())
        assert all(v.dtype == torch.float32 for st in s.optimizer.state.values() for v in st.values() if v.is_floating_point())
    assert seen == [torch.float32, torch.bfloat16]
    assert first_losses["bfloat16"] == pytest.approx(first_losses["float32"], rel=0.05)
    cfg = _cfg(tmp_path / "run", data_dir, *overrides, "train.precision=bfloat16")
    train(cfg, progress=False)
    losses = [loss for _, _, loss in _steps_log(cfg.run_dir)]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_checkpoint_write_time_is_not_counted_in_throughput(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mid-epoch checkpoint's write time stays out of the next interval's tokens_per_s."""
    import time

    from recforge.train import loop

    pause = 1.0
    real = loop.save_checkpoint

    def slow_save(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(pause)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "save_checkpoint", slow_save)
    cfg = _cfg(tmp_path, data_dir, "train.epochs=1", "train.eval_every=0", "train.checkpoint_every=2",
               "train.log_every=1")  # fmt: skip
    train(cfg, progress=False)
    rows = [json.loads(line) for line in (cfg.run_dir / "train_log.jsonl").read_text().splitlines()]
    assert len(rows) >= 3
    for row in rows:  # log_every=1: each row's interval is one step
        seconds = row["tokens"] / row["tokens_per_s"]
        assert seconds < pause / 2, (row["step"], seconds)
