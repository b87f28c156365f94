"""A combined lookup (``ShardedDynamicEmbedding.distribute([a, b, c])``: one ID all-to-all, one staging, one owner
lookup for several lookups of one table) on 1 and 2 gloo ranks, against one ``DynamicEmbedding`` on the global batch:

- no ID in two parts: exactly separate lookups of the parts (new rows, their initial values, admission, counters,
  optimizer state), with one row gradient per ID on its owner;
- overlapping parts: one lookup of the parts' concatenation (each distinct ID admitted, counted and updated once,
  on its occurrences summed over the parts), whatever the admission policy.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import assert_same_rows, spawn

from recforge.sparse import AdmissionConfig, DynamicEmbedding, SparseOptimConfig, SparseOptimizer, TableConfig
from recforge.sparse.sharded import ShardedDynamicEmbedding

D, B, L, K, STEPS = 8, 2, 5, 6, 4
CFG = TableConfig(name="item", dim=D, capacity=8, init_std=0.05, seed=5, optimizer=SparseOptimConfig(kind="adam", lr=0.05))


def _parts(world_size: int, step: int, overlap: bool) -> list[torch.Tensor]:
    """Global parts of a step: history (W*B, L), targets (W*B,), negatives (W*K,). Disjoint: each part draws from
    its own 20 IDs of a pool of 60 random 62-bit keys; overlapping: targets from the history, negatives from 30."""
    gen = torch.Generator().manual_seed(10 + step)
    pool = torch.randint(0, 2**62, (60,), generator=torch.Generator().manual_seed(3))
    history = pool[torch.randint(0, 20, (world_size * B, L), generator=gen)]
    if overlap:
        targets = history[torch.arange(world_size * B), torch.randint(0, L, (world_size * B,), generator=gen)]
        negatives = pool[torch.randint(0, 30, (world_size * K,), generator=gen)]
    else:
        targets = pool[torch.randint(20, 40, (world_size * B,), generator=gen)]
        negatives = pool[torch.randint(40, 60, (world_size * K,), generator=gen)]
    return [history, targets, negatives]


def _worker(rank: int, world_size: int, cfg: TableConfig, overlap: bool, staged: bool, cuda: bool = False) -> None:
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    tol = {"rtol": 1e-4, "atol": 1e-5} if cuda else {"rtol": 1e-6, "atol": 1e-7}  # CUDA sums duplicates in another order
    sharded, plain = ShardedDynamicEmbedding(cfg, device), DynamicEmbedding(cfg, device)
    sharded.shard.clock = plain.clock = lambda: 0.0
    lookups = []
    for step in range(STEPS):
        parts = [p.to(device) for p in _parts(world_size, step, overlap)]
        mine = [p.view(world_size, -1, *p.shape[1:])[rank] for p in parts]  # this rank's share of each part
        weights = [torch.randn(*p.shape, D, generator=torch.Generator().manual_seed(100 + step * 3 + k)).to(device)
                   for k, p in enumerate(parts)]  # fmt: skip
        handle = sharded.distribute(mine)  # one ID all-to-all for the three lookups
        if staged:
            sharded.stage(handle)
        outs = [sharded.lookup(handle, part=k) for k in range(3)]
        if overlap:  # one lookup of the concatenation
            expected = plain(torch.cat([p.reshape(-1) for p in parts])).split([p.numel() for p in parts])
            expected = [e.view(*p.shape, D) for e, p in zip(expected, parts, strict=True)]
        else:  # separate lookups, in order
            expected = [plain(p) for p in parts]
        for k, (out, exp) in enumerate(zip(outs, expected, strict=True)):
            share = exp.view(world_size, -1, *exp.shape[1:])[rank]
            torch.testing.assert_close(out, share, **tol, msg=f"step {step} part {k}")
            assert out.shape == (*mine[k].shape, D)
        sum((o * w.view(world_size, -1, *w.shape[1:])[rank]).sum() for o, w in zip(outs, weights, strict=True)).backward()
        sum((e * w).sum() for e, w in zip(expected, weights, strict=True)).backward()
        pending = sharded.shard._pending  # one row gradient per ID on its owner: the parts' gradients summed
        assert len(pending) <= 1 and all(r.unique().numel() == r.numel() for r, _, _ in pending)
        lookups.append(sharded.shard.stats["lookups"])
        SparseOptimizer([sharded]).step()
        plain.apply_gradients()
        assert_same_rows(sharded, plain, **tol)
    assert lookups == sorted(lookups) and lookups[-1] <= STEPS  # at most one lookup per step on each shard
    totals = sharded.global_stats()
    names = ("admitted", "not_admitted", "ids")
    assert {n: totals[n] for n in names} == {n: plain.stats[n] for n in names}
    if cfg.admission.kind == "count":
        assert plain.stats["not_admitted"] > 0  # the case is exercised


COUNT = dataclasses.replace(CFG, admission=AdmissionConfig(kind="count", threshold=2))
TIERED = dataclasses.replace(CFG, cache_rows=80)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(("cfg", "staged"), [(CFG, False), (COUNT, False), (TIERED, True)],
                         ids=["always", "count", "host-tier-staged"])  # fmt: skip
def test_disjoint_parts_equal_separate_lookups(world_size: int, cfg: TableConfig, staged: bool) -> None:
    """One rank: new rows get the initial values of separate lookups (the same draws in the same order); two: shards
    other than 0 draw their own rows, so new rows start at 0 (``init_std=0``) as in ``test_sharded``."""
    spawn(_worker, world_size, cfg if world_size == 1 else dataclasses.replace(cfg, init_std=0.0), False, staged)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("cfg", [CFG, COUNT], ids=["always", "count"])
def test_overlapping_parts_equal_one_lookup_of_their_concatenation(world_size: int, cfg: TableConfig) -> None:
    """New IDs are admitted part by part (by their first part); with ``init_std=0`` the values do not tell the
    order, so the state equals one lookup of the concatenation (which admits them all at once)."""
    spawn(_worker, world_size, dataclasses.replace(cfg, init_std=0.0), True, True)


def test_combined_lookup_needs_a_process_group_and_no_tags() -> None:
    table = ShardedDynamicEmbedding(CFG)
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="needs a process group"):
        table.distribute([ids, ids])
    with pytest.raises(ValueError, match="takes no tags"):
        table.distribute([ids], torch.zeros_like(ids))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("overlap", [False, True], ids=["disjoint", "overlapping"])
def test_combined_lookup_on_cuda_nccl(cuda_device: torch.device, world_size: int, overlap: bool) -> None:
    """The same on CUDA (NCCL, the sorted index, the host tier's device cache): disjoint parts with new rows'
    initial values on one rank."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA GPUs (torch.cuda.device_count() is {torch.cuda.device_count()})")
    cfg = TIERED if world_size == 1 and not overlap else dataclasses.replace(TIERED, init_std=0.0)
    spawn(_worker, world_size, cfg, overlap, True, True, backend="nccl")
