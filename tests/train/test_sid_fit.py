"""`recforge sid fit` workflow: leakage checks of run-based (collaborative) SIDs, balanced codes on disk,
and input errors that say what is wrong and how to fix it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from recforge.cli import main
from recforge.config import load_config
from recforge.data.dataset import load_dataset, write_dataset
from recforge.train.sid_fit import run_item_embeddings
from recforge.data.sids import check_embedding_run, read_sids
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train import generative

SASREC = ["model.dim=16", "model.ffn_dim=16", "train.threads=1", "train.epochs=1", "eval.batch_size=64"]
TINY_GEN = ["model.dim=16", "model.num_blocks=1", "generative.decoder_blocks=1", "model.num_heads=2", "model.ffn_dim=32",
            "train.threads=1", "data.max_seq_len=10", "generative.beam=10", "eval.ks=[1,5,10]"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = SyntheticConfig(num_users=50, num_items=40, seed=1, mean_seq_len=10, max_seq_len=25)
    return write_synthetic(tmp_path_factory.mktemp("sidfit") / "data", config)


def _retrieval_run(tmp_path: Path, data: Path, protocol: str) -> Path:
    run = tmp_path / f"sasrec-{protocol}"
    assert main(["--no-progress", "train", "configs/beauty-sasrec.yaml", f"data.path={data}", f"train.output_dir={run}",
                 f"data.protocol={protocol}", *SASREC]) == 0  # fmt: skip
    return run


def _fit(data: Path, out: Path, *extra: str) -> int:
    return main(["sid", "fit", str(data), "--out", str(out), "--codebook-size", "8", "--levels", "2", *extra])


def _generative_cfg(tmp_path: Path, data: Path, sids: Path, protocol: str):
    return load_config("configs/beauty-sid-tiger.yaml", [f"data.path={data}", f"generative.sids={sids}",
                       f"data.protocol={protocol}", f"train.output_dir={tmp_path / 'gen'}", *TINY_GEN])  # fmt: skip


def test_run_sids_record_their_provenance_and_a_paper_run_is_refused_for_clean_evaluation(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture
) -> None:  # fmt: skip
    """A paper-protocol run trained on each user's second-to-last item: the clean protocol's validation
    target. SIDs from it serve paper-protocol models only; clean-run SIDs serve both."""
    paper, clean = _retrieval_run(tmp_path, data, "paper"), _retrieval_run(tmp_path, data, "clean")
    assert _fit(data, tmp_path / "sids-paper", "--source", f"run:{paper}") == 0
    assert _fit(data, tmp_path / "sids-clean", "--source", f"run:{clean}") == 0
    torch.set_num_threads(2)  # other than the run's train.threads (1)
    torch.manual_seed(int(torch.randint(1000, 2**30, (), generator=torch.Generator())))  # other than the run's seed
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    run_item_embeddings(clean, data)  # the run's train.threads (1) and seed stay out of the calling process
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng)
    meta = read_sids(tmp_path / "sids-paper").meta["embedding_run"]
    assert meta["protocol"] == "paper" and meta["holdout"] == 1
    assert meta["checkpoint"] != "best" and (paper / "checkpoints" / meta["checkpoint"]).is_dir()  # never chosen on test
    assert read_sids(tmp_path / "sids-clean").meta["embedding_run"]["holdout"] == 2
    with pytest.raises(ValueError, match="data.protocol=paper.*saw the validation target"):
        generative.setup(_generative_cfg(tmp_path, data, tmp_path / "sids-paper", "clean"))
    generative.setup(_generative_cfg(tmp_path, data, tmp_path / "sids-paper", "paper"))
    for protocol in ("clean", "paper"):
        generative.setup(_generative_cfg(tmp_path, data, tmp_path / "sids-clean", protocol))
    capsys.readouterr()
    config = tmp_path / "gen.yaml"
    config.write_text(Path("configs/beauty-sid-tiger.yaml").read_text())
    args = [f"data.path={data}", f"generative.sids={tmp_path / 'sids-paper'}", f"train.output_dir={tmp_path / 'r'}", *TINY_GEN]
    assert main(["--no-progress", "train", str(config), *args, "train.max_steps=1", "optim.warmup_steps=0"]) == 2
    assert "Retrain the retrieval run with data.protocol=clean" in capsys.readouterr().err


def test_sids_from_a_run_on_other_data_are_refused(tmp_path: Path, data: Path, capsys: pytest.CaptureFixture) -> None:
    dataset = load_dataset(data)
    more = pa.concat_tables([dataset.events, dataset.events.slice(0, 3)]).sort_by([("user_id", "ascending")])
    other = write_dataset(tmp_path / "other", more, dataset.items, name="other", source="test")  # a superset
    run = _retrieval_run(tmp_path, other, "clean")
    capsys.readouterr()
    assert _fit(data, tmp_path / "s", "--source", f"run:{run}") == 2
    assert "interactions differ" in capsys.readouterr().err and not (tmp_path / "s").exists()
    # SIDs fitted on the run's own data, then used to train on another dataset
    assert _fit(other, tmp_path / "s-other", "--source", f"run:{run}") == 0
    with pytest.raises(ValueError, match="interactions differ"):
        generative.setup(_generative_cfg(tmp_path, data, tmp_path / "s-other", "clean"))
    meta = read_sids(tmp_path / "s-other").meta
    del meta["embedding_run"]  # SIDs fitted before the provenance was recorded cannot be checked
    with pytest.raises(ValueError, match="do not record which data"):
        check_embedding_run(meta, dataset.events, "clean", data)
    check_embedding_run({"source": "text"}, dataset.events, "clean", data)  # content SIDs never saw interactions


def test_balanced_sids_on_disk_respect_the_cap_at_every_level(tmp_path: Path, data: Path) -> None:
    assert _fit(data, tmp_path / "b", "--balanced", "--no-collision-level") == 0
    codes = read_sids(tmp_path / "b").codes  # (40, 2)
    for level in range(2):
        assert int(torch.bincount(codes[:, level]).max()) <= math.ceil(40 / 8)


def _with_items(tmp_path: Path, data: Path, name: str, items: pa.Table | None) -> Path:
    return write_dataset(tmp_path / name, load_dataset(data).events, items, name=name, source="test")


def _embedding_items(data: Path, vectors: list, kind: pa.DataType = pa.list_(pa.float32())) -> pa.Table:
    ids = sorted(set(load_dataset(data).events.column("item_id").to_pylist()))
    return pa.table({"item_id": pa.array(ids, pa.int64()), "embedding": pa.array(vectors(len(ids)), kind)})


def _random(n: int, dim: int = 4) -> list:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(n)).tolist()


BAD_EMBEDDINGS = {
    "ragged": (lambda n: [v[: 3 if i == 5 else 4] for i, v in enumerate(_random(n))], None, "same length.*lengths \\[3\\].*re-encode"),
    "nan": (lambda n: [[float("nan")] * 4 if i == 2 else v for i, v in enumerate(_random(n))], None, "NaN or infinite.*fix or re-encode"),
    "null": (lambda n: [None if i == 1 else v for i, v in enumerate(_random(n))], None, "null 'embedding'.*give every item"),
    "scalar": (lambda n: [float(i) for i in range(n)], pa.float32(), "must be a list of floats"),
    "missing rows": (lambda n: _random(n)[:-2], None, "2 of .* items have no row.*needs an 'embedding'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_EMBEDDINGS))
def test_bad_embedding_columns_say_what_is_wrong(tmp_path: Path, data: Path, capsys: pytest.CaptureFixture, case: str) -> None:
    vectors, kind, message = BAD_EMBEDDINGS[case]
    if case == "missing rows":
        full = _embedding_items(data, _random)
        items = full.slice(0, full.num_rows - 2)
    else:
        items = _embedding_items(data, vectors, kind or pa.list_(pa.float32()))
    bad = _with_items(tmp_path, data, "bad", items)
    capsys.readouterr()
    assert _fit(bad, tmp_path / "s", "--source", "embedding") == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err and not (tmp_path / "s").exists()


BAD_ARGS = {
    "levels": (["--levels", "0"], "--levels.*at least 1 quantization level"),
    "codebook": (["--codebook-size", "1"], "--codebook-size.*at least 2 codes"),
    "codebook > items": (["--codebook-size", "500"], "--codebook-size 500 for 40 items.*use --codebook-size 40 or less"),
    "balanced rqvae": (["--method", "rqvae", "--balanced"], "--balanced.*option of --method rkmeans"),
    "text dim": (["--text-dim", "0"], "--text-dim 0.*at least 1"),
    "rqvae epochs": (["--method", "rqvae", "--rqvae-epochs", "0"], "--rqvae-epochs.*>= 1"),
    "source": (["--source", "bert"], "--source 'bert': expected embedding, text or run:RUN_DIR"),
    "run dir": (["--source", "run:/nonexistent"], "not a recforge run directory"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_fit_arguments_say_what_is_wrong(tmp_path: Path, data: Path, capsys: pytest.CaptureFixture, case: str) -> None:
    args, message = BAD_ARGS[case]
    capsys.readouterr()
    assert main(["sid", "fit", str(data), "--out", str(tmp_path / "s"), *args]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_items_without_attributes_and_new_items_of_another_width(tmp_path: Path, data: Path, capsys: pytest.CaptureFixture) -> None:
    empty = _with_items(tmp_path, data, "empty", pa.table({"item_id": pa.array([], pa.int64())}))
    capsys.readouterr()
    assert _fit(empty, tmp_path / "s", "--source", "text") == 2
    assert "no item has text or attribute values" in capsys.readouterr().err
    assert _fit(empty, tmp_path / "s", "--source", "embedding") == 2
    assert "has no 'embedding' column" in capsys.readouterr().err
    good = _with_items(tmp_path, data, "good", _embedding_items(data, _random))
    assert _fit(good, tmp_path / "s", "--source", "embedding") == 0
    grown = _embedding_items(data, lambda n: _random(n, dim=6))
    grown = pa.concat_tables([grown, pa.table({"item_id": pa.array([9999], pa.int64()),
                                               "embedding": pa.array([[0.0] * 6], pa.list_(pa.float32()))})])  # fmt: skip
    capsys.readouterr()
    assert main(["sid", "add", str(tmp_path / "s"), str(_with_items(tmp_path, data, "grown", grown))]) == 2
    assert "have 6 dimensions but the SIDs were fitted on 4" in capsys.readouterr().err
