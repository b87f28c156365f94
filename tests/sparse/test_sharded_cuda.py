"""ShardedDynamicEmbedding on CUDA with NCCL (world size 1, and 2 with two GPUs) over tiered shards; skips without CUDA.

Each rank's shard keeps its own device cache over its host table (``cache_rows`` > 0); one
sharded step must equal one CUDA ``DynamicEmbedding`` (fused Adam, sorted index) on the global batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import assert_same_rows, spawn

from recforge.sparse import DynamicEmbedding, SparseOptimConfig, TableConfig, load_sparse_checkpoint
from recforge.sparse.sharded import ShardedDynamicEmbedding
from recforge.sparse.sharded_checkpoint import export_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint

pytestmark = pytest.mark.gpu
D, ROWS_PER_RANK = 16, 4


def _cfg(cache_rows: int) -> TableConfig:
    return TableConfig(name="item", dim=D, capacity=256, init_std=0.0, cache_rows=cache_rows,
                       optimizer=SparseOptimConfig(kind="adam", lr=0.05))  # fmt: skip


def _cuda_worker(rank: int, world_size: int, cache_rows: int, root: str) -> None:
    device = torch.device("cuda", rank)
    sharded, plain = ShardedDynamicEmbedding(_cfg(cache_rows), device), DynamicEmbedding(_cfg(cache_rows), device)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 2**62, (3000,), generator=gen)  # ~3000 rows on the host, 512 cached
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    batches = [(pool[torch.randint(0, 3000, (world_size * ROWS_PER_RANK, 50), generator=gen)],
                torch.randn(world_size * ROWS_PER_RANK, 50, D, generator=gen)) for _ in range(6)]  # fmt: skip
    for step, (ids, weights) in enumerate(batches):
        ids, weights = ids.to(device), weights.to(device)
        if step + 1 < len(batches):  # the host tier: each shard prefetches the rows it owns
            sharded.prefetch([batches[step + 1][0][mine].to(device)])
        out, expected = sharded(ids[mine]), plain(ids)
        torch.testing.assert_close(out, expected[mine], rtol=1e-4, atol=1e-5)
        (out * weights[mine]).sum().backward(), (expected * weights).sum().backward()
        sharded.apply_gradients(), plain.apply_gradients()
    assert_same_rows(sharded, plain, rtol=1e-4, atol=1e-5)  # CUDA sums duplicate gradients in another order; Adam divides by |g|
    assert sharded.stats["updated_rows"] > 0
    # checkpoint under NCCL: save, restore exactly on the same ranks, export to one process
    save_sharded_checkpoint(Path(root) / "ckpt", {"item": sharded})
    restored = ShardedDynamicEmbedding(_cfg(cache_rows), device)
    load_sharded_checkpoint(Path(root) / "ckpt", {"item": restored})
    assert_same_rows(restored, plain, rtol=1e-4, atol=1e-5)
    assert torch.equal(restored.shard.row_key, sharded.shard.row_key)
    if rank == 0:
        export_sharded_checkpoint(Path(root) / "ckpt", Path(root) / "single")
    dist.barrier()
    single = {"item": DynamicEmbedding(_cfg(cache_rows), device)}
    load_sparse_checkpoint(Path(root) / "single", single)
    assert single["item"].num_live == plain.num_live
    assert_same_rows(sharded, single["item"], rtol=0, atol=0)


@pytest.mark.parametrize("cache_rows", [0, 512])
@pytest.mark.parametrize("world_size", [1, 2])
def test_sharded_cuda_nccl_step_equals_one_table(cuda_device: torch.device, world_size: int, cache_rows: int, tmp_path: Path) -> None:
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA GPUs (torch.cuda.device_count() is {torch.cuda.device_count()})")
    spawn(_cuda_worker, world_size, cache_rows, str(tmp_path), backend="nccl")
