"""Triton forward kernel of ``recforge.ops.cached_hstu_attention``: new tokens over cached keys + themselves.

One program per (block of a request's new tokens, request, head). The rows are the positions
n_b .. n_b + m_b - 1 of the request's whole sequence, so the training kernels' helpers
(``_common.query_block_ranges``, ``key_tile``, ``visible``, ``hstu._scores``) walk and mask
the keys with the one rule set of ``recforge.jagged.mask``; a key tile reads positions < n_b from
the cache and the others from the new tokens. A block of targets walks the history only and
adds each target's attention to itself directly (targets see no other target), so C
candidates cost C x history, not C x (history + C).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.jagged.mask import AttentionMask
from recforge.ops.triton._common import (
    block_of_program,
    free_tile_span,
    key_tile,
    mask_args,
    max_len_bucket,
    placeholder,
    query_block_ranges,
    time_bucket,
    time_thresholds,
    visible,
)
from recforge.ops.triton._common import sigmoid
from recforge.ops.triton.hstu import _meta, _scores
from recforge.ops.triton.tuning import launch, tuned


@triton.jit
def _cached_fwd(
    Q, K, V, KC, VC, O, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, skc_t, skc_h, svc_t, svc_h, so_s, so_t, so_h,
    q_offsets, cache_offsets, splits, num_targets, num_contextual, seg_ends, ts_mask, ts_bias, pos_w, time_w, time_thr,
    scale, window, P, NB, num_heads, len_key,
    S: tl.constexpr, FULL_BITS: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TS: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BD_QK: tl.constexpr, BD_V: tl.constexpr,
    DOT_PREC: tl.constexpr, FAST_SIGMOID: tl.constexpr, SPLIT_LOOPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    blk, num_blocks, bs, h = block_of_program(len_key, num_heads, BLOCK_M)
    b = bs // splits  # the grid's "sequences" are (request, key split) pairs
    split = bs % splits
    pid_m = num_blocks - 1 - blk
    q_start = tl.load(q_offsets + b)
    m = (tl.load(q_offsets + b + 1) - q_start).to(tl.int32)
    r0 = pid_m * BLOCK_M
    if r0 >= m:
        return
    c_start = tl.load(cache_offsets + b)
    nc = (tl.load(cache_offsets + b + 1) - c_start).to(tl.int32)
    full_start = q_start + c_start  # the whole sequence's first token in the timestamps' layout
    n = nc + m
    c = tl.load(num_contextual + b) if HAS_CONTEXT else 0
    he = n - (tl.load(num_targets + b) if HAS_TARGETS else 0)
    ends = seg_ends + b * S
    i0 = nc + r0
    i1 = tl.minimum(i0 + BLOCK_M, n)
    ctx_end, start, end, free_lo, free_hi = query_block_ranges(
        i0, i1, n, c, he, ends, window, S, FULL_BITS, CAUSAL, HAS_WINDOW)
    only_targets = i0 >= he
    end = tl.where(only_targets, tl.minimum(end, he), end)  # their own keys: the self term below

    offs_r = r0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    dq_ = tl.arange(0, BD_QK)
    dv_ = tl.arange(0, BD_V)
    row_ok = offs_r < m
    rows = (q_start + offs_r)[:, None].to(tl.int64)
    q = tl.load(Q + rows * sq_t + h * sq_h + dq_[None, :], mask=row_ok[:, None] & (dq_[None, :] < DQK), other=0.0)
    i = (nc + offs_r)[:, None]
    ts_i = tl.load(ts_mask + full_start + nc + offs_r, mask=row_ok, other=0) if HAS_TS else offs_r
    acc = tl.zeros((BLOCK_M, BD_V), dtype=tl.float32)
    K_h, V_h = K + h * sk_h, V + h * sv_h
    KC_h, VC_h = KC + h * skc_h, VC + h * svc_h

    m_lo, m_hi = free_tile_span(start, free_lo, free_hi, BLOCK_N)
    n_ctx = tl.cdiv(ctx_end, BLOCK_N)
    n_masked = n_ctx + m_lo + tl.cdiv(end - start, BLOCK_N) - m_hi
    total = n_masked + m_hi - m_lo
    t_lo = split * total // splits  # this program's share of the key tiles
    t_hi = (split + 1) * total // splits
    for phase in tl.static_range(1 + SPLIT_LOOPS):  # see SPLIT_LOOPS in tuning.launch
        for t in range(tl.maximum(t_lo, phase * n_masked), tl.minimum(t_hi, n_masked if SPLIT_LOOPS and phase == 0 else total)):
            j_start, khi, masked = key_tile(t, n_masked, n_ctx, m_lo, m_hi, start, ctx_end, end, BLOCK_N)
            if SPLIT_LOOPS:
                masked = phase == 0
            j_vec = j_start + offs_n
            key_ok = j_vec < khi
            cached = key_ok & (j_vec < nc)
            new = key_ok & (j_vec >= nc)
            tc = (c_start + j_vec).to(tl.int64)
            tn = (q_start + j_vec - nc).to(tl.int64)
            kT = (tl.load(KC_h + tc[None, :] * skc_t + dq_[:, None], mask=cached[None, :] & (dq_[:, None] < DQK), other=0.0)
                  + tl.load(K_h + tn[None, :] * sk_t + dq_[:, None], mask=new[None, :] & (dq_[:, None] < DQK), other=0.0))
            v = (tl.load(VC_h + tc[:, None] * svc_t + dv_[None, :], mask=cached[:, None] & (dv_[None, :] < DV), other=0.0)
                 + tl.load(V_h + tn[:, None] * sv_t + dv_[None, :], mask=new[:, None] & (dv_[None, :] < DV), other=0.0))
            j = j_vec[None, :]
            s = _scores(q, kT, i, j, he, c, full_start, ts_bias, pos_w, time_w, time_thr, P, NB, (i < n) & (j < n),
                        HAS_POS, HAS_TIME, DOT_PREC)
            a = s * sigmoid(s, FAST_SIGMOID) * scale
            if masked:
                ts_j = tl.load(ts_mask + full_start + j_vec, mask=key_ok, other=0) if HAS_TS else j_vec
                vis = visible(i, j, n, c, he, ends, ts_i[:, None], ts_j[None, :], window,
                              S, FULL_BITS, HAS_WINDOW, HAS_TS) & (j < khi)
                a = tl.where(vis, a, 0.0)
            acc += tl.dot(a.to(v.dtype), v, input_precision=DOT_PREC)
    if only_targets & (split == 0):  # each target sees itself (in one split only): SiLU(q_i . k_i + rab(0)) * scale * v_i
        k_self = tl.load(K_h + rows * sk_t + dq_[None, :], mask=row_ok[:, None] & (dq_[None, :] < DQK), other=0.0)
        v_self = tl.load(V_h + rows * sv_t + dv_[None, :], mask=row_ok[:, None] & (dv_[None, :] < DV), other=0.0)
        s_self = tl.sum(q.to(tl.float32) * k_self.to(tl.float32), 1)
        if HAS_POS:
            s_self += tl.load(pos_w).to(tl.float32)
        if HAS_TIME:
            s_self += tl.load(time_w + time_bucket(ts_i.to(tl.int64) * 0, time_thr, NB)).to(tl.float32)
        a_self = s_self * tl.sigmoid(s_self) * scale
        acc += a_self[:, None] * v_self.to(tl.float32)
    tl.store(O + split * so_s + rows * so_t + h * so_h + dv_[None, :], acc.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dv_[None, :] < DV))


_fwd = tuned(_cached_fwd, kind="fwd")


def cached_hstu_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    q_offsets: Tensor,
    cache_offsets: Tensor,
    max_q_len: int,
    max_cache_len: int,
    mask: AttentionMask,
    scale: float,
    pos_weights: Tensor | None = None,
    timestamps: Tensor | None = None,
    time_weights: Tensor | None = None,
) -> Tensor:
    """Triton forward; same contract as ``cached_hstu_attention_reference``. Inputs may be strided
    views with a contiguous last dimension (slices of a fused projection, one layer of a cache)."""
    q, k, v, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, k_cache, v_cache))
    q_offsets, cache_offsets = q_offsets.contiguous(), cache_offsets.contiguous()
    ma = mask_args(mask, q_offsets)
    has_pos = pos_weights is not None
    has_time = time_weights is not None and timestamps is not None
    total, heads, dqk = q.shape
    dv = v.shape[2]
    batch = q_offsets.numel() - 1
    out = torch.empty(total, heads, dv, dtype=q.dtype, device=q.device)
    if total == 0 or batch == 0:
        return out
    splits = num_splits(batch, heads, max_q_len, max_cache_len, q.device)
    # more than one split: each writes its float32 partial sums, added up below (no atomics: deterministic,
    # and autotuning may rerun the kernel freely)
    target = out if splits == 1 else torch.empty(splits, total, heads, dv, dtype=torch.float32, device=q.device)
    dummy_f = placeholder(q.device, torch.float32)
    num_buckets = time_weights.numel() - 1 if has_time else 0
    thr = time_thresholds(num_buckets, q.device) if has_time else placeholder(q.device, torch.int64, 2)
    ts_bias = timestamps.to(torch.int64).contiguous() if has_time else ma.ts
    meta = _meta(ma, dqk, dv, has_pos, has_time, q.dtype)
    split_stride = target.stride(0) if splits > 1 else 0
    strides = target.stride()[-3:-1]
    args = (q, k, v, k_cache, v_cache, target, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[:2],
            *v_cache.stride()[:2], split_stride, *strides, q_offsets, cache_offsets, splits, ma.num_targets,
            ma.num_contextual, ma.segment_ends, ma.ts, ts_bias, pos_weights if has_pos else dummy_f,
            time_weights if has_time else dummy_f, thr, float(scale), ma.window,
            pos_weights.numel() if has_pos else 1, num_buckets, heads, max_len_bucket(max_q_len))  # fmt: skip
    launch(_fwd, "m", batch * splits, heads, max_q_len, args, meta)
    return out if splits == 1 else target.sum(0).to(q.dtype)


def num_splits(batch: int, heads: int, max_q_len: int, max_cache_len: int, device: torch.device) -> int:
    """How many programs share one query block's keys: serving passes are one or a few requests of a
    few heads (1,000 candidates x 2 heads = 32 blocks of 64 rows), too few programs for a GPU's SMs;
    splitting the key walk fills them. At most 8 splits, each of at least 256 keys."""
    if device.type != "cuda":
        return 1
    programs = batch * heads * max(1, -(-max_q_len // 64))
    wanted = -(-2 * _multiprocessors(device.index) // programs)
    return max(1, min(8, wanted, (max_cache_len + max_q_len) // 256))


@functools.lru_cache(maxsize=16)
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count


__all__ = ["cached_hstu_attention_triton", "num_splits"]
