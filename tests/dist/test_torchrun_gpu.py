"""Distributed training on GPUs with NCCL: ``torchrun`` jobs of 1 rank (and 2 where the host has 2 GPUs).

Run: ``python -m pytest -m gpu tests/dist -q`` (a few minutes on one H200).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from recforge.config import config_from_dict
from recforge.train import retrieval
from tests.dist.test_torchrun import _config_file, _losses, _raw, data_dir, torchrun  # noqa: F401 - data_dir is a fixture

pytestmark = pytest.mark.gpu


def test_nccl_world_of_one_follows_one_process(tmp_path: Path, data_dir: Path, cuda_device: torch.device) -> None:  # noqa: F811
    """``torchrun --nproc-per-node 1`` on CUDA (NCCL, DDP, side-stream prefetch) trains the loss curve
    of a plain single process on the same GPU and writes a checkpoint that ``recforge eval`` reads."""
    deterministic = ["model.kernel=pytorch"]  # the Triton attention backward sums with atomics (run-to-run bits)
    single = config_from_dict(_raw(data_dir, tmp_path / "one", device="cuda"), deterministic)
    retrieval.train(single, progress=False)
    torchrun(1, ["train", _config_file(tmp_path, _raw(data_dir, tmp_path / "dist", device="cuda")), *deterministic])
    run_dir = tmp_path / "dist" / "run"
    np.testing.assert_allclose(_losses(run_dir), _losses(single.run_dir), rtol=2e-3, atol=1e-4)
    got, ref = (json.loads((d / "eval.json").read_text()) for d in (run_dir, single.run_dir))
    assert got["ndcg@10"] == pytest.approx(ref["ndcg@10"], abs=0.02)


def test_nccl_dynamic_tiered_bf16_pipeline(tmp_path: Path, data_dir: Path, cuda_device: torch.device) -> None:  # noqa: F811
    """Sharded dynamic tables (host tier + device cache) on NCCL, bf16 autocast, grad accumulation,
    the input pipeline on: the loss falls, and the metrics gathered during training equal the
    single-process evaluation of the exported checkpoint."""
    raw = _raw(data_dir, tmp_path, device="cuda", epochs=3, eval_every=3, precision="bfloat16")
    overrides = ["model.embedding=dynamic", "sparse.cache_rows=64", "sparse.optimizer=adam", "sparse.lr=0.01",
                 "dist.grad_accum=2", "dist.pipeline=true"]  # fmt: skip
    done = torchrun(1, ["train", _config_file(tmp_path, raw), *overrides])
    run_dir = tmp_path / "run"
    assert "sharding plan" in done.stderr
    losses = _losses(run_dir)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert all(row["h2d_s"] >= 0 and "fetch_s" in row for row in log)
    gathered = json.loads((run_dir / "evals.jsonl").read_text().splitlines()[-1])
    single = json.loads((run_dir / "eval.json").read_text())
    for key in ("hr@10", "ndcg@10", "mrr"):
        assert gathered[key] == pytest.approx(single[key], abs=1e-6), key


def test_nccl_two_ranks_follow_one_process(tmp_path: Path, data_dir: Path, cuda_device: torch.device) -> None:  # noqa: F811
    """2 GPUs (NCCL): the loss curve of one process on the same global batches."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs (this host has {torch.cuda.device_count()})")
    deterministic = ["model.kernel=pytorch"]
    single = config_from_dict(_raw(data_dir, tmp_path / "one", device="cuda"), deterministic)
    retrieval.train(single, progress=False)
    torchrun(2, ["train", _config_file(tmp_path, _raw(data_dir, tmp_path / "two", device="cuda")), *deterministic])
    np.testing.assert_allclose(_losses(tmp_path / "two" / "run"), _losses(single.run_dir), rtol=2e-3, atol=1e-4)
