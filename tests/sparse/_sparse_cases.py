"""Shared configs and batches of the tiered-storage and CUDA tests."""

from __future__ import annotations

import torch

from recforge.sparse import AdmissionConfig, EvictionConfig, SparseOptimConfig, TableConfig

D = 8


def tiered_cfg(**kw) -> TableConfig:
    return TableConfig(
        name="t", dim=D, capacity=64, max_rows=200, seed=3,
        optimizer=SparseOptimConfig(kind="adamw", lr=0.05, weight_decay=0.01),
        admission=AdmissionConfig(kind="count", threshold=2), eviction=EvictionConfig(kind="lfu"), **kw,
    )  # fmt: skip


def zipf_batches(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, 401, dtype=torch.float64) ** 1.1  # power-law popularity over 400 raw IDs
    raw = torch.randint(0, 2**60, (400,), generator=gen)
    return [raw[torch.multinomial(zipf, 40, replacement=True, generator=gen)] for _ in range(n)]
