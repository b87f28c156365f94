"""A combined lookup staged early (``ShardedDynamicEmbedding.stage``) whose rows are evicted, and partly taken by other
IDs, before its ``lookup`` trains exactly as the same lookup staged at use: only the staged keys that lost their rows
(or had none) are looked up again; if none lost its row, the staged rows are read as they are, with no host sync
beyond the check. On 1 and 2 gloo ranks, one-tier and tiered."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _dist import spawn

from recforge.sparse import SparseOptimConfig, TableConfig
from recforge.sparse.sharded import ShardedDynamicEmbedding

D, STEPS = 8, 9
CFG = TableConfig(name="item", dim=D, capacity=64, init_std=0.05, seed=5, optimizer=SparseOptimConfig(kind="adam", lr=0.05))
TIERED = dataclasses.replace(CFG, cache_rows=40)


def _pool(seed: int) -> torch.Tensor:
    return torch.randint(0, 2**62, (60,), generator=torch.Generator().manual_seed(seed))


def _ids(rank: int, step: int, seed: int) -> list[torch.Tensor]:
    """This rank's parts of a step (history, targets, negatives) from a pool of 40 random 62-bit keys, and other IDs."""
    gen = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    pool = _pool(seed)
    history = pool[torch.randint(0, 30, (3, 4), generator=gen)]
    return [history, history[:, -1].clone(), pool[torch.randint(0, 40, (5,), generator=gen)], pool[40 + step * 2 : 42 + step * 2]]


def _evict(table: ShardedDynamicEmbedding, step: int) -> None:
    """Every third step: evict the live rows whose key is 0 mod 3 (some staged keys lose their rows, admitted again
    by the lookup). Other steps: only move the table's eviction epoch, as an eviction of rows no staged key holds does."""
    shard = table.shard
    live = shard.live_rows()
    if step % 3 == 1:
        shard.evict_rows(live[shard.row_key[live] % 3 == 0])
    shard.stage_epoch += 1


def _state(table: ShardedDynamicEmbedding) -> dict[int, tuple]:
    shard = table.shard
    live = shard.live_rows()
    weight, state = shard.store.host_rows(live)
    counters = shard.counters.tensors()
    return {int(key): (weight[i], *(s[i] for s in state.values()), *(c[live][i] for c in counters.values()))
            for i, key in enumerate(shard.row_key[live].tolist())}  # fmt: skip


def _worker(rank: int, world_size: int, cfg: TableConfig, seed: int) -> None:
    early, at_use = ShardedDynamicEmbedding(cfg), ShardedDynamicEmbedding(cfg)
    early.shard.clock = at_use.shard.clock = lambda: 0.0
    for table in (early, at_use):  # the pool admitted: the staged lookups find their rows unless evicted
        table(_pool(seed)[:40])
        table.apply_gradients()
    reads_without_relookup = 0
    for step in range(STEPS):
        *parts, other = _ids(rank, step, seed)
        weights = [torch.randn(*p.shape, D, generator=torch.Generator().manual_seed(step * 3 + k)) for k, p in enumerate(parts)]
        handle = early.distribute(parts)
        early.stage(handle)  # a step ahead: evictions and another lookup's admissions come in between
        outs = {}
        for name, table in (("early", early), ("at_use", at_use)):
            _evict(table, step)
            new = table(other)  # other IDs, admitted into the freed rows
            if name == "at_use":
                handle = table.distribute(parts)
                table.stage(handle)
            before = table.staged_reads
            outs[name] = [table.lookup(handle, part=k) for k in range(3)]
            if name == "early":
                reads_without_relookup += table.staged_reads - before
            (sum((o * w).sum() for o, w in zip(outs[name], weights, strict=True)) + new.sum()).backward()
            table.apply_gradients()
        for a, b in zip(outs["early"], outs["at_use"], strict=True):
            assert torch.equal(a, b), f"step {step}"
        state_early, state_at_use = _state(early), _state(at_use)
        assert state_early.keys() == state_at_use.keys()
        for key, values in state_early.items():
            assert all(torch.equal(a, b) for a, b in zip(values, state_at_use[key], strict=True)), (step, key)
        names = ("lookups", "ids", "admitted", "evicted", "updated_rows")
        assert {n: early.stats[n] for n in names} == {n: at_use.stats[n] for n in names}
    counts = torch.tensor([early.relooked_up, reads_without_relookup, at_use.relooked_up])
    dist.all_reduce(counts)
    relooked, reads, at_use_relooked = counts.tolist()
    # staged early, exactly the keys without a row at use are looked up again (lost since, or never had one): those
    # the same lookup staged at use finds without a row (the full path, taken before, counts none)
    assert relooked == at_use_relooked > 0, (relooked, at_use_relooked)
    assert reads > 0, "no staged lookup survived an eviction of other rows"


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("cfg", [CFG, TIERED], ids=["one-tier", "tiered"])
def test_a_staged_lookup_after_evictions_equals_one_staged_at_use(world_size: int, cfg: TableConfig) -> None:
    spawn(_worker, world_size, cfg, int(torch.randint(1, 2**20, ())))


def _tag_worker(rank: int, world_size: int) -> None:
    table = ShardedDynamicEmbedding(TableConfig(name="x", dim=4, capacity=16, init_std=0.1, seed=1))
    key = torch.randint(0, 2**62, (1,))
    table(key)
    table.apply_gradients()  # (key, tag 0) admitted
    row = int(table.shard.index.lookup(key, None)[0])
    handle = table.distribute([key])
    table.stage(handle)  # staged untagged: row ``row``
    table.shard.evict_rows(torch.tensor([row]))  # (key, 0) evicted ...
    table(key, tags=torch.tensor([3]))
    table.apply_gradients()  # ... and (key, 3) admitted into the freed row
    assert int(table.shard.index.lookup(key, torch.tensor([3]))[0]) == row
    table.lookup(handle, part=0)
    own = int(table.shard.index.lookup(key, torch.tensor([0]))[0])
    assert own >= 0 and own != row  # (key, 0) looked up again and admitted, not read from (key, 3)'s row


def test_an_untagged_staged_key_never_reads_another_tags_row() -> None:
    """An untagged lookup stands for tag 0: a staged row now held by the same key under another tag is lost."""
    spawn(_tag_worker, 1)
