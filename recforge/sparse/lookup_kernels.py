"""Triton kernels of the CUDA lookup path (lookup.py says what they compute); imported only where Triton is.

Module-level so that the kernels can call the ``_add_rows`` helper (Triton resolves a kernel's
callees among its module's globals).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["step", "now_bits"])
def dedup_kernel(S, ORDER, CS, LO, IK, IV, FOUND, KEYS, ROWS, OCC, SEG, PIECES, INV, ROW_OF, FACTS, COUNT, LAST_STEP, LAST_TIME,
                 n, n_index, search_steps, piece, step, now_bits,
                 HAS_INDEX: tl.constexpr, TOUCH: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(S + i, mask=m, other=0)
    prev = tl.load(S + i - 1, mask=m & (i > 0), other=0)
    nxt = tl.load(S + i + 1, mask=m & (i + 1 < n), other=0)
    start = m & ((i == 0) | (s != prev))
    end = m & ((i == n - 1) | (s != nxt))
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
    tl.store(ROW_OF + o, found, mask=m)
    tl.store(KEYS + g, s, mask=start)
    tl.store(ROWS + g, found, mask=start)
    tl.store(SEG + g, i.to(tl.int64), mask=start)
    # the lane ending a run finds the run's first position (maybe in another block) by binary search
    lo = tl.zeros_like(i)
    hi = i
    for _ in range(search_steps):  # 2**search_steps > n
        mid = (lo + hi) // 2
        right = tl.load(S + mid, mask=end, other=0) < s
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    occ = (i - lo + 1).to(tl.int64)
    tl.store(OCC + g, occ, mask=end)
    tl.store(PIECES + g + 1, (occ + piece - 1) // piece, mask=end)
    tl.store(PIECES + i * 0, occ * 0, mask=m & (i == 0))
    tl.store(SEG + g + 1, (i + 1).to(tl.int64), mask=m & (i == n - 1))
    tl.atomic_max(FACTS + 3, tl.max(tl.where(end, occ, 0), axis=0))
    tl.atomic_add(FACTS + 1, tl.sum((start & (found < 0)).to(tl.int64), axis=0))
    tl.store(FACTS + 0 + i * 0, g + 1, mask=m & (i == n - 1))
    tl.store(FACTS + 2 + i * 0, s, mask=m & (i == 0))
    if TOUCH:  # distinct ids have distinct rows: no two lanes write one row
        t = end & (found >= 0)
        r = tl.where(t, found, 0)
        c = tl.load(COUNT + r, mask=t, other=0)
        tl.store(COUNT + r, c + occ, mask=t)
        tl.store(LAST_STEP + r, tl.zeros_like(r) + step, mask=t)
        now = (tl.zeros_like(r) + now_bits).to(tl.float64, bitcast=True)
        tl.store(LAST_TIME + r, now, mask=t)


@triton.jit
def _add_rows(acc, G, ORDER, p, end, c, cmask, dim, IDENTITY: tl.constexpr):
    """acc + rows p, p+1, p+2, p+3 of G (through ORDER) where < end, added one by one (the four loads overlap)."""
    valid0, valid1, valid2, valid3 = p < end, p + 1 < end, p + 2 < end, p + 3 < end
    if IDENTITY:
        src0, src1, src2, src3 = p, p + 1, p + 2, p + 3
    else:
        src0 = tl.load(ORDER + p, mask=valid0, other=0)
        src1 = tl.load(ORDER + p + 1, mask=valid1, other=0)
        src2 = tl.load(ORDER + p + 2, mask=valid2, other=0)
        src3 = tl.load(ORDER + p + 3, mask=valid3, other=0)
    x0 = tl.load(G + src0[:, None] * dim + c[None, :], mask=valid0[:, None] & cmask[None, :], other=0.0)
    x1 = tl.load(G + src1[:, None] * dim + c[None, :], mask=valid1[:, None] & cmask[None, :], other=0.0)
    x2 = tl.load(G + src2[:, None] * dim + c[None, :], mask=valid2[:, None] & cmask[None, :], other=0.0)
    x3 = tl.load(G + src3[:, None] * dim + c[None, :], mask=valid3[:, None] & cmask[None, :], other=0.0)
    return acc + x0 + x1 + x2 + x3  # left to right: the sequential sum


@triton.jit(do_not_specialize=["u", "search_steps"])  # both vary per step: one compiled variant
def piece_sum_kernel(G, ORDER, SEG, PIECE_SEG, OUT, PARTIAL, u, dim, search_steps, piece,
                     GROUPS: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    q = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # piece index
    m = q < tl.load(PIECE_SEG + u)
    # the id of piece q: the largest g with PIECE_SEG[g] <= q (PIECE_SEG strictly increases)
    lo = tl.zeros_like(q)
    hi = tl.zeros_like(q) + (u - 1)
    for _ in range(search_steps):  # 2**search_steps > u
        mid = (lo + hi + 1) // 2
        left = tl.load(PIECE_SEG + mid, mask=m, other=0) <= q
        lo = tl.where(left, mid, lo)
        hi = tl.where(left, hi, mid - 1)
    own = tl.load(PIECE_SEG + lo, mask=m, other=0)
    single = m & (tl.load(PIECE_SEG + lo + 1, mask=m, other=0) - own == 1)  # the id's only piece: straight to OUT
    first = tl.load(SEG + lo, mask=m, other=0) + (q - own) * piece
    end = tl.where(m, tl.minimum(first + piece, tl.load(SEG + lo + 1, mask=m, other=0)), first)
    c = tl.arange(0, BLOCK_D)
    cmask = c < dim
    acc = tl.zeros((GROUPS, BLOCK_D), dtype=tl.float32)
    for j in range(0, tl.max(end - first, axis=0).to(tl.int32), 4):  # in sorted order: deterministic
        acc = _add_rows(acc, G, ORDER, first + j, end, c, cmask, dim, False)
    tl.store(OUT + lo.to(tl.int64)[:, None] * dim + c[None, :], acc, mask=single[:, None] & cmask[None, :])
    tl.store(PARTIAL + q.to(tl.int64)[:, None] * dim + c[None, :], acc, mask=(m & ~single)[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["u"])
def segment_sum_kernel(G, ORDER, SEG, OUT, u, dim, IDENTITY: tl.constexpr, GROUPS: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[g] = sum of G[ORDER[p]] (IDENTITY: G[p]) for p in [SEG[g], SEG[g + 1]); IDENTITY skips single rows
    (the second pass over pieces: an id of one piece has its sum already)."""
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    m = g < u
    first = tl.load(SEG + g, mask=m, other=0)
    end = tl.load(SEG + g + 1, mask=m, other=0)
    if IDENTITY:
        m = m & (end - first > 1)
    end = tl.where(m, end, first)
    c = tl.arange(0, BLOCK_D)
    cmask = c < dim
    acc = tl.zeros((GROUPS, BLOCK_D), dtype=tl.float32)
    for j in range(0, tl.max(end - first, axis=0).to(tl.int32), 4):  # in sorted order: deterministic
        acc = _add_rows(acc, G, ORDER, first + j, end, c, cmask, dim, IDENTITY)
    tl.store(OUT + g.to(tl.int64)[:, None] * dim + c[None, :], acc, mask=m[:, None] & cmask[None, :])
