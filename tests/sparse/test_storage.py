"""Tiered storage (host table + device cache) trains exactly like one tier."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
from _sparse_cases import tiered_cfg, zipf_batches

from recforge.sparse import AdmissionConfig, DynamicEmbedding, kernels, lookup, to_dense

# the kernels on CPU tensors: only in Triton's interpreter (tests/conftest.py turns it on without CUDA)
INTERPRETED_TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"

D = 8
_cfg, _batches = tiered_cfg, zipf_batches


def _train(table: DynamicEmbedding, batches: list[torch.Tensor], prefetch: int = 0) -> None:
    gen = torch.Generator().manual_seed(9)
    for i, ids in enumerate(batches):
        if prefetch:
            table.prefetch(batches[i + 1 : i + 1 + prefetch])
        out = table(ids)
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        table.apply_gradients()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_tiered_equals_single_tier(prefetch: int) -> None:
    batches = _batches(30, seed=prefetch)
    single = DynamicEmbedding(_cfg())
    tiered = DynamicEmbedding(dataclasses.replace(_cfg(), cache_rows=48))  # table up to 200 rows, cache 48
    _train(single, batches)
    _train(tiered, batches, prefetch)
    assert tiered.store.stats()["rows_written_back"] > 0 and tiered.num_live > 48  # the cache really cycled
    ids = torch.cat(batches).unique()
    assert torch.equal(to_dense(single, ids), to_dense(tiered, ids))
    assert single.stats == tiered.stats
    tiered.store.flush()
    for name, state in single.store.state.items():
        live = single.live_rows()
        assert torch.equal(state[live], tiered.store.host_state[name][live]), name


def _kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path (kernels, a bitmap prefetch) on CPU tensors: interpreted."""
    if not INTERPRETED_TRITON:
        pytest.skip("needs triton's interpreter (TRITON_INTERPRET=1); CUDA: test_cuda.py")
    monkeypatch.setattr(kernels, "available", lambda device: True)


@pytest.mark.parametrize("kernel_path", [False, True])
def test_prefetch_turns_misses_into_hits(kernel_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel_path:
        _kernel_path(monkeypatch)
    table = DynamicEmbedding(dataclasses.replace(_cfg(), cache_rows=16, admission=AdmissionConfig()))
    table.store.uva = kernel_path
    _train(table, [torch.arange(16), torch.arange(16, 32)])  # the cache now holds rows of IDs 16..31
    misses = table.store.stats()["cache_misses"]
    assert table.prefetch([torch.arange(16)]) == 16
    after_prefetch = table.store.stats()["cache_misses"]
    _train(table, [torch.arange(16)])
    assert after_prefetch == misses + 16 and table.store.stats()["cache_misses"] == after_prefetch  # the step missed nothing


def test_cache_smaller_than_a_step_raises() -> None:
    table = DynamicEmbedding(dataclasses.replace(_cfg(), cache_rows=4, admission=AdmissionConfig()))
    with pytest.raises(ValueError, match="raise cache_rows"):
        table(torch.arange(10))


def test_eval_reads_through_the_cache_without_filling_it() -> None:
    table = DynamicEmbedding(dataclasses.replace(_cfg(), cache_rows=16, admission=AdmissionConfig()))
    for start in range(0, 64, 16):
        _train(table, [torch.arange(start, start + 16)])
    table.eval()
    with torch.no_grad():
        out = table(torch.arange(64))  # more rows than the cache holds
    table.train()
    assert torch.equal(out, to_dense(table, torch.arange(64)))


def test_index_kinds_train_identically() -> None:
    """The sorted-array index (CUDA's default) and the hash table give the same table, tags included."""
    batches = _batches(20, seed=5)
    gen = torch.Generator().manual_seed(4)
    tags = [torch.randint(0, 2, b.shape, generator=gen) for b in batches]
    tables = [DynamicEmbedding(dataclasses.replace(_cfg(), index=kind, max_rows=64)) for kind in ("hash", "sorted")]
    for table in tables:
        for ids, tag in zip(batches, tags, strict=True):
            table(ids, tag).sum().backward()
            table.apply_gradients()
    hashed, ordered = tables
    assert hashed.stats == ordered.stats and hashed.stats["evicted"] > 0
    for tag in (0, 1):
        ids = torch.cat(batches).unique()
        assert torch.equal(to_dense(hashed, ids, tag), to_dense(ordered, ids, tag))


@pytest.mark.skipif(not INTERPRETED_TRITON, reason="needs triton's interpreter (TRITON_INTERPRET=1); CUDA: test_cuda.py")
@pytest.mark.parametrize("segment_max", [lookup.SEGMENT_MAX, 2])  # 2: row gradients of longer runs in two passes
def test_cuda_kernels_train_like_the_torch_path(segment_max: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup, fused lazy-AdamW and host<->cache swap kernels (as on CUDA, here interpreted) against torch ops."""
    monkeypatch.setattr(lookup, "SEGMENT_MAX", segment_max)
    batches = _batches(12, seed=1)
    reference = DynamicEmbedding(_cfg())
    _train(reference, batches)
    monkeypatch.setattr(kernels, "available", lambda device: True)
    single = DynamicEmbedding(_cfg())
    tiered = DynamicEmbedding(dataclasses.replace(_cfg(), cache_rows=48))
    tiered.store.uva = True  # the GPU path: swap_rows on the host table (here plain memory)
    _train(single, batches)
    _train(tiered, batches, prefetch=1)
    ids = torch.cat(batches).unique()
    assert torch.equal(to_dense(single, ids), to_dense(tiered, ids)) and single.stats == tiered.stats
    assert tiered.store.stats()["rows_written_back"] > 0
    torch.testing.assert_close(to_dense(single, ids), to_dense(reference, ids), rtol=1e-5, atol=1e-6)
    out = single(batches[0][:2])
    (out * torch.tensor([[float("nan")] * D, [1.0] * D])).sum().backward()
    before = single.stats["updated_rows"]
    single.apply_gradients()
    assert single.stats["nonfinite_grad_rows"] == 1 and single.stats["updated_rows"] == before + 1


@pytest.mark.parametrize("kernel_path", [False, True])
def test_prefetch_loads_what_fits_beside_pinned_rows(kernel_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel_path:
        _kernel_path(monkeypatch)
    table = DynamicEmbedding(dataclasses.replace(_cfg(), cache_rows=16, admission=AdmissionConfig()))
    table.store.uva = kernel_path
    _train(table, [torch.arange(12), torch.arange(100, 110)])  # rows for 0..11 and 100..109 (the cache cycles)
    out = table(torch.arange(12))  # 12 of 16 slots pinned by this step
    assert table.prefetch([torch.arange(100, 110)]) == 10  # 4 slots free of pinned rows: no error, 4 loaded
    out.sum().backward()
    table.apply_gradients()
    assert int((table.store.row_to_slot[:-1] >= 0).sum()) == 16


@pytest.mark.parametrize("kernel_path", [False, True])
def test_prefetch_rejects_negative_ids(kernel_path: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel_path:
        _kernel_path(monkeypatch)
    table = DynamicEmbedding(dataclasses.replace(_cfg(), cache_rows=16, admission=AdmissionConfig()))
    _train(table, [torch.arange(8)])
    with pytest.raises(ValueError, match="negative IDs"):
        table.prefetch([torch.tensor([3, -5, 7])])
