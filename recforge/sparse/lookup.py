"""The CUDA lookup path of a table: deduplicate raw IDs, find their rows and count them, before one host sync.

For flat ids (N,) sorted once (``torch.sort``), one Triton kernel (behind ``plan_lookup``) does
everything that does not need the distinct count U on the host, so the step's one
synchronisation (``facts.tolist()``) waits on GPU work the CPU has already queued::

    sorted ids (N,)  [5, 5, 7, 9, 9, 9]      order: position of each sorted id in the input
    groups           [0, 0, 1, 2, 2, 2]      cumsum of run starts
    keys[:U]         [5, 7, 9]               distinct ids ascending; rows[:U]: their rows (-1: none)
    seg[:U+1]        [0, 2, 3, 6]            first sorted position of each distinct id, then N
    occurrences[:U]  [2, 1, 3]               run lengths (the lane ending a run finds its start by binary search)
    inverse (N,)     distinct index of each input id;  row_of (N,): row of each input id
    facts (4,)       U, #distinct without a row, min id, max run

With counters (training) the same kernel adds each distinct row's occurrences to its counters and
stamps its step and time (the eviction policies' inputs). ``row_gradients`` sums the (N, d) output
gradient into (U, d) per distinct id along the same sort: one segment-sum kernel when no id repeats
more than ``SEGMENT_MAX`` times, else two (pieces of at most ``SEGMENT_MAX`` sorted positions, an id
of one piece written straight out, then each longer id's pieces in order). Each lane adds its rows
one by one, four loads in flight, and a program loops only as long as its longest segment: both
passes are deterministic, so a tiered table stays bit-identical to a one-tier one. The kernels are
in ``lookup_kernels.py``.

``mark_rows`` (prefetch) needs neither inverse nor counts: it marks the rows of all N ids in a
bitmap over the table's rows, without a sort.

The torch path (``DynamicEmbedding._unique_lookup``, for CUDA without Triton) computes the same
with torch ops; tests compare the kernels with ``torch.unique`` under Triton's interpreter.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from recforge.sparse.table import DynamicEmbedding

SEGMENT_MAX = 256  # runs up to this long: one segment-sum pass; longer: pieces of this many positions, then their sum
_BLOCK = 1024


@dataclass
class LookupPlan:
    """Device buffers of one lookup (sized N; the first U entries are valid once ``facts`` is read)."""

    keys: Tensor  # (N,) distinct ids ascending
    rows: Tensor  # (N,) row of each distinct id, -1 without one
    occurrences: Tensor  # (N,) how often each distinct id occurs
    seg: Tensor  # (N + 1,) first sorted position of each distinct id; seg[U] = N
    pieces: Tensor  # (N + 1,) pieces[0] = 0, pieces[g + 1]: ceil(occurrences[g] / SEGMENT_MAX) (two-pass sums)
    order: Tensor  # (N,) input position of each sorted id
    inverse: Tensor  # (N,) distinct index of each input id
    row_of: Tensor  # (N,) row of each input id, -1 without one (rows[inverse] without a gather)
    facts: Tensor  # (4,) int64: U, distinct ids without a row, smallest id, longest run
    piece: int  # SEGMENT_MAX when the plan was made

    def row_gradients(self, grad: Tensor, num_distinct: int, longest_run: int) -> Tensor:
        """(U, d): ``grad`` (N, d) summed per distinct id in sorted order (``F.embedding(inverse, ·)``'s backward)."""
        grad = grad.contiguous()
        if grad.dtype != torch.float32:  # the kernels accumulate float32 rows
            return torch.ops.aten.embedding_dense_backward(grad, self.inverse, num_distinct, -1, False)
        u, dim = num_distinct, grad.shape[1]
        out = torch.empty(u, dim, dtype=grad.dtype, device=grad.device)
        if u == 0:
            return out
        _, piece_sum_kernel, segment_sum_kernel = _kernels()
        block_d = 1 << max(0, dim - 1).bit_length()
        groups = max(1, 2048 // block_d)
        if longest_run <= self.piece:
            segment_sum_kernel[(math.ceil(u / groups),)](grad, self.order, self.seg, out, u, dim,
                                                         IDENTITY=False, GROUPS=groups, BLOCK_D=block_d)  # fmt: skip
            return out
        # a long run in one lane would serialise its whole sum: split every run into pieces of at
        # most `piece` sorted positions (summed in parallel), then sum each id's pieces in order
        piece_seg = torch.cumsum(self.pieces[: u + 1], 0)  # (U + 1,) first piece of each id; [U]: all pieces
        max_pieces = u + self.order.numel() // self.piece + 1  # sum of ceil(occ / piece) <= U + N / piece
        partial = torch.empty(max_pieces, dim, dtype=grad.dtype, device=grad.device)
        piece_sum_kernel[(math.ceil(max_pieces / groups),)](
            grad, self.order, self.seg, piece_seg, out, partial, u, dim, u.bit_length(), self.piece,
            GROUPS=groups, BLOCK_D=block_d,
        )  # fmt: skip
        segment_sum_kernel[(math.ceil(u / groups),)](partial, self.order, piece_seg, out, u, dim,
                                                     IDENTITY=True, GROUPS=groups, BLOCK_D=block_d)  # fmt: skip
        return out


@functools.cache
def _kernels():
    from recforge.sparse import lookup_kernels as k

    return k.dedup_kernel, k.piece_sum_kernel, k.segment_sum_kernel


def plan_lookup(flat: Tensor, index, counters=None, step: int = 0, now: float = 0.0) -> LookupPlan:
    """Queue the dedup, index lookup and (with ``counters``) counting of ``flat`` ids; no host sync.

    ``index``: the table's ``SortedIdIndex`` or ``IdHashTable``. ``counters``: the table's
    ``RowCounters`` to add this lookup to (training), or None.
    """
    from recforge.sparse.sorted_index import SortedIdIndex

    n = flat.numel()
    sorted_ids, order = torch.sort(flat)
    cs = torch.cumsum(sorted_ids[1:] != sorted_ids[:-1], 0)  # (N-1,) group of positions 1..N-1
    dev = flat.device
    keys, rows, occurrences, inverse, row_of = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(5))
    seg, pieces = (torch.empty(n + 1, dtype=torch.int64, device=dev) for _ in range(2))
    facts = torch.zeros(4, dtype=torch.int64, device=dev)
    direct = isinstance(index, SortedIdIndex) and not index.tagged
    if direct:
        lo, found = torch.searchsorted(index.keys, sorted_ids), sorted_ids
    else:
        lo, found = sorted_ids, index.lookup(sorted_ids, None)
    cs = cs if cs.numel() else facts  # N = 1: never read
    touch = counters is not None
    target = (counters.count, counters.last_step, counters.last_time) if touch else (facts, facts, facts)
    now_bits = struct.unpack("<q", struct.pack("<d", float(now)))[0]
    _kernels()[0][(math.ceil(n / _BLOCK),)](
        sorted_ids, order, cs, lo, index.keys if direct else lo, index.values if direct else lo, found,
        keys, rows, occurrences, seg, pieces, inverse, row_of, facts, *target,
        n, index.keys.numel() if direct else 0, n.bit_length(), SEGMENT_MAX, step, now_bits,
        HAS_INDEX=direct, TOUCH=touch, BLOCK=_BLOCK,
    )  # fmt: skip
    return LookupPlan(keys, rows, occurrences, seg, pieces, order, inverse, row_of, facts, SEGMENT_MAX)


def mark_rows(flat: Tensor, index, num_rows: int) -> Tensor:
    """(num_rows + 2,) bool: ``[2 + r]`` row r holds an id of ``flat``; ``[0]`` some id is negative; ``[1]`` some has no row.

    A prefetch needs neither the inverse nor counts: instead of a sort, the rows of all N ids (index
    lookups) are marked in a bitmap over the table's rows; no host synchronisation.
    """
    rows = index.lookup(flat, None)  # (N,) -1: no row
    mark = torch.zeros(num_rows + 2, dtype=torch.bool, device=flat.device)
    return mark.index_fill_(0, torch.where(flat < 0, 0, rows + 2), True)  # a negative id never marks a row


class GatherRows(torch.autograd.Function):
    """Forward: the cached rows at ``slots``. Backward: hand the (U, d) row gradient to the table."""

    @staticmethod
    def forward(ctx, anchor: Tensor, table: DynamicEmbedding, slots: Tensor, rows: Tensor) -> Tensor:
        ctx.table, ctx.rows, ctx.slots = table, rows, slots
        return table.store.weight.index_select(0, slots)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.table._pending.append((ctx.rows, ctx.slots, grad))  # slots stay valid: the step pinned them
        return None, None, None, None


class LookupIds(torch.autograd.Function):
    """``GatherRows`` + ``F.embedding(inverse, ·)`` in one node (the kernel path, every id with a row).

    Forward: each id's cached row (N, d), read once. Backward: the per-row gradient (U, d), duplicates
    summed along the lookup's sort (``LookupPlan.row_gradients``), handed to the table.
    """

    @staticmethod
    def forward(ctx, anchor: Tensor, table: DynamicEmbedding, slots: Tensor, rows: Tensor, plan: LookupPlan, longest: int,
                id_slots: Tensor) -> Tensor:  # fmt: skip
        ctx.table, ctx.rows, ctx.slots, ctx.plan, ctx.longest = table, rows, slots, plan, longest
        return table.store.weight.index_select(0, id_slots)  # (N, d)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_rows = ctx.plan.row_gradients(grad, ctx.rows.numel(), ctx.longest)  # (U, d)
        ctx.table._pending.append((ctx.rows, ctx.slots, grad_rows))
        return None, None, None, None, None, None, None
