"""ShardedDynamicEmbedding on gloo (2 and 4 CPU ranks spawned here) against one DynamicEmbedding on the global batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import assert_same_rows, spawn

from recforge.sparse import AdmissionConfig, DynamicEmbedding, EmbeddingCollection, FeatureConfig, JaggedIds, SparseOptimConfig
from recforge.sparse import SparseOptimizer, TableConfig, warm_start
from recforge.sparse.planner import shard_collection
from recforge.sparse.routing import owner_of
from recforge.sparse.sharded import ShardedDynamicEmbedding

D, ROWS_PER_RANK, LEN = 8, 2, 6
RTOL, ATOL = 1e-6, 1e-7  # the same sums in another order (rows summed per rank, then across ranks)


def _cfg(**kw) -> TableConfig:
    return TableConfig(name="item", dim=D, capacity=16, init_std=0.0, seed=5,
                       optimizer=SparseOptimConfig(kind="adam", lr=0.05), **kw)  # fmt: skip


def _global_batches(world_size: int, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: ids (W * 2, LEN) drawn from 24 raw IDs (duplicates within and across ranks), loss weights (..., D)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 2**62, (24,), generator=gen)
    out = []
    for _ in range(steps):
        ids = pool[torch.randint(0, 24, (world_size * ROWS_PER_RANK, LEN), generator=gen)]
        out.append((ids, torch.randn(*ids.shape, D, generator=gen)))
    return out


def _warm(table: ShardedDynamicEmbedding | DynamicEmbedding) -> None:
    """The same random rows for 12 of the pool's 24 IDs (new rows start at 0: init_std=0)."""
    pool = torch.randint(0, 2**62, (24,), generator=torch.Generator().manual_seed(0))  # _global_batches' pool
    weight = torch.randn(12, D, generator=torch.Generator().manual_seed(1))
    if isinstance(table, ShardedDynamicEmbedding):
        table.warm_start(weight, pool[:12])  # each rank keeps the rows it owns
    else:
        warm_start(table, weight, pool[:12])


def _step_worker(rank: int, world_size: int, admission: str, micro_batches: int, owner_rank: int | None,
                 cache_rows: int = 0) -> None:  # fmt: skip
    cfg = _cfg(admission=AdmissionConfig(kind=admission, threshold=3), cache_rows=cache_rows)
    sharded, plain = ShardedDynamicEmbedding(cfg, owner_rank=owner_rank), DynamicEmbedding(cfg)
    _warm(sharded), _warm(plain)
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    batches = _global_batches(world_size, 3 * micro_batches)
    first = batches[0][0]  # duplicates within this rank's IDs and across ranks
    assert first[mine].unique().numel() < first[mine].numel() and bool(torch.isin(first[mine], first[mine.stop :]).any() or rank)
    feedback = torch.Generator().manual_seed(7)
    for step in range(3):
        shows = torch.randint(0, 3, batches[step][0].shape, generator=feedback).float()
        sharded.record_feedback(batches[step][0][mine], shows[mine], shows[mine] / 2)  # show/click counters on the owners
        plain.record_feedback(batches[step][0], shows, shows / 2)
        if cache_rows and step:  # the host tier: this step's rows go to their owners' caches ahead of the lookups
            upcoming = [ids for ids, _ in batches[step * micro_batches : (step + 1) * micro_batches]]
            loaded = sharded.prefetch([torch.cat([ids[mine] for ids in upcoming])])
            keys = torch.cat(upcoming).unique()  # every rank's upcoming IDs: this rank owns some of them
            rows = sharded.shard.index.lookup(keys[sharded.owners(keys, torch.zeros_like(keys)) == rank], None)
            assert loaded == int((rows >= 0).sum()) > 0  # exactly the owned, admitted rows of all ranks' batches
            assert bool((sharded.shard.store.row_to_slot[rows[rows >= 0]] >= 0).all()), "an owned upcoming row is not cached"
        for ids, weights in batches[step * micro_batches : (step + 1) * micro_batches]:
            out, expected = sharded(ids[mine]), plain(ids)
            torch.testing.assert_close(out, expected[mine], rtol=RTOL, atol=ATOL, msg=f"step {step} embeddings")
            (out * weights[mine]).sum().backward()
            (expected * weights).sum().backward()
        SparseOptimizer([sharded]).step()
        plain.apply_gradients()
        assert_same_rows(sharded, plain)
    names = ("admitted", "not_admitted", "updated_rows")
    totals = sharded.global_stats()
    assert {n: totals[n] for n in names} == {n: plain.stats[n] for n in names}
    if admission == "count":
        assert plain.stats["not_admitted"] > 0  # the case is exercised: some IDs got no row and no gradient
    if owner_rank is not None:
        assert (sharded.num_live > 0) == (rank == owner_rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_step_equals_single_process(world_size: int) -> None:
    spawn(_step_worker, world_size, "always", 1, None)


def test_sharded_count_admission_grad_accumulation_host_tier() -> None:
    # count admission over the global batch (an ID seen once on two ranks is seen twice); 2 micro-batches per step;
    # each shard a host table with its own 20-row cache
    spawn(_step_worker, 2, "count", 2, None, 20)


def test_table_wise_goes_through_the_same_path() -> None:
    spawn(_step_worker, 2, "always", 1, 1)


def _world_one_worker(rank: int, world_size: int) -> None:
    # world size 1 with a process group: the collectives run; random initial rows equal the plain table's
    cfg = dataclasses.replace(_cfg(), init_std=0.1)
    sharded, plain = ShardedDynamicEmbedding(cfg), DynamicEmbedding(cfg)
    for ids, weights in _global_batches(1, 3):
        out, expected = sharded(ids), plain(ids)
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
        (out * weights).sum().backward(), (expected * weights).sum().backward()
        sharded.apply_gradients(), plain.apply_gradients()
    assert_same_rows(sharded, plain)
    with pytest.raises(ValueError, match=r"negative IDs \[-5\]"):
        sharded(torch.tensor([3, -5]))


def test_world_size_one_process_group_equals_plain() -> None:
    spawn(_world_one_worker, 1)


def test_no_process_group_is_exactly_plain() -> None:
    cfg = dataclasses.replace(_cfg(admission=AdmissionConfig(kind="count", threshold=2)), init_std=0.1)
    sharded, plain = ShardedDynamicEmbedding(cfg), DynamicEmbedding(cfg)
    assert sharded.world_size == 1 and not sharded.collective
    for ids, weights in _global_batches(1, 3):
        tags = (ids % 2)
        out, expected = sharded(ids, tags), plain(ids, tags)
        assert torch.equal(out, expected)
        (out * weights).sum().backward(), (expected * weights).sum().backward()
        sharded.apply_gradients(), plain.apply_gradients()
    assert torch.equal(sharded.shard.store.weight, plain.store.weight) and sharded.stats == plain.stats
    with pytest.raises(ValueError, match="negative IDs"):
        sharded(torch.tensor([-1]))


def test_plain_table_accumulates_micro_batches() -> None:
    # two forward/backward passes, one apply_gradients == one pass over both batches (row gradients summed);
    # rows warm-started or starting at 0, so admission order (per micro-batch vs once) cannot matter
    accumulated, whole = DynamicEmbedding(_cfg()), DynamicEmbedding(_cfg())
    _warm(accumulated), _warm(whole)
    (a, wa), (b, wb) = _global_batches(1, 2)
    for ids, weights in ((a, wa), (b, wb)):
        (accumulated(ids) * weights).sum().backward()
    (whole(torch.cat([a, b])) * torch.cat([wa, wb])).sum().backward()
    accumulated.apply_gradients(), whole.apply_gradients()
    assert accumulated.stats["updated_rows"] == whole.stats["updated_rows"] > 0
    keys = whole.row_key[whole.live_rows()]
    rows_a, rows_w = accumulated.index.lookup(keys, None), whole.index.lookup(keys, None)
    torch.testing.assert_close(accumulated.store.weight[rows_a], whole.store.weight[rows_w], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(accumulated.store.state["exp_avg"][rows_a], whole.store.state["exp_avg"][rows_w], rtol=RTOL, atol=ATOL)


def _batch_of(rank: int) -> dict[str, JaggedIds]:
    ids = torch.tensor([3, 4, 4, 5]) + rank
    return {"history": JaggedIds(ids, torch.tensor([0, 2, 4])), "genres": JaggedIds(ids, torch.tensor([0, 4]))}


def _collection_worker(rank: int, world_size: int) -> None:
    tables = [_cfg(), dataclasses.replace(_cfg(), name="genre")]  # equal configs: one physical table, two tags
    features = [FeatureConfig("history", "item"), FeatureConfig("genres", "genre", pooling="mean")]
    sharded, plain = EmbeddingCollection(tables, features), EmbeddingCollection(tables, features)
    plan = shard_collection(sharded, row_wise_min_bytes=0)
    with pytest.raises(ValueError, match="default='learned' is not supported sharded"):
        ShardedDynamicEmbedding(dataclasses.replace(_cfg(), default="learned"))
    used = EmbeddingCollection(tables, features)
    used(_batch_of(rank))
    with pytest.raises(ValueError, match="already hold rows"):
        shard_collection(used)
    assert plan.tables["item+genre"].kind == "row_wise"
    ids, weights = _global_batches(world_size, 1)[0]
    offsets = torch.arange(0, ids.numel() + 1, LEN)
    batch = {"history": JaggedIds(ids.reshape(-1), offsets), "genres": JaggedIds(ids.reshape(-1) % 5, offsets)}
    mine = slice(rank * ROWS_PER_RANK * LEN, (rank + 1) * ROWS_PER_RANK * LEN)
    local = {"history": JaggedIds(ids.reshape(-1)[mine], offsets[: ROWS_PER_RANK + 1]),
             "genres": JaggedIds(ids.reshape(-1)[mine] % 5, offsets[: ROWS_PER_RANK + 1])}  # fmt: skip
    out, expected = sharded(local), plain(batch)
    torch.testing.assert_close(out["history"], expected["history"][mine], rtol=0, atol=0)
    torch.testing.assert_close(out["genres"], expected["genres"][rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK], rtol=0, atol=0)
    (out["history"] * weights.reshape(-1, D)[mine]).sum().backward()
    (expected["history"] * weights.reshape(-1, D)).sum().backward()
    SparseOptimizer([sharded]).step(), SparseOptimizer([plain]).step()
    assert_same_rows(sharded.tables["item+genre"], plain.tables["item+genre"])


def test_sharded_collection_with_tags() -> None:
    spawn(_collection_worker, 2)


def test_owner_hash_is_fixed_and_balanced() -> None:
    keys = torch.arange(40_000) * 7919
    owners = owner_of(keys, torch.zeros_like(keys), 4)
    counts = torch.bincount(owners, minlength=4)
    assert counts.min() > 9_000 and counts.max() < 11_000
    # a fixed function of (id, tag): sharded checkpoints record it, so these values must never change
    keys, tags = torch.tensor([0, 1, 7, 2**62, 12345678901]), torch.tensor([0, 0, 0, 1, 2])
    assert owner_of(keys, tags, 4).tolist() == [0, 2, 3, 3, 0]
    assert owner_of(keys, tags, 7).tolist() == [0, 4, 2, 5, 3]


def _eval_lookup_worker(rank: int, world_size: int) -> None:
    # a host-tier shard with a 4-row cache: an evaluation lookup reads rows without loading them into the cache
    cfg = dataclasses.replace(_cfg(cache_rows=4), init_std=0.1)
    sharded, plain = ShardedDynamicEmbedding(cfg), DynamicEmbedding(cfg)
    _warm(sharded), _warm(plain)
    pool = torch.randint(0, 2**62, (24,), generator=torch.Generator().manual_seed(0))  # _warm's pool: 12 rows exist
    hot = pool[:3]
    sharded(hot).sum().backward()  # training: the hot rows go to the cache
    sharded.apply_gradients()
    plain(hot).sum().backward()
    plain.apply_gradients()
    store = sharded.shard.store
    cached, stats = store.row_to_slot.clone(), dict(sharded.stats)
    cold = pool[torch.randperm(12, generator=torch.Generator().manual_seed(int(torch.randint(0, 99, ()))))[:8]]
    sharded.eval(), plain.eval()
    with torch.no_grad():
        out, expected = sharded(cold), plain(cold)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    assert torch.equal(store.row_to_slot, cached), "an evaluation lookup changed the device cache"
    assert sharded.stats["admitted"] == stats["admitted"]


def test_eval_lookup_leaves_the_device_cache_alone() -> None:
    spawn(_eval_lookup_worker, 1)
