"""``train.compile``: the training step's forward and loss through ``torch.compile``.

The objective (model + loss, see ``train.distributed.Objective``) is compiled in place
(``nn.Module.compile``: the module keeps its type, so DDP/FSDP wrapping and ``no_sync`` see the
same object) with dynamic shapes, so jagged batches of any token count reuse one graph; the
sampled negatives' count, a constant of the run, is static (``mark_static_dims``). The backward
is compiled by AOTAutograd with it. Inductor fuses the norms, activations, splits and
the loss's elementwise work into a few kernels; the Triton HSTU attention stays one custom op per
block (``recforge.ops.custom_ops``). The dense optimizer is the fused AdamW on CUDA, compiled or not
(``runtime.make_optimizer``).

CUDA only: on a CPU device the setting is ignored (logged once) and the eager step runs, since
Inductor's CPU code needs a C++ toolchain and buys little for recforge's CPU uses (tests, smoke
runs). Dynamic tables (``model.embedding=dynamic``) and FSDP2 keep the eager step as well.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from recforge.config import RunConfig
from recforge.train.losses import SampledNegatives

log = logging.getLogger(__name__)


def compile_enabled(cfg: RunConfig, device: torch.device) -> bool:
    """Whether ``train.compile`` applies to this run on ``device`` (logging why not, when it does not)."""
    mode = cfg.train.compile
    if mode == "none":
        return False
    why = None
    if device.type != "cuda":
        why = f"the device is {device.type}: the compiled step is CUDA only"
    elif cfg.model.embedding == "dynamic":
        why = "model.embedding=dynamic: the dynamic tables' lookups and updates run eagerly"
    elif cfg.dist.dense == "fsdp2" and torch.distributed.is_initialized():
        why = "dist.dense=fsdp2: the FSDP2 hooks run eagerly"
    if why is not None:
        log.warning("train.compile=%s is off for this run (%s); the eager step runs", mode, why)
        return False
    return True


def compile_objective(objective: nn.Module, cfg: RunConfig, device: torch.device) -> nn.Module:
    """``objective``, compiled in place per ``train.compile`` when it applies (see the module doc)."""
    if not compile_enabled(cfg, device):
        return objective
    compile_dynamic(objective, mode=None if cfg.train.compile == "default" else cfg.train.compile)
    log.info("train.compile=%s: the step's forward + loss + backward run compiled (first steps compile)",
             cfg.train.compile)  # fmt: skip
    return objective


def compile_dynamic(module: nn.Module, *, mode: str | None = None, backend: str | Callable = "inductor") -> None:
    """``module.compile(dynamic=True)`` with Python floats specialised (``torch._dynamo.config.specialize_float``,
    set process-wide): the model's float attributes (embedding scales, norms' eps, the loss temperature) are
    constants of the run. Left symbolic (PyTorch's default), dynamo made each a graph input and then restarted the
    whole trace to specialise them (~20% of the first compile on a CPU probe of ML-1M's step). Autocast regions are
    made cacheable (``_autocast_cacheable``), so a later process reuses the compiled graph from the on-disk caches."""
    torch._dynamo.config.specialize_float = True
    _autocast_cacheable()
    module.compile(mode=mode, dynamic=True, backend=backend)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place (``nn.Module.compile``, as ``compile_objective`` does)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def mark_static_dims(draws: object) -> None:
    """Mark the sampled negatives' count static in ``draws`` (a ``SampledNegatives``; anything else is left alone),
    before a call of the objective compiled by ``compile_dynamic``: the shared set's size (``ids`` (K,), and the
    chunked loss's ``shared`` (K,) when no in-batch columns follow), a per-position draw's width (``ids`` and
    ``rows`` (T, K)). Under ``dynamic=True`` every input dim is symbolic, so Inductor's kernels over the (T, K)
    logits reduced over a K it did not know: the loss's logsumexp and its backward over 64K x 8,192 logits ran 1.7x
    and 2.4x faster with K static (H200, BENCHMARKS.md, 17th session). K is a setting of the run
    (``loss.num_negatives``), so no recompile follows; the token and sequence counts stay symbolic."""
    if not isinstance(draws, SampledNegatives):
        return
    static = [(t, t.dim() - 1) for t in (draws.ids, draws.rows) if t is not None and t.dim() > 0]
    if draws.shared is not None and draws.in_batch is None:
        static.append((draws.shared, 0))
    for tensor, dim in static:
        torch._dynamo.mark_static(tensor, dim)


# the autocast context's graph nodes (a bf16 step's float32 loss turns autocast off inside the graph)
_AUTOCAST_NODES = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")


def _autocast_cacheable() -> None:
    """Let AOTAutograd's cache take graphs with autocast regions, which it refuses by default (an allowlist of
    functions it knows): the region's device, dtype and on/off are the node's arguments, so they are part of the
    graph the cache key is computed from. Without it a bf16 run re-traces its joint graph in every process."""
    import torch._inductor.config as config  # loaded by compiling anyway

    marked = getattr(config, "unsafe_marked_cacheable_functions", None)  # PyTorch >= 2.8
    if marked is not None and not all(name in marked for name in _AUTOCAST_NODES):
        config.unsafe_marked_cacheable_functions = {**marked, **dict.fromkeys(_AUTOCAST_NODES, torch.__version__)}

