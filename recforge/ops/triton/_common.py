"""Mask description -> kernel arguments, and the Triton helpers both attention kernels share.

Visibility is computed per tile from per-sequence scalars (length n, contextual c, first
target position he = n - t, segment ends, window) exactly as ``recforge.jagged.mask`` defines
it. Each program walks only the key (or query) tiles its rows can see:

    query block rows [i0, i1) of one sequence
    keys:  [0, ctx_end)            contextual prefix left of a window's start
           [start, end)            everything else a row of the block may see
             [free_lo, free_hi)    inside it, tiles that are fully visible: no mask math

and the transposed walk for a key block in the dK/dV kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from recforge.jagged.index import lengths_from_offsets
from recforge.jagged.mask import AttentionMask
from recforge.ops.time_bias import TIME_BUCKET_LOG_BASE, time_buckets

assert TIME_BUCKET_LOG_BASE == 0.301, "time_bucket() below hard-codes the log base: change both"

INT64_MAX = 2**63 - 1


@dataclass
class MaskArgs:
    """The mask description as kernel arguments (tensors on the batch's device)."""

    num_targets: Tensor  # (B,) int32, dummy when not has_targets
    num_contextual: Tensor  # (B,) int32, dummy when not has_contextual
    segment_ends: Tensor  # (B, S) int32 exclusive ends of the segments, positions in the sequence
    ts: Tensor  # (T,) int64 mask timestamps, dummy when not has_ts
    window: int
    num_segments: int
    full_bits: int  # bit s: segment s has full attention; bit S: the rest (not causal)
    causal: bool
    has_targets: bool
    has_contextual: bool
    has_window: bool
    has_ts: bool


_placeholders: dict[tuple[torch.device, torch.dtype, int], Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype, size: int = 1) -> Tensor:
    """A zero tensor for a kernel argument that the launch's flags leave unread (or only read),
    made once per (device, dtype, size): allocating and filling one on the device each call cost a
    kernel launch per placeholder, several per attention call. Never write to it."""
    key = (device, dtype, size)
    t = _placeholders.get(key)
    if t is None:
        t = _placeholders[key] = torch.zeros(size, dtype=dtype, device=device)
    return t


def sequence_order(offsets: Tensor) -> Tensor:
    """The batch's sequences longest first (int64 indices, ties in batch order): the order in which the HSTU kernels
    launch their (sequence, head) program groups, so that the last programs to start are the shortest and the grid
    does not end on one long program while the other SMs idle (``sequence_of_rank``)."""
    return torch.argsort(offsets[1:] - offsets[:-1], descending=True, stable=True)


def mask_args(mask: AttentionMask, offsets: Tensor) -> MaskArgs:
    device = offsets.device
    dummy32 = placeholder(device, torch.int32)
    batch = offsets.numel() - 1
    c = mask.num_contextual
    contextual = c.to(device=device, dtype=torch.int32).contiguous() if c is not None else dummy32
    t = mask.num_targets
    targets = t.to(device=device, dtype=torch.int32).contiguous() if t is not None else dummy32
    if mask.segment_lengths is not None and mask.segment_lengths.shape[1] > 0:
        seg = mask.segment_lengths.to(device=device, dtype=torch.int64)
        start = c.to(device=device, dtype=torch.int64) if c is not None else torch.zeros(batch, dtype=torch.int64, device=device)
        ends = (start.view(-1, 1) + torch.cumsum(seg, 1)).to(torch.int32).contiguous()
        flags = tuple(bool(f) for f in mask.segment_full)
    else:
        ends, flags = dummy32, ()
    full_bits = sum(1 << s for s, f in enumerate(flags) if f) | ((not mask.causal) << len(flags))
    ts = mask.timestamps
    return MaskArgs(
        num_targets=targets,
        num_contextual=contextual,
        segment_ends=ends,
        ts=ts.to(device=device, dtype=torch.int64).contiguous() if ts is not None else placeholder(device, torch.int64),
        window=int(mask.max_attn_len or 0),
        num_segments=len(flags),
        full_bits=full_bits,
        causal=mask.causal,
        has_targets=t is not None,
        has_contextual=c is not None,
        has_window=mask.max_attn_len is not None,
        has_ts=ts is not None,
    )


@functools.lru_cache(maxsize=8)
def _time_thresholds_cpu(num_buckets: int) -> Tensor:
    """thr[k] = smallest |delta| whose reference bucket is >= k (k = 1..NB); thr[0] = 0, thr[NB+1] = max.

    Found by binary search over the reference ``time_buckets`` itself, so the kernel's
    bucket (a float log, then corrected against these integers) is bit-identical to it.
    """
    k = torch.arange(1, num_buckets + 1, dtype=torch.int64)
    lo = torch.ones_like(k)
    hi = torch.full_like(k, 2**62)
    reachable = time_buckets(hi, num_buckets) >= k
    for _ in range(64):
        mid = (lo + hi) // 2
        ok = time_buckets(mid, num_buckets) >= k
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid + 1)
    thr = torch.where(reachable, hi, torch.full_like(hi, INT64_MAX))
    return torch.cat([torch.zeros(1, dtype=torch.int64), thr, torch.full((1,), INT64_MAX, dtype=torch.int64)])


_thresholds: dict[tuple[int, torch.device], Tensor] = {}


def time_thresholds(num_buckets: int, device: torch.device) -> Tensor:
    """``_time_thresholds_cpu`` on ``device``, copied there once (read-only)."""
    key = (num_buckets, device)
    if key not in _thresholds:
        _thresholds[key] = _time_thresholds_cpu(num_buckets).to(device)
    return _thresholds[key]


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), in plain Python: ``triton.next_power_of_2`` is a
    Triton constexpr function, ~1.6 us per host call, and attention calls this on every launch."""
    return 1 << (int(n) - 1).bit_length()


def max_len_bucket(max_seq_len: int) -> int:
    """Autotuning key: sequence lengths rounded up to a power of two."""
    return next_power_of_2(max(int(max_seq_len), 16))


def padded_dim(dim: int) -> int:
    """A head dim as the kernels' tiles hold it: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, next_power_of_2(dim))


def lengths_ok(offsets: Tensor, max_seq_len: int) -> None:
    if offsets.numel() > 1 and offsets.device.type == "cpu":
        longest = int(lengths_from_offsets(offsets).max())
        if longest > max_seq_len:
            raise ValueError(f"a sequence has {longest} tokens, more than max_seq_len={max_seq_len}")


# ---------------------------------------------------------------------------------------------
# Triton helpers


@triton.jit
def block_of_program(len_key, num_heads, BLOCK: tl.constexpr):
    """(block index, number of blocks, sequence, head) of this program in the one-dimensional
    block-major grid of ``tuning.launch``: ``cdiv(len_key, BLOCK)`` blocks per (sequence, head),
    neighbours in launch order."""
    num_blocks = tl.cdiv(len_key, BLOCK)
    pid = tl.program_id(0)
    bh = pid // num_blocks
    return pid % num_blocks, num_blocks, bh // num_heads, bh % num_heads


@triton.jit
def sequence_of_rank(rank, seq_order, SEQ_ORDER: tl.constexpr):
    """The batch index of the ``rank``-th sequence in launch order: ``seq_order[rank]`` (the batch's sequences
    longest first, ``sequence_order``) when ``SEQ_ORDER``, else ``rank``."""
    b = rank
    if SEQ_ORDER:
        b = tl.load(seq_order + rank).to(tl.int32)
    return b


@triton.jit
def segment_of(p, ends_ptr, c, he, S: tl.constexpr, FULL_BITS: tl.constexpr):
    """(start, end, full) of the history segment holding scalar position ``p``."""
    s_start = c
    s_end = he
    s_full = ((FULL_BITS >> S) & 1) != 0
    prev = c
    matched = p < 0
    for s in tl.static_range(S):
        e = tl.load(ends_ptr + s)
        inside = (p >= prev) & (p < e)
        s_start = tl.where(inside, prev, s_start)
        s_end = tl.where(inside, e, s_end)
        s_full = tl.where(inside, ((FULL_BITS >> s) & 1) != 0, s_full)
        matched = matched | inside
        prev = e
    s_start = tl.where(matched, s_start, prev)
    return s_start, s_end, s_full


@triton.jit
def visible(i, j, n, c, he, ends_ptr, ts_i, ts_j, window,
            S: tl.constexpr, FULL_BITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TS: tl.constexpr):
    """Query positions i see key positions j (broadcast tiles): the rule of recforge.jagged.mask."""
    q = tl.minimum(i, he - 1)  # a target sees what the last history token sees
    if S > 0:
        seg_q = tl.zeros_like(q)
        seg_j = tl.zeros_like(j)
        for s in tl.static_range(S):
            e = tl.load(ends_ptr + s)
            seg_q += (q >= e).to(tl.int32)
            seg_j += (j >= e).to(tl.int32)
        full_q = seg_q < 0
        for s in tl.static_range(S + 1):
            if ((FULL_BITS >> s) & 1) != 0:
                full_q = full_q | (seg_q == s)
        hist = (seg_j < seg_q) | ((seg_j == seg_q) & (full_q | (j <= q)))
    else:
        if (FULL_BITS & 1) != 0:
            hist = (j <= q) | (j > q)
        else:
            hist = j <= q
    if HAS_WINDOW:
        hist = hist & ((q - j < window) | (j >= q))
    if HAS_TS:
        hist = hist & ((ts_j < ts_i) | (i < he))
    vis = (hist & (j < he)) | (j == i)
    vis = tl.where(i < c, j < c, vis | (j < c))
    return vis & (i < n) & (j < n)


@triton.jit
def query_block_ranges(i0, i1, n, c, he, ends_ptr, window,
                       S: tl.constexpr, FULL_BITS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key ranges for query rows [i0, i1): (ctx_end, start, end, free_lo, free_hi), see module doc."""
    q_last = tl.minimum(i1 - 1, he - 1)
    _, s_end, s_full = segment_of(q_last, ends_ptr, c, he, S, FULL_BITS)
    end = tl.where((q_last >= c) & s_full, tl.maximum(i1, s_end), i1)
    end = tl.minimum(tl.maximum(end, tl.where(i0 < c, c, 0)), n)
    start = i0 * 0
    if HAS_WINDOW:
        q_first = tl.minimum(tl.maximum(i0, c), he - 1)
        start = tl.maximum(q_first - window + 1, 0)
    ctx_end = tl.minimum(c, start)
    rows_history = (i0 >= c) & (i1 <= he)
    if (FULL_BITS & 1) != 0 and S == 0:
        free_hi = he
    else:
        free_hi = tl.minimum(i0 + 1, he)
    free_lo = start
    if HAS_WINDOW:
        free_lo = tl.maximum(start, i1 - window)
    free_hi = tl.where(rows_history, free_hi, start)
    free_lo = tl.where(rows_history, free_lo, start)
    return ctx_end, start, end, free_lo, free_hi


@triton.jit
def key_block_ranges(j0, j1, n, c, he, ends_ptr, window,
                     S: tl.constexpr, FULL_BITS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query rows that may see keys [j0, j1): (lo, hi, free_lo, free_hi)."""
    s_start, _, s_full = segment_of(j0, ends_ptr, c, he, S, FULL_BITS)
    lo = tl.where(j0 < he, tl.where(s_full, s_start, j0), j0)
    hi = n
    if HAS_WINDOW:
        j_max = tl.minimum(j1, he) - 1
        hi = tl.where(j_max >= he - window, n, tl.maximum(tl.minimum(he, j_max + window), j1))
    hi = tl.where(j0 >= he, j1, hi)  # target keys: seen by themselves only
    lo = tl.where(j0 < c, 0, lo)  # contextual keys: seen by every row
    hi = tl.where(j0 < c, n, hi)
    keys_history = (j0 >= c) & (j1 <= he)
    if (FULL_BITS & 1) != 0 and S == 0:
        free_lo = tl.maximum(lo, c)
    else:
        free_lo = tl.maximum(lo, j1 - 1)
    free_hi = he
    if HAS_WINDOW:
        free_hi = tl.minimum(he, j0 + window)
    free_lo = tl.where(keys_history, free_lo, lo)
    free_hi = tl.where(keys_history, free_hi, lo)
    return lo, hi, free_lo, free_hi


@triton.jit
def free_tile_span(lo, free_lo, free_hi, BLOCK: tl.constexpr):
    """Tile indices [m_lo, m_hi) (tiles start at lo + m * BLOCK) lying inside [free_lo, free_hi)."""
    m_lo = tl.cdiv(free_lo - lo, BLOCK)
    m_hi = (free_hi - lo) // BLOCK
    ok = m_hi > m_lo
    return tl.where(ok, m_lo, 0), tl.where(ok, m_hi, 0)


@triton.jit
def key_tile(t, n_masked, n_ctx, m_lo, m_hi, start, ctx_end, end, BLOCK: tl.constexpr):
    """(first key, key bound, needs the mask) of the t-th key tile a query block walks.

    Tiles t < n_masked need the mask: the contextual prefix tiles, then the tiles of
    [start, end) outside the free span [m_lo, m_hi); the free span's tiles follow. Kernels walk
    them in one loop or two (``SPLIT_LOOPS``, see ``recforge.ops.triton.tuning.split_loops``).
    """
    masked = t < n_masked
    u = t - n_ctx
    u = tl.where(u < m_lo, u, u - m_lo + m_hi)
    j_masked = tl.where(t < n_ctx, t * BLOCK, start + u * BLOCK)
    j_start = tl.where(masked, j_masked, start + (t - n_masked + m_lo) * BLOCK)
    khi = tl.where(masked & (t < n_ctx), ctx_end, end)
    return j_start, khi, masked


@triton.jit
def query_tile(t, n_masked, m_lo, m_hi, lo, BLOCK: tl.constexpr):
    """(first row, needs the mask) of the t-th query tile a key block walks: the tiles of
    [lo, hi) outside the free span [m_lo, m_hi) first, then the free span (see ``key_tile``)."""
    masked = t < n_masked
    u = tl.where(masked, tl.where(t < m_lo, t, t - m_lo + m_hi), t - n_masked + m_lo)
    return lo + u * BLOCK, masked


@triton.jit
def time_bucket(delta, thr_ptr, NB):
    """Reference ``time_buckets`` of int64 deltas: a float log, corrected against exact thresholds."""
    d = tl.maximum(tl.abs(delta), 1)
    # 0.301 is TIME_BUCKET_LOG_BASE, written as a literal: jit code reads no Python globals
    b = tl.floor(tl.log(d.to(tl.float32)) / 0.301).to(tl.int32)
    b = tl.minimum(tl.maximum(b, 0), NB)
    lo = tl.load(thr_ptr + b)
    hi = tl.load(thr_ptr + b + 1)
    b = b - (d < lo).to(tl.int32) + (d >= hi).to(tl.int32)
    return tl.minimum(tl.maximum(b, 0), NB)


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    """1 / (1 + exp(-x)) in float32. FAST (bf16/fp16 inputs): 0.5 + 0.5 tanh(x / 2) on the
    hardware tanh (relative error ~2^-11, under bf16/fp16 rounding of the tile before the next
    dot): one special-function op per element instead of two (exp, reciprocal). At head dim 64
    those ops, not the tensor cores, bound the forward: a 128x64 tile's two dots take ~512 cycles
    per SM, its 8192 exp + 8192 reciprocals at 16 per cycle ~1024. The HSTU forward at head dims over 64,
    the serving kernel (``cached``) and the norm-gate kernels' gate SiLU use it; the other HSTU kernels
    ``hstu._silu`` / ``_silu_and_twice_grad``."""
    if FAST:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [0.5 * x], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return 0.5 + 0.5 * t
    else:
        return tl.sigmoid(x)
