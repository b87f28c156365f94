"""``train.cuda_graphs``: the whole training step (forward, loss, backward, clipping, AdamW) as one CUDA graph per
shape bucket, replayed with a single launch.

A small model's step is ~500 kernel launches whose host cost exceeds their GPU time. Here each batch is
padded to a shape bucket (``recforge.jagged.padding``; the recipe's ``pad`` makes the padding change no
gradient, e.g. ``recforge.train.step_padding``), and the first batch of each bucket runs the padded step
eagerly (on the capture stream: Triton autotuning, cuBLAS workspaces, the optimizer's lazily built state),
then the step is captured (``torch.cuda.graph``; capturing runs nothing) and every later batch of the
bucket is copied into the graph's input buffers and replayed::

    batch ─ pad (T', B') ─┬─ first of its bucket: eager padded step, then capture
                          └─ else: copy into the bucket's buffers, lr → device scalar, replay

The graphs share one memory pool: each replay leaves nothing that another graph reads (gradients are
written before they are read in every replay; the loss is copied out), so the pool holds about one
step's activations, not one per bucket. The learning rate the loop sets each step reaches the captured
AdamW through device scalars (``capturable``); dropout draws fresh masks per replay (PyTorch registers
the default CUDA generator with each graph). The step must not synchronise with the host: a sync
during capture fails it, and the run stops with the error (``tests/train/test_graphed_step.py``
checks the retrieval step with ``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from recforge.config import RunConfig
from recforge.jagged.batch import JaggedBatch
from recforge.train.compiled import is_compiled, mark_static_dims

log = logging.getLogger(__name__)
MAX_GRAPHS = 64  # buckets captured at most; later new shapes run the padded step eagerly (logged once)


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[Tensor]  # the step's input buffers, in ``_tensors`` order
    scales: list[Tensor]  # three float32 scalars: loss_scale, loss_offset, objective_scale
    loss: Tensor  # the captured step's output: the real batch's loss


def graphs_enabled(cfg: RunConfig, device: torch.device, *, distributed: bool, sparse: bool, pad: Any) -> bool:
    """Whether ``train.cuda_graphs`` applies to this step (logging why not, when it does not).

    ``pad``: the recipe's padding (an object with ``__call__``), or a string saying why it has none."""
    if not cfg.train.cuda_graphs:
        return False
    why = None
    if device.type != "cuda":
        why = f"the device is {device.type}: CUDA graphs need CUDA"
    elif distributed:
        why = "torchrun: DDP/FSDP2 collectives are not captured; each rank runs the eager step"
    elif cfg.dist.grad_accum > 1:
        why = f"dist.grad_accum={cfg.dist.grad_accum}: one micro-batch per step is captured"
    elif sparse:
        why = "model.embedding=dynamic: the dynamic tables' lookups and updates run on the host"
    elif pad is None or isinstance(pad, str):
        why = pad or "the recipe does not pad its batches to shape buckets"
    if why is not None:
        log.warning("train.cuda_graphs is off for this run (%s); the eager step runs", why)
        return False
    return True


class GraphedStep:
    """One optimizer step of one padded batch: eager for a bucket's first batch, then a CUDA graph replay.

    Args:
        objective: the (compiled or eager) objective: ``objective(batch[, draws]) -> (objective, loss)``.
        optimizer: the dense optimizer (fused AdamW: made ``capturable`` here, its lr a device scalar in graphs).
        pad: ``(batch, draws) -> PaddedStep`` (``recforge.train.step_padding``).
        autocast: the step's autocast context factory (``runtime.autocast``).
        grad_clip: max gradient norm (0: no clipping).
        capture: capture graphs (CUDA); False runs every step as the eager padded step (CPU tests).

    Example:
        >>> step = GraphedStep(objective, optimizer, pad, lambda: autocast(cfg, device), cfg.optim.grad_clip)
        >>> loss = step(batch, draws)   # a device scalar: the real (unpadded) batch's loss
    """

    def __init__(self, objective: nn.Module, optimizer: torch.optim.Optimizer, pad: Callable[[Any, Any], Any],
                 autocast: Callable[[], AbstractContextManager], grad_clip: float, *, capture: bool = True) -> None:  # fmt: skip
        self.objective, self.optimizer, self.pad, self.autocast = objective, optimizer, pad, autocast
        self.grad_clip, self.capture = grad_clip, capture
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.graphs: dict[tuple, _Graph] = {}
        self.replays = self.eager_steps = 0  # for logs and tests
        self._pool = None
        self._stream = torch.cuda.Stream(self.params[0].device) if capture else None
        self._lr = [torch.tensor(float(g["lr"]), device=self.params[0].device) for g in optimizer.param_groups]
        self._full_logged = False
        self.failed: str | None = None  # why a capture failed: the caller then drops this step for the eager one

    def __call__(self, batch: JaggedBatch, draws: Any = None) -> Tensor:
        """Train one step on ``batch`` (and its ``draws``); the real batch's loss, a device scalar."""
        padded = self.pad(batch, draws)
        tensors = _tensors(padded)
        m = padded.batch.mask  # what the captured kernels take as Python values
        key = (padded.batch.max_seq_len, m.causal, m.max_attn_len, m.segment_full,
               *((name, None if t is None else (tuple(t.shape), t.dtype)) for name, t in tensors))  # fmt: skip
        graph = self.graphs.get(key)
        if graph is None:
            loss = self._eager(padded)
            if self.capture and len(self.graphs) < MAX_GRAPHS:
                try:
                    self.graphs[key] = self._capture(padded, tensors)
                except Exception as err:  # noqa: BLE001 - e.g. a host sync in the step: the run goes on eagerly
                    self.failed = f"{type(err).__name__}: {err}"
                    log.warning("train.cuda_graphs: capturing the step failed (%s); the rest of the run trains with the "
                                "eager step. A step that synchronises with the host cannot be captured: find the sync "
                                "with torch.cuda.set_sync_debug_mode('error')", self.failed)  # fmt: skip
                    log.debug("train.cuda_graphs: where the capture failed", exc_info=True)
                    return loss
                log.info("train.cuda_graphs: captured the step for %d tokens in %d sequences (%d graphs)",
                         padded.batch.num_tokens, padded.batch.batch_size, len(self.graphs))  # fmt: skip
            elif self.capture and not self._full_logged:
                self._full_logged = True
                log.warning("train.cuda_graphs: %d shape buckets captured; new shapes run eagerly (raise "
                            "train.graph_bucket_ratio for fewer buckets)", MAX_GRAPHS)  # fmt: skip
            return loss
        for dst, (_, src) in zip(graph.inputs, tensors, strict=True):
            if dst is not None:
                dst.copy_(src, non_blocking=True)
        # fills, not host-to-device copies: a copy from pageable memory may wait for the stream
        for scale, value in zip(graph.scales, (padded.loss_scale, padded.loss_offset, padded.objective_scale), strict=True):
            scale.fill_(value)
        for lr, group in zip(self._lr, self.optimizer.param_groups, strict=True):
            lr.fill_(group["lr"])  # what the loop set for this step
        graph.graph.replay()
        self.replays += 1
        return graph.loss.clone()

    def _body(self, batch: JaggedBatch, draws: Any, scales: list[Tensor] | tuple[float, float, float]) -> Tensor:
        """Forward, backward, clipping and the optimizer step; the real batch's loss (detached)."""
        loss_scale, loss_offset, objective_scale = scales[0], scales[1], scales[2]
        if draws is not None and is_compiled(self.objective):
            mark_static_dims(draws)
        with self.autocast():
            objective, loss = self.objective(batch) if draws is None else self.objective(batch, draws)
        (objective * objective_scale).backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        return loss.detach().float() * loss_scale + loss_offset

    def _eager(self, padded: Any) -> Tensor:
        """The padded step, eagerly (on the capture stream when capturing, so its lazy set-up is that stream's)."""
        self.eager_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        scales = (padded.loss_scale, padded.loss_offset, padded.objective_scale)
        if self._stream is None:
            return self._body(padded.batch, padded.draws, scales)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            loss = self._body(padded.batch, padded.draws, scales)
        torch.cuda.current_stream().wait_stream(self._stream)
        loss.record_stream(torch.cuda.current_stream())
        return loss

    def _capture(self, padded: Any, tensors: list[tuple[str, Tensor | None]]) -> _Graph:
        """Capture the step of ``padded``'s shapes into a new graph (nothing runs; buffers hold ``padded``)."""
        from recforge.jagged.index import clear_padding_index_cache

        inputs = [None if t is None else t.clone() for _, t in tensors]  # outside the graph's pool: they persist
        batch, draws = _rebuild(padded, inputs)
        device = self.params[0].device
        scales = [torch.tensor(float(v), device=device) for v in (padded.loss_scale, padded.loss_offset, padded.objective_scale)]
        groups = self.optimizer.param_groups
        before = [(g["lr"], g["capturable"]) for g in groups]
        self.optimizer.zero_grad(set_to_none=True)  # the graph's backward allocates (and owns) its gradients
        clear_padding_index_cache()  # an eager result cached for these buffers must not be baked into the graph
        graph = torch.cuda.CUDAGraph()
        try:
            for group, lr in zip(groups, self._lr, strict=True):
                group["lr"], group["capturable"] = lr, True
            self._stream.wait_stream(torch.cuda.current_stream())
            # No garbage collection while capturing: a collection that frees CUDA objects of earlier work (a dropped
            # graph, its memory pool, events) calls CUDA APIs a capture forbids, and the capture fails (it did in the
            # GPU tests, after earlier steppers became garbage). Collected now instead, and off until the end.
            gc.collect()
            gc_was_on = gc.isenabled()
            gc.disable()
            try:
                # thread_local: the input prefetch thread may allocate and copy meanwhile; the backward's autograd
                # thread launches onto the capture stream, so it is captured all the same
                with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                    loss = self._body(batch, draws, scales)
            finally:
                if gc_was_on:
                    gc.enable()
        finally:
            for group, (lr, capturable) in zip(groups, before, strict=True):
                group["lr"], group["capturable"] = lr, capturable  # a checkpoint saves the run's own settings
            self.optimizer.zero_grad(set_to_none=True)  # eager code never sees a graph's gradient buffers
            clear_padding_index_cache()
        torch.cuda.current_stream().wait_stream(self._stream)
        if self._pool is None:
            self._pool = graph.pool()
        return _Graph(graph, inputs, scales, loss)


def _tensors(padded: Any) -> list[tuple[str, Tensor | None]]:
    """Every tensor a padded step reads, named, in a fixed order (the graph key and its input buffers)."""
    b = padded.batch
    out: list[tuple[str, Tensor | None]] = [("seq_offsets", b.seq_offsets)]
    for kind, table in (("features", b.features), ("dense", b.dense), ("labels", b.labels)):
        out += [(f"{kind}.{k}", table[k]) for k in sorted(table)]
    m = b.mask
    out += [(f"mask.{f}", getattr(m, f)) for f in ("num_targets", "num_contextual", "segment_lengths", "timestamps")]
    if padded.draws is not None:
        out += [(f"draws.{f.name}", getattr(padded.draws, f.name)) for f in dataclasses.fields(padded.draws)]
    return out


def _rebuild(padded: Any, inputs: list[Tensor | None]) -> tuple[JaggedBatch, Any]:
    """``padded``'s batch and draws made of the buffers ``inputs`` (in ``_tensors`` order), with a fresh mask object."""
    it = iter(inputs)
    b = padded.batch
    offsets = next(it)
    tables = [{k: next(it) for k in sorted(table)} for table in (b.features, b.dense, b.labels)]
    mask = dataclasses.replace(b.mask, num_targets=next(it), num_contextual=next(it), segment_lengths=next(it),
                               timestamps=next(it))  # fmt: skip
    batch = JaggedBatch(offsets, tables[0], b.max_seq_len, tables[1], tables[2], mask)
    draws = None
    if padded.draws is not None:
        draws = dataclasses.replace(padded.draws, **{f.name: next(it) for f in dataclasses.fields(padded.draws)})
    return batch, draws
