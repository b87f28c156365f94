"""The retrieval recipe with ``model.embedding=dynamic``: trains, checkpoints the table, resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from recforge.checkpoint import find_checkpoint
from recforge.config import RunConfig, config_from_dict
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.sparse import DynamicEmbedding
from recforge.train.retrieval import evaluate_run, setup, train


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = SyntheticConfig(num_users=40, num_items=50, num_clusters=5, mean_seq_len=10, min_seq_len=3, max_seq_len=30, seed=11)
    return write_synthetic(tmp_path_factory.mktemp("dynamic") / "synth", config)


def _cfg(out: Path, data: Path, name: str, *overrides: str) -> RunConfig:
    raw = {
        "name": name,
        "data": {"path": str(data), "protocol": "paper", "max_seq_len": 20},
        "model": {"kind": "hstu", "dim": 16, "num_blocks": 1, "num_heads": 1, "dqk": 8, "dv": 8, "dropout": 0.2, "embedding": "dynamic"},
        "sparse": {"optimizer": "adam", "lr": 0.01, "capacity": 16, "admission": "count", "admission_threshold": 2},
        "loss": {"negatives": "per_position", "num_negatives": 16, "temperature": 0.05},
        "train": {"epochs": 2, "batch_size": 12, "eval_every": 1, "output_dir": str(out / "{name}"), "device": "cpu",
                  "keep_checkpoints": 50, "threads": 1, "seed": 5},
        "eval": {"ks": [1, 10], "batch_size": 16},
    }  # fmt: skip
    return config_from_dict(raw, list(overrides))


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "train_log.jsonl").read_text().splitlines())]


def test_dynamic_item_table_trains_and_resumes_exactly(tmp_path: Path, data_dir: Path) -> None:
    reference = _cfg(tmp_path, data_dir, "ref")
    summary = train(reference, progress=False)
    assert 0.0 <= summary["hr@10"] <= 1.0
    ckpt = find_checkpoint(reference.run_dir)
    assert (ckpt / "sparse" / "manifest.json").is_file()
    s = setup(reference)
    table = s.model.prefix.item_embedding
    assert isinstance(table, DynamicEmbedding) and s.sparse_optimizer is not None
    assert all(not isinstance(p, DynamicEmbedding) for p in s.optimizer.param_groups[0]["params"])

    first = _cfg(tmp_path, data_dir, "resumed", "train.max_steps=3")
    train(first, progress=False)
    rest = _cfg(tmp_path, data_dir, "resumed")
    train(rest, resume=True, progress=False)
    assert _losses(rest.run_dir) == _losses(reference.run_dir)  # same losses, bit for bit
    a, b = find_checkpoint(reference.run_dir) / "sparse", find_checkpoint(rest.run_dir) / "sparse"
    for shard in sorted(p.name for p in a.glob("*.safetensors")):
        ta, tb = load_file(a / shard), load_file(b / shard)
        differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert ta.keys() == tb.keys() and differ in ([], ["key.counter.last_time"]), (shard, differ)  # wall clock aside
    manifest = json.loads((a / "manifest.json").read_text())["tables"]["prefix.item_embedding"]
    assert manifest["stats"]["admitted"] > 0 and manifest["stats"]["not_admitted"] > 0  # count admission at work
    assert evaluate_run(rest.run_dir)["hr@10"] == evaluate_run(reference.run_dir)["hr@10"]



def test_a_run_with_dynamic_tables_writes_its_checkpoints_at_the_step(tmp_path: Path, data_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamic tables change every step (rows, keys, free lists, counters) and are not in the background writer's host
    snapshot, so a run with one writes each checkpoint before the next step, never in the background."""
    import recforge.train.loop as loop

    def no_snapshot(*args, **kwargs):
        raise AssertionError("a run with dynamic tables took the background checkpoint path")

    monkeypatch.setattr(loop, "host_snapshot", no_snapshot)
    cfg = _cfg(tmp_path, data_dir, "sync", "train.epochs=1")
    train(cfg, progress=False)
    assert (find_checkpoint(cfg.run_dir) / "sparse" / "manifest.json").is_file()


def test_dynamic_tables_follow_the_run_learning_rate_schedule(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """optim.schedule (here a warm-up) scales the sparse tables' learning rate each step, as the dense one's."""
    from recforge.sparse import SparseOptimizer
    from recforge.train.loop import lr_at

    scales = []
    real = SparseOptimizer.step

    def recording(self, lr_scale: float = 1.0) -> None:
        scales.append(lr_scale)
        real(self, lr_scale)

    monkeypatch.setattr(SparseOptimizer, "step", recording)
    cfg = _cfg(tmp_path, data_dir, "warm", "optim.warmup_steps=4", "train.max_steps=6", "train.eval_every=0")
    train(cfg, progress=False)
    assert scales == pytest.approx([lr_at(cfg, step, 6) / cfg.optim.lr for step in range(6)], rel=1e-12)
    assert scales[0] == pytest.approx(0.25) and scales[-1] == pytest.approx(1.0)
