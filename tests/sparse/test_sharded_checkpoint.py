"""Sharded checkpoints: save on 4 gloo ranks, export to one process, load on 2 and 1 (resharding) and on 2 again (exact)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import assert_same_rows, spawn
from safetensors.torch import load_file, save_file

from recforge.sparse import AdmissionConfig, DynamicEmbedding, SparseOptimConfig, TableConfig, load_sparse_checkpoint
from recforge.sparse.sharded import ShardedDynamicEmbedding
from recforge.sparse.sharded_checkpoint import export_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint

D = 8


def _cfg(name: str = "item") -> TableConfig:
    return TableConfig(name=name, dim=D, capacity=32, init_std=0.1, default="fixed", seed=3,
                       admission=AdmissionConfig(kind="count", threshold=2),
                       optimizer=SparseOptimConfig(kind="adam", lr=0.05))  # fmt: skip


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches (8, 6) over 60 raw IDs and loss weights; rank r of W takes rows [r * 8 / W, (r + 1) * 8 / W)."""
    gen = torch.Generator().manual_seed(4)
    pool = torch.randint(0, 2**62, (60,), generator=gen)
    return [(pool[torch.randint(0, 60, (8, 6), generator=gen)], torch.randn(8, 6, D, generator=gen)) for _ in range(steps)]


PROBE = torch.cat([_batches(4)[3][0].reshape(-1), torch.tensor([1, 2, 3, 4])])  # (52,): seen, unseen, never-admitted IDs


def _tables(owner_rank: int | None = None) -> dict[str, ShardedDynamicEmbedding]:
    return {"emb.item": ShardedDynamicEmbedding(_cfg()), "emb.genre": ShardedDynamicEmbedding(_cfg("genre"), owner_rank=owner_rank)}


def _train(tables: dict[str, ShardedDynamicEmbedding], batches, rank: int, world_size: int, admit: bool = True) -> None:
    mine = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    for ids, weights in batches:
        for table in tables.values():
            (table(ids[mine] % (2**40 if table.cfg.name == "genre" else 2**62), admit=admit) * weights[mine]).sum().backward()
            table.apply_gradients()


def _probe(table: ShardedDynamicEmbedding, rank: int, world_size: int) -> torch.Tensor:
    """Eval lookups of every probe ID (each rank asks for its part; all parts gathered)."""
    table.eval()
    probe = PROBE % (2**40 if table.cfg.name == "genre" else 2**62)
    part = probe.tensor_split(world_size)[rank]
    with torch.no_grad():
        out = table(part)
    table.train()
    if world_size == 1:
        return out
    parts = [torch.empty(p.numel(), D) for p in probe.tensor_split(world_size)]
    dist.all_gather(parts, out)
    return torch.cat(parts)


def _save_worker(rank: int, world_size: int, root: str) -> None:
    root = Path(root)
    tables = _tables(owner_rank=3)
    _train(tables, _batches(3), rank, world_size)
    save_sharded_checkpoint(root / "ckpt4", tables)
    probes = {name: _probe(t, rank, world_size) for name, t in tables.items()}
    if rank == 0:
        save_file(probes, root / "probe4.safetensors")
        export_sharded_checkpoint(root / "ckpt4", root / "single")
    dist.barrier()
    merged = _merged(root)
    for name, table in tables.items():  # the export holds exactly every shard's rows (clock included)
        assert_same_rows(table, merged[name], rtol=0, atol=0, clock=True)


def _merged(root: Path) -> dict[str, DynamicEmbedding]:
    merged = {"emb.item": DynamicEmbedding(_cfg()), "emb.genre": DynamicEmbedding(_cfg("genre"))}
    load_sparse_checkpoint(root / "single", merged)
    return merged


def _reshard_worker(rank: int, world_size: int, root: str) -> None:
    root = Path(root)
    tables = _tables(owner_rank=0)  # genre was table-wise on rank 3 of 4; here on rank 0 of 2
    load_sharded_checkpoint(root / "ckpt4", tables)
    merged, expected = _merged(root), load_file(root / "probe4.safetensors")
    for name, table in tables.items():
        assert_same_rows(table, merged[name], rtol=0, atol=0, clock=True)
        torch.testing.assert_close(_probe(table, rank, world_size), expected[name], rtol=0, atol=0)
        assert table.step == 3
        _assert_same_candidates(table, merged[name])
    # a single-process sparse checkpoint (the export) loads on 2 ranks too
    from_single = _tables(owner_rank=0)
    load_sharded_checkpoint(root / "single", from_single)
    for name, table in from_single.items():
        assert_same_rows(table, merged[name], rtol=0, atol=0, clock=True)
        _assert_same_candidates(table, merged[name])
    # training continues identically: optimizer state and counters moved with the rows (no new rows: their
    # random initial values come from each shard's own generator)
    batches = _batches(5)[3:]
    _train(tables, batches, rank, world_size, admit=False)
    _train_plain(merged, batches)
    for name, table in tables.items():
        assert_same_rows(table, merged[name])
    # same world size and layout: an exact restore (row numbers, free stack, RNG)
    save_sharded_checkpoint(root / "ckpt2", tables)
    again = _tables(owner_rank=0)
    load_sharded_checkpoint(root / "ckpt2", again)
    for name, table in tables.items():
        assert torch.equal(again[name].shard.row_key, table.shard.row_key)
        assert torch.equal(again[name].shard.free[: table.shard.num_free], table.shard.free[: table.shard.num_free])
        assert torch.equal(again[name].shard.generator.get_state(), table.shard.generator.get_state())


def _assert_same_candidates(sharded: ShardedDynamicEmbedding, plain: DynamicEmbedding) -> None:
    """Count admission's candidates (IDs seen, not yet admitted) moved to their owners with their counts."""
    keys, tags, slots = sharded.shard.cand_index.items()
    p_keys, p_tags, p_slots = plain.cand_index.items()
    mine = sharded.owners(p_keys, p_tags) == sharded.rank
    assert sorted(keys.tolist()) == sorted(p_keys[mine].tolist())
    count = dict(zip(p_keys.tolist(), plain.cand.count[p_slots].tolist(), strict=True))
    assert [count[k] for k in keys.tolist()] == sharded.shard.cand.count[slots].tolist()
    total = torch.tensor([keys.numel()])
    dist.all_reduce(total)
    assert int(total) == p_keys.numel() > 0


def _train_plain(tables: dict[str, DynamicEmbedding], batches) -> None:
    for ids, weights in batches:
        for name, table in tables.items():
            (table(ids % (2**40 if name == "emb.genre" else 2**62), admit=False) * weights).sum().backward()
            table.apply_gradients()


def test_save_on_4_load_on_2_and_1(tmp_path: Path) -> None:
    spawn(_save_worker, 4, str(tmp_path))
    manifest = json.loads((tmp_path / "ckpt4" / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["plan"]["tables"]["emb.genre"] == {
        "kind": "table_wise", "ranks": [3], "rows": 32, "bytes": manifest["plan"]["tables"]["emb.genre"]["bytes"]}
    assert len(manifest["tables"]["emb.item"]["ranks"]) == 4
    spawn(_reshard_worker, 2, str(tmp_path))
    # world size 1, no process group: one shard holds every row
    single = {"emb.item": ShardedDynamicEmbedding(_cfg()), "emb.genre": ShardedDynamicEmbedding(_cfg("genre"))}
    load_sharded_checkpoint(tmp_path / "ckpt4", single)
    merged, expected = _merged(tmp_path), load_file(tmp_path / "probe4.safetensors")
    for name, table in single.items():
        assert table.num_live == merged[name].num_live > 0
        assert_same_rows(table, merged[name], rtol=0, atol=0, clock=True)
        torch.testing.assert_close(_probe(table, 0, 1), expected[name], rtol=0, atol=0)


def test_load_refuses_other_dims_and_non_checkpoints(tmp_path: Path) -> None:
    tables = {"t": ShardedDynamicEmbedding(_cfg("t"))}
    tables["t"](torch.tensor([5, 5, 6]))
    save_sharded_checkpoint(tmp_path / "c", tables)
    wide = {"t": ShardedDynamicEmbedding(TableConfig("t", dim=D * 2, optimizer=SparseOptimConfig(kind="adam")))}
    with pytest.raises(ValueError, match="dim 8"):
        load_sharded_checkpoint(tmp_path / "c", wide)
    with pytest.raises(ValueError, match="not a sparse checkpoint"):
        load_sharded_checkpoint(tmp_path, tables)
    with pytest.raises(ValueError, match="no tables given"):
        save_sharded_checkpoint(tmp_path / "empty", {})
    with pytest.raises(ValueError, match="no state for tables"):
        load_sharded_checkpoint(tmp_path / "c", {"other": tables["t"]})
