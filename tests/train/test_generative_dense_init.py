"""``generative.dense_init`` / ``dense_freeze`` / ``item_dim``: a SID model's item tables loaded from a trained
retrieval run, rows matched by raw item ID (a permuted vocabulary too), other catalogues and leaky runs refused,
a frozen table bit-identical after training and resuming, and the config errors that name the fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from recforge.checkpoint import find_checkpoint
from recforge.cli import main
from recforge.config import ConfigError, load_config
from recforge.train import dense_init, generative
from recforge.train.dense_init import rows_by_item_id
from _sid_runs import RUN_TINY, run_args, sid_dataset

CONFIG = "configs/beauty-sid-tiger-liger-init.yaml"
SASREC = ["model.dim=8", "model.ffn_dim=8", "train.threads=1", "train.epochs=1", "eval.batch_size=64"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sid_dataset(tmp_path_factory.mktemp("denseinit") / "data", seed=11)


def _sasrec(root: Path, data: Path, protocol: str) -> Path:
    run = root / f"sasrec-{protocol}"
    assert main(["--no-progress", "train", "configs/beauty-sasrec.yaml", f"data.path={data}", f"train.output_dir={run}",
                 f"data.protocol={protocol}", *SASREC]) == 0  # fmt: skip
    return run


@pytest.fixture(scope="module")
def sasrec(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Path:
    return _sasrec(tmp_path_factory.mktemp("sasrec"), data, "clean")


def _args(tmp_path: Path, data: Path, sasrec: Path, *extra: str) -> list[str]:
    return run_args(tmp_path, data, *RUN_TINY, f"generative.dense_init={sasrec}", "generative.item_dim=8", *extra)


def _sasrec_rows(sasrec: Path) -> torch.Tensor:
    """The SASRec run's item table as its best checkpoint stores it (rows: the same dataset's vocabulary)."""
    return load_file(find_checkpoint(sasrec, "best") / "model.safetensors")["prefix.item_embedding.weight"]


def test_rows_are_matched_by_raw_item_id_and_other_vocabularies_are_refused() -> None:
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    vocab = np.concatenate([[-1], torch.randperm(1000, generator=g)[:40].numpy() * 7 + 3])  # (41,) row 0: padding
    perm = torch.randperm(40, generator=g).numpy()
    run_ids, run_vectors = vocab[1:][perm], torch.randn(40, 6, generator=g).numpy()  # the run's rows in another order
    table = rows_by_item_id(run_ids, run_vectors, vocab, "run")
    assert table.shape == (41, 6) and torch.equal(table[0], torch.zeros(6))
    for row in range(1, 41):
        assert torch.equal(table[row], torch.from_numpy(run_vectors[int(np.flatnonzero(run_ids == vocab[row])[0])]))
    with pytest.raises(ValueError, match=r"vocabulary differs .*1 of this run's 40 items missing there"):
        rows_by_item_id(run_ids[1:], run_vectors[1:], vocab, "run")
    with pytest.raises(ValueError, match=r"vocabulary differs .*1 items there not here, e.g. \[5\]"):
        rows_by_item_id(np.append(run_ids, 5), np.vstack([run_vectors, run_vectors[:1]]), vocab, "run")
    with pytest.raises(ValueError, match="repeats raw item IDs"):
        rows_by_item_id(np.append(run_ids, run_ids[0]), np.vstack([run_vectors, run_vectors[:1]]), vocab, "run")


def test_config_errors_name_the_fix(tmp_path: Path, data: Path, sasrec: Path) -> None:
    base = "configs/beauty-sid-tiger.yaml"
    with pytest.raises(ConfigError, match="dense_init=.*dense_head and generative.item_id_embedding are off"):
        load_config(base, run_args(tmp_path, data, *RUN_TINY, f"generative.dense_init={sasrec}"))
    with pytest.raises(ConfigError, match="generative.item_dim=8 applies to the item tables"):
        load_config(base, run_args(tmp_path, data, *RUN_TINY, "generative.item_dim=8"))
    with pytest.raises(ConfigError, match="dense_init is empty"):
        load_config(CONFIG, run_args(tmp_path, data, *RUN_TINY, "generative.dense_init="))
    with pytest.raises(ConfigError, match="generative.item_dim"):
        load_config(CONFIG, _args(tmp_path, data, sasrec, "generative.item_dim=-1"))
    cfg = load_config(CONFIG, _args(tmp_path, data, sasrec, "generative.item_dim=0"))  # 16 = model.dim, the run's is 8
    with pytest.raises(ValueError, match=r"8 wide but this model's item tables are 16 .*set generative.item_dim=8"):
        generative.setup(cfg, fresh=True)


def test_init_copies_the_runs_rows_by_item_id(tmp_path: Path, data: Path, sasrec: Path, monkeypatch) -> None:
    cfg = load_config(CONFIG, _args(tmp_path, data, sasrec, "generative.item_id_embedding=true"))
    s = generative.setup(cfg, fresh=True)
    want = F.normalize(_sasrec_rows(sasrec)[1:], dim=-1) * 8**0.5  # both vocabularies: the same dataset's
    for weight in (s.model.dense_items.weight, s.model.item_embedding.weight):
        torch.testing.assert_close(weight[1:], want, rtol=1e-6, atol=1e-6)
        assert not weight.requires_grad  # the config freezes them
    assert torch.equal(s.model.item_embedding.weight[0], torch.zeros(8))  # padding stays zero
    trainable = {id(p) for group in s.optimizer.param_groups for p in group["params"]}
    assert id(s.model.dense_items.weight) not in trainable and id(s.model.dense_user.weight) in trainable
    # a run whose rows come in another order (and unit norms, other scale): still matched by raw ID
    real = dense_init.run_item_embeddings
    perm = torch.randperm(s.seqs.num_items).numpy()

    def permuted(run_dir, data_dir, what=""):
        ids, vectors, provenance = real(run_dir, data_dir, what)
        return ids[perm], vectors[perm] * 3.0, provenance

    def one_item_short(run_dir, data_dir, what=""):
        ids, vectors, provenance = real(run_dir, data_dir, what)
        return ids[1:], vectors[1:], provenance

    monkeypatch.setattr(dense_init, "run_item_embeddings", permuted)
    permuted_rows = generative.setup(cfg, fresh=True).model.dense_items.weight[1:]
    torch.testing.assert_close(permuted_rows, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(dense_init, "run_item_embeddings", one_item_short)
    with pytest.raises(ValueError, match=f"generative.dense_init={sasrec}: its item vocabulary differs"):
        generative.setup(cfg, fresh=True)
    monkeypatch.undo()
    # without fresh (evaluation, resume) nothing is read from the run: the tables keep their seeded init
    fresh_off = generative.setup(cfg).model.dense_items.weight
    assert not torch.allclose(fresh_off[1:], want)


def test_a_paper_protocol_run_is_refused_for_a_clean_model(tmp_path: Path, data: Path) -> None:
    paper = _sasrec(tmp_path, data, "paper")
    with pytest.raises(ValueError, match="data.protocol=paper .*saw the validation target"):
        generative.setup(load_config(CONFIG, _args(tmp_path, data, paper)), fresh=True)
    with pytest.raises(ValueError, match="not a recforge run directory"):
        generative.setup(load_config(CONFIG, _args(tmp_path, data, tmp_path / "nothing")), fresh=True)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    step_dir = json.loads((run / "checkpoints/latest.json").read_text())["step_dir"]
    return load_file(run / "checkpoints" / step_dir / "model.safetensors")


def test_a_frozen_table_stays_bit_identical_through_training_and_resume(
    tmp_path: Path, data: Path, sasrec: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:  # fmt: skip
    args = _args(tmp_path, data, sasrec, "train.epochs=2", "train.eval_every=1")
    loaded = generative.setup(load_config(CONFIG, args), fresh=True).model.dense_items.weight.detach().clone()
    assert main(["--no-progress", "train", CONFIG, *args, "train.max_steps=2"]) == 0
    first = _weights(tmp_path / "run")
    assert torch.equal(first["dense_items.weight"], loaded)
    with monkeypatch.context() as patch:  # a resumed run reads its own table from its checkpoint, never the init run
        patch.setattr(generative, "item_table_from_run", lambda *a: pytest.fail("dense_init re-read on resume"))
        assert main(["--no-progress", "train", CONFIG, *args, "--resume"]) == 0
    resumed = _weights(tmp_path / "run")
    assert torch.equal(resumed["dense_items.weight"], loaded)
    assert not torch.equal(resumed["dense_user.weight"], first["dense_user.weight"])  # the user tower learns
    # the same schedule in one go gives the resumed weights (the init is not re-read on resume)
    straight = tmp_path / "straight"
    assert main(["--no-progress", "train", CONFIG, *args, f"train.output_dir={straight}"]) == 0
    for name, value in _weights(straight).items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert main(["eval", str(straight)]) == 0
    result = json.loads((straight / "eval.json").read_text())
    assert 0.0 <= result["ndcg@10"] <= result["hr@10"] <= 1.0
    # not frozen: the loaded table is trained
    thawed = tmp_path / "thawed"
    assert main(["--no-progress", "train", CONFIG, *args, "generative.dense_freeze=false", "train.max_steps=2",
                 f"train.output_dir={thawed}"]) == 0  # fmt: skip
    assert not torch.equal(_weights(thawed)["dense_items.weight"], loaded)
    # resuming it with the table frozen: its optimizer state covers other parameters -> a clear refusal
    capsys.readouterr()
    assert main(["--no-progress", "train", CONFIG, *args, "generative.dense_freeze=true", f"train.output_dir={thawed}",
                 "--resume"]) != 0  # fmt: skip
    err = capsys.readouterr().err
    assert "trainable parameters changed" in err and "dense_freeze=False" in err

