"""The ranking recipe end to end: train, eval.json with per-task AUC/GAUC, exported slices, config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recforge.cli import main
from recforge.config import ConfigError, load_config
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.models.ranking import load_slices
from recforge.train import ranking

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "ranking-synthetic-hstu.yaml"
SMALL = [
    "model.dim=16", "model.dqk=8", "model.dv=8", "model.head_hidden=16", "data.max_seq_len=64",
    "ranking.max_targets=16", "train.batch_size=16", "eval.batch_size=64", "train.threads=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "impressions"
    cfg = SyntheticConfig(num_users=60, num_items=120, num_clusters=4, mean_seq_len=20, max_seq_len=50, seed=5)
    return write_synthetic(out, cfg, impressions=True)


@pytest.mark.integration
def test_train_eval_and_export(tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture) -> None:
    overrides = [f"data.path={data_dir}", f"train.output_dir={tmp_path}/{{name}}", "train.epochs=2", *SMALL]
    assert main(["--no-progress", "train", str(CONFIG), *overrides]) == 0
    printed = capsys.readouterr().out
    assert "bayes_auc" in printed and "purchase" in printed
    run_dir = tmp_path / "ranking-synthetic-hstu"
    result = json.loads((run_dir / "eval.json").read_text())
    for task in ("click", "like", "purchase"):
        for metric in ("auc", "gauc", "bayes_auc", "bayes_gauc", "logloss"):
            assert 0 <= result[f"{task}/{metric}"] <= (1 if "auc" in metric else 10), (task, metric)
        assert result[f"{task}/bayes_auc"] > 0.55  # the generator's probabilities carry signal
    assert result["split"] == "test" and result["impressions"] > 0
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [e["split"] for e in evals] == ["valid", "valid"]

    # the exported slices reproduce the checkpoint's predictions
    cfg = load_config(run_dir / "config.yaml")
    s = ranking.setup(cfg)
    from recforge.checkpoint import find_checkpoint, load_checkpoint

    load_checkpoint(find_checkpoint(run_dir, "best"), s.model)
    s.model.eval()
    model, manifest = load_slices(run_dir / "model")
    assert [t["name"] for t in manifest["tasks"]] == ["click", "like", "purchase"]
    vocab = json.loads((run_dir / "model" / "vocab.json").read_text())
    assert len(vocab["item_ids"]) == s.data.num_items and vocab["actions"] == ["click", "like", "purchase", "view"]
    samples = ranking._samples(s, "test")
    batch = ranking._batch(s, samples, torch.arange(min(8, len(samples))))
    with torch.no_grad():
        torch.testing.assert_close(model(batch), s.model(batch))

    # `recforge eval` on the validation split writes eval-valid.json beside the test split's eval.json
    assert main(["--no-progress", "eval", str(run_dir), "--split", "valid"]) == 0
    assert json.loads((run_dir / "eval-valid.json").read_text())["split"] == "valid"
    assert json.loads((run_dir / "eval.json").read_text())["split"] == "test"


@pytest.mark.integration
def test_dlrm_interleave_listwise_mmoe_variants_train(tmp_path: Path, data_dir: Path) -> None:
    base = [f"data.path={data_dir}", f"train.output_dir={tmp_path}/{{name}}", "train.max_steps=2", *SMALL]
    for i, extra in enumerate(
        (["model.kind=dlrm"], ["ranking.action_encoding=interleave", "model.head=ple"], ["ranking.listwise_weight=1.0"],
         ["model.target_attention=din"], ["model.attn_norm=visible_mean"], ["model.kind=dlrm", "model.target_attention=din"], ["model.item_tower=0.5"], ["model.context_cross=true"])
    ):
        cfg = load_config(CONFIG, [*base, f"name=v{i}", *extra])
        summary = ranking.train(cfg, progress=False)
        assert 0 <= summary["click/auc"] <= 1


def test_refit_trains_on_train_and_valid_and_evaluates_the_last_checkpoint(tmp_path: Path, data_dir: Path) -> None:
    base = [f"data.path={data_dir}", f"train.output_dir={tmp_path}/{{name}}", "train.epochs=2", "train.eval_every=0", *SMALL]
    plain = ranking.setup(load_config(CONFIG, base))
    refit_cfg = load_config(CONFIG, [*base, "ranking.refit=true", "name=refit"])
    refit = ranking.setup(refit_cfg)
    train, valid, both = ranking._samples(plain, "train"), ranking._samples(plain, "valid"), ranking._training_samples(refit)
    assert len(ranking._training_samples(plain)) == len(train)
    assert len(both) == len(train) + len(valid) and both.num_targets == train.num_targets + valid.num_targets
    assert torch.equal(both.events.sort().values, torch.cat([train.events, valid.events]).sort().values)
    for sid in (0, len(train), len(both) - 1):  # a sample's targets are one user's, in time order
        events = both.events[both.offsets[sid] : both.offsets[sid + 1]]
        assert bool((refit.data.event_user[events] == both.user[sid]).all()) and bool((events.diff() > 0).all())
    summary = ranking.train(refit_cfg, progress=False)
    run_dir = tmp_path / "refit"
    assert summary["checkpoint"] == json.loads((run_dir / "eval.json").read_text())["checkpoint"]
    from recforge.checkpoint import find_checkpoint

    assert summary["checkpoint"] == find_checkpoint(run_dir, "latest").name


def test_ranking_config_errors_are_collected() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            CONFIG,
            ["ranking.tasks=[bad, 'x:y>=z']", "ranking.task_weights=[1, 2, 3]", "eval.select_metric=hr@10",
             "model.kind=sasrec", "ranking.max_targets=300", "ranking.test_fraction=0", "model.item_tower=0.5",
             "ranking.listwise_weight=0.5"],
        )  # fmt: skip
    message = str(err.value)
    for fragment in ("'bad'", "'z' is not a number", "3 weights for 2 tasks", "TASK/auc", "hstu, dlrm and item",
                     "max_targets", "test_fraction", "model.item_tower"):  # fmt: skip
        assert fragment in message, fragment


def test_item_tower_trains_each_tower_on_its_own_loss(tmp_path: Path, data_dir: Path) -> None:
    """With model.item_tower the objective is the main tower's loss plus the candidate tower's, each on
    its own outputs (not the loss of their mixed score)."""
    from recforge.train.losses import pointwise_loss

    overrides = [f"data.path={data_dir}", f"train.output_dir={tmp_path}", "model.item_tower=0.5", "model.dropout=0.0", *SMALL]
    s = ranking.setup(load_config(CONFIG, overrides))
    batch = ranking._batch(s, ranking._samples(s, "train"), torch.arange(16))
    objective, _ = ranking._loss(s, batch)
    labels = batch.labels["tasks"]
    main, candidate = s.model.postfix.parts(s.model.postfix_inputs(batch))
    expected = pointwise_loss(main, labels, s.kinds, s.weights)[0] + pointwise_loss(candidate, labels, s.kinds, s.weights)[0]
    torch.testing.assert_close(objective, expected, rtol=1e-6, atol=1e-6)
    mixed = pointwise_loss(s.model.postfix(s.model.postfix_inputs(batch)), labels, s.kinds, s.weights)[0]
    assert not torch.allclose(objective, mixed, rtol=1e-3)


VARIANTS = {  # ranking model variants whose bf16 step must run (each exercises other modules under autocast)
    "hstu-listwise": ["ranking.listwise_weight=0.5"],
    "din-mmoe": ["model.target_attention=din", "model.head=mmoe"],
    "tower-cross": ["model.item_tower=0.5", "model.context_cross=true"],
    "dynamic": ["model.embedding=dynamic"],
}


def _bf16_step(tmp_path: Path, data_dir: Path, variant: list[str], device: str) -> None:
    losses = {}
    for precision in ("float32", "bfloat16"):
        overrides = [f"data.path={data_dir}", f"train.output_dir={tmp_path}/{precision}", f"train.precision={precision}",
                     f"train.device={device}", "model.dropout=0.0", *SMALL, *variant]
        s = ranking.setup(load_config(CONFIG, overrides))
        seen = []
        linear = next(m for m in s.model.encoder.modules() if isinstance(m, torch.nn.Linear))
        hook = linear.register_forward_hook(lambda m, args, out, seen=seen: seen.append(out.dtype))
        samples = ranking._samples(s, "train")
        losses[precision] = ranking._train_step(s, ranking._batch(s, samples, torch.arange(16)))[0]
        hook.remove()
        assert seen == [torch.float32 if precision == "float32" else torch.bfloat16]
        assert all(p.dtype == torch.float32 for p in s.model.parameters())
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.05)


@pytest.mark.parametrize("variant", ["plain", *VARIANTS])
def test_bfloat16_precision_ranking_step(tmp_path: Path, data_dir: Path, variant: str) -> None:
    """train.precision=bfloat16 in the ranking recipe: bf16 matmuls, a finite loss close to float32's on
    the same batch, float32 weights; for each model variant."""
    _bf16_step(tmp_path, data_dir, VARIANTS.get(variant, []), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", *VARIANTS])
def test_gpu_bfloat16_precision_ranking_step(tmp_path: Path, data_dir: Path, cuda_device, variant: str) -> None:
    """The same on CUDA, whose autocast casts another set of ops (exp, log, sums, softmax) to float32."""
    _bf16_step(tmp_path, data_dir, VARIANTS.get(variant, []), str(cuda_device))
