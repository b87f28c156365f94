"""Spawning gloo process groups inside a test: ``spawn(worker, world_size, *args)`` runs ``worker(rank, world_size, *args)``;
``assert_same_rows``: a rank's shard against one unsharded table.

Workers are module-level functions (spawned processes import them); they assert themselves, and a
failure on any rank fails the test with that rank's traceback (``torch.multiprocessing.spawn``).
The rendezvous is a file store in a fresh temporary directory (no port to race for).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recforge.sparse import DynamicEmbedding
from recforge.sparse.sharded import ShardedDynamicEmbedding


def _entry(rank: int, world_size: int, store: str, backend: str, worker: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        worker(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(worker: Callable, world_size: int, *args, backend: str = "gloo") -> None:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` processes joined in one process group.

    gloo (CPU) ranks are forked: they start in milliseconds instead of importing torch again (~2 s of
    CPU each); NCCL ranks are spawned (CUDA cannot be used in a forked child).
    """
    method = "spawn" if backend == "nccl" else "fork"
    with tempfile.TemporaryDirectory(prefix="recforge-dist-") as tmp:
        mp.start_processes(_entry, args=(world_size, os.path.join(tmp, "store"), backend, worker, args), nprocs=world_size,
                           join=True, start_method=method)  # fmt: skip


def assert_same_rows(sharded: ShardedDynamicEmbedding, plain: DynamicEmbedding, rtol: float = 1e-6, atol: float = 1e-7,
                     clock: bool = False) -> None:  # fmt: skip
    """Every row this rank owns equals the plain table's row of that ID (weight, optimizer state, counters;
    ``clock``: also the wall-clock time of each row's last lookup); the shards together hold exactly the plain table's IDs."""
    shard = sharded.shard
    live = shard.live_rows()
    keys, tags = shard.row_key[live], shard.row_tag[live]
    assert bool((sharded.owners(keys, tags) == sharded.rank).all()), "a shard holds an ID it does not own"
    plain_rows = plain.index.lookup(keys, tags)
    assert bool((plain_rows >= 0).all()), "a shard holds an ID the plain table does not"
    (w_s, st_s), (w_p, st_p) = shard.store.host_rows(live), plain.store.host_rows(plain_rows)
    torch.testing.assert_close(w_s, w_p, rtol=rtol, atol=atol)
    for name in st_p:
        torch.testing.assert_close(st_s[name], st_p[name], rtol=rtol, atol=atol)
    for name, counter in plain.counters.tensors().items():
        if clock or name != "last_time":
            torch.testing.assert_close(shard.counters.tensors()[name][live], counter[plain_rows], rtol=0, atol=0)
    total = torch.tensor([shard.num_live], device=shard.device)  # NCCL reduces device tensors
    if dist.is_initialized():
        dist.all_reduce(total)
    assert int(total) == plain.num_live
