"""Triton HSTU attention on jagged sequences: forward, dQ and dK/dV(/d bias) kernels.

    out_i = sum_j visible_ij * SiLU(q_i . k_j + rab_ij) * scale * v_j

One program per (query block or key block, sequence, head); tiles a row block cannot see
are never visited, and fully visible tiles skip the mask arithmetic (``recforge.ops.triton._common``).
Batches of long sequences launch them longest first (``SEQ_ORDER_MIN_LEN``). On Hopper the hot path (bf16/fp16, head
dim 128, causal, no relative bias) runs warp-specialized Gluon kernels instead, forward and backward
(``recforge.ops.triton.hstu_gluon``).
The bias gradients (position and time-bucket weights, shared by all heads) are summed
per tile and weight before any atomic (``recforge.ops.triton.bias_grad``), in float32.

Sections: the kernels' shared tile math (scores, sigmoid, SiLU and its derivative); the three kernels (forward, dQ,
dK/dV); the backward's switches (time-bias gradient loops, per-pair atomics, dQ inside the dK/dV kernel); launching
(constexprs, forward, backward); the autograd function and the public entry point.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.env import hstu_fused_dq
from recforge.jagged.mask import AttentionMask
from recforge.ops.triton._common import (
    MaskArgs,
    block_of_program,
    free_tile_span,
    key_block_ranges,
    key_tile,
    mask_args,
    max_len_bucket,
    next_power_of_2,
    padded_dim,
    placeholder,
    query_block_ranges,
    query_tile,
    sequence_of_rank,
    sequence_order,
    sigmoid,
    time_thresholds,
    visible,
)
from recforge.ops.triton import hstu_gluon
from recforge.ops.triton.bias_grad import pos_grad_tile, time_grad_tile, time_index
from recforge.ops.triton.tuning import dot_precision, is_interpreting, launch, tuned


# ---- shared tile math ------------------------------------------------------------------------------------------


@triton.jit
def _scores(q, kT, i, j, he, c, start_tok, ts_bias, pos_w, time_w, time_thr, P, NB, seq_end_mask,
            HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, DOT_PREC: tl.constexpr):
    """q . k + rab for one tile; i, j positions broadcast to the tile's shape. Targets (positions
    >= he, the history end) all take position he for the position bias; contextual tokens
    (positions < c) are not events and get no time bias."""
    if HAS_TIME:
        s, _, _ = _scores_and_bucket(q, kT, i, j, he, c, start_tok, ts_bias, pos_w, time_w, time_thr, P, NB,
                                     seq_end_mask, HAS_POS, DOT_PREC)  # fmt: skip
    else:
        s = _scores_without_time(q, kT, i, j, he, pos_w, P, HAS_POS, DOT_PREC)
    return s


@triton.jit
def _scores_without_time(q, kT, i, j, he, pos_w, P, HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr):
    s = tl.dot(q, kT, input_precision=DOT_PREC)
    if HAS_POS:
        s += tl.load(pos_w + tl.minimum(tl.maximum(tl.minimum(i, he) - tl.minimum(j, he), 0), P - 1)).to(tl.float32)
    return s


@triton.jit
def _scores_and_bucket(q, kT, i, j, he, c, start_tok, ts_bias, pos_w, time_w, time_thr, P, NB, seq_end_mask,
                       HAS_POS: tl.constexpr, DOT_PREC: tl.constexpr):
    """``_scores`` with the time bias, also returning each pair's (time bucket, gets a time bias): the dK/dV
    kernel can sum its time-weight gradient by these buckets instead of computing them a second time."""
    s = _scores_without_time(q, kT, i, j, he, pos_w, P, HAS_POS, DOT_PREC)
    bucket, events = time_index(i, j, c, start_tok, ts_bias, time_thr, NB, seq_end_mask)
    s += tl.where(events, tl.load(time_w + bucket).to(tl.float32), 0.0)
    return s, bucket, events


# The training kernels' SiLU from h = s / 2: SiLU(s) = s sigmoid(s) = h (1 + tanh h), one hardware tanh and a fused
# multiply-add per element after the halving, and 2 SiLU'(s) = (1 + tanh h)(1 + h (1 - tanh h)); the attention's
# 1 / max_len scale, and the 1/2 of SiLU', multiply each program's accumulators (or the bias gradients) once at the
# end instead of every element of every tile: two to three float32 operations per element fewer than
# ``s * sigmoid(s) * scale`` and its derivative. The forward does so at head dims up to 64 only (1.04x there;
# at 128 ~3% slower on an H200, BENCHMARKS.md, 18th session). Halving q or k once per program instead of each
# score cost a second copy of the key block in shared memory and was not faster. With float16 inputs dS, carried
# times 2 / scale into its dots, overflows 2 max_len times sooner than dS would (a loss scaler backs off; bfloat16,
# which training uses, has float32's range).


@triton.jit
def _tanh_approx(h):
    """tanh(h) in float32 on the hardware tanh (relative error ~2^-11, as ``_common.sigmoid``'s FAST)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [h], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _silu(s, FAST: tl.constexpr):
    """SiLU(s) = h (1 + tanh h), h = s / 2."""
    if FAST:
        h = 0.5 * s
        return h + h * _tanh_approx(h)
    else:
        return s * tl.sigmoid(s)


@triton.jit
def _silu_and_twice_grad(s, FAST: tl.constexpr):
    """(SiLU(s), 2 SiLU'(s)): SiLU'(s) = sigmoid(s) (1 + s (1 - sigmoid(s))), sigmoid(s) = (1 + tanh h) / 2."""
    if FAST:
        h = 0.5 * s
        t = _tanh_approx(h)
        return h + h * t, (1.0 + t) * (1.0 + h * (1.0 - t))
    else:
        sig = tl.sigmoid(s)
        return s * sig, 2.0 * sig * (1.0 + s * (1.0 - sig))


# ---- the kernels --------------------------------------------------------------------------------------------------


@triton.jit
def _hstu_fwd(
    Q, K, V, O, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
    offsets, seq_order, num_targets, num_contextual, seg_ends, ts_mask, ts_bias, pos_w, time_w, time_thr,
    scale, window, P, NB, num_heads, len_key,
    S: tl.constexpr, FULL_BITS: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TS: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    DOT_PREC: tl.constexpr, FAST_SIGMOID: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
    SEQ_ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    blk, num_blocks, rank, h = block_of_program(len_key, num_heads, BLOCK_M)
    b = sequence_of_rank(rank, seq_order, SEQ_ORDER)  # the longest sequences first
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
    q = tl.load(Q + (start_tok + offs_m)[:, None].to(tl.int64) * sq_t + h * sq_h + dq_[None, :],
                mask=row_ok[:, None] & (dq_[None, :] < DQK), other=0.0)
    ts_i = tl.load(ts_mask + start_tok + offs_m, mask=row_ok, other=0) if HAS_TS else offs_m
    acc = tl.zeros((BLOCK_M, BD_V), dtype=tl.float32)
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
            j = j_vec[None, :]
            s = _scores(q, kT, i, j, he, c, start_tok, ts_bias, pos_w, time_w, time_thr, P, NB, (i < n) & (j < n),
                        HAS_POS, HAS_TIME, DOT_PREC)
            if BD_QK <= 64:  # see _silu: at head dim 128 the per-element scale measured faster
                a = _silu(s, FAST_SIGMOID)  # scale: once, at the end
            else:
                a = s * sigmoid(s, FAST_SIGMOID) * scale
            if masked:
                ts_j = tl.load(ts_mask + start_tok + j_vec, mask=key_ok, other=0) if HAS_TS else j_vec
                vis = visible(i, j, n, c, he, ends, ts_i[:, None], ts_j[None, :], window,
                              S, FULL_BITS, HAS_WINDOW, HAS_TS) & (j < khi)
                a = tl.where(vis, a, 0.0)
            acc += tl.dot(a.to(v.dtype), v, input_precision=DOT_PREC)
    tl.store(O + (start_tok + offs_m)[:, None].to(tl.int64) * so_t + h * so_h + dv_[None, :],
             (acc * scale if BD_QK <= 64 else acc).to(O.dtype.element_ty), mask=row_ok[:, None] & (dv_[None, :] < DV))


@triton.jit
def _hstu_bwd_dq(
    Q, K, V, DO, DQ, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sdq_t, sdq_h,
    offsets, seq_order, num_targets, num_contextual, seg_ends, ts_mask, ts_bias, pos_w, time_w, time_thr,
    scale, window, P, NB, num_heads, len_key,
    S: tl.constexpr, FULL_BITS: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TS: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    DOT_PREC: tl.constexpr, FAST_SIGMOID: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
    SEQ_ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    blk, num_blocks, rank, h = block_of_program(len_key, num_heads, BLOCK_M)
    b = sequence_of_rank(rank, seq_order, SEQ_ORDER)
    pid_m = num_blocks - 1 - blk
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
    rows = (start_tok + offs_m)[:, None].to(tl.int64)
    q = tl.load(Q + rows * sq_t + h * sq_h + dq_[None, :], mask=row_ok[:, None] & (dq_[None, :] < DQK), other=0.0)
    do = tl.load(DO + rows * so_t + h * so_h + dv_[None, :], mask=row_ok[:, None] & (dv_[None, :] < DV), other=0.0)
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
            j = j_vec[None, :]
            s = _scores(q, kT, i, j, he, c, start_tok, ts_bias, pos_w, time_w, time_thr, P, NB, (i < n) & (j < n),
                        HAS_POS, HAS_TIME, DOT_PREC)
            _, grad2 = _silu_and_twice_grad(s, FAST_SIGMOID)
            da = tl.dot(do, vT, input_precision=DOT_PREC)
            ds = da * grad2  # dS * 2 / scale: its factor once, at the end
            if masked:
                ts_j = tl.load(ts_mask + start_tok + j_vec, mask=key_ok, other=0) if HAS_TS else j_vec
                vis = visible(i, j, n, c, he, ends, ts_i[:, None], ts_j[None, :], window,
                              S, FULL_BITS, HAS_WINDOW, HAS_TS) & (j < khi)
                ds = tl.where(vis, ds, 0.0)
            dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=DOT_PREC)
    tl.store(DQ + rows * sdq_t + h * sdq_h + dq_[None, :], (dq * (0.5 * scale)).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (dq_[None, :] < DQK))


@triton.jit
def _hstu_bwd_dkdv(
    Q, K, V, DO, DK, DV_, DQ32, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sdk_t, sdk_h, sdv_t, sdv_h,
    sdq_t, sdq_h,
    offsets, seq_order, num_targets, num_contextual, seg_ends, ts_mask, ts_bias, pos_w, time_w, time_thr, dpos, dtime,
    scale, window, P, NB, num_heads, len_key,
    S: tl.constexpr, FULL_BITS: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TS: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr, PAIR_ATOMICS: tl.constexpr,
    NB_PAD: tl.constexpr, TIME_STEPS: tl.constexpr, TIME_LOOP: tl.constexpr, REUSE_BUCKET: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    FUSED_DQ: tl.constexpr, DOT_PREC: tl.constexpr, FAST_SIGMOID: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
    SEQ_ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n, _, rank, h = block_of_program(len_key, num_heads, BLOCK_N)  # first keys (most rows see them) first
    b = sequence_of_rank(rank, seq_order, SEQ_ORDER)
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
    j = offs_n[:, None]  # tiles here are (keys, queries)
    Q_h = Q + h * sq_h
    DO_h = DO + h * so_h
    pos_first = tl.zeros((1,), dtype=tl.float32)  # this program's dS summed for position weights 0, P - 1
    pos_last = tl.zeros((1,), dtype=tl.float32)
    time_hist = tl.zeros((NB_PAD,), dtype=tl.float32)  # and per time bucket

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
            i = i_vec[None, :]
            if TIME_GRAD and REUSE_BUCKET and not PAIR_ATOMICS:
                sT, bucket, events = _scores_and_bucket(k, qT, i, j, he, c, start_tok, ts_bias, pos_w, time_w, time_thr,
                                                        P, NB, (i < n) & (j < n), HAS_POS, DOT_PREC)  # fmt: skip
            else:
                sT = _scores(k, qT, i, j, he, c, start_tok, ts_bias, pos_w, time_w, time_thr, P, NB, (i < n) & (j < n),
                             HAS_POS, HAS_TIME, DOT_PREC)  # (BLOCK_N, BLOCK_M)
            aT, grad2 = _silu_and_twice_grad(sT, FAST_SIGMOID)  # A / scale, SiLU' * 2
            daT = tl.dot(v, doT, input_precision=DOT_PREC)
            dsT = daT * grad2  # dS * 2 / scale: its factor once, at the end (bias gradients: in hstu_backward)
            if masked:
                ts_i = tl.load(ts_mask + start_tok + i_vec, mask=row_ok, other=0) if HAS_TS else i_vec
                vis = visible(i, j, n, c, he, ends, ts_i[None, :], ts_j[:, None], window,
                              S, FULL_BITS, HAS_WINDOW, HAS_TS) & (i < hi)
                aT = tl.where(vis, aT, 0.0)
                dsT = tl.where(vis, dsT, 0.0)
            dv += tl.dot(aT.to(doT.dtype), tl.trans(doT), input_precision=DOT_PREC)
            dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=DOT_PREC)
            if FUSED_DQ:  # this tile's share of dQ, added to the float32 dQ of its rows (see fused_dq)
                dq_part = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=DOT_PREC)  # (BLOCK_M, BD_QK)
                tl.atomic_add(DQ32 + h * sdq_h + tok[:, None] * sdq_t + dq_[None, :], dq_part,
                              mask=row_ok[:, None] & (dq_[None, :] < DQK), sem="relaxed")
            if PAIR_ATOMICS:  # the per-pair atomics of earlier releases, for A/B benchmarks only
                if POS_GRAD:
                    dist = tl.minimum(i, he) - tl.minimum(j, he)
                    if tl.min(dist) >= P - 1:  # every pair of the tile uses the last weight
                        tl.atomic_add(dpos + P - 1, tl.sum(dsT))
                    else:
                        tl.atomic_add(dpos + tl.minimum(tl.maximum(dist, 0), P - 1), dsT, mask=dsT != 0.0)
                if TIME_GRAD:
                    bucket, events = time_index(i, j, c, start_tok, ts_bias, time_thr, NB, (i < n) & (j < n))
                    tl.atomic_add(dtime + bucket, dsT, mask=(dsT != 0.0) & events)
            else:
                if POS_GRAD:
                    pos_first, pos_last = pos_grad_tile(dsT, i, j, i_start, j0, he, P, dpos, pos_first, pos_last,
                                                        HAS_TARGETS, BLOCK_N, BLOCK_M)
                if TIME_GRAD:
                    if not REUSE_BUCKET:
                        bucket, events = time_index(i, j, c, start_tok, ts_bias, time_thr, NB, (i < n) & (j < n))
                    # the masked tiles (phase 0 of two loops) every bucket in a loop; see time_grad_tile
                    time_hist = time_grad_tile(dsT, bucket, events, time_hist, dtime, NB_PAD, TIME_STEPS,
                                               TIME_LOOP and SPLIT_LOOPS and phase == 0)
    if POS_GRAD and not PAIR_ATOMICS:
        tl.atomic_add(dpos + tl.zeros((1,), dtype=tl.int32), pos_first, mask=pos_first != 0.0)
        tl.atomic_add(dpos + tl.full((1,), P - 1, dtype=tl.int32), pos_last, mask=pos_last != 0.0)
    if TIME_GRAD and not PAIR_ATOMICS:
        slots = tl.arange(0, NB_PAD)
        tl.atomic_add(dtime + slots, time_hist, mask=(slots <= NB) & (time_hist != 0.0))
    tl.store(DK + keys * sdk_t + h * sdk_h + dq_[None, :], (dk * (0.5 * scale)).to(DK.dtype.element_ty),
             mask=key_ok[:, None] & (dq_[None, :] < DQK))
    tl.store(DV_ + keys * sdv_t + h * sdv_h + dv_[None, :], (dv * scale).to(DV_.dtype.element_ty),
             mask=key_ok[:, None] & (dv_[None, :] < DV))


# ---- the backward's switches --------------------------------------------------------------------------------------

# Time buckets a mask-free tile of the dK/dV kernel sums one at a time, from its highest down, and
# its lowest (``bias_grad.time_grad_tile``); pairs in the others, rare there, take an atomic each.
TIME_STEPS = 4
# The masked tiles (the first loop of two) sum every bucket from their lowest to their highest in
# a loop: the diagonal tiles span many. That loop keeps Triton from software-pipelining the first
# tile loop (a few tiles per key block); False: the masked tiles as the others (for A/B benchmarks).
time_loop_in_masked_tiles = True
# True: the dK/dV kernel sums the time-weight gradient by the buckets it computed for the scores, instead of
# computing them a second time (two timestamp loads, a log and two threshold loads per pair; more ptxas spills on
# sm_90). H200, bf16, 64K-token batches (benchmarks/attention_bias_grad.py): the backward 1.13-1.22x faster at
# L 1024-4096, within noise at L 256 (BENCHMARKS.md). False: for A/B benchmarks.
reuse_time_bucket = True
# (A second dK/dV launch that only summed the bias gradients, spill-free in ptxas, was 1.1-1.2x slower on an
# H200 than one launch: two dots per tile recomputed cost more than the spills. Removed; BENCHMARKS.md.)
# True: the bias gradients by one atomic per pair, as in earlier releases (for A/B benchmarks:
# serialises on long sequences); read at each backward call.
pair_atomics = False
# True: the dK/dV kernel also computes dQ (one more dot per tile, its (BLOCK_M, Dqk) product added with float32
# atomics into a zeroed float32 buffer, dQ * 2 / scale: see _silu_and_twice_grad) and the dQ kernel is not launched:
# each (query, key) tile's scores and dS are computed once instead of twice (5 tile dots instead of 7). dQ's float32
# sums then come in no fixed order (run to run differences at float32 rounding); never used under
# torch.use_deterministic_algorithms(True). Read at each backward call; autotuned (bf16/fp16, long sequences)
# launches only. None (the default, $RECFORGE_HSTU_FUSED_DQ unset): on for sequences of more than FUSED_DQ_AUTO_LEN
# tokens at head dims over 64, where an H200 measured it faster (1.14x the two kernels at D 128, L 8192; equal at
# L 2048, no gain at D 64: BENCHMARKS.md, 16th session).
fused_dq = hstu_fused_dq()
FUSED_DQ_AUTO_LEN = 2048
# Batches whose max_seq_len is over this launch their sequences longest first (``_common.sequence_order``: one argsort
# per call): in the one-dimensional grid each (sequence, head) group of programs runs its longest programs first, and
# with the groups in batch order the grid's last programs could be a long sequence's longest, run while the other SMs
# idle. Up to it (short sequences, many short programs) the batch order is kept and no sort is launched.
SEQ_ORDER_MIN_LEN = 256

# ---- launching ----------------------------------------------------------------------------------------------------

_fwd = tuned(_hstu_fwd, kind="fwd")
_bwd_dq = tuned(_hstu_bwd_dq, kind="bwd_dq")
_bwd_dkdv = tuned(_hstu_bwd_dkdv, kind="bwd_dkdv", reset_to_zero=["dpos", "dtime", "DQ32"])


def _meta(ma: MaskArgs, dqk: int, dv: int, has_pos: bool, has_time: bool, dtype: torch.dtype) -> dict:
    return dict(_static_meta(ma.num_segments, ma.full_bits, ma.causal, ma.has_targets, ma.has_contextual,
                             ma.has_window, ma.has_ts, dqk, dv, has_pos, has_time, dtype))


@functools.lru_cache(maxsize=256)
def _static_meta(num_segments, full_bits, causal, has_targets, has_contextual, has_window, has_ts, dqk, dv,
                 has_pos, has_time, dtype) -> tuple:
    """The kernels' constexprs, once per combination (built on every call, they cost ~10 us of host time)."""
    return tuple({
        "S": num_segments, "FULL_BITS": full_bits, "CAUSAL": causal, "HAS_TARGETS": has_targets,
        "HAS_CONTEXT": has_contextual, "HAS_WINDOW": has_window, "HAS_TS": has_ts, "HAS_POS": has_pos,
        "HAS_TIME": has_time, "DQK": dqk, "DV": dv, "BD_QK": padded_dim(dqk), "BD_V": padded_dim(dv),
        "DOT_PREC": dot_precision(dtype),
        "FAST_SIGMOID": dtype != torch.float32 and not is_interpreting(),  # PTX tanh: compiled CUDA only
    }.items())


def hstu_forward(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int, ma: MaskArgs, scale: float,
                 pos_w: Tensor | None, ts_bias: Tensor | None, time_w: Tensor | None, num_buckets: int,
                 seq_order: Tensor | None = None) -> Tensor:  # fmt: skip
    """The forward kernel's (T, H, Dv) output (no autograd: ``_HSTUAttention`` and the custom op call it): the Gluon
    forward's on Hopper for the calls it supports (``recforge.ops.triton.hstu_gluon``), else the Triton kernel's.
    ``seq_order``: ``launch_order(offsets, max_seq_len)`` when the caller has it (None: taken here)."""
    total, heads, dqk = q.shape
    dv = v.shape[2]
    batch = offsets.numel() - 1
    out = torch.empty(total, heads, dv, dtype=q.dtype, device=q.device)
    if total > 0 and batch > 0:
        order = seq_order if seq_order is not None else launch_order(offsets, max_seq_len)
        if hstu_gluon.supported(q, k, v, max_seq_len, ma, pos_w, time_w, forward=True):
            return hstu_gluon.hstu_forward_gluon(q, k, v, offsets, max_seq_len, scale, order, out)
        common, scalars, meta = _launch_args(q, v, offsets, max_seq_len, ma, scale, pos_w, ts_bias, time_w, num_buckets,
                                             order)  # fmt: skip
        launch(_fwd, "m", batch, heads, max_seq_len,
               (q, k, v, out, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *out.stride()[:2], *common, *scalars), meta)
    return out


def hstu_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int, ma: MaskArgs,
                  scale: float, pos_w: Tensor | None, ts_bias: Tensor | None, time_w: Tensor | None, num_buckets: int,
                  pos_grad: bool, time_grad: bool, unscaled_dq: bool = False, seq_order: Tensor | None = None,
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """(dq, dk, dv, d pos_w, d time_w) of ``hstu_forward``; the bias gradients None unless ``pos_grad``/``time_grad``.

    ``unscaled_dq``: return dQ * 2 / scale in float32 instead of dQ (the dK/dV kernel's sums as they are when it
    computes dQ), for the caller to scale and round: the compiled step's next kernel does, instead of one more pass.
    The Gluon backward computes the calls ``hstu_gluon.supported`` accepts (with ``grad_out`` TMA-readable)."""
    do = grad_out.contiguous()
    total, heads, _ = q.shape
    batch = offsets.numel() - 1
    if total > 0 and batch > 0 and hstu_gluon.supported(q, k, v, max_seq_len, ma, pos_w, time_w) and \
            hstu_gluon.tma_ready(do, q.dtype):  # no relative bias: no bias gradients
        dq = torch.empty(q.shape, dtype=torch.float32 if unscaled_dq else q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        order = seq_order if seq_order is not None else launch_order(offsets, max_seq_len)
        hstu_gluon.hstu_backward_gluon(do, q, k, v, offsets, max_seq_len, scale, order, dq, dk, dv,
                                       1.0 if unscaled_dq else 0.5 * scale)
        return dq, dk, dv, None, None
    fused = _fused_dq(max_seq_len, dot_precision(q.dtype), q.shape[2])
    # fused: the dK/dV kernel adds dS * 2 / scale times k into dq32: dQ * 2 / scale
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if fused else placeholder(q.device, torch.float32)
    if unscaled_dq:
        dq = dq32 if fused else torch.empty(q.shape, dtype=torch.float32, device=q.device)
    else:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    pos_grad = pos_grad and pos_w is not None
    time_grad = time_grad and time_w is not None
    # summed by the dK/dV kernel (atomics) when wanted; otherwise never written (POS_GRAD/TIME_GRAD off)
    dpos = (torch.zeros(pos_w.numel(), dtype=torch.float32, device=q.device) if pos_grad
            else placeholder(q.device, torch.float32))
    dtime = (torch.zeros(num_buckets + 1, dtype=torch.float32, device=q.device) if time_grad
             else placeholder(q.device, torch.float32))
    if total > 0 and batch > 0:
        common, scalars, meta = _launch_args(q, v, offsets, max_seq_len, ma, scale, pos_w, ts_bias, time_w, num_buckets,
                                             seq_order)  # fmt: skip
        strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *do.stride()[:2])
        if not fused:  # the kernel's dQ times its scale argument: 2 for dQ * 2 / scale
            dq_scalars = (2.0, *scalars[1:]) if unscaled_dq else scalars
            launch(_bwd_dq, "m", batch, heads, max_seq_len,
                   (q, k, v, do, dq, *strides, *dq.stride()[:2], *common, *dq_scalars), meta)
        dq_strides = dq32.stride()[:2] if fused else (0, 0)
        dkdv_args = (q, k, v, do, dk, dv, dq32, *strides, *dk.stride()[:2], *dv.stride()[:2], *dq_strides, *common,
                     dpos, dtime, *scalars)  # fmt: skip
        bias_meta = dict(meta, PAIR_ATOMICS=bool(pair_atomics), NB_PAD=next_power_of_2(num_buckets + 1) if time_grad else 16,
                         TIME_STEPS=TIME_STEPS, TIME_LOOP=bool(time_loop_in_masked_tiles),
                         REUSE_BUCKET=bool(reuse_time_bucket))  # fmt: skip
        launch(_bwd_dkdv, "n", batch, heads, max_seq_len, dkdv_args,
               dict(bias_meta, POS_GRAD=pos_grad, TIME_GRAD=time_grad, FUSED_DQ=fused))
        if fused and not unscaled_dq:
            torch.mul(dq32, 0.5 * scale, out=dq)
    else:
        dq.zero_(), dk.zero_(), dv.zero_()
    # the kernel summed dS * 2 / scale (see _silu_and_twice_grad)
    d_pos = (dpos * (0.5 * scale)).to(pos_w.dtype) if pos_grad else None
    d_time = (dtime * (0.5 * scale)).to(time_w.dtype) if time_grad else None
    return dq, dk, dv, d_pos, d_time


def _fused_dq(max_seq_len: int, dot_prec: str, dqk: int) -> bool:
    """Whether this backward computes dQ in the dK/dV kernel (``fused_dq``: True, or None with sequences of more than
    ``FUSED_DQ_AUTO_LEN`` tokens and a head dim ``dqk`` over 64), never in deterministic mode, only for an autotuned
    launch (bf16/fp16 on sequences over 256 tokens) or the interpreter (its tests)."""
    wanted = fused_dq if fused_dq is not None else (max_seq_len > FUSED_DQ_AUTO_LEN and dqk > 64)
    if not wanted or torch.are_deterministic_algorithms_enabled():
        return False
    return is_interpreting() or (max_seq_len > 256 and dot_prec != "ieee")


def launch_order(offsets: Tensor, max_seq_len: int) -> Tensor | None:
    """The order in which the kernels take a batch's sequences (``SEQ_ORDER_MIN_LEN``), None: batch order."""
    return sequence_order(offsets) if offsets.numel() > 2 and max_seq_len > SEQ_ORDER_MIN_LEN else None


def _launch_args(q, v, offsets, max_seq_len, ma, scale, pos_w, ts_bias, time_w, num_buckets, seq_order) -> tuple:
    """The kernels' shared arguments: (mask and bias tensors, scalars, constexprs); ``seq_order`` None: taken here."""
    has_pos, has_time = pos_w is not None, time_w is not None
    dummy_f = placeholder(q.device, torch.float32)
    thr = time_thresholds(num_buckets, q.device) if has_time else placeholder(q.device, torch.int64, 2)
    order = seq_order if seq_order is not None else launch_order(offsets, max_seq_len)
    order_arg = order if order is not None else placeholder(q.device, torch.int64)  # SEQ_ORDER False: never read
    common = (offsets, order_arg, ma.num_targets, ma.num_contextual, ma.segment_ends, ma.ts, ts_bias if has_time else ma.ts,
              pos_w if has_pos else dummy_f, time_w if has_time else dummy_f, thr)  # fmt: skip
    P = pos_w.numel() if has_pos else 1
    scalars = (scale, ma.window, P, num_buckets, q.shape[1], max_len_bucket(max_seq_len))
    return common, scalars, dict(_meta(ma, q.shape[2], v.shape[2], has_pos, has_time, q.dtype), SEQ_ORDER=order is not None)


# ---- autograd and the entry point ---------------------------------------------------------------------------------


class _HSTUAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, max_seq_len, ma, scale, pos_w, ts_bias, time_w, num_buckets):
        order = launch_order(offsets, max_seq_len)  # taken once for the forward and the backward
        ctx.save_for_backward(q, k, v, offsets, pos_w, ts_bias, time_w, order)
        ctx.stuff = (max_seq_len, ma, scale, num_buckets)
        return hstu_forward(q, k, v, offsets, max_seq_len, ma, scale, pos_w, ts_bias, time_w, num_buckets, order)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, offsets, pos_w, ts_bias, time_w, order = ctx.saved_tensors
        max_seq_len, ma, scale, num_buckets = ctx.stuff
        dq, dk, dv, d_pos, d_time = hstu_backward(grad_out, q, k, v, offsets, max_seq_len, ma, scale, pos_w, ts_bias,
                                                  time_w, num_buckets, ctx.needs_input_grad[7], ctx.needs_input_grad[9],
                                                  seq_order=order)  # fmt: skip
        return dq, dk, dv, None, None, None, None, d_pos, None, d_time, None


def hstu_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    mask: AttentionMask,
    scale: float,
    pos_weights: Tensor | None = None,
    timestamps: Tensor | None = None,
    time_weights: Tensor | None = None,
) -> Tensor:
    """Triton HSTU attention; same contract as ``hstu_attention_reference``.

    q/k/v may be strided views (last dimension contiguous), e.g. slices of one fused projection.
    """
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    offsets = seq_offsets.contiguous()
    ma = mask_args(mask, offsets)
    has_time = time_weights is not None and timestamps is not None
    ts_bias = timestamps.to(torch.int64).contiguous() if has_time else None
    num_buckets = time_weights.numel() - 1 if has_time else 0
    return _HSTUAttention.apply(
        q, k, v, offsets, max_seq_len, ma, float(scale), pos_weights, ts_bias,
        time_weights if has_time else None, num_buckets,
    )
