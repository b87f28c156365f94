"""The CUDA path (sorted index, fused lazy Adam, host<->cache swap kernel) against the CPU reference; skips without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _sparse_cases import tiered_cfg as _cfg
from _sparse_cases import zipf_batches as _batches

from recforge.sparse import AdmissionConfig, DynamicEmbedding, EvictionConfig, kernels, lookup, to_dense


def _run(table: DynamicEmbedding, batches: list[torch.Tensor], prefetch: int = 0) -> None:
    gen = torch.Generator().manual_seed(9)
    for i, ids in enumerate(batches):
        if prefetch:
            table.prefetch([b.to(table.device) for b in batches[i + 1 : i + 1 + prefetch]])
        out = table(ids.to(table.device))
        (out * torch.randn(out.shape, generator=gen).to(out.device)).sum().backward()
        table.apply_gradients()


def test_cuda_table_matches_cpu(cuda_device: torch.device) -> None:
    # growth, count admission, AdamW; rows start at 0 (CUDA and CPU generators draw different numbers)
    cfg = dataclasses.replace(_cfg(), max_rows=0, eviction=EvictionConfig(), init_std=0.0)
    batches = _batches(20, seed=3)
    cpu, gpu = DynamicEmbedding(cfg), DynamicEmbedding(cfg, cuda_device)
    _run(cpu, batches)
    _run(gpu, batches)
    assert cpu.stats == gpu.stats and gpu.stats["grown"] > 0
    ids = torch.cat(batches).unique()
    # float32 rounding differs (fused kernel vs torch ops) and Adam amplifies it where v is tiny
    torch.testing.assert_close(to_dense(gpu, ids).cpu(), to_dense(cpu, ids), rtol=1e-3, atol=2e-4)


@pytest.mark.parametrize("segment_max", [lookup.SEGMENT_MAX, 2])  # 2: row gradients in two passes (pieces)
def test_cuda_tiered_equals_single_tier(segment_max: int, cuda_device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookup, "SEGMENT_MAX", segment_max)
    batches = _batches(30, seed=2)
    single = DynamicEmbedding(_cfg(), cuda_device)
    tiered = DynamicEmbedding(dataclasses.replace(_cfg(), cache_rows=48), cuda_device)
    assert tiered.store.uva == kernels.HAS_TRITON
    _run(single, batches)
    _run(tiered, batches, prefetch=1)
    assert tiered.store.stats()["rows_written_back"] > 0 and tiered.num_live > 48
    ids = torch.cat(batches).unique()
    assert torch.equal(to_dense(single, ids), to_dense(tiered, ids)) and single.stats == tiered.stats


def test_cuda_nonfinite_rows_skipped(cuda_device: torch.device) -> None:
    table = DynamicEmbedding(dataclasses.replace(_cfg(), admission=AdmissionConfig()), cuda_device)
    out = table(torch.tensor([1, 2], device=cuda_device))
    before = table.store.weight[:2].clone()
    (out * torch.tensor([[float("nan")] * out.shape[1], [1.0] * out.shape[1]], device=cuda_device)).sum().backward()
    table.apply_gradients()
    assert table.stats["nonfinite_grad_rows"] == 1 and table.stats["updated_rows"] == 1
    assert torch.equal(table.store.weight[0], before[0]) and not torch.equal(table.store.weight[1], before[1])
