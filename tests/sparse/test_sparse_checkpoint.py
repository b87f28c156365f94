"""Sparse checkpoints: exact resume, atomicity, delta and low-precision exports, dense round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import recforge.sparse.checkpoint as sparse_ckpt
from recforge.sparse import AdmissionConfig, DynamicEmbedding, EvictionConfig, SparseOptimConfig, TableConfig
from recforge.sparse import export_rows, load_export, load_sparse_checkpoint, save_sparse_checkpoint
from recforge.sparse import to_dense, to_embedding, warm_start

D = 6


def _cfg(**kw) -> TableConfig:
    return TableConfig(
        name="item", dim=D, capacity=16, max_rows=40, seed=1, optimizer=SparseOptimConfig(kind="adam", lr=0.05),
        admission=AdmissionConfig(kind="count", threshold=2), eviction=EvictionConfig(kind="lru"), **kw,
    )  # fmt: skip


def _steps(table: DynamicEmbedding, seed: int, n: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 80, (30,), generator=gen) * 1_000_003
        out = table(ids)
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        table.apply_gradients()


@pytest.mark.parametrize("cache_rows", [0, 24])
def test_resume_is_exact(tmp_path: Path, cache_rows: int) -> None:
    a = DynamicEmbedding(_cfg(cache_rows=cache_rows))
    _steps(a, seed=0, n=4)
    save_sparse_checkpoint(tmp_path / "ckpt", {"item": a}, num_shards=3)
    assert len(list((tmp_path / "ckpt").glob("item.shard-*.safetensors"))) == 3
    b = DynamicEmbedding(_cfg(cache_rows=cache_rows))
    load_sparse_checkpoint(tmp_path / "ckpt", {"item": b})
    _steps(a, seed=1, n=4)
    _steps(b, seed=1, n=4)
    ids = torch.arange(80) * 1_000_003
    assert a.stats == b.stats and a.stats["evicted"] > 0
    assert torch.equal(to_dense(a, ids), to_dense(b, ids))
    assert torch.equal(a.row_key, b.row_key)


def test_failed_save_leaves_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = DynamicEmbedding(_cfg())
    _steps(table, seed=0, n=3)
    save_sparse_checkpoint(tmp_path / "ckpt", {"item": table}, num_shards=2)
    expected = to_dense(table, torch.arange(80) * 1_000_003)
    _steps(table, seed=1, n=3)
    calls = []
    real_save = sparse_ckpt.save_file

    def failing_save(tensors, path):  # dies on the second shard, mid-checkpoint
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real_save(tensors, path)

    monkeypatch.setattr(sparse_ckpt, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_sparse_checkpoint(tmp_path / "ckpt", {"item": table}, num_shards=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp directory left behind
    fresh = DynamicEmbedding(_cfg())
    load_sparse_checkpoint(tmp_path / "ckpt", {"item": fresh})
    assert torch.equal(to_dense(fresh, torch.arange(80) * 1_000_003), expected)


def test_delta_export_holds_changed_rows_and_evictions(tmp_path: Path) -> None:
    table = DynamicEmbedding(dataclasses.replace(_cfg(), admission=AdmissionConfig(), max_rows=0, optimizer=SparseOptimConfig(kind="sgd", lr=0.1)))
    table(torch.tensor([1, 2, 3])).sum().backward()
    table.apply_gradients()
    full = export_rows(tmp_path / "full", table)
    assert full["num_rows"] == 3
    table(torch.tensor([2])).sum().backward()
    table.apply_gradients()
    table.evict_rows(table.index.lookup(torch.tensor([3]), torch.zeros(1, dtype=torch.int64)))
    meta = export_rows(tmp_path / "delta", table, delta=True)
    rows = load_export(tmp_path / "delta")
    assert meta["num_rows"] == 1 and rows["keys"].tolist() == [2] and rows["deleted_keys"].tolist() == [3]
    torch.testing.assert_close(rows["weight"], to_dense(table, torch.tensor([2])))
    assert export_rows(tmp_path / "empty", table, delta=True)["num_rows"] == 0


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_low_precision_export_error_bound(tmp_path: Path, precision: str) -> None:
    table = DynamicEmbedding(TableConfig(dim=32, capacity=256))
    warm_start(table, torch.randn(200, 32) * torch.rand(200, 1) * 5, torch.arange(200) * 7)
    export_rows(tmp_path / "e", table, precision=precision)
    rows = load_export(tmp_path / "e")
    exact = to_dense(table, rows["keys"])
    err = (rows["weight"] - exact).abs()
    if precision == "int8":
        bound = (exact.amax(1) - exact.amin(1)) / 255 / 2 + 1e-6  # half a quantisation step per row
        assert bool((err.amax(1) <= bound).all())
    else:
        assert bool((err <= exact.abs() * 2**-11 + 1e-7).all())


def test_dense_round_trip() -> None:
    emb = nn.Embedding(50, D)
    table = DynamicEmbedding(TableConfig(dim=D, capacity=8))
    warm_start(table, emb)
    assert table.num_live == 50
    back = to_embedding(table, 60)
    assert torch.equal(back.weight[:50], emb.weight) and torch.equal(back.weight[50:], torch.zeros(10, D))


def test_loading_into_a_different_table_raises(tmp_path: Path) -> None:
    save_sparse_checkpoint(tmp_path / "c", {"item": DynamicEmbedding(_cfg())})
    with pytest.raises(ValueError, match="dim"):
        load_sparse_checkpoint(tmp_path / "c", {"item": DynamicEmbedding(dataclasses.replace(_cfg(), dim=D + 1))})
    with pytest.raises(ValueError, match="no state for tables"):
        load_sparse_checkpoint(tmp_path / "c", {"user": DynamicEmbedding(_cfg())})


def test_evictions_are_recorded_only_once_rows_have_been_exported(tmp_path: Path) -> None:
    """Before the first export no consumer holds a key: evictions leave no record (nothing grows while
    a recipe trains); after it, they are kept for the next delta and survive a checkpoint round trip."""
    cfg = dataclasses.replace(_cfg(), admission=AdmissionConfig(), max_rows=0, optimizer=SparseOptimConfig(kind="sgd", lr=0.1))
    table = DynamicEmbedding(cfg)
    zero = torch.zeros(1, dtype=torch.int64)
    table(torch.tensor([1, 2, 3, 4])).sum().backward()
    table.apply_gradients()
    table.evict_rows(table.index.lookup(torch.tensor([4]), zero))
    assert table.deleted is None
    export_rows(tmp_path / "full", table)
    table.evict_rows(table.index.lookup(torch.tensor([3]), zero))
    save_sparse_checkpoint(tmp_path / "ckpt", {"item": table})
    fresh = DynamicEmbedding(cfg)
    load_sparse_checkpoint(tmp_path / "ckpt", {"item": fresh})
    assert load_export(tmp_path / "full")["keys"].tolist() == [1, 2, 3]
    assert export_rows(tmp_path / "delta", fresh, delta=True)["num_deleted"] == 1
    assert load_export(tmp_path / "delta")["deleted_keys"].tolist() == [3]
    assert fresh.deleted == []
    save_sparse_checkpoint(tmp_path / "ckpt2", {"item": fresh})  # tracked with nothing evicted yet
    again = DynamicEmbedding(cfg)
    load_sparse_checkpoint(tmp_path / "ckpt2", {"item": again})
    assert again.deleted is not None and export_rows(tmp_path / "d2", again, delta=True)["num_deleted"] == 0


def test_generator_state_of_another_device_type_reseeds_reproducibly() -> None:
    """A CUDA generator's state (16 bytes, Philox) cannot be set on a CPU generator (mt19937) or the
    reverse: moving or restoring a table across device types seeds from a hash of the saved state."""
    cuda_like_state = torch.randint(0, 256, (16,), dtype=torch.uint8)
    draws = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
        sparse_ckpt.restore_generator(gen, cuda_like_state)
        draws.append(torch.rand(4, generator=gen))
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)
    other = torch.Generator().manual_seed(3)
    sparse_ckpt.restore_generator(other, torch.randint(0, 256, (16,), dtype=torch.uint8) ^ 1)
    assert not torch.equal(torch.rand(4, generator=other), draws[0])
    same_type = torch.Generator().manual_seed(7)
    saved = same_type.get_state()
    expected = torch.rand(4, generator=same_type)
    restored = torch.Generator()
    sparse_ckpt.restore_generator(restored, saved)  # same device type: the exact state
    torch.testing.assert_close(torch.rand(4, generator=restored), expected, rtol=0, atol=0)
