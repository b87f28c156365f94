"""model.relative_bias=false: an HSTU retrieval run without the relative position bias, end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from recforge.checkpoint import CheckpointMismatchError, find_checkpoint, load_checkpoint
from recforge.config import config_from_dict
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train.retrieval import evaluate_run, setup, train


def _cfg(out: Path, data: Path, relative_bias: bool, epochs: int = 2):
    raw = {
        "name": "run",
        "data": {"path": str(data), "protocol": "paper", "max_seq_len": 20},
        "model": {"kind": "hstu", "dim": 16, "num_blocks": 2, "num_heads": 2, "dqk": 8, "dv": 8, "dropout": 0.2,
                  "relative_bias": relative_bias},
        "loss": {"negatives": "per_position", "num_negatives": 16, "temperature": 0.05},
        "train": {"epochs": epochs, "batch_size": 12, "eval_every": 1, "output_dir": str(out / "{name}"), "device": "cpu",
                  "threads": 1, "seed": 3},
        "eval": {"ks": [1, 10], "batch_size": 16},
    }  # fmt: skip
    return config_from_dict(raw, [])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = SyntheticConfig(num_users=40, num_items=50, num_clusters=5, mean_seq_len=10, min_seq_len=3, max_seq_len=30,
                             seed=7)  # fmt: skip
    return write_synthetic(tmp_path_factory.mktemp("norab") / "synth", config)


def test_trains_evaluates_and_names_a_mismatched_config(tmp_path: Path, data_dir: Path) -> None:
    cfg = _cfg(tmp_path / "off", data_dir, relative_bias=False)
    assert cfg.model.relative_bias is False
    train(cfg, progress=False)
    ckpt = find_checkpoint(cfg.run_dir)
    weights = load_file(ckpt / "model.safetensors")
    assert not any(k.endswith("pos_weights") for k in weights)  # nothing saved for a bias that does not exist
    assert sum(k.endswith("uvqk.weight") for k in weights) == 2
    result = evaluate_run(cfg.run_dir)  # rebuilds the model from the run's config.yaml
    assert 0.0 <= result["hr@10"] <= 1.0 and math.isfinite(result["mrr"])

    # the same checkpoint into a model that has the bias (the default), and the other way round
    with_bias = setup(_cfg(tmp_path / "on", data_dir, relative_bias=True)).model
    with pytest.raises(CheckpointMismatchError, match="trained without the relative position bias: set "
                                                      "model.relative_bias=false"):  # fmt: skip
        load_checkpoint(ckpt, with_bias)
    cfg_on = _cfg(tmp_path / "on", data_dir, relative_bias=True, epochs=1)
    train(cfg_on, progress=False)
    without = setup(cfg).model
    with pytest.raises(CheckpointMismatchError, match="set model.relative_bias=true"):
        load_checkpoint(find_checkpoint(cfg_on.run_dir), without)

