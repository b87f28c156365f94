"""``train.compile``: the training step's forward and loss through ``torch.compile``.

The objective (model + loss, see ``train.distributed.Objective``) is compiled in place
(``nn.Module.compile``: the module keeps its type, so DDP/FSDP wrapping and ``no_sync`` see the
same object) with dynamic shapes, so jagged batches of any token count reuse one graph; the
backward is compiled by AOTAutograd with it. Inductor fuses the norms, activations, splits and
the loss's elementwise work into a few kernels; the Triton HSTU attention stays one custom op per
block (``recforge.ops.custom_ops``). The dense optimizer is the fused AdamW on CUDA, compiled or not
(``runtime.make_optimizer``).

CUDA only: on a CPU device the setting is ignored (logged once) and the eager step runs, since
Inductor's CPU code needs a C++ toolchain and buys little for recforge's CPU uses (tests, smoke
runs). Dynamic tables (``model.embedding=dynamic``) and FSDP2 keep the eager step as well.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from recforge.config import RunConfig

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
    mode = None if cfg.train.compile == "default" else cfg.train.compile
    objective.compile(mode=mode, dynamic=True)
    log.info("train.compile=%s: the step's forward + loss + backward run compiled (first steps compile)",
             cfg.train.compile)  # fmt: skip
    return objective
