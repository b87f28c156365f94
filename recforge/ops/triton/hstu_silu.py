"""The HSTU block's SiLU, attention (and gate) as one op: the projection's gradient from the backward kernels' stores.

    u, v, q, k = split(SiLU(x))        x = W_uvqk · LayerNorm(h), columns u | v | q | k
    a          = hstu_attention(q, k, v)    (plain causal mask, no relative bias)
    g          = dropout(LayerNorm(a) * u)  (the gate op only)

Run as steps, the backward concatenates du, dv, dq, dk and multiplies them by SiLU'(x) in a pass of its own over the
(T, 2 H Dv + 2 H Dqk) projection: 2.1 ms of a 43 ms step at NVIDIA's 8 x 1024 / 4K-user shape on an H200
(BENCHMARKS.md, 24th session). Here the Gluon backward (``hstu_gluon.hstu_backward_gluon(pre=...)``) multiplies dQ,
dK and dV by SiLU' of x's columns as it stores them, straight into the projection's gradient; the gate's columns take
one SiLU-backward pass (``silu_attention_*``: the op returns u and a) or none (``silu_attention_gate_*``: the
norm-gate kernels read x_u and write its gradient, ``norm_gate_forward(silu_u=True)``; u is never written). Calls the
Gluon kernels do not take (``hstu_gluon.supported``, checked again at run time) compute the same gradients from the
Triton backward and SiLU-backward passes.

Entry points: ``hstu_silu_attention_triton`` and ``hstu_silu_attention_gate_triton`` (eager: ``autograd.Function``s)
and, under ``torch.compile``, ``recforge.ops.custom_ops.hstu_silu_attention_op`` / ``hstu_silu_attention_gate_op``;
``recforge.ops.hstu_attention.hstu_silu_attention`` / ``hstu_silu_attention_gate`` pick.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.jagged.mask import AttentionMask
from recforge.ops.triton import hstu_gluon
from recforge.ops.triton._common import mask_args
from recforge.ops.triton.hstu import hstu_backward, hstu_forward, launch_order
from recforge.ops.triton.norm_gate import norm_gate_backward, norm_gate_forward


@triton.jit
def _silu_split(X, U, Y, rows, sx, WU: tl.constexpr, WY: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                FIRST: tl.constexpr):  # fmt: skip
    """SiLU of x's (rows, WU + WY) columns: the first WU into u (rows, WU), the rest into y (rows, WY); BN divides WU.
    Column blocks from ``FIRST`` on (WU / BN: y's only)."""
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    c0 = (tl.program_id(1) + FIRST) * BN
    c = c0 + tl.arange(0, BN)
    keep = r[:, None] < rows
    r64 = r[:, None].to(tl.int64)
    x = tl.load(X + r64 * sx + c[None, :], mask=keep, other=0.0).to(tl.float32)
    s = (x * tl.sigmoid(x)).to(U.dtype.element_ty)
    if c0 < WU:
        tl.store(U + r64 * WU + c[None, :], s, mask=keep)
    else:
        tl.store(Y + r64 * WY + (c[None, :] - WU), s, mask=keep)


@triton.jit
def _silu_backward(G, X, DX, rows, sg, sx, sdx, W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """dx = g SiLU'(x) on (rows, W) matrices of row strides sg, sx, sdx; BN divides W."""
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    keep = r[:, None] < rows
    r64 = r[:, None].to(tl.int64)
    g = tl.load(G + r64 * sg + c[None, :], mask=keep, other=0.0).to(tl.float32)
    x = tl.load(X + r64 * sx + c[None, :], mask=keep, other=0.0).to(tl.float32)
    sig = tl.sigmoid(x)
    tl.store(DX + r64 * sdx + c[None, :], (g * sig * (1.0 + x * (1.0 - sig))).to(DX.dtype.element_ty), mask=keep)


_BM = 32


def _block_cols(width: int) -> int:
    """Columns per program: a power of two up to 128 that divides ``width``."""
    return min(128, width & -width)


def silu_backward_into(g: Tensor, x: Tensor, out: Tensor) -> None:
    """``out`` = ``g`` SiLU'(``x``), three (rows, W) matrices with unit column strides (2D views, any row strides)."""
    rows, width = x.shape
    if rows == 0:
        return
    bn = _block_cols(width)
    _silu_backward[(triton.cdiv(rows, _BM), width // bn)](g, x, out, rows, g.stride(0), x.stride(0), out.stride(0),
                                                          W=width, BM=_BM, BN=bn, num_warps=4)  # fmt: skip


def _columns(x: Tensor, heads: int, dqk: int, dv: int) -> tuple[Tensor, Tensor, Tensor]:
    """(v, q, k) of ``x``'s columns v | q | k, as (T, H, D) views."""
    tokens = x.shape[0]
    v, q, k = x.split([heads * dv, heads * dqk, heads * dqk], dim=1)
    return q.view(tokens, heads, dqk), k.view(tokens, heads, dqk), v.view(tokens, heads, dv)


def silu_attention_forward(pre: Tensor, offsets: Tensor, max_seq_len: int, scale: float, heads: int, dqk: int, dv: int,
                           seq_order: Tensor | None = None, gate: bool = True) -> tuple[Tensor | None, Tensor, Tensor]:  # fmt: skip
    """(u, y, a): u = SiLU(x_u) (T, H Dv; None unless ``gate``), y = SiLU(x_vqk) (T, H (Dv + 2 Dqk); the backward's
    q, k, v), a (T, H, Dv) the causal HSTU attention of y's q, k, v; ``pre`` = x (T, H (2 Dv + 2 Dqk)),
    row-contiguous."""
    tokens, width_u = pre.shape[0], heads * dv
    width_y = pre.shape[1] - width_u
    u = torch.empty(tokens, width_u, dtype=pre.dtype, device=pre.device) if gate else None
    y = torch.empty(tokens, width_y, dtype=pre.dtype, device=pre.device)
    if tokens > 0:  # one pass over the projection (PyTorch's SiLU of each column slice ran at a third of its speed)
        bn = _block_cols(math.gcd(width_u, width_y))  # no column block straddles u's end or misses y's last columns
        first = 0 if gate else width_u // bn
        _silu_split[(triton.cdiv(tokens, _BM), pre.shape[1] // bn - first)](
            pre, u if gate else y, y, tokens, pre.stride(0), WU=width_u, WY=width_y, BM=_BM, BN=bn, FIRST=first,
            num_warps=4)  # fmt: skip
    q, k, v = _columns(y, heads, dqk, dv)
    ma = mask_args(AttentionMask(), offsets)
    return u, y, hstu_forward(q, k, v, offsets, max_seq_len, ma, scale, None, None, None, 0, seq_order)


def silu_attention_backward(du: Tensor | None, da: Tensor | None, pre: Tensor, y: Tensor, offsets: Tensor,
                            max_seq_len: int, scale: float, heads: int, dqk: int, dv: int,
                            seq_order: Tensor | None = None) -> Tensor:  # fmt: skip
    """The gradient of ``pre`` (its dtype, row-contiguous) given those of ``silu_attention_forward``'s u and a (None:
    zero)."""
    width_u = heads * dv
    d_pre = torch.empty(pre.shape, dtype=pre.dtype, device=pre.device)
    if du is None:
        d_pre[:, :width_u].zero_()
    else:
        silu_backward_into(du.reshape(pre.shape[0], width_u).contiguous(), pre[:, :width_u], d_pre[:, :width_u])
    if da is None:
        d_pre[:, width_u:].zero_()
    else:
        _attention_backward_into(da, pre, y, d_pre, offsets, max_seq_len, scale, heads, dqk, dv, seq_order)
    return d_pre


def _attention_backward_into(da: Tensor, pre: Tensor, y: Tensor, d_pre: Tensor, offsets: Tensor, max_seq_len: int,
                             scale: float, heads: int, dqk: int, dv: int, seq_order: Tensor | None) -> None:  # fmt: skip
    """``d_pre``'s v | q | k columns: the attention's gradients given ``da``, times SiLU' of ``pre``'s."""
    width_u = heads * dv
    q, k, v = _columns(y, heads, dqk, dv)
    x_q, x_k, x_v = _columns(pre[:, width_u:], heads, dqk, dv)
    g_q, g_k, g_v = _columns(d_pre[:, width_u:], heads, dqk, dv)
    ma = mask_args(AttentionMask(), offsets)
    do = da.contiguous()
    total, batch = q.shape[0], offsets.numel() - 1
    if total > 0 and batch > 0 and hstu_gluon.supported(q, k, v, max_seq_len, ma, None, None) and \
            all(hstu_gluon.tma_ready(t, q.dtype) for t in (do, x_q, g_q)):  # x_k, x_v, g_k, g_v: the same strides
        order = seq_order if seq_order is not None else launch_order(offsets, max_seq_len)
        hstu_gluon.hstu_backward_gluon(do, q, k, v, offsets, max_seq_len, scale, order, g_q, g_k, g_v, 0.5 * scale,
                                       pre=(x_q, x_k, x_v))  # fmt: skip
        return
    grads = hstu_backward(do, q, k, v, offsets, max_seq_len, ma, scale, None, None, None, 0, False, False,
                          seq_order=seq_order)[:3]  # fmt: skip
    for g, x, out in zip(grads, (x_q, x_k, x_v), (g_q, g_k, g_v), strict=True):
        silu_backward_into(*(t.flatten(1) for t in (g, x, out)))


class _HSTUSiluAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre, offsets, max_seq_len, scale, heads, dqk, dv):
        order = launch_order(offsets, max_seq_len)  # taken once for the forward and the backward
        u, y, a = silu_attention_forward(pre, offsets, max_seq_len, scale, heads, dqk, dv, order)
        ctx.save_for_backward(pre, y, offsets, order)
        ctx.stuff = (max_seq_len, scale, heads, dqk, dv)
        return u, a

    @staticmethod
    def backward(ctx, du, da):
        pre, y, offsets, order = ctx.saved_tensors
        return silu_attention_backward(du, da, pre, y, offsets, *ctx.stuff, order), None, None, None, None, None, None


def hstu_silu_attention_triton(pre: Tensor, offsets: Tensor, max_seq_len: int, scale: float, heads: int, dqk: int,
                               dv: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(u (T, H Dv), a (T, H, Dv)) of the projection ``pre`` (see the module docstring), with autograd."""
    return _HSTUSiluAttention.apply(pre.contiguous(), offsets.contiguous(), max_seq_len, float(scale), heads, dqk, dv)


# ---- with the gate: dropout(LayerNorm(a) * u) -----------------------------------------------------------------------


def silu_attention_gate_forward(pre: Tensor, offsets: Tensor, max_seq_len: int, scale: float, heads: int, dqk: int,
                                dv: int, weight: Tensor, bias: Tensor, seed: Tensor | None, eps: float, p: float,
                                seq_order: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(g, y, a, mean, rstd): g = dropout(LayerNorm(a) * SiLU(x_u)) (T, H Dv; ``norm_gate_forward`` with the
    LayerNorm's ``weight``, ``bias``, ``eps``, dropout ``p`` drawn from ``seed``), reading the gate's pre-activation
    columns of ``pre`` (u never written); y, a as ``silu_attention_forward``'s; the LayerNorm's row statistics."""
    _, y, a = silu_attention_forward(pre, offsets, max_seq_len, scale, heads, dqk, dv, seq_order, gate=False)
    g, mean, rstd = norm_gate_forward(a.view(a.shape[0], heads * dv), pre[:, :heads * dv], weight, bias, seed, eps, p,
                                      silu_u=True)  # fmt: skip
    return g, y, a, mean, rstd


def silu_attention_gate_backward(dg: Tensor, pre: Tensor, y: Tensor, a: Tensor, mean: Tensor, rstd: Tensor,
                                 weight: Tensor, bias: Tensor, seed: Tensor | None, p: float, offsets: Tensor,
                                 max_seq_len: int, scale: float, heads: int, dqk: int, dv: int,
                                 seq_order: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(d pre, d weight, d bias) of ``silu_attention_gate_forward``'s g given its gradient ``dg``: the norm-gate
    backward writes the gate's columns of d pre (times SiLU'), the attention backward the rest."""
    width_u = heads * dv
    d_pre = torch.empty(pre.shape, dtype=pre.dtype, device=pre.device)
    da, _, d_weight, d_bias = norm_gate_backward(dg, a.view(a.shape[0], width_u), pre[:, :width_u], weight, bias, mean,
                                                 rstd, seed, p, silu_u=True, du=d_pre[:, :width_u])  # fmt: skip
    _attention_backward_into(da.view(a.shape), pre, y, d_pre, offsets, max_seq_len, scale, heads, dqk, dv, seq_order)
    return d_pre, d_weight, d_bias


class _HSTUSiluAttentionGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre, offsets, max_seq_len, scale, heads, dqk, dv, weight, bias, seed, eps, p):
        order = launch_order(offsets, max_seq_len)  # taken once for the forward and the backward
        g, y, a, mean, rstd = silu_attention_gate_forward(pre, offsets, max_seq_len, scale, heads, dqk, dv, weight, bias,
                                                          seed, eps, p, order)  # fmt: skip
        ctx.save_for_backward(pre, y, a, mean, rstd, weight, bias, seed, offsets, order)
        ctx.stuff = (max_seq_len, scale, heads, dqk, dv, p)
        return g

    @staticmethod
    def backward(ctx, dg):
        pre, y, a, mean, rstd, weight, bias, seed, offsets, order = ctx.saved_tensors
        max_seq_len, scale, heads, dqk, dv, p = ctx.stuff
        d_pre, d_weight, d_bias = silu_attention_gate_backward(dg, pre, y, a, mean, rstd, weight, bias, seed, p, offsets,
                                                               max_seq_len, scale, heads, dqk, dv, order)  # fmt: skip
        return d_pre, None, None, None, None, None, None, d_weight, d_bias, None, None, None


def hstu_silu_attention_gate_triton(pre: Tensor, offsets: Tensor, max_seq_len: int, scale: float, heads: int, dqk: int,
                                    dv: int, weight: Tensor, bias: Tensor, seed: Tensor | None, eps: float,
                                    p: float) -> Tensor:  # fmt: skip
    """dropout(LayerNorm(a) * u) (T, H Dv) of the projection ``pre`` (``silu_attention_gate_forward``), with
    autograd."""
    return _HSTUSiluAttentionGate.apply(pre.contiguous(), offsets.contiguous(), max_seq_len, float(scale), heads, dqk, dv,
                                        weight, bias, seed, float(eps), float(p))
