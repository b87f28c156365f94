"""Tiered storage (host table + device cache) trains exactly like one tier."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from recforge.sparse import AdmissionConfig, DynamicEmbedding, EvictionConfig, SparseOptimConfig, TableConfig, to_dense

D = 8


def _cfg(**kw) -> TableConfig:
    return TableConfig(
        name="t", dim=D, capacity=64, max_rows=200, seed=3,
        optimizer=SparseOptimConfig(kind="adamw", lr=0.05, weight_decay=0.01),
        admission=AdmissionConfig(kind="count", threshold=2), eviction=EvictionConfig(kind="lfu"), **kw,
    )  # fmt: skip


def _batches(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, 401, dtype=torch.float64) ** 1.1  # power-law popularity over 400 raw IDs
    raw = torch.randint(0, 2**60, (400,), generator=gen)
    return [raw[torch.multinomial(zipf, 40, replacement=True, generator=gen)] for _ in range(n)]


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


def test_prefetch_turns_misses_into_hits() -> None:
    table = DynamicEmbedding(dataclasses.replace(_cfg(), cache_rows=16, admission=AdmissionConfig()))
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
