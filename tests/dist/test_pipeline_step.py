"""The sparse pipeline (``recforge.train.pipeline_step``): a step's lookups of one table made as ONE combined lookup
(one ID all-to-all, one staging) during the previous step train exactly as the same combined lookup made at the step,
on 1 and 2 gloo ranks, with heavily overlapping IDs, a host tier, admission and eviction; also the sampled negatives
drawn before the step (``recforge.train.step_draws``), staged with the batch's IDs."""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sparse"))
from _dist import spawn  # noqa: E402

from recforge.config import RunConfig  # noqa: E402
from recforge.sparse import AdmissionConfig, EvictionConfig, SparseOptimConfig, SparseOptimizer, TableConfig  # noqa: E402
from recforge.train.distributed import DistContext  # noqa: E402
from recforge.train.inputs import StepInputs  # noqa: E402
from recforge.train.losses import SampledNegatives, draw_negatives, sampled_softmax_loss  # noqa: E402
from recforge.train.pipeline_step import AheadTable  # noqa: E402
from recforge.train.step import StepRunner  # noqa: E402
from recforge.train.step_draws import rank_seed  # noqa: E402

D, POOL, STEPS, NEG = 8, 40, 24, 6
JUMP = 12  # the step whose seed jumps


@dataclasses.dataclass
class Batch:
    """The tensors a recipe's batch carries: features and labels (the lookups' IDs), a loss weight."""

    features: dict[str, torch.Tensor]
    labels: dict[str, torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return self.features["item_ids"].numel()

    def to(self, device, non_blocking: bool = False) -> Batch:
        return Batch({k: v.to(device) for k, v in self.features.items()}, {k: v.to(device) for k, v in self.labels.items()})


# sampled negatives drawn before the step: (negatives, chunk_size); None: drawn in the loss from the pool, unstaged
DRAWN = {"in-loss": None, "shared": ("shared", 0), "per-position-chunked": ("per_position", 3)}


class Tiny(nn.Module):
    def __init__(self, cfg: TableConfig, drawn: tuple[str, int] | None = None, rank: int = 0) -> None:
        super().__init__()
        self.table = AheadTable(cfg)
        self.table.shard.clock = lambda: 0.0  # TTL/last_time: the same in both runs
        self.proj = nn.Linear(D, D)
        self.pool = _pool(drawn)
        self.drawn, self.rank = drawn, rank

    def draw(self, batch: Batch, seed: int) -> SampledNegatives:
        """Negatives from the pool's ids 1..POOL (as the retrieval recipe draws them), with in-batch negatives."""
        negatives, chunk = self.drawn
        seed = rank_seed(seed, self.rank) if negatives == "per_position" else seed
        return draw_negatives(batch.labels["next_item"], POOL, negatives=negatives, num_negatives=NEG, in_batch_negatives=True,
                              chunk_size=chunk, exact_distinct=True, generator=torch.Generator().manual_seed(seed))  # fmt: skip

    def loss(self, batch: Batch, sampled: SampledNegatives | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        history = self.table(batch.features["item_ids"])  # (B, L, D): staged a step ahead
        if sampled is not None:  # every lookup of the loss (targets, negatives, in-batch) staged a step ahead
            negatives, chunk = self.drawn
            user = F.normalize(self.proj(history.mean(1)), dim=-1)  # (B, D)
            loss = sampled_softmax_loss(user, batch.labels["next_item"], lambda ids: F.normalize(self.table(ids), dim=-1),
                                        POOL, negatives=negatives, num_negatives=NEG, in_batch_negatives=True, temperature=0.2,
                                        chunk_size=chunk, exact_distinct=True, sampled=sampled)  # fmt: skip
            return loss, loss
        target = self.table(batch.labels["next_item"])  # (B, D): staged a step ahead
        negatives = self.table(self.pool[torch.randint(0, POOL, (NEG,))])  # (NEG, D): made here, looked up at use
        user = self.proj(history.mean(1))  # (B, D)
        logits = torch.cat([(user * target).sum(-1, keepdim=True), user @ negatives.T], 1)  # (B, 1 + NEG)
        loss = -torch.log_softmax(logits, 1)[:, 0].mean()
        return loss, loss


def _pool(drawn: tuple[str, int] | None) -> torch.Tensor:
    """The IDs the batches draw from: random 62-bit keys, or items 1..POOL where negatives are drawn as items."""
    if drawn is not None:
        return torch.arange(1, POOL + 1)
    return torch.randint(0, 2**62, (POOL,), generator=torch.Generator().manual_seed(3))


def _batches(rank: int, world_size: int, drawn: tuple[str, int] | None) -> list[Batch | None]:
    """Zipf-like draws from a pool of 40 IDs: most IDs recur within a step, across ranks and in consecutive steps.
    The last rank's data ends a step early (a stand-in step)."""
    gen = torch.Generator().manual_seed(100 + rank)
    pool = _pool(drawn)
    weights = 1.0 / torch.arange(1, POOL + 1).double()
    out: list[Batch | None] = []
    for step in range(STEPS):
        if rank == world_size - 1 and world_size > 1 and step == STEPS - 1:
            out.append(None)
            continue
        history = pool[torch.multinomial(weights, 4 * 5, replacement=True, generator=gen)].view(4, 5)
        target = pool[torch.multinomial(weights, 4, replacement=True, generator=gen)]
        out.append(Batch({"item_ids": history}, {"next_item": target}))
    return out


def _train(cfg_table: TableConfig, drawn: tuple[str, int] | None, pipeline: bool, rank: int,
           world_size: int) -> tuple[list[float], Tiny, StepRunner]:  # fmt: skip
    torch.manual_seed(0)
    model = Tiny(cfg_table, drawn, rank)
    cfg = RunConfig()
    cfg.optim.lr = 0.01
    ctx = DistContext(rank, world_size, rank, initialized=True)
    runner = StepRunner(cfg, model, torch.device("cpu"), ctx, loss_fn=model.loss, units_fn=lambda b: float(b.labels["next_item"].numel()),
                        sparse_optimizer=SparseOptimizer([model]), draw=model.draw if drawn else None)  # fmt: skip
    distributes = {"main": 0, "worker": 0}  # ID all-to-alls of the table, by the thread that started them
    real = model.table.distribute

    def counted(*args, **kwargs):
        distributes["main" if threading.current_thread() is threading.main_thread() else "worker"] += 1
        return real(*args, **kwargs)

    model.table.distribute = counted
    runner.distributes = distributes
    batches = _batches(rank, world_size, drawn)
    inputs = StepInputs(iter([[b] for b in batches] + [[None]] * 2), build=lambda b: b, device=torch.device("cpu"),
                        snapshot=None, prefetch=pipeline)  # fmt: skip
    runner.set_upcoming(inputs.peek if pipeline else None)
    losses = []
    torch.manual_seed(1)  # the in-loss negatives
    try:
        for step in range(STEPS):
            if drawn:
                # as the training loop re-seeds every step: the drawn negatives' seeds; one jump (as on a resume) makes
                # the worker's draws, and so its combined lookup, for the wrong seed: the step makes them again
                torch.manual_seed(1000 + step + (50 if step >= JUMP else 0))
            result = runner(next(inputs).micro)
            losses.append(result.loss)
    finally:
        runner.set_upcoming(None)
        inputs.close()
    return losses, model, runner


def _table_state(table: AheadTable) -> dict[int, tuple]:
    shard = table.shard
    live = shard.live_rows()
    weight, state = shard.store.host_rows(live)
    counters = {k: v[live] for k, v in shard.counters.tensors().items()}
    return {int(key): (weight[i], *(s[i] for s in state.values()), *(c[i] for c in counters.values()))
            for i, key in enumerate(shard.row_key[live].tolist())}  # fmt: skip


def _equal_worker(rank: int, world_size: int, cfg_table: TableConfig, drawn: tuple[str, int] | None) -> None:
    off_losses, off, off_runner = _train(cfg_table, drawn, False, rank, world_size)
    on_losses, on, runner = _train(cfg_table, drawn, True, rank, world_size)
    assert on_losses == off_losses, (on_losses, off_losses)  # bitwise
    for (name, p_on), p_off in zip(on.named_parameters(), off.parameters(), strict=True):
        assert torch.equal(p_on, p_off), name
    state_on, state_off = _table_state(on.table), _table_state(off.table)
    assert state_on.keys() == state_off.keys()
    for key, values in state_on.items():
        for a, b in zip(values, state_off[key], strict=True):
            assert torch.equal(a, b), key
    names = ("lookups", "ids", "admitted", "not_admitted", "evicted", "updated_rows")
    assert {n: on.table.stats[n] for n in names} == {n: off.table.stats[n] for n in names}
    # the pipeline really ran ahead: history and target lookups (and the drawn negatives') of every step but the
    # first used staged handles, and the negatives the worker drew
    paths = [("features", "item_ids"), ("labels", "next_item")]
    if drawn == ("shared", 0):  # unchunked: the targets, the sampled set, the in-batch negatives
        paths += [("draws", "ids"), ("draws", "in_batch")]
    elif drawn:  # chunked: the shared columns (in-batch), the distinct per-position negatives, then the targets
        paths[1:] = [("draws", "shared"), ("draws", "distinct"), ("labels", "next_item")]
    assert runner.ahead.paths == off_runner.ahead.paths == {"table": paths}
    remade = 2 if drawn else 0  # the jump's step, and the next (the worker repeats the jump: StepDraws' guess)
    assert on.table.combined_lookups == off.table.combined_lookups == len(paths) * (STEPS - 1)
    assert on.table.lookups_ahead == len(paths) * (STEPS - 1 - remade) and runner.ahead.remade == remade
    assert off.table.lookups_ahead == 0 and not off_runner.ahead.started
    # one ID all-to-all per step for all of the table's batch lookups (the first step learns them one by one, after
    # DDP's probe forward; the in-loss negatives, made inside the model, have their own): off on the main thread, on
    # in the worker (which also stages a stand-in for the step after the last, dropped)
    own = 0 if drawn else 1  # per step: lookups made inside the model
    first = 3 + len(paths) + own  # DDP's probe: Tiny.loss without draws (history, targets, in-loss negatives)
    assert off_runner.distributes == {"main": first + (STEPS - 1) * (1 + own), "worker": 0}
    assert runner.distributes == {"main": first + (STEPS - 1) * own + remade, "worker": STEPS}
    if drawn:
        assert runner.draws.reused == STEPS - 1 - remade and off_runner.draws.reused == 0
    reads = torch.tensor([on.table.ahead_reads])
    dist.all_reduce(reads)
    if cfg_table is TIERED:  # (evictions and unadmitted IDs make the other config's lookups redo the owner's part)
        assert int(reads) > 0, "no staged lookup was read without redoing it"
    else:  # ... only for the staged keys evicted since, or without a row: the others' staged rows are used
        relooked = torch.tensor([on.table.relooked_up])
        dist.all_reduce(relooked)
        assert int(relooked) > 0, "no staged key was looked up again at use"
    stats = runner.ahead.stats
    assert len(stats) == STEPS and all(s["stage_s"] > 0 for s in stats)


TIERED = TableConfig(name="item", dim=D, capacity=16, init_std=0.05, seed=5, cache_rows=48,
                     optimizer=SparseOptimConfig(kind="adam", lr=0.05))  # fmt: skip
EVICTING = dataclasses.replace(
    TIERED, max_rows=24, cache_rows=0, admission=AdmissionConfig(kind="count", threshold=2),
    eviction=EvictionConfig(kind="lru", every_steps=2, ttl_steps=1, on_pressure=True),
)  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("cfg_table", [TIERED, EVICTING], ids=["host-tier", "count-admission-lru-eviction"])
@pytest.mark.parametrize("drawn", DRAWN.values(), ids=DRAWN.keys())
def test_pipelined_training_equals_unpipelined(world_size: int, cfg_table: TableConfig, drawn: tuple[str, int] | None) -> None:
    spawn(_equal_worker, world_size, cfg_table, drawn)


class _Skipping(Tiny):
    """Looks the targets up on the first step only: from the third step on they are no longer combined."""

    calls = 0

    def loss(self, batch: Batch, sampled: SampledNegatives | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        if self.calls <= 2:  # DDP's probe and the first step: history, targets, in-loss negatives
            return super().loss(batch, sampled)
        loss = self.proj(self.table(batch.features["item_ids"]).mean(1)).pow(2).mean()
        return loss, loss


def _skipping_worker(rank: int, world_size: int) -> None:
    model = _Skipping(TIERED)
    ctx = DistContext(rank, world_size, rank, initialized=True)
    runner = StepRunner(RunConfig(), model, torch.device("cpu"), ctx, loss_fn=model.loss, units_fn=lambda b: 1.0,
                        sparse_optimizer=SparseOptimizer([model]))  # fmt: skip
    for batch in _batches(rank, world_size, None)[:4]:
        runner([batch])
    assert runner.ahead.paths == {"table": [("features", "item_ids")]}  # the targets, unread on step 2, dropped
    assert model.table.combined_lookups == 3  # steps 2, 3, 4: the history


def test_a_combined_path_no_lookup_reads_is_dropped() -> None:
    spawn(_skipping_worker, 1)


def _kept_worker(rank: int, world_size: int) -> None:
    model = _Skipping(TIERED)  # stops reading the targets after the first step
    ctx = DistContext(rank, world_size, rank, initialized=True)
    runner = StepRunner(RunConfig(), model, torch.device("cpu"), ctx, loss_fn=model.loss, units_fn=lambda b: 1.0,
                        sparse_optimizer=SparseOptimizer([model]))  # fmt: skip
    for batch in _batches(rank, world_size, None)[:4]:
        runner([batch])
    # with several ranks a path one rank might not read is never dropped on its own: every rank keeps combining the
    # same paths, so the collectives stay paired (one process drops it: test above)
    assert runner.ahead.paths == {"table": [("features", "item_ids"), ("labels", "next_item")]}
    assert model.table.combined_lookups == 3


def test_with_several_ranks_an_unread_path_stays_combined_on_every_rank() -> None:
    spawn(_kept_worker, 2)


def _chunk_decision_worker(rank: int, world_size: int) -> None:
    from recforge.train.losses import use_chunks

    positions = 4 + rank  # rank 0: 4 positions (not above the chunk size), rank 1: 5 (above it)
    decisions = torch.tensor([float(use_chunks(4, positions)), float(use_chunks(0, positions))])
    gathered = [torch.zeros(2) for _ in range(world_size)]
    dist.all_gather(gathered, decisions)
    assert all(torch.equal(g, torch.tensor([1.0, 0.0])) for g in gathered), gathered  # every rank chunks alike


def test_every_rank_takes_the_same_loss_path_whatever_its_batch_size() -> None:
    """Which tensors the loss looks up (so which lookups are combined and which collectives run) must not depend on
    one rank's batch size: with several ranks the loss is chunked whenever loss.chunk_size > 0."""
    from recforge.train.losses import use_chunks

    assert not use_chunks(4, 4) and use_chunks(4, 5) and not use_chunks(0, 100)  # one process: only when it helps
    spawn(_chunk_decision_worker, 2)
