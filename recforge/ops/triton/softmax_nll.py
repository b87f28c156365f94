"""Triton kernel for the sampled softmax's per-row loss and logit gradients in one pass over the logits.

    nll[t]      = logsumexp([pos[t] | s[t, :] masked]) - pos[t]
    grad[t, k]  = softmax(...)[1 + k] * share[t]        (0 at masked columns)
    grad_pos[t] = (softmax(...)[0] - 1) * share[t]

where column k is masked (-inf) when its item ``ids[t, k]`` (or ``ids[k]``, one row shared by every position) is the
row's target or the padding item 0. PyTorch (or Inductor) reads the (T, K) float32 logits twice for this, once
for the forward's logsumexp and once for the backward's softmax, and writes the gradient in between; here each
program keeps whole rows in registers (K <= ``WHOLE_ROW``; several rows at once when K is small) and reads them
once, so the pass costs one read of the logits and one write of the gradient (bfloat16 for the loss's bf16 gradient
matmuls: half the bytes). Rows wider than ``WHOLE_ROW`` take two passes over their columns (an online logsumexp,
then the gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

WHOLE_ROW = 16384  # widest row a program holds in registers (one read of the logits); wider rows are read twice
# Launch configurations: (elements of a program's (rows x columns) register tile, several rows at once when they are
# narrow; row blocks per program; warps; a shared draw's ids kept in registers for all of them). Wide rows (the MFU
# benchmark's 8,192 shared columns, or more) and narrow ones (the paper's 129 per-position columns), as
# ``benchmarks/softmax_nll.py`` measured them on an H200 (BENCHMARKS.md, 25th session): wide 0.93 ms at 64K x 8,192
# (3.5 TB/s; a program of 4 rows x 4 blocks: 1.27 ms), narrow 0.12 ms at 64K x 129 (one row block per program, 4
# warps: 0.17 ms)
WIDE, NARROW = (16384, 1, 16, True), (8192, 4, 4, True)


@triton.jit
def _ids(IDS, rows, c, ok, stride_ids):
    """The columns' items for a (rows x columns) tile: each row's own, or (stride 0) the shared ones."""
    return tl.load(IDS + rows[:, None] * stride_ids + c, mask=ok, other=0)


@triton.jit
def _logits(S, rows, c, ok, stride_s, ids, tgt):
    """A (rows x columns) tile of logits in float32, -inf where the column's item is the row's target or padding."""
    s = tl.load(S + rows[:, None] * stride_s + c, mask=ok, other=float("-inf")).to(tl.float32)
    return tl.where((ids == tgt) | (ids == 0), float("-inf"), s)


@triton.jit
def _softmax_nll(S, POS, IDS, TGT, SHARE, NLL, G, GPOS, T, K, stride_s, stride_ids, stride_g,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr, TILES: tl.constexpr,
                 IDS_ONCE: tl.constexpr, HAS_SHARE: tl.constexpr):  # fmt: skip
    cols = tl.arange(0, BLOCK_K)[None, :]
    if IDS_ONCE:  # the shared draw's ids (stride_ids 0) in registers, reused by every row of the program
        ids = tl.load(IDS + cols, mask=cols < K, other=0)
    for i in range(GROUPS):
        rows = (tl.program_id(0).to(tl.int64) * GROUPS + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = rows < T
        pos = tl.load(POS + rows, mask=live, other=0.0).to(tl.float32)
        tgt = tl.load(TGT + rows, mask=live, other=0)[:, None]
        share = tl.load(SHARE + rows, mask=live, other=0.0).to(tl.float32) if HAS_SHARE else 1.0
        if TILES == 1:  # whole rows in registers: the logits read once
            ok = (cols < K) & live[:, None]
            if IDS_ONCE:
                s = _logits(S, rows, cols, ok, stride_s, ids, tgt)
            else:  # each row's own ids (stride_ids > 0), or the shared ones again (from L1/L2)
                s = _logits(S, rows, cols, ok, stride_s, _ids(IDS, rows, cols, ok, stride_ids), tgt)
            top = tl.maximum(tl.max(s, 1), pos)
            e = tl.exp(s - top[:, None])
            total = tl.sum(e, 1) + tl.exp(pos - top)
            g = e * (share / total)[:, None]
            tl.store(G + rows[:, None] * stride_g + cols, g.to(G.dtype.element_ty), mask=ok)
        else:  # an online logsumexp over the rows' column tiles, then the gradient from a second read
            top = pos
            total = tl.full((BLOCK_M,), 1.0, tl.float32)
            for j in range(TILES):
                c = j * BLOCK_K + cols
                ok = (c < K) & live[:, None]
                s = _logits(S, rows, c, ok, stride_s, _ids(IDS, rows, c, ok, stride_ids), tgt)
                new_top = tl.maximum(top, tl.max(s, 1))
                total = total * tl.exp(top - new_top) + tl.sum(tl.exp(s - new_top[:, None]), 1)
                top = new_top
            for j in range(TILES):
                c = j * BLOCK_K + cols
                ok = (c < K) & live[:, None]
                s = _logits(S, rows, c, ok, stride_s, _ids(IDS, rows, c, ok, stride_ids), tgt)
                g = tl.exp(s - top[:, None]) * (share / total)[:, None]
                tl.store(G + rows[:, None] * stride_g + c, g.to(G.dtype.element_ty), mask=ok)
        p_pos = tl.exp(pos - top) / total
        tl.store(NLL + rows, top + tl.log(total) - pos, mask=live)
        tl.store(GPOS + rows, (p_pos - 1.0) * share, mask=live)


_fwd = _softmax_nll  # the name the tests' interpreter fixture checks (tests/ops/conftest.py)


def softmax_nll(logits: Tensor, pos: Tensor, ids: Tensor, targets: Tensor, share: Tensor | None,
                grad_dtype: torch.dtype, config: tuple[int, int, int, bool] | None = None,
                ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(nll (T,), grad (T, K) ``grad_dtype``, grad_pos (T,)) of ``recforge.ops.softmax_nll.softmax_nll`` (same
    contract; inputs checked there). ``config``: (elements of a row block, row blocks per program, warps, shared ids
    kept in registers) instead of ``WIDE`` / ``NARROW`` (``benchmarks/softmax_nll.py`` times them)."""
    num, k = logits.shape
    nll = pos.new_empty(num, dtype=torch.float32)
    grad_pos = torch.empty_like(nll)
    grad = logits.new_empty((num, k), dtype=grad_dtype)
    if num == 0:
        return nll, grad, grad_pos
    logits, ids = (x if x.stride(-1) == 1 else x.contiguous() for x in (logits, ids))  # rows read with unit stride
    pos, targets, share = (None if x is None else x.contiguous() for x in (pos, targets, share))  # indexed by row
    block = min(triton.next_power_of_2(max(k, 1)), WHOLE_ROW)
    per_row = ids.dim() == 2
    tile, groups, warps, ids_once = config or (WIDE if block >= 4096 else NARROW)
    block_m = max(1, min(tile // block, triton.next_power_of_2(num)))
    _softmax_nll[(triton.cdiv(num, block_m * groups),)](
        logits, pos, ids, targets, pos if share is None else share, nll, grad, grad_pos, num, k, logits.stride(0),
        ids.stride(0) if per_row else 0, grad.stride(0), BLOCK_M=block_m, BLOCK_K=block, GROUPS=groups,
        TILES=triton.cdiv(k, block), IDS_ONCE=ids_once and not per_row and block >= k,
        HAS_SHARE=share is not None, num_warps=warps,
    )  # fmt: skip
    return nll, grad, grad_pos
