"""Triton softmax attention on jagged sequences (flash-style): forward, dQ and dK/dV kernels.

Same tile walk as the HSTU kernels (``recforge.ops.triton._common``); the forward keeps a
running max and sum per row and stores the row's log-sum-exp (base 2) for the backward.
Every real row sees itself, so no row's softmax is empty.

The backward recomputes P in both kernels (dQ: QKᵀ, dO Vᵀ, dS K; dK/dV: QKᵀ, Pᵀ dO, V dOᵀ,
dSᵀ Q), as FlashAttention-2's Triton form and FlexAttention do. The dQ kernel runs first and
also writes delta = rowsum(dO * O) for the dK/dV kernel (no separate pass over dO and O).
Accumulating dQ with float32 atomics from the dK/dV kernel instead (5 matmuls, no dQ kernel;
vectorised ``atom.add.v4.f32``) took 1.2x the time of the two kernels on an H100 (D 64/128,
L 2048-8192; BENCHMARKS.md, "Attention kernels"): the atomics cost more than the two
recomputed matmuls.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.jagged.mask import AttentionMask
from recforge.ops.triton._common import (
    block_of_program,
    free_tile_span,
    key_block_ranges,
    key_tile,
    mask_args,
    max_len_bucket,
    padded_dim,
    query_block_ranges,
    query_tile,
    visible,
)
from recforge.ops.triton.tuning import dot_precision, launch, tuned

LOG2E = 1.4426950408889634


@triton.jit
def _sm_fwd(
    Q, K, V, O, LSE, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
    offsets, num_targets, num_contextual, seg_ends, ts_mask,
    qk_scale, window, num_heads, len_key,
    S: tl.constexpr, FULL_BITS: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TS: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    DOT_PREC: tl.constexpr, SPLIT_LOOPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    blk, num_blocks, b, h = block_of_program(len_key, num_heads, BLOCK_M)
    pid_m = num_blocks - 1 - blk  # of a sequence's row blocks, the longest key walk first
    start_tok = tl.load(offsets + b)
    n = (tl.load(offsets + b + 1) - start_tok).to(tl.int32)
    i0 = pid_m * BLOCK_M
    if i0 >= n:
        return
    c = tl.load(num_contextual + b) if HAS_CONTEXT else 0
    he = n - (tl.load(num_targets + b) if HAS_TARGETS else 0)
    ends = seg_ends + b * S
    i1 = tl.minimum(i0 + BLOCK_M, n)
    ctx_end, start, end, free_lo, free_hi = query_block_ranges(
        i0, i1, n, c, he, ends, window, S, FULL_BITS, CAUSAL, HAS_WINDOW)

    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    dq_ = tl.arange(0, BD_QK)
    dv_ = tl.arange(0, BD_V)
    row_ok = offs_m < n
    rows = (start_tok + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * sq_t + h * sq_h + dq_[None, :], mask=row_ok[:, None] & (dq_[None, :] < DQK), other=0.0)
    ts_i = tl.load(ts_mask + start_tok + offs_m, mask=row_ok, other=0) if HAS_TS else offs_m
    acc = tl.zeros((BLOCK_M, BD_V), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    i = offs_m[:, None]
    K_h = K + h * sk_h
    V_h = V + h * sv_h

    m_lo, m_hi = free_tile_span(start, free_lo, free_hi, BLOCK_N)
    n_ctx = tl.cdiv(ctx_end, BLOCK_N)
    n_masked = n_ctx + m_lo + tl.cdiv(end - start, BLOCK_N) - m_hi
    for phase in tl.static_range(1 + SPLIT_LOOPS):  # see SPLIT_LOOPS in tuning.launch
        for t in range(phase * n_masked, n_masked if SPLIT_LOOPS and phase == 0 else n_masked + m_hi - m_lo):
            j_start, khi, masked = key_tile(t, n_masked, n_ctx, m_lo, m_hi, start, ctx_end, end, BLOCK_N)
            if SPLIT_LOOPS:
                masked = phase == 0  # a compile-time constant: no branch in the loop
            j_vec = j_start + offs_n
            key_ok = j_vec < khi
            tok = (start_tok + j_vec).to(tl.int64)
            kT = tl.load(K_h + tok[None, :] * sk_t + dq_[:, None], mask=key_ok[None, :] & (dq_[:, None] < DQK), other=0.0)
            v = tl.load(V_h + tok[:, None] * sv_t + dv_[None, :], mask=key_ok[:, None] & (dv_[None, :] < DV), other=0.0)
            s = tl.dot(q, kT, input_precision=DOT_PREC) * qk_scale
            if masked:
                j = j_vec[None, :]
                ts_j = tl.load(ts_mask + start_tok + j_vec, mask=key_ok, other=0) if HAS_TS else j_vec
                vis = visible(i, j, n, c, he, ends, ts_i[:, None], ts_j[None, :], window,
                              S, FULL_BITS, HAS_WINDOW, HAS_TS) & (j < khi)
                s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(O + rows[:, None] * so_t + h * so_h + dv_[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dv_[None, :] < DV))
    tl.store(LSE + rows * num_heads + h, m_i + tl.math.log2(l_safe), mask=row_ok)


@triton.jit
def _sm_bwd_dq(
    Q, K, V, O, DO, DQ, LSE, DELTA, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sdq_t, sdq_h,
    offsets, num_targets, num_contextual, seg_ends, ts_mask,
    qk_scale, sm_scale, window, num_heads, len_key,
    S: tl.constexpr, FULL_BITS: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TS: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    DOT_PREC: tl.constexpr, SPLIT_LOOPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    blk, num_blocks, b, h = block_of_program(len_key, num_heads, BLOCK_M)
    pid_m = num_blocks - 1 - blk  # of a sequence's row blocks, the longest key walk first
    start_tok = tl.load(offsets + b)
    n = (tl.load(offsets + b + 1) - start_tok).to(tl.int32)
    i0 = pid_m * BLOCK_M
    if i0 >= n:
        return
    c = tl.load(num_contextual + b) if HAS_CONTEXT else 0
    he = n - (tl.load(num_targets + b) if HAS_TARGETS else 0)
    ends = seg_ends + b * S
    i1 = tl.minimum(i0 + BLOCK_M, n)
    ctx_end, start, end, free_lo, free_hi = query_block_ranges(
        i0, i1, n, c, he, ends, window, S, FULL_BITS, CAUSAL, HAS_WINDOW)

    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    dq_ = tl.arange(0, BD_QK)
    dv_ = tl.arange(0, BD_V)
    row_ok = offs_m < n
    rows = (start_tok + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * sq_t + h * sq_h + dq_[None, :], mask=row_ok[:, None] & (dq_[None, :] < DQK), other=0.0)
    row_dv = row_ok[:, None] & (dv_[None, :] < DV)
    do = tl.load(DO + rows[:, None] * so_t + h * so_h + dv_[None, :], mask=row_dv, other=0.0)
    o = tl.load(O + rows[:, None] * so_t + h * so_h + dv_[None, :], mask=row_dv, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # rowsum(dO * O), stored for the dK/dV kernel
    tl.store(DELTA + rows * num_heads + h, delta, mask=row_ok)
    lse = tl.load(LSE + rows * num_heads + h, mask=row_ok, other=0.0)
    ts_i = tl.load(ts_mask + start_tok + offs_m, mask=row_ok, other=0) if HAS_TS else offs_m
    dq = tl.zeros((BLOCK_M, BD_QK), dtype=tl.float32)
    i = offs_m[:, None]
    K_h = K + h * sk_h
    V_h = V + h * sv_h

    m_lo, m_hi = free_tile_span(start, free_lo, free_hi, BLOCK_N)
    n_ctx = tl.cdiv(ctx_end, BLOCK_N)
    n_masked = n_ctx + m_lo + tl.cdiv(end - start, BLOCK_N) - m_hi
    for phase in tl.static_range(1 + SPLIT_LOOPS):  # see SPLIT_LOOPS in tuning.launch
        for t in range(phase * n_masked, n_masked if SPLIT_LOOPS and phase == 0 else n_masked + m_hi - m_lo):
            j_start, khi, masked = key_tile(t, n_masked, n_ctx, m_lo, m_hi, start, ctx_end, end, BLOCK_N)
            if SPLIT_LOOPS:
                masked = phase == 0  # a compile-time constant: no branch in the loop
            j_vec = j_start + offs_n
            key_ok = j_vec < khi
            tok = (start_tok + j_vec).to(tl.int64)
            kT = tl.load(K_h + tok[None, :] * sk_t + dq_[:, None], mask=key_ok[None, :] & (dq_[:, None] < DQK), other=0.0)
            vT = tl.load(V_h + tok[None, :] * sv_t + dv_[:, None], mask=key_ok[None, :] & (dv_[:, None] < DV), other=0.0)
            s = tl.dot(q, kT, input_precision=DOT_PREC) * qk_scale
            p = tl.math.exp2(s - lse[:, None])
            if masked:
                j = j_vec[None, :]
                ts_j = tl.load(ts_mask + start_tok + j_vec, mask=key_ok, other=0) if HAS_TS else j_vec
                vis = visible(i, j, n, c, he, ends, ts_i[:, None], ts_j[None, :], window,
                              S, FULL_BITS, HAS_WINDOW, HAS_TS) & (j < khi)
                p = tl.where(vis, p, 0.0)
            dp = tl.dot(do, vT, input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=DOT_PREC)
    tl.store(DQ + rows[:, None] * sdq_t + h * sdq_h + dq_[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (dq_[None, :] < DQK))


@triton.jit
def _sm_bwd_dkdv(
    Q, K, V, DO, DK, DV_, LSE, DELTA, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sdk_t, sdk_h, sdv_t, sdv_h,
    offsets, num_targets, num_contextual, seg_ends, ts_mask,
    qk_scale, sm_scale, window, num_heads, len_key,
    S: tl.constexpr, FULL_BITS: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TS: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    DOT_PREC: tl.constexpr, SPLIT_LOOPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n, _, b, h = block_of_program(len_key, num_heads, BLOCK_N)
    start_tok = tl.load(offsets + b)
    n = (tl.load(offsets + b + 1) - start_tok).to(tl.int32)
    j0 = pid_n * BLOCK_N
    if j0 >= n:
        return
    c = tl.load(num_contextual + b) if HAS_CONTEXT else 0
    he = n - (tl.load(num_targets + b) if HAS_TARGETS else 0)
    ends = seg_ends + b * S
    j1 = tl.minimum(j0 + BLOCK_N, n)
    lo, hi, free_lo, free_hi = key_block_ranges(j0, j1, n, c, he, ends, window, S, FULL_BITS, CAUSAL, HAS_WINDOW)

    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    dq_ = tl.arange(0, BD_QK)
    dv_ = tl.arange(0, BD_V)
    key_ok = offs_n < n
    keys = (start_tok + offs_n)[:, None].to(tl.int64)
    k = tl.load(K + keys * sk_t + h * sk_h + dq_[None, :], mask=key_ok[:, None] & (dq_[None, :] < DQK), other=0.0)
    v = tl.load(V + keys * sv_t + h * sv_h + dv_[None, :], mask=key_ok[:, None] & (dv_[None, :] < DV), other=0.0)
    ts_j = tl.load(ts_mask + start_tok + offs_n, mask=key_ok, other=0) if HAS_TS else offs_n
    dk = tl.zeros((BLOCK_N, BD_QK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BD_V), dtype=tl.float32)
    j = offs_n[:, None]
    Q_h = Q + h * sq_h
    DO_h = DO + h * so_h

    m_lo, m_hi = free_tile_span(lo, free_lo, free_hi, BLOCK_M)
    n_masked = m_lo + tl.cdiv(hi - lo, BLOCK_M) - m_hi
    for phase in tl.static_range(1 + SPLIT_LOOPS):  # see SPLIT_LOOPS in tuning.launch
        for t in range(phase * n_masked, n_masked if SPLIT_LOOPS and phase == 0 else n_masked + m_hi - m_lo):
            i_start, masked = query_tile(t, n_masked, m_lo, m_hi, lo, BLOCK_M)
            if SPLIT_LOOPS:
                masked = phase == 0  # a compile-time constant: no branch in the loop
            i_vec = i_start + offs_m
            row_ok = i_vec < hi
            tok = (start_tok + i_vec).to(tl.int64)
            qT = tl.load(Q_h + tok[None, :] * sq_t + dq_[:, None], mask=row_ok[None, :] & (dq_[:, None] < DQK), other=0.0)
            doT = tl.load(DO_h + tok[None, :] * so_t + dv_[:, None], mask=row_ok[None, :] & (dv_[:, None] < DV), other=0.0)
            lse = tl.load(LSE + tok * num_heads + h, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + tok * num_heads + h, mask=row_ok, other=0.0)
            sT = tl.dot(k, qT, input_precision=DOT_PREC) * qk_scale
            pT = tl.math.exp2(sT - lse[None, :])
            if masked:
                i = i_vec[None, :]
                ts_i = tl.load(ts_mask + start_tok + i_vec, mask=row_ok, other=0) if HAS_TS else i_vec
                vis = visible(i, j, n, c, he, ends, ts_i[None, :], ts_j[:, None], window,
                              S, FULL_BITS, HAS_WINDOW, HAS_TS) & (i < hi)
                pT = tl.where(vis, pT, 0.0)
            dv += tl.dot(pT.to(doT.dtype), tl.trans(doT), input_precision=DOT_PREC)
            dpT = tl.dot(v, doT, input_precision=DOT_PREC)
            dsT = pT * (dpT - delta[None, :])
            dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=DOT_PREC)
    tl.store(DK + keys * sdk_t + h * sdk_h + dq_[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
             mask=key_ok[:, None] & (dq_[None, :] < DQK))
    tl.store(DV_ + keys * sdv_t + h * sdv_h + dv_[None, :], dv.to(DV_.dtype.element_ty),
             mask=key_ok[:, None] & (dv_[None, :] < DV))


_fwd = tuned(_sm_fwd, kind="fwd")
_bwd_dq = tuned(_sm_bwd_dq, kind="softmax_bwd_dq")
_bwd_dkdv = tuned(_sm_bwd_dkdv, kind="softmax_bwd_dkdv")


class _SoftmaxAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, max_seq_len, ma, sm_scale):
        total, heads, dqk = q.shape
        dv = v.shape[2]
        batch = offsets.numel() - 1
        out = torch.empty(total, heads, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(total, heads, dtype=torch.float32, device=q.device)
        meta = {
            "S": ma.num_segments, "FULL_BITS": ma.full_bits, "CAUSAL": ma.causal, "HAS_TARGETS": ma.has_targets,
            "HAS_CONTEXT": ma.has_contextual, "HAS_WINDOW": ma.has_window, "HAS_TS": ma.has_ts, "DQK": dqk, "DV": dv,
            "BD_QK": padded_dim(dqk), "BD_V": padded_dim(dv),
            "DOT_PREC": dot_precision(q.dtype),
        }
        common = (offsets, ma.num_targets, ma.num_contextual, ma.segment_ends, ma.ts)
        if total > 0 and batch > 0:
            launch(_fwd, "m", batch, heads, max_seq_len,
                    (q, k, v, out, lse, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2], *common,
                     sm_scale * LOG2E, ma.window, heads, max_len_bucket(max_seq_len)), meta)
        ctx.save_for_backward(q, k, v, out, lse, offsets, ma.num_targets, ma.num_contextual, ma.segment_ends, ma.ts)
        ctx.stuff = (max_seq_len, ma, sm_scale, meta)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, offsets, *mask_tensors = ctx.saved_tensors
        max_seq_len, ma, sm_scale, meta = ctx.stuff
        do = grad_out.contiguous()
        total, heads, _ = q.shape
        batch = offsets.numel() - 1
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if total == 0 or batch == 0:
            return dq.zero_(), dk.zero_(), dv.zero_(), None, None, None, None
        delta = torch.empty(total, heads, dtype=torch.float32, device=q.device)  # rowsum(dO * O), by the dQ kernel
        common = (offsets, *mask_tensors)
        scalars = (sm_scale * LOG2E, sm_scale, ma.window, heads, max_len_bucket(max_seq_len))
        strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *do.stride()[:2])
        assert out.stride() == do.stride()  # one set of strides for O and dO
        launch(_bwd_dq, "m", batch, heads, max_seq_len,
                (q, k, v, out, do, dq, lse, delta, *strides, *dq.stride()[:2], *common, *scalars), meta)
        launch(_bwd_dkdv, "n", batch, heads, max_seq_len,
                (q, k, v, do, dk, dv, lse, delta, *strides, *dk.stride()[:2], *dv.stride()[:2], *common, *scalars), meta)
        return dq, dk, dv, None, None, None, None


def softmax_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, scale: float | None = None
) -> Tensor:
    """Triton softmax attention over jagged (T, H, D) q/k/v; scale defaults to 1/sqrt(Dqk) as in SDPA."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    offsets = seq_offsets.contiguous()
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _SoftmaxAttention.apply(q, k, v, offsets, max_seq_len, mask_args(mask, offsets), sm_scale)
