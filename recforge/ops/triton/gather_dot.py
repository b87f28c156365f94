"""Triton kernels for the gather-dot of sampled softmax: ``logits[n, r] = q[n] . table[idx[n, r]]``, never
materialising the (N, R, D) gathered rows, and its two gradients.

    forward   logits[n, r] = sum_d q[n, d] * table[idx[n, r], d]         grid (N, R blocks), loop over D
    dq        dq[n]        = sum_r g[n, r] * table[idx[n, r]]            grid (N, D blocks), loop over R
    dtable    dtable[e]    = sum_{(n, r): idx[n, r] = e} g[n, r] * q[n]   grid (rows, D blocks), loop over e's pairs

All three are memory bound (each gathered element is used once) and run on CUDA cores in float32 whatever the
inputs' dtype. ``dq`` and ``dtable`` are one kernel (``_gather_rows_sum``): a weighted sum of gathered rows per output
row, over a regular segment (``dq``: the R pairs of row n) or a sorted one (``dtable``: the pairs of table row e,
found by sorting the (n, r) pairs by ``idx``). Sorting, not float32 atomics, for ``dtable``, because:

- a sort of the N*R keys (2M at N = 16K, R = 128) is a ~0.1 ms radix sort, small next to the ~8 GB of rows
  the pass reads; after it every table row is written exactly once, by one program: no zero fill and no
  float32 scratch copy of a bf16/fp16 table, and rows nobody drew are written as zeros by their program;
- the result is deterministic (a fixed summation order: equal losses run to run, as the step tests compare);
- atomics serialise on hot rows: uniform draws hit a 100K-row table ~20 times per row, but the positives
  (popular targets) and popularity-skewed samplers put thousands of pairs on a few rows, and a padded batch's
  padding positions all targeted one row; the segmented sum splits such a row over its D blocks instead (and,
  with ``split_segments``, into pieces of at most that many pairs);
- the pairs of one row gather rows of ``q`` (N x D, 64 MB at 16K x 1024 float32), which stay mostly in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE = 4096  # elements of a program's (rows x columns) register tile
# Accumulate each program's (rows x columns) products in a register tile and reduce it once after the loop, instead
# of reducing every iteration's tile (across warps: a shared-memory round trip and a barrier per iteration; ptxas
# for sm_90 shows the bf16 tile's rows spread over 4 warps, float32's over 2, and bf16's backward measured 3x slower
# than float32's on the H200). Not timed yet: off until ``benchmarks/gather_dot.py --variants fused fused2d`` says.
accumulate_2d = False
# ``dtable`` with at most this many pairs per program (0: one program per table row and D block, whatever its pair
# count). A row drawn very often (a popularity-skewed sampler's head items; before the padding fix, a graphed step's
# padding rows: 27 ms of a 42 ms step) is otherwise summed serially by its D/256 programs. On: the sorted pairs are
# cut into pieces at the rows' boundaries and every ``split_segments`` pairs, each piece summed by one program into a
# float32 partial, then each row's partials summed in order (deterministic; fixed sizes, no host sync). Costs a
# (rows + pairs / split_segments, D) float32 scratch and a second pass. H200 (``benchmarks/gather_dot.py --variants
# fused fusedsplit --hot-share 0.1`` / ``0``, BENCHMARKS.md): 3.9-4.3x faster than unsplit with 10% of the pairs on
# one row, 1.1-1.7x slower on uniform pairs, so off by default.
split_segments = 0


@triton.jit
def _gather_dot_fwd(Q, E, IDX, OUT, R, D, stride_q, stride_e, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                    ACC_2D: tl.constexpr):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    rows = tl.load(IDX + n * R + r, mask=r_ok, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    tile = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(Q + n * stride_q + d, mask=d_ok, other=0.0).to(tl.float32)
        e = tl.load(E + rows[:, None] * stride_e + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        if ACC_2D:
            tile += e.to(tl.float32) * q[None, :]
        else:
            acc += tl.sum(e.to(tl.float32) * q[None, :], 1)
    if ACC_2D:
        acc = tl.sum(tile, 1)
    tl.store(OUT + n * R + r, acc, mask=r_ok)


@triton.jit
def _gather_rows_sum(G, SRC, IDX, SEG, OUT, R, D, stride_src, stride_out, SORTED: tl.constexpr, BLOCK_P: tl.constexpr,
              BLOCK_D: tl.constexpr, ACC_2D: tl.constexpr):  # fmt: skip
    """OUT[s, d-block] = sum over the pairs p of segment s of G[pair] * SRC[source row]. SORTED: the pairs of s are
    IDX[SEG[s]:SEG[s+1]] (flat pair indices, sorted by table row), the source row pair // R (a row of q); else
    the pairs s*R .. s*R + R - 1, the source row IDX[pair] (a row of the table)."""
    s = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    if SORTED:
        lo = tl.load(SEG + s)
        hi = tl.load(SEG + s + 1)
    else:
        lo = s * R
        hi = lo + R
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    tile = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    for p0 in range(lo, hi, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        p_ok = p < hi
        if SORTED:
            pair = tl.load(IDX + p, mask=p_ok, other=0).to(tl.int64)
            src = pair // R
        else:
            pair = p
            src = tl.load(IDX + p, mask=p_ok, other=0).to(tl.int64)
        w = tl.load(G + pair, mask=p_ok, other=0.0).to(tl.float32)
        x = tl.load(SRC + src[:, None] * stride_src + d[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        if ACC_2D:
            tile += x.to(tl.float32) * w[:, None]
        else:
            acc += tl.sum(x.to(tl.float32) * w[:, None], 0)
    if ACC_2D:
        acc = tl.sum(tile, 0)
    tl.store(OUT + s * stride_out + d, acc.to(OUT.dtype.element_ty), mask=d_ok)


_fwd = _gather_dot_fwd  # the name the tests' interpreter fixture checks (tests/ops/conftest.py)


def tiles(width: int, count: int, tile: int = TILE) -> tuple[int, int]:
    """(BLOCK over ``count`` (pairs or columns of R), BLOCK_D): up to 256 columns, ``tile`` elements per program."""
    block_d = min(triton.next_power_of_2(max(width, 1)), 256)
    return max(1, min(triton.next_power_of_2(max(count, 1)), tile // block_d)), block_d


def _warps(block: int, block_d: int) -> int:
    return 8 if block * block_d >= 8192 else 4


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gather_dot_forward(q: Tensor, table: Tensor, idx: Tensor, tile: int = TILE) -> Tensor:
    """(N, R) float32 logits ``q[n] . table[idx[n, r]]``; ``q`` (N, D), ``table`` (rows, D) with unit column
    stride (any row stride), ``idx`` (N, R) int32/int64 in [0, rows)."""
    q, table, idx = _rows(q), _rows(table), idx.contiguous()
    (n, r), d = idx.shape, q.shape[1]
    out = torch.empty((n, r), dtype=torch.float32, device=q.device)
    block_r, block_d = tiles(d, r, tile)
    if n and r:
        _gather_dot_fwd[(n, triton.cdiv(r, block_r))](q, table, idx, out, r, d, q.stride(0), table.stride(0),
                                                      BLOCK_R=block_r, BLOCK_D=block_d, ACC_2D=accumulate_2d,
                                                      num_warps=_warps(block_r, block_d))  # fmt: skip
    return out


def gather_rows_sum(g: Tensor, table: Tensor, idx: Tensor, tile: int = TILE) -> Tensor:
    """(N, D) ``sum_r g[n, r] * table[idx[n, r]]`` in ``table``'s dtype (float32 sums): the forward's ``dq``."""
    table, idx, g = _rows(table), idx.contiguous(), g.contiguous()
    (n, r), d = idx.shape, table.shape[1]
    out = torch.empty((n, d), dtype=table.dtype, device=table.device)
    block_p, block_d = tiles(d, r, tile)
    if n:
        _gather_rows_sum[(n, triton.cdiv(d, block_d))](g, table, idx, idx, out, r, d, table.stride(0), out.stride(0),
                                                SORTED=False, BLOCK_P=block_p, BLOCK_D=block_d, ACC_2D=accumulate_2d,
                                                num_warps=_warps(block_p, block_d))  # fmt: skip
    return out


def sort_pairs(idx: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """(order, segments): the flat (n, r) pair indices sorted by table row (stable: a fixed summation order), and
    (num_rows + 1,) offsets of each row's pairs in ``order``. No host sync (fixed sizes)."""
    flat = idx.reshape(-1)
    keys = flat.to(torch.int32) if num_rows < 2**31 else flat
    sorted_keys, order = torch.sort(keys, stable=True)
    bounds = torch.arange(num_rows + 1, device=idx.device, dtype=keys.dtype)
    return order, torch.searchsorted(sorted_keys, bounds)


def scatter_rows_sum(g: Tensor, q: Tensor, idx: Tensor, num_rows: int, tile: int = TILE) -> Tensor:
    """(num_rows, D) ``dtable[e] = sum_{idx[n, r] = e} g[n, r] * q[n]`` in ``q``'s dtype (float32 sums, every row
    written once, zeros where no pair points): the forward's ``dtable``. Indices outside [0, num_rows) add nothing."""
    q, g = _rows(q), g.contiguous()
    r, d = idx.shape[1], q.shape[1]
    order, segments = sort_pairs(idx, num_rows)
    out = torch.empty((num_rows, d), dtype=q.dtype, device=q.device)
    if num_rows and split_segments > 0:
        return _split_rows_sum(g, q, order, segments, out, r, split_segments, tile)
    block_p, block_d = tiles(d, max(1, idx.numel() // max(num_rows, 1)), tile)
    if num_rows:
        _gather_rows_sum[(num_rows, triton.cdiv(d, block_d))](g, q, order, segments, out, r, d, q.stride(0), out.stride(0),
                                                       SORTED=True, BLOCK_P=block_p, BLOCK_D=block_d,
                                                       ACC_2D=accumulate_2d,
                                                       num_warps=_warps(block_p, block_d))  # fmt: skip
    return out


def _split_rows_sum(g: Tensor, q: Tensor, order: Tensor, segments: Tensor, out: Tensor, r: int, chunk: int,
                    tile: int) -> Tensor:  # fmt: skip
    """``scatter_rows_sum``'s pass with ``split_segments``: pieces of at most ``chunk`` sorted pairs (cut at every row
    boundary and every ``chunk`` pairs) summed into float32 partials, then each row's partials (contiguous) summed."""
    d, pairs = q.shape[1], order.numel()
    cuts = torch.arange(0, pairs, chunk, device=q.device, dtype=segments.dtype)  # ceil(pairs / chunk): a fixed size
    bounds = torch.sort(torch.cat([segments, cuts])).values  # (pieces + 1,) piece i = sorted pairs [b_i, b_i+1)
    pieces = bounds.numel() - 1
    partials = torch.empty((pieces, d), dtype=torch.float32, device=q.device)
    block_p, block_d = tiles(d, min(chunk, max(1, pairs)), tile)
    _gather_rows_sum[(pieces, triton.cdiv(d, block_d))](g, q, order, bounds, partials, r, d, q.stride(0),
                                                         partials.stride(0), SORTED=True, BLOCK_P=block_p,
                                                         BLOCK_D=block_d, ACC_2D=accumulate_2d,
                                                         num_warps=_warps(block_p, block_d))  # fmt: skip
    # row e's pieces are those starting in [segments[e], segments[e + 1]): contiguous in ``bounds``
    starts = torch.searchsorted(bounds, segments)  # (rows + 1,)
    ones = torch.ones(pieces, dtype=torch.float32, device=q.device)
    ident = torch.arange(pieces, device=q.device)
    block_p, block_d = tiles(d, 2, tile)
    _gather_rows_sum[(out.shape[0], triton.cdiv(d, block_d))](ones, partials, ident, starts, out, 1, d,
                                                               partials.stride(0), out.stride(0), SORTED=True,
                                                               BLOCK_P=block_p, BLOCK_D=block_d, ACC_2D=accumulate_2d,
                                                               num_warps=_warps(block_p, block_d))  # fmt: skip
    return out


class GatherDot(torch.autograd.Function):
    """``gather_dot_forward`` with its gradients (eager calls: less host time than the custom op)."""

    @staticmethod
    def forward(ctx, q: Tensor, table: Tensor, idx: Tensor) -> Tensor:
        ctx.save_for_backward(q, table, idx)
        return gather_dot_forward(q, table, idx)

    @staticmethod
    def backward(ctx, g: Tensor):
        q, table, idx = ctx.saved_tensors
        dq = gather_rows_sum(g, table, idx) if ctx.needs_input_grad[0] else None
        dtable = scatter_rows_sum(g, q, idx, table.shape[0]) if ctx.needs_input_grad[1] else None
        return dq, dtable, None


__all__ = ["GatherDot", "gather_dot_forward", "gather_rows_sum", "scatter_rows_sum", "sort_pairs", "tiles"]
