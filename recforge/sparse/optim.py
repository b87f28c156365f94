"""Sparse optimizers applied to the touched rows only, and per-table learning-rate schedules.

Each update reads the touched rows of the weight and of its state once, computes the new
values and writes them back (``index_select`` -> math -> ``index_copy_``): nothing is done
for rows a batch did not touch. ``adam`` is lazy Adam with a per-row step count, so a row
evolves exactly as ``torch.optim.Adam`` would on that row alone, over the steps it was
touched; ``adamw`` adds decoupled weight decay on those rows.

Example:
    >>> opt = SparseOptimizer([table])          # sparse tables
    >>> dense = torch.optim.AdamW(model.parameters())
    >>> loss.backward(); dense.step(); opt.step(); dense.zero_grad(); opt.zero_grad()
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw")
SCHEDULES = ("constant", "linear", "cosine", "exponential")


@dataclass
class SparseOptimConfig:
    """One table's optimizer; ``schedule`` scales ``lr`` by the table's step count."""

    kind: str = "adam"  # sgd | adagrad | rowwise_adagrad | adam (lazy) | adamw (lazy, decoupled decay)
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0  # adamw: decoupled; other kinds: added to the gradient (L2)
    initial_accumulator: float = 0.0  # adagrad kinds
    schedule: str = "constant"  # constant | linear | cosine | exponential
    schedule_steps: int = 0  # linear/cosine: steps to reach min_lr_ratio (then held)
    min_lr_ratio: float = 0.0  # linear/cosine: final lr / lr
    gamma: float = 1.0  # exponential: lr * gamma ** step

    def validate(self) -> None:
        """Raise ``ValueError`` naming each bad field."""
        if self.kind not in KINDS:
            raise ValueError(f"sparse optimizer kind={self.kind!r}: expected one of {KINDS}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"sparse optimizer schedule={self.schedule!r}: expected one of {SCHEDULES}")
        if self.schedule in ("linear", "cosine") and self.schedule_steps <= 0:
            raise ValueError(f"schedule={self.schedule!r} needs schedule_steps > 0 (the steps to decay over)")
        if self.lr < 0 or len(self.betas) != 2:
            raise ValueError(f"sparse optimizer: lr must be >= 0 and betas two numbers, got lr={self.lr}, betas={self.betas}")


def lr_at(cfg: SparseOptimConfig, step: int) -> float:
    """Learning rate of ``cfg`` at a table step (0-based)."""
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "exponential":
        return cfg.lr * cfg.gamma**step
    progress = min(step / cfg.schedule_steps, 1.0)
    if cfg.schedule == "linear":
        factor = 1.0 - (1.0 - cfg.min_lr_ratio) * progress
    else:
        factor = cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * factor


def state_spec(kind: str, dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-row optimizer state of ``kind``: name -> (shape after the row axis, dtype)."""
    if kind == "sgd":
        return {}
    if kind == "adagrad":
        return {"sum": ((dim,), torch.float32)}
    if kind == "rowwise_adagrad":
        return {"sum": ((), torch.float32)}
    return {"exp_avg": ((dim,), torch.float32), "exp_avg_sq": ((dim,), torch.float32), "step": ((), torch.int64)}


def initial_state(cfg: SparseOptimConfig, name: str) -> float:
    """Value a fresh row's state ``name`` starts at."""
    return cfg.initial_accumulator if name == "sum" else 0.0


def apply_update(
    cfg: SparseOptimConfig, lr: float, weight: Tensor, state: dict[str, Tensor], slots: Tensor, grad: Tensor
) -> None:
    """Update ``weight[slots]`` (and its state) in place with the summed gradient ``grad`` (U, d)."""
    w = weight.index_select(0, slots).float()  # (U, d)
    g = grad.float()
    if cfg.weight_decay and cfg.kind != "adamw":
        g = g + cfg.weight_decay * w
    if cfg.kind == "sgd":
        w = w - lr * g
    elif cfg.kind == "adagrad":
        acc = state["sum"].index_select(0, slots) + g * g  # (U, d)
        state["sum"].index_copy_(0, slots, acc)
        w = w - lr * g / (acc.sqrt() + cfg.eps)
    elif cfg.kind == "rowwise_adagrad":
        acc = state["sum"].index_select(0, slots) + (g * g).mean(1)  # (U,)
        state["sum"].index_copy_(0, slots, acc)
        w = w - lr * g / (acc.sqrt() + cfg.eps)[:, None]
    else:
        beta1, beta2 = cfg.betas
        step = state["step"].index_select(0, slots) + 1  # (U,) per-row step: lazy Adam
        state["step"].index_copy_(0, slots, step)
        m = state["exp_avg"].index_select(0, slots).lerp_(g, 1 - beta1)
        v = state["exp_avg_sq"].index_select(0, slots).mul_(beta2).addcmul_(g, g, value=1 - beta2)
        state["exp_avg"].index_copy_(0, slots, m)
        state["exp_avg_sq"].index_copy_(0, slots, v)
        if cfg.kind == "adamw" and cfg.weight_decay:
            w = w * (1 - lr * cfg.weight_decay)
        stepf = step.to(torch.float32)[:, None]
        bias1 = 1 - beta1**stepf
        bias2_sqrt = (1 - beta2**stepf).sqrt()
        w = w - (lr / bias1) * m / (v.sqrt() / bias2_sqrt + cfg.eps)
    weight.index_copy_(0, slots, w.to(weight.dtype))


class SparseOptimizer:
    """``step()``/``zero_grad()`` over dynamic tables, beside a dense ``torch.optim`` optimizer.

    Each table keeps the gradients its lookups produced (summed per unique row) and its own
    ``SparseOptimConfig``; ``step()`` applies them (``table.apply_gradients()``).

    Args:
        tables: ``DynamicEmbedding`` tables or modules holding them (e.g. an
            ``EmbeddingCollection``): every ``DynamicEmbedding`` inside is stepped.
    """

    def __init__(self, tables: list) -> None:
        from recforge.sparse.table import DynamicEmbedding

        found = []
        for item in tables:
            mods = item.modules() if isinstance(item, torch.nn.Module) else [item]
            found += [m for m in mods if isinstance(m, DynamicEmbedding) and m not in found]
        if not found:
            raise ValueError("SparseOptimizer: no DynamicEmbedding tables given")
        self.tables = found

    def step(self, lr_scale: float = 1.0) -> None:
        """Apply each table's pending row gradients; ``lr_scale`` multiplies every table's learning
        rate this step (a run-level schedule, e.g. warm-up, on top of the tables' own)."""
        for table in self.tables:
            table.apply_gradients(lr_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop pending gradients (after ``step()`` there are none; this is for skipped steps)."""
        for table in self.tables:
            table.zero_grad_rows()
