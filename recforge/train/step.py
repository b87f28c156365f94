"""One optimizer step on one rank: K micro-batches, weighted so N ranks equal one process.

``train.batch_size`` (and ``train.token_budget``) are global per optimizer step. A step hands
each rank K = ``dist.grad_accum`` micro-batches (``None`` where the rank has no data left); the
runner

1. all-reduces how many real micro-batches and loss units (targets) the step holds globally
   (zero real micro-batches everywhere: the epoch is over, every rank agrees);
2. runs forward + backward of each micro-batch through the DDP/FSDP2-wrapped objective, the
   gradient sync only on the last one (``no_sync``), each objective scaled so that the averaged
   gradient is the gradient of the *global* batch's loss: mean-type losses by
   ``world * units / global units``, token-budget (already sum-type) losses by ``world``;
3. clips the synchronised gradient (the full norm over all ranks), steps the dense optimizer,
   then the sparse one (the dynamic tables' row gradients of all K micro-batches, applied once).

A rank without data for a micro-batch repeats its last batch with weight 0, so the collectives of
DDP and of sharded tables still match across ranks; its table lookups are marked as a stand-in
(``standin_lookups``), so they change no sparse state (admission, counters, optimizer). A rank that
has had no batch at all yet borrows one from a rank with data. One process skips missing micro-batches.
DDP wraps the objective at the first step, after a probe of its batch tells whether some parameter
is outside the loss (then, and only then, DDP searches for unused parameters every step).

Example:
    >>> runner = StepRunner(cfg, model, device, ctx, loss_fn=lambda b: _loss(s, b), units_fn=lambda b: b.num_targets)
    >>> result = runner([batch_a, batch_b], lr_scale=1.0)   # None: no rank had data (epoch over)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recforge.config import RunConfig
from recforge.sparse import SparseOptimizer
from recforge.sparse.sharded import standin_lookups
from recforge.train.compiled import compile_objective, is_compiled, mark_static_dims
from recforge.train.distributed import DistContext, Objective, unused_parameters, wrap_dense
from recforge.train.graphed import GraphedStep, graphs_enabled
from recforge.train.pipeline_step import AheadTable, LookAhead
from recforge.train.runtime import autocast, make_optimizer
from recforge.train.step_draws import DrawFn, StepDraws

log = logging.getLogger(__name__)
LossFn = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]  # device batch -> (objective, loss to log)
UnitsFn = Callable[[Any], float]  # batch -> loss units its mean-type objective averages over (e.g. targets)


@dataclass
class StepResult:
    loss: float | torch.Tensor  # the global batch's loss (units-weighted mean over ranks and micro-batches): a device scalar (gloo: CPU)
    tokens: int  # tokens trained on by all ranks this step


class StepRunner:
    """The dense wrapper, the optimizers and the step of one rank.

    Args:
        cfg: run configuration (``dist``, ``optim.grad_clip``, ``train.precision``).
        model: the unwrapped model (evaluation and checkpoints use it directly).
        device: this rank's device.
        ctx: the distributed context (single-process: no wrapping, no collectives).
        loss_fn: the recipe's loss of a device batch.
        units_fn: loss units of a batch (host-side count, no device sync).
        summed: the objective is already a sum with global weights (token-budget batches).
        sparse_optimizer: the dynamic tables' optimizer, stepped after the dense one.
        draw: ``(batch, seed) -> draws`` (e.g. sampled negatives), drawn before each micro-batch's forward
            (``recforge.train.step_draws``) and given to ``loss_fn(batch, draws)``; None: ``loss_fn(batch)``.
        pad: ``(batch, draws) -> PaddedStep``, the recipe's padding to shape buckets for ``train.cuda_graphs``
            (``recforge.train.step_padding``; ``recforge.train.graphed`` runs the step), or why it has none.
    """

    def __init__(self, cfg: RunConfig, model: nn.Module, device: torch.device, ctx: DistContext, *, loss_fn: LossFn,
                 units_fn: UnitsFn, summed: bool = False, sparse_optimizer: SparseOptimizer | None = None,
                 draw: DrawFn | None = None, pad: Callable[[Any, Any], Any] | str | None = None) -> None:  # fmt: skip
        self.cfg, self.model, self.device, self.ctx = cfg, model, device, ctx
        self.objective: nn.Module = compile_objective(Objective(model, loss_fn), cfg, device)  # train.compile
        self.compiled = is_compiled(self.objective)
        # DDP waits for the first batch: it tells whether DDP must search for unused parameters each step
        self._wrap_later = ctx.initialized and cfg.dist.dense == "ddp"
        if not self._wrap_later:
            self.objective = wrap_dense(self.objective, cfg, ctx, device)
        # created after FSDP2 wrapping (it replaces the parameters; DDP keeps them); order of model.parameters()
        self.optimizer = make_optimizer(cfg, self.objective)
        self.units_fn, self.summed, self.sparse_optimizer = units_fn, summed, sparse_optimizer
        self._last: Any = None  # this rank's last real batch: the stand-in when it has none
        tables = {n: m for n, m in model.named_modules() if isinstance(m, AheadTable)}
        self.ahead = LookAhead(tables, device, announce=ctx.is_main) if tables else None
        self.upcoming: Callable[[], list] | None = None  # the next step's micro-batches (StepInputs.peek)
        self.draws = StepDraws(draw) if draw is not None else None
        self.graphed: GraphedStep | None = None  # train.cuda_graphs: the whole step as CUDA graphs
        if graphs_enabled(cfg, device, distributed=ctx.initialized, sparse=sparse_optimizer is not None or bool(tables),
                          pad=pad):  # fmt: skip
            self.graphed = GraphedStep(self.objective, self.optimizer, pad, lambda: autocast(cfg, device),
                                       cfg.optim.grad_clip)  # fmt: skip

    def set_upcoming(self, peek: Callable[[], list] | None) -> None:
        """Where the next step's batches can be seen early (the loop's prefetched inputs), or None."""
        self.upcoming = peek if self.ahead is not None else None
        if peek is None and self.ahead is not None:
            self.ahead.drop()  # e.g. started for a step a step budget (train.max_steps) then skipped
            if self.ctx.is_main and self.ahead.started:
                used = {name: t.lookups_ahead for name, t in self.ahead.tables.items()}
                log.info("lookups staged a step ahead, so far: %s", used)

    def _start_next(self) -> None:
        """Distribute and stage the next step's first micro-batch's lookups in the sparse worker (its stand-in
        on a rank without data, as ``__call__`` will pick it), so every rank starts the same collectives."""
        upcoming = self.upcoming()
        last = next((b for b in reversed(upcoming) if b is not None), self._last)
        first = upcoming[0] if upcoming[0] is not None else last
        if first is not None:  # stand-in IDs: 0 occurrences
            self.ahead.start(first, standin=upcoming[0] is None, draw=self.draws.ahead(first) if self.draws else None)

    @contextlib.contextmanager
    def full_weights(self):
        """Within: the model's own weights are whole (FSDP2 gathers them, e.g. for an evaluation that
        calls model parts directly); DDP and single-process weights already are."""
        fsdp = self.ctx.initialized and hasattr(self.objective, "unshard")
        if fsdp:
            self.objective.unshard()
        try:
            yield
        finally:
            if fsdp:
                self.objective.reshard()

    def _no_sync(self, last: bool):
        if last or not self.ctx.initialized:
            return contextlib.nullcontext()
        if isinstance(self.objective, nn.parallel.DistributedDataParallel):
            return self.objective.no_sync()
        return _fsdp_no_sync(self.objective)

    def __call__(self, micro: list[Any | None], lr_scale: float = 1.0) -> StepResult | None:
        """Train one step on this rank's micro-batches (device batches or None); None when no rank had any."""
        units = [self.units_fn(b) if b is not None else 0.0 for b in micro]
        has = [float(b is not None) for b in micro]
        # one collective: real micro-batches, loss units, ranks without any batch yet, tokens, ranks with data per
        # micro-batch (the step's only host sync under torchrun; none in one process)
        needy = float(not any(has) and self._last is None)
        tokens = sum(b.num_tokens for b in micro if b is not None)
        totals = self.ctx.all_reduce_sum([sum(has), sum(units), needy, tokens, *has])
        global_real, global_units, global_needy, global_tokens, ranks_with = (totals[0], totals[1], totals[2],
                                                                              totals[3], totals[4:])  # fmt: skip
        if global_real == 0:
            if self.ahead is not None:
                self.ahead.drop()  # started for a step that no rank has data for
            return None
        if global_needy:
            self._borrow_standin(micro)
        if self.draws is not None:
            self.draws.begin_step()
        if any(has):
            self._last = next(b for b in reversed(micro) if b is not None)
        if self._wrap_later:  # the first step: every rank probes its first (or stand-in) batch
            probe = next((b for b in micro if b is not None), self._last)
            find = unused_parameters(self.objective, probe, self.ctx, lambda: autocast(self.cfg, self.device))
            self.objective, self._wrap_later = wrap_dense(self.objective, self.cfg, self.ctx, self.device, find_unused=find), False
        if not self.ctx.initialized:  # one process: no collective to match, a missing micro-batch is just skipped
            units = [n for b, n in zip(micro, units, strict=True) if b is not None]
            micro = [b for b in micro if b is not None]
            ranks_with = [1.0] * len(micro)
            if self.graphed is not None:  # one micro-batch (dist.grad_accum=1): padded, then replayed
                draws = self.draws(micro[0], 0) if self.draws is not None else None
                loss = self.graphed(micro[0], draws)
                if self.graphed.failed:  # logged: the later steps run eagerly
                    self.graphed = None
                return StepResult(loss.double(), micro[0].num_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (batch, n) in enumerate(zip(micro, units, strict=True)):
            with standin_lookups(self.model, here=batch is None, anywhere=ranks_with[i] < self.ctx.world_size):
                loss = self._micro_step(i, batch, n, global_units, last=i == len(micro) - 1)
            if batch is not None:
                loss_sum += loss.detach().double() * n
        if self.cfg.optim.grad_clip > 0:  # gradients are already reduced: this is the norm over all ranks
            torch.nn.utils.clip_grad_norm_(self.objective.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        if self.ahead is not None:  # the next step's staging (overlapping backward and the dense update) is done
            drawn = self.ahead.wait()
            if self.draws is not None:
                self.draws.keep(drawn)
        if self.sparse_optimizer is not None:
            self.sparse_optimizer.step(lr_scale=lr_scale)
        if not self.ctx.initialized:  # the loss stays on the device: the loop reads it once per log interval
            return StepResult(loss_sum / max(global_units, 1e-12), tokens)
        # summed over ranks on the device (NCCL: no host sync; the loop reads it once per log interval, as above)
        total_loss = loss_sum.to(self.ctx.comm_device)
        torch.distributed.all_reduce(total_loss)
        return StepResult(total_loss / max(global_units, 1e-12), int(global_tokens))

    def _micro_step(self, i: int, batch: Any | None, units: float, global_units: float, last: bool) -> torch.Tensor:
        """Forward + backward of micro-batch ``i`` (the stand-in, weight 0, where ``batch`` is None); its loss."""
        world = self.ctx.world_size
        weight = 0.0 if batch is None else (world if self.summed else world * units / max(global_units, 1e-12))
        inputs = batch if batch is not None else self._last
        learn = i == 0 and self.ahead is not None and self.ahead.learning()
        draws = self.draws(inputs, i) if self.draws is not None else None
        with self._no_sync(last=last):
            if learn:
                self.ahead.begin()
            elif self.ahead is not None:
                self.ahead.prepare(inputs, draws)  # each table's one combined lookup of the batch's (and draws') IDs
            if draws is not None and self.compiled:
                mark_static_dims(draws)
            with autocast(self.cfg, self.device):
                objective, loss = self.objective(inputs) if draws is None else self.objective(inputs, draws)
            if learn:
                self.ahead.end(inputs, draws)
            if self.ahead is not None:
                self.ahead.finish()
            if last and self.upcoming is not None:
                self._start_next()  # the next step's sparse input overlaps this backward and the dense update
            (objective * weight).backward()
        return loss

    def _borrow_standin(self, micro: list[Any | None]) -> None:
        """A rank that has had no batch yet (e.g. resumed at the end of its share of an epoch) borrows a
        stand-in from a rank with data (a collective, only on the steps where some rank needs one)."""
        mine = next((b for b in micro if b is not None), None)
        offers = self.ctx.all_gather_objects(None if mine is None else mine.to("cpu"))
        if self._last is None and mine is None:
            self._last = next(b for b in offers if b is not None).to(self.device)


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module):
    """FSDP2's counterpart of DDP's ``no_sync``: keep unsharded gradients, reduce-scatter later."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
