"""Spawning gloo process groups inside a test: ``spawn(worker, world_size, *args)`` runs ``worker(rank, world_size, *args)``.

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


def _entry(rank: int, world_size: int, store: str, backend: str, worker: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        worker(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(worker: Callable, world_size: int, *args, backend: str = "gloo") -> None:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` processes joined in one process group."""
    with tempfile.TemporaryDirectory(prefix="recforge-dist-") as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "store"), backend, worker, args), nprocs=world_size, join=True)
