"""The relative bias of one HSTU tile, and its gradient summed per weight without contention.

The dK/dV kernel adds each tile's dS (keys x queries, float32) to the gradients of the P
position weights and the NB + 1 time-bucket weights, shared by every head and sequence. Adding
each pair with its own atomic serialises on long sequences: 32 users of 4K tokens, 4 heads are
~10^9 pairs a layer, and with events 1 s - 1 h apart they fall into under 30 time buckets, most
into a handful. Here each tile is first summed per weight:

- positions: a tile's non-target pairs have distance ``i - j = r + (m - n)`` (r = first query -
  first key), so the tile's diagonal sums (``diagonal_sums``, one gather) are its gradient for
  BLOCK_N + BLOCK_M - 1 consecutive weights: one atomic per weight and tile; the parts clamped
  to weight 0 or P - 1 (and tiles wholly there) go to two per-program sums, one atomic each
  at the program's end. Target queries all sit at the history end: one sum per key.
- time buckets: log-spaced, so a tile spans few buckets; each is summed over the tile into a
  per-program register histogram, written with one atomic per bucket at the program's end
  (``time_grad_tile``: mask-free tiles unroll their few highest buckets and their lowest, and
  add pairs in any others, rare there, by atomics).

The cost per tile no longer depends on how many pairs share a weight; results equal the
per-pair sums up to float32 summation order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from recforge.ops.triton._common import time_bucket


@triton.jit
def time_index(i, j, c, start_tok, ts_bias, time_thr, NB, in_seq):
    """(time bucket, gets a time bias) of each pair of a tile; positions i, j broadcast to the
    tile's shape. Contextual tokens (positions < c) are not events and get no time bias."""
    ts_i = tl.load(ts_bias + start_tok + i, mask=in_seq & (i >= 0), other=0)
    ts_j = tl.load(ts_bias + start_tok + j, mask=in_seq & (j >= 0), other=0)
    return time_bucket(ts_i - ts_j, time_thr, NB), (i >= c) & (j >= c)


@triton.jit
def diagonal_sums(a, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, W: tl.constexpr):
    """(W,) sums of the diagonals of ``a`` (BLOCK_N, BLOCK_M): entry t sums a[n, m] over
    m - n = t - (BLOCK_N - 1); entries t >= BLOCK_N + BLOCK_M - 1 are zero."""
    n = tl.arange(0, BLOCK_N)[:, None]
    t = tl.arange(0, W)[None, :]
    m = t + n - (BLOCK_N - 1)  # (BLOCK_N, W): row n shifted right by n
    skewed = tl.gather(a, tl.minimum(tl.maximum(m, 0), BLOCK_M - 1), axis=1)
    return tl.sum(tl.where((m >= 0) & (m < BLOCK_M), skewed, 0.0), axis=0)


@triton.jit
def pos_grad_tile(dsT, i, j, i_start, j0, he, P, dpos, acc_first, acc_last,
                  HAS_TARGETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Add a (keys j0.., queries i_start..) tile's dS to the position-weight gradient ``dpos``:
    weights 1..P-2 by atomics here, weights 0 and P - 1 into the returned per-program sums.

    The distance of pair (i, j) is clamp(min(i, he) - min(j, he), 0, P - 1), he the history end.
    """
    W: tl.constexpr = 2 * BLOCK_N if BLOCK_N >= BLOCK_M else 2 * BLOCK_M  # a power of two > BLOCK_N + BLOCK_M - 2
    a = dsT
    if HAS_TARGETS:
        if (i_start + BLOCK_M > he) | (j0 + BLOCK_N > he):
            # target queries (i >= he) sit at he: distance he - j for a history key j
            rows = tl.sum(tl.where((i >= he) & (j < he), dsT, 0.0), axis=1)  # (BLOCK_N,)
            keys = j0 + tl.arange(0, BLOCK_N)
            dist = he - keys
            acc_last += tl.sum(tl.where(dist >= P - 1, rows, 0.0))
            tl.atomic_add(dpos + tl.minimum(dist, P - 1), rows,
                          mask=(keys < he) & (dist < P - 1) & (rows != 0.0))
            # target keys (j >= he): distance min(i, he) - he <= 0
            acc_first += tl.sum(tl.where(j >= he, dsT, 0.0))
            a = tl.where((i < he) & (j < he), dsT, 0.0)
    d0 = i_start - j0 - (BLOCK_N - 1)  # the distance of diagonal t = 0: last key, first query
    if d0 >= P - 1:  # the whole tile takes the last weight
        acc_last += tl.sum(a)
    elif d0 + (BLOCK_N + BLOCK_M - 2) <= 0:  # the whole tile takes the first
        acc_first += tl.sum(a)
    else:
        sums = diagonal_sums(a, BLOCK_N, BLOCK_M, W)
        d = d0 + tl.arange(0, W)
        if (d0 <= 0) | (d0 + (BLOCK_N + BLOCK_M - 2) >= P - 1):  # the tile straddles weight 0 or P - 1
            first = d <= 0
            last = (d >= P - 1) & ~first
            acc_first += tl.sum(tl.where(first, sums, 0.0))
            acc_last += tl.sum(tl.where(last, sums, 0.0))
            tl.atomic_add(dpos + d, sums, mask=~first & ~last & (sums != 0.0))
        else:
            tl.atomic_add(dpos + d, sums, mask=(tl.arange(0, W) < BLOCK_N + BLOCK_M - 1) & (sums != 0.0))
    return acc_first, acc_last


@triton.jit
def _max_and_min(hi0, lo0, hi1, lo1):
    return tl.maximum(hi0, hi1), tl.minimum(lo0, lo1)


@triton.jit
def time_grad_tile(dsT, bucket, events, hist, dtime, NB_PAD: tl.constexpr, STEPS: tl.constexpr,
                   DYNAMIC: tl.constexpr):
    """Add a tile's dS to ``hist`` (NB_PAD,), the program's per-bucket sums, one bucket at a time.

    DYNAMIC: every bucket from the tile's lowest to its highest (a loop inside the tile loop,
    which Triton then does not software-pipeline: for the few masked tiles). Otherwise the
    STEPS highest buckets and the lowest (unrolled); pairs in the others, rare outside the
    diagonal tiles (each step down shrinks the time gap 1.35x), are added to ``dtime`` by
    atomics directly.
    """
    bucket = tl.where(events & (dsT != 0.0), bucket, -1)
    b_hi, b_lo = tl.reduce((bucket, tl.where(bucket >= 0, bucket, NB_PAD)), 1, _max_and_min)  # both in one pass
    b_hi, b_lo = tl.reduce((b_hi, b_lo), 0, _max_and_min)
    slots = tl.arange(0, NB_PAD)
    if DYNAMIC:
        for b in range(b_lo, b_hi + 1):
            hist = tl.where(slots == b, hist + tl.sum(tl.where(bucket == b, dsT, 0.0)), hist)
    else:
        for k in tl.static_range(STEPS):
            b = b_hi - k
            if b >= b_lo:
                hist = tl.where(slots == b, hist + tl.sum(tl.where(bucket == b, dsT, 0.0)), hist)
        if b_lo <= b_hi - STEPS:  # and the lowest (a diagonal tile's i == j pairs: bucket 0)
            hist = tl.where(slots == b_lo, hist + tl.sum(tl.where(bucket == b_lo, dsT, 0.0)), hist)
            if b_lo < b_hi - STEPS:
                rest = (bucket > b_lo) & (bucket <= b_hi - STEPS)
                tl.atomic_add(dtime + tl.maximum(bucket, 0), dsT, mask=rest)
    return hist
