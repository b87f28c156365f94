"""Training checkpoints across process layouts: a single-process checkpoint resumes on sharded tables (any
number of ranks), and one process reads a torchrun checkpoint's shards directly (no export written)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sparse"))
from _dist import assert_same_rows, spawn  # noqa: E402

from recforge.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from recforge.sparse import DynamicEmbedding, SparseOptimConfig, TableConfig  # noqa: E402
from recforge.sparse.sharded import ShardedDynamicEmbedding  # noqa: E402


def _cfg() -> TableConfig:
    return TableConfig("item", dim=4, capacity=16, init_std=0.1, optimizer=SparseOptimConfig(kind="adam", lr=0.1))


class _Model(nn.Module):
    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.item = table
        self.head = nn.Linear(4, 1)


def _trained_plain() -> _Model:
    torch.manual_seed(0)  # the head's initial weights
    model = _Model(DynamicEmbedding(_cfg()))
    for step in range(3):
        ids = torch.arange(step * 5, step * 5 + 12)
        model.head(model.item(ids)).sum().backward()
        model.item.apply_gradients()
    return model


def _resume_worker(rank: int, world_size: int, run_dir: str) -> None:
    model = _Model(ShardedDynamicEmbedding(_cfg()))
    load_checkpoint(find_checkpoint(Path(run_dir)), model)  # used to refuse: "saved by a single process"
    assert_same_rows(model.item, _trained_plain().item, rtol=0, atol=0)


def test_single_process_checkpoint_resumes_on_two_ranks(tmp_path: Path) -> None:
    plain = _trained_plain()
    save_checkpoint(tmp_path, step=3, model=plain, optimizer=None, manifest={})
    spawn(_resume_worker, 2, str(tmp_path))


def _save_sharded_worker(rank: int, world_size: int, run_dir: str) -> None:
    from recforge.sparse.sharded import sharded_tables
    from recforge.sparse.sharded_checkpoint import save_sharded_checkpoint

    model = _Model(ShardedDynamicEmbedding(_cfg()))
    load_checkpoint(find_checkpoint(Path(run_dir) / "single"), model)
    staged = save_sharded_checkpoint(Path(run_dir) / "sharded" / "checkpoints" / ".sparse-00000003", sharded_tables(model))
    if rank == 0:
        save_checkpoint(Path(run_dir) / "sharded", step=3, model=model, optimizer=None, manifest={}, sharded_sparse=staged)


def test_one_process_reads_a_torchrun_checkpoint_without_an_export(tmp_path: Path) -> None:
    plain = _trained_plain()
    save_checkpoint(tmp_path / "single", step=3, model=plain, optimizer=None, manifest={})
    spawn(_save_sharded_worker, 2, str(tmp_path))
    ckpt = find_checkpoint(tmp_path / "sharded")
    assert (ckpt / "sparse_sharded").is_dir() and not (ckpt / "sparse").exists()  # no whole-table export
    assert not list((tmp_path / "sharded" / "checkpoints").glob(".sparse-*"))
    model = _Model(DynamicEmbedding(_cfg()))
    load_checkpoint(ckpt, model)
    assert model.item.num_live == plain.item.num_live
    for key in plain.item.row_key[plain.item.live_rows()].tolist():
        ids = torch.tensor([key])
        torch.testing.assert_close(model.item.eval()(ids), plain.item.eval()(ids), rtol=0, atol=0)
