"""Process setup every recipe shares: the device, threads, autocast precision, the dense optimizer."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys

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


# torch.optim.AdamW's methods under torch's wrappers (``_disable_dynamo``, ``_use_grad_for_differentiable``, step hooks)
_UNWRAPPED = {name: inspect.unwrap(getattr(torch.optim.AdamW, name))
              for name in ("add_param_group", "step", "zero_grad", "state_dict", "load_state_dict")}  # fmt: skip


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


class EagerAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (the same update, state and state dict) that does not import ``torch._dynamo``.

    torch's optimizer methods (``add_param_group``, which the constructor calls, ``step``, ``zero_grad``,
    ``state_dict``, ``load_state_dict``) import ``torch._dynamo`` for decorators that only matter while
    ``torch.compile`` traces them: seconds of a run's start-up (5.5 s on a fresh GPU host, 1.2 s on a warm
    2-core CPU) in a run that never compiles. This class calls the undecorated methods while ``torch._dynamo`` is
    not loaded (``step`` under the grad mode its decorator sets: ``defaults["differentiable"]``), and torch's own
    once it is (``train.compile``, or anything else that loaded it).
    """

    def add_param_group(self, param_group: dict) -> None:
        if _dynamo_loaded():
            return super().add_param_group(param_group)
        return _UNWRAPPED["add_param_group"](self, param_group)

    def step(self, closure=None):
        if _dynamo_loaded():
            return super().step(closure)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _UNWRAPPED["step"](self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _dynamo_loaded():
            return super().zero_grad(set_to_none)
        return _UNWRAPPED["zero_grad"](self, set_to_none)

    def state_dict(self) -> dict:
        if _dynamo_loaded():
            return super().state_dict()
        return _UNWRAPPED["state_dict"](self)

    def load_state_dict(self, state_dict: dict) -> None:
        if _dynamo_loaded():
            return super().load_state_dict(state_dict)
        return _UNWRAPPED["load_state_dict"](self, state_dict)


def make_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over every parameter, per ``cfg.optim``: the fused kernel when every parameter is on one CUDA or CPU
    device type (one launch group per step instead of ~10 per parameter chunk on CUDA; on the CPU one fused loop
    instead of ~10 ops per parameter: the per-parameter update cost a small model's step milliseconds of host
    time; the same update, equal up to float rounding), except under FSDP2 (its sharded parameters take the
    multi-tensor one). An ``EagerAdamW``: no ``torch._dynamo`` import in a run that does not compile. Frozen
    parameters (``requires_grad`` False, e.g. ``generative.dense_freeze``) are left out: no state, no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    one_kind = bool(params) and (all(p.is_cuda for p in params) or all(p.device.type == "cpu" for p in params))
    fused = True if one_kind and cfg.dist.dense != "fsdp2" else None
    return EagerAdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
                      fused=fused)  # fmt: skip
