"""Multi-process training on ``torchrun``: the process group, dense wrapping, small collectives.

One process (a plain ``recforge train``) gets ``DistContext()`` (rank 0 of 1, no process group)
and every helper here is then a no-op or an identity, so the recipes run the same code either
way. Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment) the process
group is created even at world size 1, so the collectives really run (NCCL on CUDA, gloo on CPU).

Example:
    $ torchrun --nproc-per-node 2 -m recforge.cli train configs/ml1m-hstu.yaml
    >>> ctx = init_distributed(cfg, device)           # inside the recipe
    >>> dense = wrap_dense(Objective(model, loss_fn), cfg, ctx, device)
    >>> total, count = ctx.all_reduce_sum([loss_sum, targets])
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recforge.config import RunConfig
from recforge.data.resume import PipelineState

log = logging.getLogger(__name__)

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # set by torchrun for every process it starts


@dataclass
class DistContext:
    """Where this process sits in the job. ``initialized`` is False for a plain single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized: bool = False
    comm_device: torch.device = torch.device("cpu")  # where collective buffers live (CUDA for NCCL)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, configs and the dense half of checkpoints."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.initialized:
            dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum each number over all ranks (float64, one collective, one host sync)."""
        if not self.initialized:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return t.tolist()

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable; our own processes only), in rank order."""
        if not self.initialized:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's (N_r, ...) CPU tensor in rank order (N_r may differ)."""
        if not self.initialized:
            return tensor
        return torch.cat(self.all_gather_objects(tensor.cpu()))

    def shard(self, n: int) -> tuple[int, int]:
        """[lo, hi) of this rank's contiguous share of ``n`` items (shares differ by at most one)."""
        return n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size


def even_batches(n: int, batch_size: int, ctx: DistContext) -> int:
    """Evaluation batches every rank runs over its share of ``n`` items: the same count on all ranks
    (that of the largest share), since dynamic-table lookups are collectives."""
    largest_share = -(-n // ctx.world_size)
    return -(-largest_share // batch_size)


def launched_by_torchrun() -> bool:
    return all(key in os.environ for key in ENV_KEYS)


def several_ranks() -> bool:
    """A process group of more than one rank is running (collectives must then be issued alike on every rank)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_distributed(cfg: RunConfig, device: torch.device) -> DistContext:
    """Join the ``torchrun`` job (idempotent) or return the single-process context.

    Args:
        cfg: the run configuration (``dist.backend``, ``dist.timeout_minutes``).
        device: this process's training device (``resolve_device`` already picked ``cuda:LOCAL_RANK``).
    """
    if not launched_by_torchrun():
        return DistContext()
    rank, world, local = (int(os.environ[k]) for k in ENV_KEYS)
    backend = cfg.dist.backend if cfg.dist.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("dist.backend=nccl needs train.device=cuda (or auto on a GPU host); use dist.backend=gloo on CPU")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=cfg.dist.timeout_minutes),
                                device_id=device if backend == "nccl" else None)  # NCCL: bound to this rank's GPU
        if rank == 0:
            log.info("distributed: %d rank(s), backend %s, dense %s", world, backend, cfg.dist.dense)
    comm = device if backend == "nccl" else torch.device("cpu")
    return DistContext(rank, world, local, initialized=True, comm_device=comm)


def shutdown_distributed() -> None:
    """Leave the process group (call once, at process exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class Objective(nn.Module):
    """The model and its loss as one module, so DDP/FSDP2 see the whole training forward.

    The recipes' losses call several model parts (``postfix_inputs``, ``item_vectors``...);
    wrapping the loss keeps every one of those calls inside the wrapper's ``forward``, which is
    where DDP prepares its gradient buckets and FSDP2 gathers the weights.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any, *draws: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss_fn(batch, *draws)  # (objective, loss to log); draws: the step's (recforge.train.step_draws)


def wrap_dense(objective: Objective, cfg: RunConfig, ctx: DistContext, device: torch.device, *,
               find_unused: bool = True) -> nn.Module:  # fmt: skip
    """DDP (default) or FSDP2 over the objective's dense parameters; the objective itself when single-process.

    Buffers are not broadcast: dynamic-table shards live in buffers and differ per rank by design.
    ``find_unused``: DDP searches the graph for parameters the loss did not use (needed by some
    configs, e.g. time buckets without timestamps; ``unused_parameters`` tells; it costs a graph pass per step).
    """
    if not ctx.initialized:
        return objective
    if cfg.dist.dense == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in fsdp_blocks(objective.model):  # each its own group: gathered only around its forward
            fully_shard(block)
        return fully_shard(objective)  # the rest (embeddings, heads: used by item_vectors etc.) in the root group
    ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        objective, device_ids=ids, broadcast_buffers=False, find_unused_parameters=find_unused
    )


def unused_parameters(objective: Objective, batch: Any, ctx: DistContext, precision: Callable[[], Any]) -> bool:
    """Whether the loss of ``batch`` leaves a trainable parameter without gradient on any rank (a collective).

    One probe forward + gradient, run as a stand-in (dynamic tables read only, see
    ``sparse.sharded.standin_lookups``) with the RNG state restored, so training is unchanged.
    """
    from recforge.sparse.sharded import standin_lookups

    params = [p for p in objective.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with standin_lookups(objective.model, here=True, anywhere=True), precision():
            value, _ = objective(batch)
        grads = torch.autograd.grad(value, params, allow_unused=True)
    unused = [name for (name, p), g in zip(((n, p) for n, p in objective.named_parameters() if p.requires_grad), grads,
                                            strict=True) if g is None]  # fmt: skip
    if unused and ctx.is_main:
        log.info("parameters without gradient in this config (DDP will search for them each step): %s", unused[:8])
    return ctx.all_reduce_sum([float(bool(unused))])[0] > 0


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as groups of their own: each element of the outermost ``nn.ModuleList``s
    (the encoder's blocks, the towers) that owns parameters and no dynamic table. Only their ``forward``
    may use their weights (FSDP2 gathers them around it); everything else stays in the root group."""
    from recforge.sparse.sharded import ShardedDynamicEmbedding
    from recforge.sparse.table import DynamicEmbedding

    blocks: list[nn.Module] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        for index, child in enumerate(module):
            tables = any(isinstance(m, (DynamicEmbedding, ShardedDynamicEmbedding)) for m in child.modules())
            if not tables and any(True for _ in child.parameters()):
                blocks.append(child)
                taken.append(f"{name}.{index}" if name else str(index))
    return blocks


def full_dense_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict | None]:
    """FSDP2: the model's and optimizer's full ``state_dict``s (each DTensor gathered; a collective, call on
    every rank), so checkpoints keep the single-process format. (None, None) when nothing is sharded."""
    tensors = sys.modules.get("torch.distributed.tensor")  # not imported here: 0.5 s+ (sympy) at a first checkpoint
    if tensors is None:  # nothing is a DTensor before its module is loaded (FSDP2 loads it)
        return None, None
    DTensor = tensors.DTensor

    full = lambda v: v.full_tensor() if isinstance(v, DTensor) else v  # noqa: E731
    weights = model.state_dict()
    if not any(isinstance(v, DTensor) for v in weights.values()):
        return None, None
    opt = optimizer.state_dict()
    state = {i: {k: full(v) for k, v in s.items()} for i, s in sorted(opt["state"].items())}
    return {k: full(v) for k, v in weights.items()}, {"state": state, "param_groups": opt["param_groups"]}


def merged_data_state(ctx: DistContext, state: dict) -> dict:
    """All ranks' pipeline states as one (a row is consumed if any rank consumed it); a resume on any
    number of ranks re-splits the rest. The saved ``resumes`` counter is the ranks' own (not bumped)."""
    states = ctx.all_gather_objects(state)
    if len(states) == 1:
        return states[0]
    merged = PipelineState.merge([PipelineState.from_dict(s) for s in states]).to_dict()
    merged["resumes"] = max(int(s["resumes"]) for s in states)
    return merged


def any_rank(ctx: DistContext, flag: bool) -> bool:
    """True on every rank when it is True on any (a wall-clock budget must stop all ranks at the same step)."""
    return ctx.all_reduce_sum([float(flag)])[0] > 0


def split_budget(cfg: RunConfig, ctx: DistContext) -> tuple[int, int]:
    """(rows, tokens) of one micro-batch on one rank: the global ``train.batch_size`` /
    ``train.token_budget`` split over ``world_size x dist.grad_accum`` micro-batches."""
    parts = ctx.world_size * cfg.dist.grad_accum
    t = cfg.train
    if t.token_budget:
        if t.token_budget // parts < 1:
            raise ValueError(f"train.token_budget={t.token_budget} is less than one token per micro-batch over "
                             f"{ctx.world_size} rank(s) x dist.grad_accum={cfg.dist.grad_accum}; raise it")  # fmt: skip
        return t.batch_size, t.token_budget // parts
    if t.batch_size % parts:
        raise ValueError(
            f"train.batch_size={t.batch_size} (global, per optimizer step) must divide evenly into {ctx.world_size} "
            f"rank(s) x dist.grad_accum={cfg.dist.grad_accum} micro-batches with train.loader=pipeline; use a "
            f"multiple of {parts}"
        )
    return t.batch_size // parts, 0


def shard_source(source: Any, ctx: DistContext) -> Any:
    """This rank's ``PipelineSource``: one over the same rows that reads only this rank's share of the unconsumed ones.

    The sample engine splits rows by ``Pipeline.rank``/``world_size`` at every (re)start, from the
    merged state of all ranks, so a resume on a different number of ranks re-splits what is left.
    The given source is left as it is (a new source wraps its ``build``).
    """
    if not ctx.initialized:
        return source
    from recforge.data.pipeline import PipelineSource

    def build_share(state: dict | None, build: Callable[[dict | None], Any] = source.build) -> Any:
        pipeline = build(state)
        pipeline.rank, pipeline.world_size = ctx.rank, ctx.world_size  # read by Pipeline.__iter__'s plan
        return pipeline

    return PipelineSource(build_share, source.num_steps_estimate)


def shard_dynamic_tables(model: nn.Module, cfg: RunConfig, ctx: DistContext) -> Any:
    """Under ``torchrun``, replace the model's ``DynamicEmbedding`` tables by ``ShardedDynamicEmbedding``s.

    The planner (``recforge.sparse.planner``) places each table row-wise over all ranks or whole on
    one rank, from its size; rank 0 logs the plan and saves it as ``RUN_DIR/sharding_plan.json``.
    At world size 1 the tables are sharded too (one shard), so the collectives of a multi-rank run
    really run. A plain single process keeps its tables. Returns the plan (None when unchanged).
    """
    if cfg.model.embedding != "dynamic" or not ctx.initialized:
        return None
    from recforge.sparse.planner import plan_sharding
    from recforge.sparse.table import DynamicEmbedding
    from recforge.train.pipeline_step import AheadTable

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, DynamicEmbedding)]
    plan = plan_sharding([m.cfg for _, m in found], ctx.world_size)
    for name, table in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        # AheadTable: a ShardedDynamicEmbedding whose step lookups read one combined lookup (made a step ahead with dist.pipeline)
        setattr(parent, attr, plan.build(table.cfg, table.device, cls=AheadTable))
    if ctx.is_main:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        plan.save(cfg.run_dir / "sharding_plan.json")
        log.info("sharding plan of the dynamic tables (%d rank(s)), saved to %s:\n%s", ctx.world_size,
                 cfg.run_dir / "sharding_plan.json", plan)  # fmt: skip
    return plan
