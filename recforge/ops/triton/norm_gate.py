"""Triton kernels for the HSTU block's combine chain ``y = dropout(layer_norm(a) * u)``, rows of width N = H*Dv.

Forward: one kernel (LayerNorm statistics, affine, gate, dropout; float32 math, one write of ``y``).
Backward: one kernel (dA, dU and per-program partial sums of dWeight/dBias, no atomics: deterministic)
and a sum of the partials. The dropout mask is never stored: both kernels draw it from Philox with the
same seed, read from a one-element device tensor, and the element's index, so the seed is made by a
torch op on the device (``torch.randint``: CUDA-graph safe, fresh per replay, replayed by activation
checkpointing) and a call never reads random state on the host.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.ops.triton._common import sigmoid
from recforge.ops.triton.tuning import is_interpreting

@triton.jit
def _keep(SEED, rows, cols, N, p):
    """Dropout's keep mask of elements (rows, cols): Philox uniform >= p (kept with probability 1 - p)."""
    seed = tl.load(SEED)
    index = rows.to(tl.int64)[:, None] * N + cols[None, :]
    return tl.rand(seed, index.to(tl.uint32)) >= p


@triton.jit
def _norm_gate_fwd(X, U, W, B, Y, MEAN, RSTD, SEED, T, N, stride_x, stride_u, eps, p, scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, SILU_U: tl.constexpr,
                   FAST: tl.constexpr):  # fmt: skip
    """``SILU_U``: U holds the gate's pre-activation; the gate is its SiLU (``FAST``: the sigmoid on the hardware
    tanh, ``_common.sigmoid``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < T, cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / N
    xc = tl.where(ok, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / N + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    u = tl.load(U + r64 * stride_u + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if SILU_U:
        u = u * sigmoid(u, FAST)
    y = (xc * rstd[:, None] * w[None, :] + b[None, :]) * u
    if DROPOUT:
        y = tl.where(_keep(SEED, rows, cols, N, p), y * scale, 0.0)
    tl.store(Y + r64 * N + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _norm_gate_bwd(DY, X, U, W, B, MEAN, RSTD, SEED, DX, DU, PART, T, N, stride_dy, stride_x, stride_u, stride_du,
                   p, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr,
                   SILU_U: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """Row blocks pid, pid + programs, ...; dWeight/dBias partial sums over them in registers (element-wise per
    (row, column) of the block, summed over its rows once after the loop: no cross-warp reduction per block), one
    column of partials per program (kernel names hold "norm": ``benchmarks/train_mfu.py`` counts them as
    elementwise/norm). ``SILU_U``: U holds the gate's pre-activation x_u; DU gets the gradient of x_u."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(pid * BLOCK_M, T, tl.num_programs(0) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        ok = row_ok[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x = tl.load(X + r64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        xhat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)
        dg = tl.load(DY + r64 * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if DROPOUT:
            dg = tl.where(_keep(SEED, rows, cols, N, p), dg * scale, 0.0)
        u = tl.load(U + r64 * stride_u + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        du = dg * (xhat * w[None, :] + b[None, :])
        if SILU_U:
            sig = sigmoid(u, FAST)
            du = du * sig * (1.0 + u * (1.0 - sig))
            u = u * sig
        tl.store(DU + r64 * stride_du + cols[None, :], du.to(DU.dtype.element_ty), mask=ok)
        dn = dg * u  # gradient of the LayerNorm output
        dw += dn * xhat
        db += dn
        dxhat = dn * w[None, :]
        c1 = tl.sum(xhat * dxhat, 1) / N
        c2 = tl.sum(dxhat, 1) / N
        dx = (dxhat - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(DX + r64 * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
    # PART (2, N, programs): each column's partials contiguous, so the sum after the kernel is one inner-dim reduction
    # (two sums of (programs, N) partials over dim 0 before: PyTorch's strided reduction, see BENCHMARKS.md)
    programs = tl.num_programs(0)
    tl.store(PART + cols * programs + pid, tl.sum(dw, 0), mask=col_ok)
    tl.store(PART + (N + cols) * programs + pid, tl.sum(db, 0), mask=col_ok)


_fwd = _norm_gate_fwd  # the name the tests' interpreter fixture checks (tests/ops/conftest.py)


def _tile(width: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps): about 4K elements per program (N = 128: 32 rows, N = 512: 8 rows)."""
    block_n = triton.next_power_of_2(width)
    return max(1, min(64, 4096 // block_n)), block_n, 4 if block_n <= 1024 else 8


@functools.lru_cache(maxsize=8)
def _programs(device: torch.device) -> int:
    """Backward programs: 4 per SM on CUDA (a host query, no sync; cached), 4 on the interpreter."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _fast(u: Tensor) -> bool:
    """The gate's sigmoid on the hardware tanh: bf16/fp16 gates on a GPU (not float32, not the interpreter)."""
    return u.dtype != torch.float32 and not is_interpreting()


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dropout_args(seed: Tensor | None, p: float, like: Tensor) -> tuple[Tensor, float, bool]:
    if p > 0.0 and seed is None:
        raise ValueError("norm_gate_forward: dropout p > 0 needs a seed tensor (one int64 on the inputs' device)")
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return (seed if seed is not None else like), scale, p > 0.0


def norm_gate_forward(x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, seed: Tensor | None, eps: float,
                      p: float, silu_u: bool = False) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(y, mean, rstd): ``y`` (T, N) in the inputs' promoted dtype, float32 row statistics (T,) for the backward.

    ``x``, ``u``: (T, N) with unit column stride (any row stride); ``seed``: (1,) int64, used when p > 0.
    ``silu_u``: ``u`` is the gate's pre-activation, the gate SiLU(u) (``recforge.ops.triton.hstu_silu``)."""
    x, u = _rows(x), _rows(u)
    tokens, width = x.shape
    y = torch.empty((tokens, width), dtype=torch.promote_types(x.dtype, u.dtype), device=x.device)
    mean = torch.empty(tokens, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    seed_arg, scale, dropout = _dropout_args(seed, p, mean)
    block_m, block_n, warps = _tile(width)
    if tokens:
        _norm_gate_fwd[(triton.cdiv(tokens, block_m),)](
            x, u, weight, bias, y, mean, rstd, seed_arg, tokens, width, x.stride(0), u.stride(0), float(eps), float(p),
            scale, BLOCK_M=block_m, BLOCK_N=block_n, DROPOUT=dropout, SILU_U=silu_u, FAST=_fast(u), num_warps=warps)  # fmt: skip
    return y, mean, rstd


def norm_gate_backward(dy: Tensor, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor,
                       seed: Tensor | None, p: float, silu_u: bool = False,
                       du: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dx, du, dweight, dbias) of ``norm_gate_forward``'s ``y`` given its gradient ``dy``; ``silu_u``: as there (du
    is then the gradient of the pre-activation). ``du``: where to write it ((T, N), unit column stride), else new."""
    dy, x, u = _rows(dy), _rows(x), _rows(u)
    tokens, width = x.shape
    dx = torch.empty((tokens, width), dtype=x.dtype, device=x.device)
    if du is None:
        du = torch.empty((tokens, width), dtype=u.dtype, device=x.device)
    block_m, block_n, warps = _tile(width)
    programs = max(1, min(triton.cdiv(tokens, block_m), _programs(x.device)))
    part = torch.empty((2, width, programs), dtype=torch.float32, device=x.device)  # dWeight, dBias partial sums
    seed_arg, scale, dropout = _dropout_args(seed, p, mean)
    _norm_gate_bwd[(programs,)](dy, x, u, weight, bias, mean, rstd, seed_arg, dx, du, part, tokens, width,
                                dy.stride(0), x.stride(0), u.stride(0), du.stride(0), float(p), scale, BLOCK_M=block_m,
                                BLOCK_N=block_n, DROPOUT=dropout, SILU_U=silu_u, FAST=_fast(u), num_warps=warps)  # fmt: skip
    # two sums, not one over (2, N, programs): a custom op's outputs may not be views of one tensor
    return dx, du, part[0].sum(1).to(weight.dtype), part[1].sum(1).to(bias.dtype)


class NormGate(torch.autograd.Function):
    """``dropout(layer_norm(x) * u)`` with the kernels above (eager calls: less host time than the custom op)."""

    @staticmethod
    def forward(ctx, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, seed: Tensor | None, eps: float,
                p: float) -> Tensor:  # fmt: skip
        y, mean, rstd = norm_gate_forward(x, u, weight, bias, seed, eps, p)
        ctx.save_for_backward(x, u, weight, bias, mean, rstd, seed)
        ctx.p = p
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, u, weight, bias, mean, rstd, seed = ctx.saved_tensors
        dx, du, dw, db = norm_gate_backward(dy, x, u, weight, bias, mean, rstd, seed, ctx.p)
        return dx, du, dw, db, None, None, None


__all__ = ["NormGate", "norm_gate_backward", "norm_gate_forward"]
