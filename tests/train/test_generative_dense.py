"""``generative.dense_head`` / ``generative.rescore`` through the recipe: config checks, train -> resume -> eval
(`recforge eval`) -> retrieve, the re-scored list against its definition, items coded after training, and
another catalogue refused."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file

from recforge.cli import main
from recforge.config import ConfigError, load_config
from recforge.data.dataset import load_dataset, write_dataset
from recforge.data.sid_sequences import eval_samples, transition_samples
from recforge.generate import Retriever
from recforge.train import generative
from recforge.train.sid_fit import add_items
from _sid_runs import RUN_TINY as TINY
from _sid_runs import check_retrieves_evaluated, histories_of, run_args, sid_dataset

CONFIG = "configs/beauty-sid-tiger-dense.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sid_dataset(tmp_path_factory.mktemp("dense") / "data", seed=5)


def _args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    return run_args(tmp_path, data, *TINY, *extra)


def test_the_dense_config_is_the_tiger_config_plus_the_options() -> None:
    base, dense = load_config("configs/beauty-sid-tiger.yaml").to_dict(), load_config(CONFIG).to_dict()
    g = base["generative"]
    assert not g["dense_head"] and g["rescore"] == 0.0 and g["dense_weight"] == 1.0  # off by default
    assert dense["generative"]["dense_head"] and dense["generative"]["rescore"] > 0
    dense["generative"].update(dense_head=False, rescore=0.0, dense_weight=1.0)
    dense["name"] = base["name"]
    assert dense == base


def test_config_errors_name_the_fix(tmp_path: Path, data: Path) -> None:
    with pytest.raises(ConfigError, match="generative.dense_head is off and generative.dense_scorer is empty; set generative.dense_scorer="):
        load_config("configs/beauty-sid-tiger.yaml", _args(tmp_path, data, "generative.rescore=0.5"))
    with pytest.raises(ConfigError, match="only model.kind=tiger has a dense head"):
        load_config(CONFIG, _args(tmp_path, data, "model.kind=sid_hstu", "generative.rescore=0"))
    with pytest.raises(ConfigError, match="generative.rescore"):
        load_config(CONFIG, _args(tmp_path, data, "generative.rescore=-1"))
    with pytest.raises(ConfigError, match="generative.dense_weight"):
        load_config(CONFIG, _args(tmp_path, data, "generative.dense_weight=0"))


def test_the_objective_adds_the_weighted_full_catalogue_softmax(tmp_path: Path, data: Path) -> None:
    s = generative.setup(load_config(CONFIG, _args(tmp_path, data, "generative.dense_weight=0.5")))
    s.model.eval()  # no dropout: the parts can be recomputed
    every = transition_samples(s.seqs, s.holdout)
    samples = every[torch.randperm(every.shape[0])[:32]]
    batch = generative.training_batch(s, samples)
    objective, logged = generative._loss(s, batch)
    sid, user = s.model.loss_and_user(batch.history, batch.mask, batch.targets, batch.items)
    logits = user @ torch.nn.functional.normalize(s.model.dense_items.weight, dim=-1).T / s.cfg.loss.temperature
    logits[:, 0] = -torch.inf  # the padding row is no class
    dense = torch.nn.functional.cross_entropy(logits, batch.target_items)
    torch.testing.assert_close(objective, sid + 0.5 * dense, rtol=1e-5, atol=1e-6)
    assert logged is objective and batch.target_items.min() >= 1
    objective.backward()
    assert s.model.dense_items.weight.grad[1:].abs().sum() > 0 and s.model.dense_user.weight.grad.abs().sum() > 0
    # off: the batch carries no targets for a head, and the objective is the SID model's own loss
    off = generative.setup(load_config("configs/beauty-sid-tiger.yaml", _args(tmp_path, data)))
    off.model.eval()
    off_batch = generative.training_batch(off, samples)
    assert off_batch.target_items is None
    assert torch.equal(generative._loss(off, off_batch)[0], off.model.loss(off_batch.history, off_batch.mask,
                                                                           off_batch.targets))  # fmt: skip


def test_train_resume_eval_and_retrieve_with_a_dense_head(tmp_path: Path, data: Path) -> None:
    args = _args(tmp_path, data, "train.epochs=2", "train.eval_every=1")
    assert main(["--no-progress", "train", CONFIG, *args, "train.max_steps=2"]) == 0
    assert main(["--no-progress", "train", CONFIG, *args, "--resume"]) == 0
    straight = tmp_path / "straight"
    assert main(["--no-progress", "train", CONFIG, *args, f"train.output_dir={straight}"]) == 0
    step_dir = json.loads((straight / "checkpoints/latest.json").read_text())["step_dir"]
    weights = load_file(straight / "checkpoints" / step_dir / "model.safetensors")
    resumed = load_file(tmp_path / "run/checkpoints" / step_dir / "model.safetensors")
    for name, value in weights.items():  # the dense head resumes like every other weight
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
    s, _, _ = generative.load_run(straight)
    assert weights["item_id_vocab"].tolist() == s.seqs.item_vocab.tolist()  # each row's raw ID is saved with it
    assert weights["dense_items.weight"].shape == (31, 16) and "item_embedding.weight" not in weights

    assert main(["eval", str(straight)]) == 0  # `recforge eval` on the run's own settings (rescore 1.0)
    result = json.loads((straight / "eval.json").read_text())
    assert result["num_users"] == 50 and result["rescore"] == 1.0 and 0.0 <= result["ndcg@10"] <= result["hr@10"] <= 1.0
    assert main(["eval", str(straight), "generative.rescore=0", "--split", "valid"]) == 0  # another weight, on valid
    valid = json.loads((straight / "eval-valid.json").read_text())
    assert valid["split"] == "valid" and valid["rescore"] == 0.0 and "generative.rescore=0" in valid["command"]
    assert json.loads((straight / "eval.json").read_text()) == result  # the test result is left alone
    assert main(["eval", str(straight), "generative.dense_candidates=6", "--split", "valid"]) == 0  # LIGER's candidates
    liger = json.loads((straight / "eval-valid.json").read_text())
    assert liger["dense_candidates"] == 6 and liger["rescore"] == 1.0 and "generative.dense_candidates=6" in liger["command"]
    assert 0.0 <= liger["ndcg@10"] <= liger["hr@10"] <= 1.0
    assert result["dense_candidates"] == 0  # the run's own setting: the beam's items only

    # the re-scored list is its definition: the generation-only list of every beam item, + rescore x dense logit
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1)[:24], 1)
    items, scores, targets = generative.generated_items(s, samples, k=10)
    s.cfg.generative.rescore = 0.0
    every, sid_scores, _ = generative.generated_items(s, samples, k=10 * s.trie.max_items_per_leaf)
    with torch.no_grad():
        history, mask, rows, _ = generative._inputs(s, samples)
        user = s.model.start(history, mask, rows).user
        dense = s.model.dense_logits(user, every)  # trie item i = dense index i + 1 = table row i + 1
    for row in range(samples.shape[0]):
        keep = every[row] > 0
        combined = sid_scores[row][keep] + 1.0 * dense[row][keep]
        order = torch.argsort(combined, descending=True, stable=True)[:10]
        assert items[row][: order.numel()].tolist() == every[row][keep][order].tolist()
        torch.testing.assert_close(scores[row][: order.numel()], combined[order], rtol=1e-5, atol=1e-5)
    assert not torch.equal(items, every[:, :10])  # the dense head reorders some lists

    # the Retriever takes the run's rescore and returns exactly the evaluated list for a history without its target
    retriever = Retriever.from_run(straight, device="cpu")
    assert retriever.rescore == 1.0
    histories = histories_of(s, samples)
    check_retrieves_evaluated(retriever, s, histories, targets, items, scores, beam=10)
    with pytest.raises(ValueError, match="needs a model with a dense head"):
        Retriever(s.model.__class__(s.model.cfg.__class__(num_levels=2, vocab_size=8)), retriever.item_vocab,
                  retriever.item_codes, retriever.trie, retriever.max_items, rescore=1.0)  # fmt: skip


def _grown(tmp_path: Path, data: Path) -> Path:
    dataset = load_dataset(data)
    extra = dataset.items.slice(0, 1).set_column(0, "item_id", pa.array([5000], pa.int64()))
    return write_dataset(tmp_path / "grown", dataset.events, pa.concat_tables([dataset.items, extra]), name="g", source="t")


def test_items_coded_after_training_keep_their_sid_score_and_other_catalogues_are_refused(tmp_path: Path, data: Path) -> None:
    assert main(["--no-progress", "train", CONFIG, *_args(tmp_path, data, "train.epochs=1")]) == 0
    run = tmp_path / "run"
    grown = _grown(tmp_path, data)
    assert add_items(run / "sids", grown)["added"] == 1
    retriever = Retriever.from_run(run, device="cpu")
    generation = Retriever(retriever.model, retriever.item_vocab, retriever.item_codes, retriever.trie,
                           retriever.max_items, retriever.config)  # fmt: skip
    new = int(retriever.catalogue.dense_ids([5000], "history")[0][0])
    assert int(retriever.item_rows[new]) == 0  # no dense row
    raw = load_dataset(data).events.column("item_id").to_pylist()
    allowed = [5000, *raw[10:16]]
    (items, scores), = retriever.retrieve([raw[:4]], k=7, beam=10, allowed_items=[allowed])
    (plain_items, plain_scores), = generation.retrieve([raw[:4]], k=7, beam=10, allowed_items=[allowed])
    assert 5000 in items and set(items) == set(plain_items)  # the same candidates, re-sorted
    assert scores[items.index(5000)] == pytest.approx(plain_scores[plain_items.index(5000)], abs=1e-6)
    assert any(abs(a - plain_scores[plain_items.index(i)]) > 1e-3 for i, a in zip(items, scores, strict=True))
    # evaluation and resuming on another catalogue of the same size are refused: the table rows are the training's
    dataset = load_dataset(grown)
    item_ids = dataset.events.column("item_id")
    moved = pc.if_else(pc.equal(item_ids, item_ids[0]), 5000, item_ids).cast(pa.int64())  # one item renamed
    events = dataset.events.set_column(dataset.events.schema.get_field_index("item_id"), "item_id", moved)
    other = write_dataset(tmp_path / "other", events, dataset.items, name="o", source="t")
    with pytest.raises(ValueError, match="another item catalogue"):
        generative.evaluate_run(run, overrides=[f"data.path={other}", f"generative.sids={run / 'sids'}"])
    cfg = load_config(CONFIG, _args(tmp_path, data, "train.epochs=2", f"data.path={other}", f"generative.sids={run / 'sids'}"))
    with pytest.raises(ValueError, match="another item catalogue"):
        generative.train(cfg, resume=True, progress=False)


@pytest.mark.gpu
def test_gpu_rescored_retrieve_matches_cpu(tmp_path: Path, data: Path, cuda_device: torch.device) -> None:
    assert main(["--no-progress", "train", CONFIG, *_args(tmp_path, data, "train.epochs=1", "train.device=cpu")]) == 0
    cpu = Retriever.from_run(tmp_path / "run", device="cpu")
    gpu = Retriever.from_run(tmp_path / "run", device=str(cuda_device))
    assert gpu.rescore == cpu.rescore == 1.0
    raw = load_dataset(data).events.column("item_id").to_pylist()
    histories = [raw[i : i + 1 + i % 9] for i in range(0, 64, 8)]  # mixed lengths: padded batches
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32's ~1e-3 on a cosine is ~0.02 on a logit: it could swap items
    try:
        want, got = cpu.retrieve(histories, k=10, beam=16), gpu.retrieve(histories, k=10, beam=16)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for (items_cpu, scores_cpu), (items_gpu, scores_gpu) in zip(want, got, strict=True):
        assert items_cpu == items_gpu
        torch.testing.assert_close(torch.tensor(scores_gpu), torch.tensor(scores_cpu), rtol=1e-4, atol=1e-4)
