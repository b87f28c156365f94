"""Loading a generative run without the training code: config + checkpoint + SIDs -> model (no dataset read)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from recforge.checkpoint import save_checkpoint
from recforge.config import load_config, save_config
from recforge.data.sids import META_FILE, write_sid_dir
from recforge.generate.sid_run import build_sid_model, load_sid_run, read_run
from recforge.models.sid_hstu import SIDHSTU
from recforge.models.sid_seq2seq import SIDSeq2Seq

TINY = ["model.dim=16", "model.num_blocks=1", "generative.decoder_blocks=1", "model.num_heads=2", "model.ffn_dim=32",
        "data.max_seq_len=10"]  # fmt: skip


def _run(tmp_path: Path, kind: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run directory as training leaves it, whose data directory does not exist (never read)."""
    run = tmp_path / "run"
    cfg = load_config(Path("configs/beauty-sid-tiger.yaml"), [*TINY, f"model.kind={kind}",
                                                              f"data.path={tmp_path / 'absent-data'}"])  # fmt: skip
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    codes = torch.tensor([[0, 1], [1, 2], [2, 0]])
    write_sid_dir(run / "sids", np.array([10, 20, 30]), codes, {"codebook": torch.zeros(3, 2)}, {"vocab_size": 3})
    model = build_sid_model(cfg, num_levels=2, vocab_size=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand_like(p))  # weights no fresh build has: loading must read them
    save_checkpoint(run, step=5, model=model, optimizer=None, manifest={"config": cfg.to_dict()}, best=True)
    return run, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind, cls", [("tiger", SIDSeq2Seq), ("sid_hstu", SIDHSTU)])
def test_load_sid_run_restores_the_checkpoint_weights(tmp_path: Path, kind: str, cls: type) -> None:
    run_dir, saved = _run(tmp_path, kind)
    run = load_sid_run(run_dir, device=torch.device("cpu"))
    assert isinstance(run.model, cls) and not run.model.training
    assert run.checkpoint.name == "step_00000005" and run.sids.num_levels == 2
    assert run.model.state_dict().keys() == saved.keys()
    for name, value in run.model.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


def test_read_run_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a recforge run directory"):
        read_run(tmp_path)
    run_dir, _ = _run(tmp_path, "tiger")
    assert read_run(run_dir)[1].name == "step_00000005"  # auto: best, as the config's protocol is clean
    (run_dir / "sids" / META_FILE).unlink()
    with pytest.raises(ValueError, match="sids is missing"):
        read_run(run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(ValueError, match="has no best checkpoint; train it first"):
        read_run(run_dir)
