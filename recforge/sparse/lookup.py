"""The CUDA lookup path of a table: deduplicate raw IDs, find their rows and count them, before one host sync.

For flat ids (N,) sorted once (``torch.sort``), three Triton kernels (behind ``plan_lookup``)
do everything that does not need the distinct count U on the host, so the step's one
synchronisation (``facts.tolist()``) waits on GPU work the CPU has already queued::

    sorted ids (N,)  [5, 5, 7, 9, 9, 9]      order: position of each sorted id in the input
    groups           [0, 0, 1, 2, 2, 2]      cumsum of run starts
    keys[:U]         [5, 7, 9]               distinct ids ascending; rows[:U]: their rows (-1: none)
    seg[:U]          [0, 2, 3]               first sorted position of each distinct id (seg[U] = N)
    inverse (N,)     distinct index of each input id;  facts (4,): U, #distinct without a row, min id, max run

``touch`` adds each distinct row's occurrences to its counters and stamps its step and time
(the eviction policies' inputs) in the same pass. ``row_gradients`` sums the (N, d) output
gradient into (U, d) per distinct id along the same sort (a segment sum, one kernel) when no id
repeats more than ``SEGMENT_MAX`` times, else with PyTorch's embedding backward: both are
deterministic, so a tiered table stays bit-identical to a one-tier one.

The torch path (``DynamicEmbedding._unique_lookup``) computes the same with torch ops; tests
compare the two under Triton's interpreter.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import torch
from torch import Tensor

SEGMENT_MAX = 64  # longest run of one id the segment-sum kernel takes (longer: PyTorch's embedding backward)
_BLOCK = 1024


@dataclass
class LookupPlan:
    """Device buffers of one lookup (sized N; the first U entries are valid once ``facts`` is read)."""

    keys: Tensor  # (N,) distinct ids ascending
    rows: Tensor  # (N,) row of each distinct id, -1 without one
    occurrences: Tensor  # (N,) how often each distinct id occurs
    seg: Tensor  # (N + 1,) first sorted position of each distinct id
    order: Tensor  # (N,) input position of each sorted id
    inverse: Tensor  # (N,) distinct index of each input id
    facts: Tensor  # (4,) int64: U, distinct ids without a row, smallest id, longest run

    def row_gradients(self, grad: Tensor, num_distinct: int, longest_run: int) -> Tensor:
        """(U, d): ``grad`` (N, d) summed per distinct id (``F.embedding(inverse, ·)``'s backward)."""
        grad = grad.contiguous()
        if longest_run > SEGMENT_MAX or grad.dtype != torch.float32:
            return torch.ops.aten.embedding_dense_backward(grad, self.inverse, num_distinct, -1, False)
        out = torch.empty(num_distinct, grad.shape[1], dtype=grad.dtype, device=grad.device)
        if num_distinct == 0:
            return out
        block_d = 1 << max(0, grad.shape[1] - 1).bit_length()
        groups = max(1, 2048 // block_d)
        _kernels()[2][(math.ceil(num_distinct / groups),)](
            grad, self.order, self.seg, out, num_distinct, self.order.numel(), grad.shape[1], longest_run,
            GROUPS=groups, BLOCK_D=block_d,
        )  # fmt: skip
        return out


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def dedup_kernel(S, ORDER, CS, LO, IK, IV, FOUND, KEYS, ROWS, SEG, INV, FACTS, n, n_index,
                     HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        s = tl.load(S + i, mask=m, other=0)
        prev = tl.load(S + i - 1, mask=m & (i > 0), other=0)
        start = m & ((i == 0) | (s != prev))
        g = tl.load(CS + i - 1, mask=m & (i > 0), other=0)  # CS: cumsum of run starts after position 0
        if HAS_INDEX:  # sorted index, untagged: searchsorted position -> value where the key matches
            p = tl.minimum(tl.load(LO + i, mask=m, other=0), n_index - 1)
            hit = m & (n_index > 0)
            k = tl.load(IK + p, mask=hit, other=0)
            found = tl.where(hit & (k == s), tl.load(IV + p, mask=hit, other=-1), -1)
        else:
            found = tl.load(FOUND + i, mask=m, other=-1)
        o = tl.load(ORDER + i, mask=m, other=0)
        tl.store(INV + o, g, mask=m)
        tl.store(KEYS + g, s, mask=start)
        tl.store(ROWS + g, found, mask=start)
        tl.store(SEG + g, i.to(tl.int64), mask=start)
        tl.atomic_add(FACTS + 1, tl.sum((start & (found < 0)).to(tl.int64), axis=0))
        tl.store(FACTS + 0 + i * 0, g + 1, mask=m & (i == n - 1))
        tl.store(FACTS + 2 + i * 0, s, mask=m & (i == 0))

    @triton.jit(do_not_specialize=["step", "now_bits"])
    def touch_kernel(SEG, ROWS, OCC, FACTS, COUNT, LAST_STEP, LAST_TIME, n, step, now_bits,
                     TOUCH: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        u = tl.load(FACTS + 0)
        m = g < u
        first = tl.load(SEG + g, mask=m, other=0)
        nxt = tl.load(SEG + g + 1, mask=m & (g + 1 < u), other=n)
        occ = tl.where(g + 1 < u, nxt, n) - first
        tl.store(OCC + g, occ, mask=m)
        tl.atomic_max(FACTS + 3, tl.max(tl.where(m, occ, 0), axis=0))
        if TOUCH:  # distinct ids have distinct rows: no two lanes write one row
            r = tl.load(ROWS + g, mask=m, other=-1)
            t = m & (r >= 0)
            c = tl.load(COUNT + r, mask=t, other=0)
            tl.store(COUNT + r, c + occ, mask=t)
            tl.store(LAST_STEP + r, tl.zeros_like(r) + step, mask=t)
            now = (tl.zeros_like(r) + now_bits).to(tl.float64, bitcast=True)
            tl.store(LAST_TIME + r, now, mask=t)

    @triton.jit
    def segment_sum_kernel(G, ORDER, SEG, OUT, u, n, dim, longest, GROUPS: tl.constexpr, BLOCK_D: tl.constexpr):
        g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
        m = g < u
        first = tl.load(SEG + g, mask=m, other=0)
        end = tl.where(g + 1 < u, tl.load(SEG + g + 1, mask=m & (g + 1 < u), other=n), n)
        c = tl.arange(0, BLOCK_D)
        cmask = c < dim
        acc = tl.zeros((GROUPS, BLOCK_D), dtype=tl.float32)
        for j in range(longest):  # in sorted order: deterministic
            p = first + j
            valid = m & (p < end)
            src = tl.load(ORDER + p, mask=valid, other=0)
            acc += tl.load(G + src[:, None] * dim + c[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
        tl.store(OUT + g.to(tl.int64)[:, None] * dim + c[None, :], acc, mask=m[:, None] & cmask[None, :])

    return dedup_kernel, touch_kernel, segment_sum_kernel


def plan_lookup(flat: Tensor, index, counters=None, step: int = 0, now: float = 0.0) -> LookupPlan:
    """Queue the dedup, index lookup and (with ``counters``) touch of ``flat`` ids; no host sync.

    ``index``: the table's ``SortedIdIndex`` or ``IdHashTable``. ``counters``: the table's
    ``RowCounters`` to add this lookup to (training), or None.
    """
    from recforge.sparse.sorted_index import SortedIdIndex

    n = flat.numel()
    sorted_ids, order = torch.sort(flat)
    cs = torch.cumsum(sorted_ids[1:] != sorted_ids[:-1], 0)  # (N-1,) group of positions 1..N-1
    dev = flat.device
    keys, rows, occurrences = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(3))
    seg = torch.empty(n + 1, dtype=torch.int64, device=dev)
    inverse = torch.empty(n, dtype=torch.int64, device=dev)
    facts = torch.zeros(4, dtype=torch.int64, device=dev)
    direct = isinstance(index, SortedIdIndex) and not index.tagged
    if direct:
        lo, found = torch.searchsorted(index.keys, sorted_ids), sorted_ids
    else:
        lo, found = sorted_ids, index.lookup(sorted_ids, None)
    dedup_kernel, touch_kernel, _ = _kernels()
    grid = (math.ceil(n / _BLOCK),)
    cs = cs if cs.numel() else facts  # N = 1: never read
    dedup_kernel[grid](sorted_ids, order, cs, lo, index.keys if direct else lo, index.values if direct else lo, found,
                       keys, rows, seg, inverse, facts, n, index.keys.numel() if direct else 0,
                       HAS_INDEX=direct, BLOCK=_BLOCK)  # fmt: skip
    touch = counters is not None
    target = counters if touch else None
    now_bits = struct.unpack("<q", struct.pack("<d", float(now)))[0]
    touch_kernel[grid](seg, rows, occurrences, facts, target.count if touch else facts, target.last_step if touch else facts,
                       target.last_time if touch else facts, n, step, now_bits, TOUCH=touch, BLOCK=_BLOCK)  # fmt: skip
    return LookupPlan(keys, rows, occurrences, seg, order, inverse, facts)
