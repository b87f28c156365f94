"""Process setup every recipe shares: the device, threads, autocast precision, the dense optimizer."""

from __future__ import annotations

import contextlib
import os

import torch

from recforge.config import RunConfig
from recforge.ops.dispatch import resolve_device as resolve_any_device


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a device; under ``torchrun``, ``auto``/``cuda`` mean this process's GPU (``cuda:LOCAL_RANK``)."""
    if "LOCAL_RANK" in os.environ and name.startswith("cuda:"):
        raise ValueError(f"train.device={name!r} under torchrun would put every rank on that one GPU; use "
                         "train.device=cuda (each rank takes cuda:LOCAL_RANK) and pick the GPUs with CUDA_VISIBLE_DEVICES")  # fmt: skip
    device = resolve_any_device(name, "train.device")
    if device == torch.device("cuda") and "LOCAL_RANK" in os.environ:
        local = int(os.environ["LOCAL_RANK"])
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local} but this host has {torch.cuda.device_count()} GPU(s); "
                             "start at most that many processes per node (torchrun --nproc-per-node)")  # fmt: skip
        return torch.device("cuda", local)
    if device.type == "cuda" and device.index is None:  # an explicit index: set_device and side threads need one
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def prepare_runtime(cfg: RunConfig) -> torch.device:
    """Apply ``train.threads``, resolve ``train.device`` (TF32 matmuls on CUDA) and return it."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    return device


def autocast(cfg: RunConfig, device: torch.device):
    """The context a training step's forward and loss run in: ``torch.autocast`` to bfloat16 for
    ``train.precision=bfloat16``, else nothing."""
    if cfg.train.precision == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over every parameter, per ``cfg.optim``: the fused kernel when every parameter is on one CUDA or CPU
    device type (one launch group per step instead of ~10 per parameter chunk on CUDA; on the CPU one fused loop
    instead of ~10 ops per parameter: the per-parameter update cost a small model's step milliseconds of host
    time; the same update, equal up to float rounding), except under FSDP2 (its sharded parameters take the
    multi-tensor one)."""
    params = list(model.parameters())
    one_kind = bool(params) and (all(p.is_cuda for p in params) or all(p.device.type == "cpu" for p in params))
    fused = True if one_kind and cfg.dist.dense != "fsdp2" else None
    return torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
                             fused=fused)  # fmt: skip
