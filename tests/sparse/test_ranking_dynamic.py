"""The ranking recipe with ``model.embedding=dynamic``: trains, resumes exactly, exports a static prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from recforge.checkpoint import find_checkpoint, load_checkpoint
from recforge.cli import main
from recforge.config import RunConfig, load_config
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.models.ranking import RankingPrefix, load_slices, save_slices
from recforge.sparse import AdmissionConfig, DynamicEmbedding, SparseOptimConfig, TableConfig
from recforge.train import ranking

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "ranking-synthetic-hstu.yaml"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ranking-dynamic") / "impressions"
    cfg = SyntheticConfig(num_users=60, num_items=120, num_clusters=4, mean_seq_len=20, max_seq_len=50, seed=5)
    return write_synthetic(out, cfg, impressions=True)


def _cfg(out: Path, data: Path, name: str, *overrides: str) -> RunConfig:
    small = [
        "model.dim=16", "model.dqk=8", "model.dv=8", "model.head_hidden=16", "model.head=mlp", "data.max_seq_len=64",
        "ranking.max_targets=16", "train.batch_size=16", "eval.batch_size=64", "train.threads=1", "train.device=cpu",
        "train.keep_checkpoints=50", "train.epochs=3", "optim.lr=3e-3", "model.embedding=dynamic", "sparse.lr=0.01",
        "sparse.admission=count", "sparse.admission_threshold=2",
    ]  # fmt: skip
    return load_config(CONFIG, [f"data.path={data}", f"train.output_dir={out}/{{name}}", f"name={name}", *small, *overrides])


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "train_log.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> RunConfig:
    cfg = _cfg(tmp_path_factory.mktemp("runs"), data_dir, "ref")
    ranking.train(cfg, progress=False)
    return cfg


@pytest.mark.integration
def test_dynamic_tables_train_and_export_a_static_prefix(reference: RunConfig) -> None:
    losses = [loss for _, loss in _losses(reference.run_dir)]
    assert sum(losses[-5:]) < sum(losses[:5])  # it learns
    s = ranking.setup(reference)
    assert isinstance(s.model.prefix.item, DynamicEmbedding) and isinstance(s.model.prefix.context, DynamicEmbedding)
    assert s.sparse_optimizer is not None and set(s.sparse_optimizer.tables) == {s.model.prefix.item, s.model.prefix.context}
    dense = {id(p) for group in s.optimizer.param_groups for p in group["params"]}
    assert dense == {id(p) for p in s.model.parameters()}  # the tables' rows are no dense parameters
    load_checkpoint(find_checkpoint(reference.run_dir, "best"), s.model)
    assert s.model.prefix.item.num_live > 0 and s.model.prefix.context.num_live > 0
    s.model.eval()

    exported, _ = load_slices(reference.run_dir / "model")  # an ordinary RankingPrefix, as serving loads it
    assert type(exported.prefix) is RankingPrefix and isinstance(exported.prefix.item, nn.Embedding)
    samples = ranking._samples(s, "test")
    batch = ranking._batch(s, samples, torch.arange(min(16, len(samples))))
    with torch.no_grad():
        torch.testing.assert_close(exported(batch), s.model(batch), rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="to_static"):
        save_slices(s.model, reference.run_dir / "not-a-slice")


@pytest.mark.integration
def test_resume_equals_uninterrupted(tmp_path: Path, data_dir: Path, reference: RunConfig) -> None:
    train_first = _cfg(tmp_path, data_dir, "resumed", "train.max_steps=5")
    ranking.train(train_first, progress=False)
    rest = _cfg(tmp_path, data_dir, "resumed")
    ranking.train(rest, resume=True, progress=False)
    assert _losses(rest.run_dir) == _losses(reference.run_dir)  # same losses, bit for bit
    a, b = find_checkpoint(reference.run_dir) / "sparse", find_checkpoint(rest.run_dir) / "sparse"
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert any(name.startswith("prefix.context") for name in shards)
    for shard in shards:
        ta, tb = load_file(a / shard), load_file(b / shard)
        differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert ta.keys() == tb.keys() and differ in ([], ["key.counter.last_time"]), (shard, differ)  # wall clock aside
    stats = json.loads((a / "manifest.json").read_text())["tables"]["prefix.item"]["stats"]
    assert stats["admitted"] > 0 and stats["not_admitted"] > 0  # count admission at work
    assert main(["--no-progress", "eval", str(rest.run_dir)]) == 0
    assert json.loads((rest.run_dir / "eval.json").read_text()) | {"eval_seconds": 0, "command": ""} == json.loads(
        (reference.run_dir / "eval.json").read_text()
    ) | {"eval_seconds": 0, "command": ""}


def test_ids_not_admitted_read_the_default() -> None:
    table = DynamicEmbedding(
        TableConfig(name="item", dim=8, capacity=4, default="fixed", init_std=0.5, seed=3,
                    admission=AdmissionConfig(kind="count", threshold=2), optimizer=SparseOptimConfig(kind="sgd", lr=0.1))
    )  # fmt: skip
    torch.manual_seed(0)
    prefix = RankingPrefix(num_items=6, num_actions=2, num_context_values=3, dim=8, item_table=table)
    default = table.default_row.clone()
    features = {"item_ids": torch.tensor([0, 5, 5, 2]), "actions": torch.tensor([0, 1, 2, 1]), "context_ids": torch.tensor([1, 0, 0, 0])}
    (prefix(features) * torch.randn(4, 8)).sum().backward()  # training: id 5 seen twice -> admitted; id 2 once -> remembered, not admitted
    assert table.stats["admitted"] == 1 and table.num_live == 1 and 0 not in table.row_key.tolist()  # id 0 never looked up
    table.apply_gradients()
    static = prefix.to_static()
    torch.testing.assert_close(static.item.weight[2], default, rtol=0, atol=0)  # never admitted: the default row
    torch.testing.assert_close(static.item.weight[3], default, rtol=0, atol=0)  # never seen: the default row
    assert not static.item.weight[5].equal(default) and not static.item.weight[0].any()
    prefix.eval(), static.eval()
    unseen = {"item_ids": torch.tensor([2, 3, 5, 0]), "actions": torch.tensor([1, 1, 1, 0]), "context_ids": torch.tensor([0, 0, 0, 2])}
    with torch.no_grad():
        torch.testing.assert_close(static(unseen), prefix(unseen), rtol=0, atol=1e-6)
    prefix.train()
    prefix({"item_ids": torch.tensor([2]), "actions": torch.tensor([1]), "context_ids": torch.tensor([0])})
    assert table.num_live == 2  # the second sighting of id 2, a step later, admits it
