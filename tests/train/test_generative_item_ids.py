"""``generative.item_id_embedding`` through the recipe: config checks, train -> resume -> eval -> retrieve,
the checkpoint's ID table and raw IDs, items coded after training, and another catalogue refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file

from recforge.cli import main
from recforge.config import ConfigError, load_config
from recforge.data.dataset import load_dataset, write_dataset
from recforge.data.sid_sequences import eval_samples
from recforge.generate import RetrieveRequest, Retriever
from recforge.generate.sid_run import load_sid_run
from recforge.generate.trie import SidTrie
from recforge.train import generative
from recforge.train.sid_fit import add_items
from _sid_runs import RUN_TINY as TINY
from _sid_runs import check_retrieves_evaluated, histories_of, run_args, sid_dataset

CONFIG = "configs/beauty-sid-tiger-ids.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sid_dataset(tmp_path_factory.mktemp("ids") / "data", seed=4)


def _args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    return run_args(tmp_path, data, *TINY, *extra)


def test_the_ids_config_is_the_tiger_config_plus_the_option() -> None:
    base, ids = load_config("configs/beauty-sid-tiger.yaml").to_dict(), load_config(CONFIG).to_dict()
    assert not base["generative"]["item_id_embedding"] and ids["generative"]["item_id_embedding"]
    ids["generative"]["item_id_embedding"], ids["name"] = False, base["name"]
    assert ids == base


def test_config_errors_name_the_fix(tmp_path: Path, data: Path) -> None:
    with pytest.raises(ConfigError, match="only model.kind=tiger reads history item IDs"):
        load_config(CONFIG, _args(tmp_path, data, "model.kind=sid_hstu"))
    with pytest.raises(ConfigError, match="generative.item_id_embedding"):
        load_config(CONFIG, _args(tmp_path, data, "generative.item_id_embedding=3"))


def test_train_resume_eval_and_retrieve_with_item_ids(tmp_path: Path, data: Path) -> None:
    args = _args(tmp_path, data, "train.epochs=2", "train.eval_every=1")
    assert main(["--no-progress", "train", CONFIG, *args, "train.max_steps=2"]) == 0
    assert main(["--no-progress", "train", CONFIG, *args, "--resume"]) == 0
    straight = tmp_path / "straight"
    assert main(["--no-progress", "train", CONFIG, *args, f"train.output_dir={straight}"]) == 0
    step_dir = json.loads((straight / "checkpoints/latest.json").read_text())["step_dir"]
    weights = load_file(straight / "checkpoints" / step_dir / "model.safetensors")
    resumed = load_file(tmp_path / "run/checkpoints" / step_dir / "model.safetensors")
    for name, value in weights.items():  # the ID table resumes like every other weight
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
    dataset_vocab = generative.setup(load_config(CONFIG, args)).seqs.item_vocab
    assert weights["item_id_vocab"].tolist() == dataset_vocab.tolist()  # each row's raw ID is saved with it
    assert weights["item_embedding.weight"].shape == (31, 16) and weights["item_embedding.weight"][0].abs().sum() == 0
    assert weights["item_embedding.weight"][1:].std() > 0.1  # trained rows

    result = generative.evaluate_run(straight)
    assert result["num_users"] == 50 and 0.0 <= result["ndcg@10"] <= result["hr@10"] <= 1.0
    s, _, _ = generative.load_run(straight)
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1)[:16], 1)
    items, scores, targets = generative.generated_items(s, samples, k=10)
    # the Retriever maps the catalogue's raw IDs (RUN_DIR/sids order) to the model's rows: the evaluated list
    retriever = Retriever.from_run(straight, device="cpu")
    assert torch.equal(s.model.item_id_vocab[retriever.item_rows[1:]], torch.from_numpy(retriever.item_vocab[1:]))
    histories = histories_of(s, samples)
    fresh, got = check_retrieves_evaluated(retriever, s, histories, targets, items, scores, beam=10)
    # a catalogue in another order (dense index != table row) reads the same rows, so gives the same answers
    order = torch.randperm(len(retriever.item_vocab) - 1) + 1
    codes = retriever.item_codes[torch.cat([torch.zeros(1, dtype=torch.long), order])]
    shuffled = Retriever(retriever.model, retriever.item_vocab[np.r_[0, order.numpy()]], codes,
                         SidTrie.build(codes[1:], retriever.trie.vocab_size, "dense"), retriever.max_items, retriever.config)
    assert not torch.equal(shuffled.item_rows, retriever.item_rows)
    for (want_items, want_scores), (again, again_scores) in zip(got, shuffled.retrieve([histories[row] for row in fresh],
                                                                k=10, beam=10), strict=True):  # fmt: skip
        assert set(again) == set(want_items)  # equal scores may swap places
        torch.testing.assert_close(torch.tensor(again_scores), torch.tensor(want_scores), rtol=1e-5, atol=1e-5)


def _grown(tmp_path: Path, data: Path) -> Path:
    dataset = load_dataset(data)
    extra = dataset.items.slice(0, 1).set_column(0, "item_id", pa.array([5000], pa.int64()))
    return write_dataset(tmp_path / "grown", dataset.events, pa.concat_tables([dataset.items, extra]), name="g", source="t")


def test_items_coded_after_training_read_the_zero_row(tmp_path: Path, data: Path) -> None:
    args = _args(tmp_path, data, "train.epochs=1")
    assert main(["--no-progress", "train", CONFIG, *args]) == 0
    run = tmp_path / "run"
    grown = _grown(tmp_path, data)
    assert add_items(run / "sids", grown)["added"] == 1
    retriever = Retriever.from_run(run, device="cpu")
    new = int(retriever.catalogue.dense_ids([5000], "history")[0][0])
    assert int(retriever.item_rows[new]) == 0 and int((retriever.item_rows == 0).sum()) == 2  # padding + the new item
    raw = load_dataset(data).events.column("item_id").to_pylist()
    ((items, _),) = retriever.retrieve([raw[:4] + [5000]], k=5, beam=10, allowed_items=[[5000, *raw[10:14]]],
                                       exclude_history=False)  # fmt: skip
    assert items and set(items) <= {5000, *raw[10:14]}
    # the new item's encoding is that of row 0 (an explicit zero embedding), not an index error
    codes, mask, rows = retriever.history_batch([retriever.encode(RetrieveRequest(raw[:4] + [5000]))])
    assert rows[0, -1] == 0 and rows[0, :-1].min() > 0
    with torch.no_grad():
        memory, _ = retriever.model.encode(codes, mask, rows)
        zero = rows.clone()
        zero[0, -1] = 10**6  # outside the table: the same zero row
        again, _ = retriever.model.encode(codes, mask, zero)
    torch.testing.assert_close(memory, again, rtol=0, atol=0)
    # evaluation on another catalogue of the same size is refused: the table's rows are the training catalogue's
    dataset = load_dataset(grown)
    item_ids = dataset.events.column("item_id")
    moved = pc.if_else(pc.equal(item_ids, item_ids[0]), 5000, item_ids).cast(pa.int64())  # one item renamed: same size
    events = dataset.events.set_column(dataset.events.schema.get_field_index("item_id"), "item_id", moved)
    other = write_dataset(tmp_path / "other", events, dataset.items, name="o", source="t")
    with pytest.raises(ValueError, match="another item catalogue"):
        generative.evaluate_run(run, overrides=[f"data.path={other}", f"generative.sids={run / 'sids'}"])
    # a run loads with the table its checkpoint holds, whatever the catalogue has become since
    assert load_sid_run(run, device=torch.device("cpu")).model.item_embedding.weight.shape == (31, 16)
    # and resuming it on that other catalogue is refused before any step (it trained on the wrong rows: review)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    cfg = load_config(CONFIG, _args(tmp_path, data, "train.epochs=3", f"data.path={other}", f"generative.sids={run / 'sids'}"))
    with pytest.raises(ValueError, match="another item catalogue"):
        generative.train(cfg, resume=True, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


@pytest.mark.gpu
def test_gpu_retrieve_with_item_ids_matches_cpu(tmp_path: Path, data: Path, cuda_device: torch.device) -> None:
    assert main(["--no-progress", "train", CONFIG, *_args(tmp_path, data, "train.epochs=1", "train.device=cpu")]) == 0
    cpu = Retriever.from_run(tmp_path / "run", device="cpu")
    gpu = Retriever.from_run(tmp_path / "run", device=str(cuda_device))
    assert torch.equal(gpu.item_rows.cpu(), cpu.item_rows)
    raw = load_dataset(data).events.column("item_id").to_pylist()
    histories = [raw[i : i + 1 + i % 9] for i in range(0, 64, 8)]  # mixed lengths: padded batches
    want = cpu.retrieve(histories, k=10, beam=16)
    for (items_cpu, scores_cpu), (items_gpu, scores_gpu) in zip(want, gpu.retrieve(histories, k=10, beam=16), strict=True):
        assert items_cpu == items_gpu
        # CUDA matmuls run in TF32 (train.runtime): scores agree to ~1e-3, the items exactly
        torch.testing.assert_close(torch.tensor(scores_gpu), torch.tensor(scores_cpu), rtol=2e-3, atol=2e-3)
