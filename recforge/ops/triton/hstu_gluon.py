"""The HSTU attention in Gluon for Hopper (sm_90): warp-specialized, TMA-fed, asynchronous wgmma; forward and backward.

    out_i = scale * sum_{j <= i} SiLU(q_i . k_j) v_j        (causal mask, no relative bias)

Why next to the Triton kernels: Triton's compiler waits on every wgmma right after issuing it, so one warpgroup's
tensor cores idle through its SiLU, and ``tl.range(warp_specialize=True)`` does nothing on sm_90. Gluon (``triton
.experimental.gluon``, Triton >= 3.6) states the schedule itself. The kernels run in the block-major grid of the
Triton kernels (sequences longest first via ``seq_order``): a 1-warp loader streams tiles by TMA into a ring of stages
(ready/empty mbarriers) while two 4-warp consumer warpgroups own 64 rows each and walk the same tiles, so one
warpgroup's SiLU runs while the other's wgmmas do. The dK/dV kernel has one program per (block of 128 keys, sequence,
head), a group's longest walk first. The forward and dQ kernels have one per (``GROUP`` pairs of 128-row blocks,
sequence, head): blocks nbs - 1 - p and p of the sequence's nbs (and of pair p + per_group), in one ring, so that
every program of a sequence walks the same number of tiles (nbs + 1 per pair); their Q (and dO) tiles have two
buffers where shared memory allows (``FORWARD_QBUF``, ``DQ_QBUF``), so the next block's load runs during this one's
loop. Within each consumer of these two kernels a tile's S (and dP) is issued before the previous tile's second
product (``_rows``: FlashAttention-3's intra-warpgroup overlap; each consumer holds two stages, hence four), and a
warpgroup stops at its own diagonal tile (with 64-key tiles, the first one's rows skip the block's last tile). The
forward stores its whole 64-row output tiles by TMA from shared memory (the buffer the backward's pre-activation
tiles use), masked stores only for a sequence's last rows (27th session).

On an H200 (GPU time through the op, jagged 64K-token batches, 29th session) the overlap and the second Q buffer took
the forward 1.10-1.21x at head dims 64 and 128 (with 64-key tiles there; L 1,024-8,192), and dQ 1.07-1.10x at 128
(1.11-1.17x at 64 with its second Q/dO buffer). They replaced the forward consumers' ping-pong turns (28th session;
with the overlap 0.99x at head dim 128, 0.93-0.98x at 64) and its half-width diagonal tile (27th session; at 128 the
first warpgroup now skips the block's last 64-key tile instead, at 64 it multiplies the whole 128-key diagonal tile).
The dK/dV kernel lost on the same overlap (0.97-0.99x at head dim 64; 0.70-0.81x at 128, where ptxas spills 300
bytes).

- Forward (query rows; K/V tiles of ``FORWARD_KEYS``): S = Q K^T, P = SiLU(S), O += P V.
- Backward, dK/dV (key rows; K and V loaded once, 64-row Q/dO tiles streamed): S^T = K Q^T and dP^T = V dO^T
  issued together, P^T and dS^T in registers feed dV += P^T dO and dK += dS^T Q.
- Backward, dQ (query rows; Q and dO loaded once, 64-key K/V tiles streamed): S = Q K^T and dP = dO V^T issued
  together, dQ += dS K. The forward and dQ share one row-block program (``_row_blocks``, ``GRAD``). Two kernels
  instead of one with dQ summed by float32 atomics: each is deterministic, and the atomics variant measured
  0.89-0.97x the Triton backward (the atomics' L2 traffic; BENCHMARKS.md, 23rd session).

Against the Triton kernels (29th session, GPU time): the forward 1.17x at head dim 128 from L 256 and 1.10-1.26x at
64 from 1,024 (level below: ``FORWARD_MIN_LEN``); the backward faster at 128 from L 512 and at 64 from 4,096 (at 64
up to 2,048 Triton's is: ``MIN_LEN``). At head dim 64 the SiLU's tanh (MUFU) costs ~20% of the forward's time (28th
session); tanh in bf16x2 was slower (the conversions). The variants that lost are in BENCHMARKS.md.

The hot path only (``supported``): CUDA sm_90, bf16/fp16, head dims 64 or 128 (q/k and v alike), a plain causal
mask (no targets, contextual tokens, segments, window or timestamps), no relative bias (so no bias gradients), heads
packed in each row (stride(1) == D, the layout of ``(T, H, D)`` tensors and of slices of a fused projection).
``RECFORGE_GLUON_HSTU=0`` turns both directions off. dS carries the factor 2 / scale of the Triton kernels
(``recforge.ops.triton.hstu``), taken out once when dK and dQ are stored.

The backward's ``SILU`` variant (``hstu_backward_gluon(pre=...)``, for ``recforge.ops.triton.hstu_silu``: q, k, v are
the SiLU of an HSTU projection's columns x) stores dQ SiLU'(x_q), dK SiLU'(x_k), dV SiLU'(x_v) straight into the
projection's gradient; the loader prefetches the x tiles by TMA after the loop's first tile (dK/dV) or after its
last (dQ, as the next block's come after them). Those bytes cost each program its share (the two kernels 1.04x at
L 8192 to 1.24x at 1,024 against plain stores on an H200) but save a pass over the whole projection (BENCHMARKS.md,
24th session); issuing them later in the loop measured the same.

Rows of another sequence that a TMA tile reads only meet rows or keys past the causal diagonal (masked) or past the
sequence's end (masked where they would reach a stored row; never stored: outputs are written with masked stores), and
rows past the tensor read as zeros.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.env import gluon_hstu
from recforge.ops.triton._common import MaskArgs

try:  # Triton >= 3.6 (the layout of the module differs in older releases)
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

BLOCK_ROWS = 64  # rows per consumer warpgroup (two per program); the backward's Q/dO and K/V tiles
FORWARD_KEYS = {128: 64, 64: 128}  # head dim -> keys per K/V tile of the forward (at 64, 64-key tiles: 1.03-1.09x at
# L 512-1,024, 0.90-0.98x from 2,048; at 128 four 128-key stages do not fit)
FORWARD_STAGES = 4  # the forward's K/V ring depth (its consumers hold two stages each: ``_rows``; 3 at 64: 0.96x)
FORWARD_QBUF = 2  # buffers of the forward's Q tiles (``_row_blocks``; 1.03-1.14x over one)
DKDV_STAGES = {128: 2, 64: 3}  # head dim -> the dK/dV kernel's ring depth (3 at 64: 1.00-1.03x; at 128 level)
DQ_STAGES = {128: 4, 64: 4}  # head dim -> the dQ kernel's (its consumers hold two stages each, as the forward's)
DQ_QBUF = {128: 1, 64: 2}  # head dim -> buffers of the dQ kernel's Q and dO tiles (at 128 two would not fit with
# four stages and the SILU tiles in the 227 KiB of shared memory)
# head dim (q/k and v alike) -> the shortest max_seq_len whose forward takes these kernels (29th session, H200): at
# 128 from the shortest measured (1.17x at L 256); at 64 Triton's is level at 512
FORWARD_MIN_LEN = {128: 256, 64: 1024}
# head dim -> the same for the backward (and so the HSTU block's SiLU + attention op: ``min_len``): at 128 level with
# Triton's at L 256, faster from 512; at 64 slower up to 2,048, faster from 4,096 (28th, 29th sessions)
MIN_LEN = {128: 512, 64: 4096}
GROUP = triton.language.constexpr(2)  # pairs of row blocks per program of the forward and dQ kernels (``_items``)


def min_len(device: torch.device, dtype: torch.dtype, dqk: int, dv: int, forward: bool = False) -> int | None:
    """The shortest ``max_seq_len`` from which calls on ``device`` with these dtype and head dims take these kernels'
    backward (``forward``: their forward), given a plain causal mask, no relative bias and TMA-readable tensors
    (``supported``), or None if none do; the switch included. ``recforge.ops.hstu_attention`` routes the HSTU block's
    SiLU + attention op by the backward's."""
    if gluon_hstu() is False or not AVAILABLE or device.type != "cuda":  # the switch first: a typo in it raises
        return None  # wherever it runs
    if dqk != dv or dqk not in MIN_LEN or dtype not in (torch.bfloat16, torch.float16):
        return None
    if torch.cuda.get_device_capability(device) != (9, 0):
        return None
    return FORWARD_MIN_LEN[dqk] if forward else MIN_LEN[dqk]


def supported(q: Tensor, k: Tensor, v: Tensor, max_seq_len: int, ma: MaskArgs, pos_w: Tensor | None,
              time_w: Tensor | None, forward: bool = False) -> bool:  # fmt: skip
    """Whether ``hstu_backward_gluon`` (``forward``: ``hstu_forward_gluon``) computes this call (see the module
    docstring), the switch included."""
    shortest = min_len(q.device, q.dtype, q.shape[2], v.shape[2], forward)
    if shortest is None or max_seq_len < shortest or pos_w is not None or time_w is not None:
        return False
    if not ma.causal or ma.has_targets or ma.has_contextual or ma.has_window or ma.has_ts or ma.num_segments:
        return False
    return all(tma_ready(x, q.dtype) for x in (q, k, v))


def tma_ready(x: Tensor, dtype: torch.dtype) -> bool:
    """``x`` ((T, H, D), D in ``MIN_LEN``) is a ``dtype`` tensor the kernels' TMA descriptors can read: heads packed in
    each row (stride(1) == D, stride(2) == 1) and 16-byte aligned rows and base."""
    if x.dtype != dtype or x.shape[2] not in MIN_LEN or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        return False
    return x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0


if AVAILABLE:
    # ---- shared: the SiLU, masks, the grid, barriers and stores ------------------------------------------------------

    @gluon.jit
    def _tanh(x):
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _silu_grad(s, dp):
        """(SiLU(s), dS * 2 / scale = dP * 2 SiLU'(s)) from h = s / 2: SiLU(s) = h (1 + tanh h), 2 SiLU'(s) =
        (1 + tanh h)(1 + h (1 - tanh h)). The fma form, not h + h * tanh h: that one crashes LLVM's SLP vectorizer in
        Triton 3.7.1 (after the inline tanh and a conditional mask)."""
        h = s * 0.5
        t = _tanh(h)
        return gl.fma(h, t, h), dp * ((1.0 + t) * gl.fma(h, 1.0 - t, 1.0))

    @gluon.jit
    def _causal(t, jb, i_lo, layout: gl.constexpr):
        """Tile ``t`` of rows i_lo ... and key tile ``jb`` with each row's later keys zeroed, if the tile crosses the
        diagonal (keys past the sequence's end only meet rows past it, never stored)."""
        rows: gl.constexpr = t.shape[0]
        BN: gl.constexpr = t.shape[1]
        if jb * BN + BN - 1 > i_lo:
            i = i_lo + gl.arange(0, rows, layout=gl.SliceLayout(1, layout))
            j = jb * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
            t = gl.where(j[None, :] <= i[:, None], t, 0.0)
        return t

    @gluon.jit
    def _program(offsets, seq_order, num_heads, len_key, BLOCK: gl.constexpr, D: gl.constexpr, SEQ_ORDER: gl.constexpr,
                 PAIRS: gl.constexpr):
        """(block index, programs per sequence and head, first token, length, column of the head) of this program in the
        block-major grid of ``recforge.ops.triton.tuning.launch`` (``_common.block_of_program`` / ``sequence_of_rank``
        in Gluon); ``PAIRS``: of a grid of programs of ``GROUP`` pairs of blocks, (program index p, ...) (``_items``,
        ``_row_block``)."""
        per_group = gl.cdiv(len_key, BLOCK)
        if PAIRS:
            per_group = gl.cdiv(gl.cdiv(per_group, 2), GROUP)
        pid = gl.program_id(0)
        bh = pid // per_group
        b = bh // num_heads
        if SEQ_ORDER:
            b = gl.load(seq_order + b).to(gl.int32)
        start = gl.load(offsets + b).to(gl.int32)
        n = (gl.load(offsets + b + 1) - start).to(gl.int32)
        return pid % per_group, per_group, start, n, (bh % num_heads) * D

    @gluon.jit
    def _items(p, nbs, per_group):
        """How many row blocks program ``p`` of a sequence of ``nbs`` blocks holds: its pairs p, p + per_group, ...
        (``GROUP`` at most, those under cdiv(nbs, 2)), two blocks each but an odd nbs's middle block alone."""
        pairs = gl.minimum(gl.cdiv(gl.cdiv(nbs, 2) - p, per_group), GROUP)
        last = p + (pairs - 1) * per_group
        return 2 * pairs - (2 * last + 1 == nbs).to(gl.int32)

    @gluon.jit
    def _row_block(p, nbs, it, per_group):
        """Row block ``it`` of program ``p``: of its pair pp = p + (it // 2) per_group, nbs - 1 - pp then pp (the
        longer key walk first)."""
        pp = p + (it // 2) * per_group
        return nbs - 1 - pp - (it % 2) * (nbs - 1 - 2 * pp)

    @gluon.jit
    def _barriers(STAGES: gl.constexpr, QBUF: gl.constexpr):
        """(ready, empty, once): the ring's mbarriers (both consumers release a stage) and those of the tiles loaded
        once per block: loaded, those the loop needs (0 ... QBUF - 1: one per buffer of them) and those only the
        stores need (QBUF: the pre-activation tiles of ``SILU``); released by both consumers, the loop's (QBUF + 1 ...
        2 QBUF) and the stores' (2 QBUF + 1), before a later block's (the row kernels' pairs; the dK/dV kernel's
        programs have one block and QBUF 1: 0 loaded, 1 the stores' loaded)."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        once = gl.allocate_shared_memory(gl.int64, [2 * QBUF + 2, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(empty.index(st), count=2)
        for b in gl.static_range(QBUF + 1):
            mbarrier.init(once.index(b), count=1)
            mbarrier.init(once.index(QBUF + 1 + b), count=2)
        fence_async_shared()
        return ready, empty, once

    @gluon.jit
    def _store_rows(ptr, stride, start, n, r0, col, acc, factor, x_s, SILU: gl.constexpr):
        """``acc * factor`` into rows r0 ... of the sequence in a (T, H * D) output; rows past its end untouched.
        ``SILU``: times SiLU'(x), x the tile of the pre-activation whose SiLU was the kernel's input, prefetched into
        shared memory ``x_s`` by the loader: the gradient of x."""
        layout: gl.constexpr = acc.type.layout
        r = r0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
        c = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
        rows = (start + r)[:, None].to(gl.int64)
        keep = (r < n)[:, None]
        val = acc * factor
        if SILU:
            x = x_s.load(layout).to(gl.float32)
            sig = 1.0 / (1.0 + gl.exp(-x))
            val = val * (sig * gl.fma(x, 1.0 - sig, 1.0))
        gl.store(ptr + rows * stride + col + c[None, :], val.to(ptr.dtype.element_ty), mask=keep)

    # ---- row blocks: the forward and the backward's dQ ---------------------------------------------------------------

    @gluon.jit
    def _row_loader(q_desc, do_desc, k_desc, v_desc, x_desc, q_s, do_s, k_s, v_s, x_s, once, ready, empty, start, n, p,
                    nbs, per_group, col, GRAD: gl.constexpr, SILU: gl.constexpr):
        """Per row block of the program (``_items``): its two Q (and, GRAD, dO) tiles once, its K/V tiles through the
        ring (one ring for all its blocks) and, SILU, its two pre-activation tiles for the stores after them; a block's
        once-loaded tiles wait until both consumers are done with the previous block's."""
        rows: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        stages: gl.constexpr = k_s.shape[0]
        QBUF: gl.constexpr = q_s.shape[0] // 2
        once_bytes: gl.constexpr = (2 + 2 * GRAD) * q_desc.block_type.nbytes
        kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
        g = 0  # K/V tiles issued so far: the ring's position
        for it in range(_items(p, nbs, per_group)):
            i0 = _row_block(p, nbs, it, per_group) * 2 * rows
            b = it % QBUF  # the buffer of the block's Q (and dO) tiles
            if it >= QBUF:
                mbarrier.wait(once.index(QBUF + 1 + b), (it // QBUF - 1) & 1)
            mbarrier.expect(once.index(b), once_bytes)
            tma.async_copy_global_to_shared(q_desc, [start + i0, col], once.index(b), q_s.index(2 * b))
            tma.async_copy_global_to_shared(q_desc, [start + i0 + rows, col], once.index(b), q_s.index(2 * b + 1))
            if GRAD:
                tma.async_copy_global_to_shared(do_desc, [start + i0, col], once.index(b), do_s.index(2 * b))
                tma.async_copy_global_to_shared(do_desc, [start + i0 + rows, col], once.index(b), do_s.index(2 * b + 1))
            for jb in range(gl.cdiv(gl.minimum(i0 + 2 * rows, n), BN)):
                st = g % stages
                mbarrier.wait(empty.index(st), ((g // stages) & 1) ^ 1)  # a fresh barrier passes parity 1
                mbarrier.expect(ready.index(st), kv_bytes)
                tma.async_copy_global_to_shared(k_desc, [start + jb * BN, col], ready.index(st), k_s.index(st))
                tma.async_copy_global_to_shared(v_desc, [start + jb * BN, col], ready.index(st), v_s.index(st))
                g += 1
            if SILU:  # the stores' tiles after the loop's
                if it > 0:
                    mbarrier.wait(once.index(2 * QBUF + 1), (it - 1) & 1)
                mbarrier.expect(once.index(QBUF), 2 * x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [start + i0, col], once.index(QBUF), x_s.index(0))
                tma.async_copy_global_to_shared(x_desc, [start + i0 + rows, col], once.index(QBUF), x_s.index(1))

    @gluon.jit
    def _row_consumer(q_s, do_s, k_s, v_s, x_s, x_desc, once, ready, empty, OUT, so_t, start, n, p, nbs, per_group, col,
                      factor, CID: gl.constexpr, GRAD: gl.constexpr, SILU: gl.constexpr):
        """Rows i0 + 64 CID ... of each row block of the program: O += SiLU(Q K^T) V, or (GRAD) dQ += dS K with S = Q K^T
        and dP = dO V^T issued together (``_rows``); stored times ``factor`` (and ``SILU``: SiLU' of ``x_s``,
        ``_store_rows``)."""
        BN: gl.constexpr = k_s.shape[1]
        D: gl.constexpr = k_s.shape[2]
        rows: gl.constexpr = q_s.shape[1]
        QBUF: gl.constexpr = q_s.shape[0] // 2
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        g = 0  # K/V tiles consumed so far
        for it in range(_items(p, nbs, per_group)):
            i0 = _row_block(p, nbs, it, per_group) * 2 * rows
            i_lo = i0 + CID * rows
            b = it % QBUF
            q_c = q_s.index(2 * b + CID)
            mbarrier.wait(once.index(b), (it // QBUF) & 1)
            acc = gl.zeros((rows, D), gl.float32, o_layout)
            nt = gl.cdiv(gl.minimum(i0 + 2 * rows, n), BN)  # the block's K/V tiles, its last the diagonal's
            acc = _rows(q_c, do_s.index(2 * b + CID), k_s, v_s, ready, empty, acc, g,
                        gl.cdiv(gl.minimum(i_lo + rows, n), BN), nt, i_lo, GRAD)
            g += nt
            mbarrier.arrive(once.index(QBUF + 1 + b), count=1)  # Q (and dO) read: a later block's may load
            if SILU:
                mbarrier.wait(once.index(QBUF), it & 1)
            if (not GRAD) and (i_lo + rows <= n):  # the forward's whole tiles by TMA (a tile past n would overwrite
                # the next sequence's rows), from shared memory; the lowering syncs the warpgroup before the copy
                tma.store_wait(0)  # the last block's store has read the buffer
                x_s.index(CID).store((acc * factor).to(x_s.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(x_desc, [start + i_lo, col], x_s.index(CID))
            else:
                _store_rows(OUT, so_t, start, n, i_lo, col, acc, factor, x_s.index(CID), SILU)
            if SILU:
                mbarrier.arrive(once.index(2 * QBUF + 1), count=1)
        if not GRAD:
            tma.store_wait(0)

    @gluon.jit
    def _issue_scores(q_c, do_c, k_s, v_s, ready, st, phase, GRAD: gl.constexpr):
        """Wait for ring stage ``st``, issue S = Q K^T on its K tile (and, GRAD, dP = dO V^T on its V tile); the
        second result is the first in the forward."""
        BN: gl.constexpr = k_s.shape[1]
        rows: gl.constexpr = q_c.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        mbarrier.wait(ready.index(st), phase)
        s_tok = warpgroup_mma(q_c, k_s.index(st).permute((1, 0)), gl.zeros((rows, BN), gl.float32, s_layout),
                              use_acc=False, is_async=True)
        if GRAD:
            dp_tok = warpgroup_mma(do_c, v_s.index(st).permute((1, 0)), gl.zeros((rows, BN), gl.float32, s_layout),
                                   use_acc=False, is_async=True)
            return s_tok, dp_tok
        else:
            return s_tok, s_tok

    @gluon.jit
    def _weights(s_tok, dp_tok, i_lo, jb, s_layout: gl.constexpr, a_layout: gl.constexpr, dtype: gl.constexpr,
                 PENDING: gl.constexpr, GRAD: gl.constexpr):
        """Wait for S (and dP) with ``PENDING`` later wgmmas left running, and make the A operand of the tile's second
        product: SiLU(S) (the forward) or dS (GRAD), causal, in ``dtype``."""
        if GRAD:
            s, dp = warpgroup_mma_wait(PENDING, deps=(s_tok, dp_tok))
            _, t = _silu_grad(s, dp)
        else:
            s, _ = warpgroup_mma_wait(PENDING, deps=(s_tok, dp_tok))  # the same token twice (a tuple in Triton 3.6)
            t, _ = _silu_grad(s, s)  # SiLU(s); the unused gradient is dropped by the compiler
        return gl.convert_layout(_causal(t, jb, i_lo, s_layout).to(dtype), a_layout)

    @gluon.jit
    def _rows(q_c, do_c, k_s, v_s, ready, empty, acc, g, nt, nt_ring, i_lo, GRAD: gl.constexpr):
        """``acc`` + SiLU(Q K^T) V (GRAD: dS K, dS from S = Q K^T and dP = dO V^T) over the first ``nt`` of the block's
        ``nt_ring`` K/V tiles (from ring position ``g``; those past the rows' diagonal tile are only taken off the
        ring). Each tile's S (and dP) is issued before the previous tile's second product, so that this warpgroup's
        SiLU of one tile runs while its product of the one before does (FlashAttention-3's intra-warpgroup overlap;
        it holds two stages, so the ring has three or more). The product in flight reads ``w``'s registers: the wait
        that ends it names them, so they stay live until then."""
        stages: gl.constexpr = k_s.shape[0]
        BN: gl.constexpr = k_s.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
        if GRAD:  # the second product's B tiles: dS K or P V
            b_s = k_s
        else:
            b_s = v_s
        st = g % stages
        s_tok, dp_tok = _issue_scores(q_c, do_c, k_s, v_s, ready, st, (g // stages) & 1, GRAD)
        w = _weights(s_tok, dp_tok, i_lo, 0, s_layout, a_layout, q_c.dtype, 0, GRAD)
        prev = st
        for jb in range(1, nt):
            st = (g + jb) % stages
            s_tok, dp_tok = _issue_scores(q_c, do_c, k_s, v_s, ready, st, ((g + jb) // stages) & 1, GRAD)
            b_t = b_s.index(prev)
            acc = warpgroup_mma(w, b_t, acc, is_async=True)
            w_next = _weights(s_tok, dp_tok, i_lo, jb, s_layout, a_layout, q_c.dtype, 1, GRAD)  # the product may still run
            acc = warpgroup_mma_wait(0, deps=(acc, b_t, w))[0]
            mbarrier.arrive(empty.index(prev), count=1)
            w = w_next
            prev = st
        b_t = b_s.index(prev)
        acc = warpgroup_mma(w, b_t, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, b_t, w))[0]
        mbarrier.arrive(empty.index(prev), count=1)
        for jb in range(nt, nt_ring):  # past the diagonal (the first warpgroup's rows, keys in tiles of 64)
            st = (g + jb) % stages
            mbarrier.wait(ready.index(st), ((g + jb) // stages) & 1)
            mbarrier.arrive(empty.index(st), count=1)
        return acc

    @gluon.jit
    def _row_consumer0(q_s, do_s, k_s, v_s, x_s, x_desc, once, ready, empty, OUT, so_t, start, n, p, nbs, per_group, col,
                       factor, GRAD: gl.constexpr, SILU: gl.constexpr):
        _row_consumer(q_s, do_s, k_s, v_s, x_s, x_desc, once, ready, empty, OUT, so_t, start, n, p, nbs, per_group, col,
                      factor, 0, GRAD, SILU)
        return (nbs,)  # Triton 3.6 wants a tuple from the default partition

    @gluon.jit
    def _row_consumer1(q_s, do_s, k_s, v_s, x_s, x_desc, once, ready, empty, OUT, so_t, start, n, p, nbs, per_group, col,
                       factor, GRAD: gl.constexpr, SILU: gl.constexpr):
        _row_consumer(q_s, do_s, k_s, v_s, x_s, x_desc, once, ready, empty, OUT, so_t, start, n, p, nbs, per_group, col,
                      factor, 1, GRAD, SILU)

    @gluon.jit
    def _row_blocks(q_desc, do_desc, k_desc, v_desc, x_desc, OUT, so_t, offsets, seq_order, factor, num_heads, len_key,
                    STAGES: gl.constexpr, SEQ_ORDER: gl.constexpr, GRAD: gl.constexpr, SILU: gl.constexpr,
                    QBUF: gl.constexpr):
        """One program per (``GROUP`` pairs of 128-row blocks, sequence, head), the sequences in ``seq_order`` when
        ``SEQ_ORDER``: blocks nbs - 1 - p and p of the sequence's nbs, then those of pair p + per_group (``_items``,
        ``_row_block``), so every program of a sequence walks about the same number of K/V tiles, and each next block's
        loads overlap the last one's stores (the module doc). ``QBUF``: buffers of the blocks' Q (and dO) tiles (2:
        the next block's load during this one's loop)."""
        rows: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        p, per_group, start, n, col = _program(offsets, seq_order, num_heads, len_key, 2 * rows, D, SEQ_ORDER, True)
        nbs = gl.cdiv(n, 2 * rows)
        if 2 * p < nbs:  # pairs past the sequence's end exit before any set-up
            q_s = gl.allocate_shared_memory(q_desc.dtype, [2 * QBUF, rows, D], q_desc.layout)
            if GRAD:
                do_s = gl.allocate_shared_memory(do_desc.dtype, [2 * QBUF, rows, D], do_desc.layout)
            else:
                do_s = q_s  # not read
            if SILU or not GRAD:  # the stores' pre-activation tiles, or the forward's output tiles for TMA stores
                x_s = gl.allocate_shared_memory(x_desc.dtype, [2, rows, D], x_desc.layout)
            else:
                x_s = q_s  # not read
            k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
            v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
            ready, empty, once = _barriers(STAGES, QBUF)
            # the loader's warp and the second consumer's four; registers (setmaxnreg where honoured)
            gl.warp_specialize([(_row_consumer0, (q_s, do_s, k_s, v_s, x_s, x_desc, once, ready, empty, OUT, so_t, start,
                                                  n, p, nbs, per_group, col, factor, GRAD, SILU)),
                                (_row_loader, (q_desc, do_desc, k_desc, v_desc, x_desc, q_s, do_s, k_s, v_s, x_s, once,
                                               ready, empty, start, n, p, nbs, per_group, col, GRAD, SILU)),
                                (_row_consumer1, (q_s, do_s, k_s, v_s, x_s, x_desc, once, ready, empty, OUT, so_t, start,
                                                  n, p, nbs, per_group, col, factor, GRAD, SILU))],
                               [1, 4], [24, 240])

    @gluon.jit
    def _hstu_fwd_gluon(q_desc, k_desc, v_desc, o_desc, O, so_t, offsets, seq_order, scale, num_heads, len_key,
                        STAGES: gl.constexpr, SEQ_ORDER: gl.constexpr, QBUF: gl.constexpr):
        """The forward: blocks of 128 query rows (up to ``2 GROUP`` per program), K/V tiles of ``k_desc``'s rows
        (``_row_blocks``)."""
        _row_blocks(q_desc, q_desc, k_desc, v_desc, o_desc, O, so_t, offsets, seq_order, scale, num_heads, len_key, STAGES,
                    SEQ_ORDER, False, False, QBUF)

    @gluon.jit
    def _hstu_bwd_dq_gluon(q_desc, do_desc, k_desc, v_desc, xq_desc, DQ, sdq_t, offsets, seq_order, dq_scale, num_heads,
                           len_key, STAGES: gl.constexpr, SEQ_ORDER: gl.constexpr, SILU: gl.constexpr,
                           QBUF: gl.constexpr):
        """dQ (times ``dq_scale``; ``SILU``: times SiLU' of the pre-activation read by ``xq_desc``): blocks of 128 query
        rows (up to ``2 GROUP`` per program), 64-key K/V tiles (``_row_blocks``)."""
        _row_blocks(q_desc, do_desc, k_desc, v_desc, xq_desc, DQ, sdq_t, offsets, seq_order, dq_scale, num_heads, len_key,
                    STAGES, SEQ_ORDER, True, SILU, QBUF)

    # ---- the backward's dK/dV: key rows ------------------------------------------------------------------------------

    @gluon.jit
    def _dkdv_loader(q_desc, do_desc, k_desc, v_desc, xk_desc, xv_desc, q_s, do_s, k_s, v_s, xk_s, xv_s, kv_bar, ready,
                     empty, start, j0, col, nt, SILU: gl.constexpr):
        """The key block's K and V (and, SILU, their pre-activations) once, two 64-row halves each, then its query
        tiles' Q and dO through the ring."""
        rows: gl.constexpr = q_desc.block_type.shape[0]
        stages: gl.constexpr = q_s.shape[0]
        mbarrier.expect(kv_bar.index(0), 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for c in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [start + j0 + c * rows, col], kv_bar.index(0), k_s.index(c))
            tma.async_copy_global_to_shared(v_desc, [start + j0 + c * rows, col], kv_bar.index(0), v_s.index(c))
        tile_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
        for t in range(nt):
            st = t % stages
            mbarrier.wait(empty.index(st), ((t // stages) & 1) ^ 1)
            mbarrier.expect(ready.index(st), tile_bytes)
            tma.async_copy_global_to_shared(q_desc, [start + j0 + t * rows, col], ready.index(st), q_s.index(st))
            tma.async_copy_global_to_shared(do_desc, [start + j0 + t * rows, col], ready.index(st), do_s.index(st))
            if SILU:
                if t == 0:  # the stores' pre-activation tiles after the loop's first (issued later: the same speed)
                    mbarrier.expect(kv_bar.index(1), 2 * xk_desc.block_type.nbytes + 2 * xv_desc.block_type.nbytes)
                    for c in gl.static_range(2):
                        tma.async_copy_global_to_shared(xk_desc, [start + j0 + c * rows, col], kv_bar.index(1),
                                                        xk_s.index(c))
                        tma.async_copy_global_to_shared(xv_desc, [start + j0 + c * rows, col], kv_bar.index(1),
                                                        xv_s.index(c))

    @gluon.jit
    def _dkdv_consumer(q_s, do_s, k_s, v_s, xk_s, xv_s, kv_bar, ready, empty, DK, DV, sdk_t, sdv_t, start, n, j0, col, nt,
                       scale, CID: gl.constexpr, SILU: gl.constexpr):
        """dK and dV of the block's keys j0 + 64 CID ...: tiles are (keys, queries); the query tiles from j0 on.
        ``SILU``: stored times SiLU' of the pre-activations in ``xk_s``, ``xv_s`` (``_store_rows``)."""
        stages: gl.constexpr = q_s.shape[0]
        BM: gl.constexpr = q_s.shape[1]
        D: gl.constexpr = q_s.shape[2]
        keys: gl.constexpr = k_s.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        jc = j0 + CID * keys
        k_c = k_s.index(CID)
        v_c = v_s.index(CID)
        mbarrier.wait(kv_bar.index(0), 0)
        dk = gl.zeros((keys, D), gl.float32, o_layout)
        dv = gl.zeros((keys, D), gl.float32, o_layout)
        for t in range(nt):
            st = t % stages
            i_start = j0 + t * BM
            mbarrier.wait(ready.index(st), (t // stages) & 1)
            if i_start + BM > jc:  # else every row precedes these keys (the second warpgroup's first tile)
                q_t = q_s.index(st)
                do_t = do_s.index(st)
                zeros = gl.zeros((keys, BM), gl.float32, s_layout)
                s_tok = warpgroup_mma(k_c, q_t.permute((1, 0)), zeros, use_acc=False, is_async=True)
                dp_tok = warpgroup_mma(v_c, do_t.permute((1, 0)), zeros, use_acc=False, is_async=True)
                s, dp = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
                p, ds = _silu_grad(s, dp)
                if (i_start < jc + keys - 1) | (i_start + BM > n):  # crosses the diagonal or the sequence's end
                    i = i_start + gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
                    j = jc + gl.arange(0, keys, layout=gl.SliceLayout(1, s_layout))
                    vis = (i[None, :] >= j[:, None]) & (i[None, :] < n)
                    p = gl.where(vis, p, 0.0)
                    ds = gl.where(vis, ds, 0.0)
                dv = warpgroup_mma(gl.convert_layout(p.to(q_s.dtype), a_layout), do_t, dv, is_async=True)
                dk = warpgroup_mma(gl.convert_layout(ds.to(q_s.dtype), a_layout), q_t, dk, is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=(dv, dk, q_t, do_t))
            mbarrier.arrive(empty.index(st), count=1)
        if SILU:
            mbarrier.wait(kv_bar.index(1), 0)
        _store_rows(DV, sdv_t, start, n, jc, col, dv, scale, xv_s.index(CID), SILU)
        _store_rows(DK, sdk_t, start, n, jc, col, dk, 0.5 * scale, xk_s.index(CID), SILU)

    @gluon.jit
    def _dkdv_consumer0(q_s, do_s, k_s, v_s, xk_s, xv_s, kv_bar, ready, empty, DK, DV, sdk_t, sdv_t, start, n, j0, col,
                        nt, scale, SILU: gl.constexpr):
        _dkdv_consumer(q_s, do_s, k_s, v_s, xk_s, xv_s, kv_bar, ready, empty, DK, DV, sdk_t, sdv_t, start, n, j0, col, nt,
                       scale, 0, SILU)
        return (nt,)

    @gluon.jit
    def _dkdv_consumer1(q_s, do_s, k_s, v_s, xk_s, xv_s, kv_bar, ready, empty, DK, DV, sdk_t, sdv_t, start, n, j0, col,
                        nt, scale, SILU: gl.constexpr):
        _dkdv_consumer(q_s, do_s, k_s, v_s, xk_s, xv_s, kv_bar, ready, empty, DK, DV, sdk_t, sdv_t, start, n, j0, col, nt,
                       scale, 1, SILU)

    @gluon.jit
    def _hstu_bwd_dkdv_gluon(q_desc, do_desc, k_desc, v_desc, xk_desc, xv_desc, DK, DV, sdk_t, sdv_t, offsets, seq_order,
                             scale, num_heads, len_key, STAGES: gl.constexpr, SEQ_ORDER: gl.constexpr,
                             SILU: gl.constexpr):
        """One program per (128 keys, sequence, head), the first keys (the longest query walk) first; ``SILU``: dK and
        dV times SiLU' of the pre-activations read by ``xk_desc``, ``xv_desc``."""
        rows: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        blk, _, start, n, col = _program(offsets, seq_order, num_heads, len_key, 2 * rows, D, SEQ_ORDER, False)
        j0 = blk * 2 * rows
        if j0 < n:
            nt = gl.cdiv(n - j0, rows)
            q_s = gl.allocate_shared_memory(q_desc.dtype, [STAGES, rows, D], q_desc.layout)
            do_s = gl.allocate_shared_memory(do_desc.dtype, [STAGES, rows, D], do_desc.layout)
            k_s = gl.allocate_shared_memory(k_desc.dtype, [2, rows, D], k_desc.layout)
            v_s = gl.allocate_shared_memory(v_desc.dtype, [2, rows, D], v_desc.layout)
            if SILU:
                xk_s = gl.allocate_shared_memory(xk_desc.dtype, [2, rows, D], xk_desc.layout)
                xv_s = gl.allocate_shared_memory(xv_desc.dtype, [2, rows, D], xv_desc.layout)
            else:
                xk_s = k_s  # not read
                xv_s = v_s
            ready, empty, kv_bar = _barriers(STAGES, 1)
            # the constexpr written in each tuple: one in a tuple variable reaches the partitions as a runtime value
            gl.warp_specialize([(_dkdv_consumer0, (q_s, do_s, k_s, v_s, xk_s, xv_s, kv_bar, ready, empty, DK, DV, sdk_t,
                                                   sdv_t, start, n, j0, col, nt, scale, SILU)),
                                (_dkdv_loader, (q_desc, do_desc, k_desc, v_desc, xk_desc, xv_desc, q_s, do_s, k_s, v_s,
                                                xk_s, xv_s, kv_bar, ready, empty, start, j0, col, nt, SILU)),
                                (_dkdv_consumer1, (q_s, do_s, k_s, v_s, xk_s, xv_s, kv_bar, ready, empty, DK, DV, sdk_t,
                                                   sdv_t, start, n, j0, col, nt, scale, SILU))], [1, 4], [24, 240])


# ---- launching -------------------------------------------------------------------------------------------------------


def programs(max_seq_len: int, pairs: bool) -> int:
    """Programs per (sequence, head): blocks of 128 rows (the dK/dV kernel), or pairs of them (the row kernels)."""
    blocks = triton.cdiv(max_seq_len, 2 * BLOCK_ROWS)
    return triton.cdiv(triton.cdiv(blocks, 2), GROUP.value) if pairs else blocks


def descriptor(x: Tensor, rows: int):
    """The TMA descriptor of ``x`` ((T, H, D), ``tma_ready``) as a (T, H * D) matrix read in (rows, D) tiles."""
    d = x.shape[2]
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(x, [x.shape[0], x.shape[1] * d], [x.stride(0), 1], [rows, d], layout)


def descriptors(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """The forward's TMA descriptors: q in 64-row tiles, k and v in tiles of ``FORWARD_KEYS`` rows."""
    keys = FORWARD_KEYS[q.shape[2]]
    return descriptor(q, BLOCK_ROWS), descriptor(k, keys), descriptor(v, keys)


def hstu_forward_gluon(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int, scale: float,
                       seq_order: Tensor | None, out: Tensor) -> Tensor:  # fmt: skip
    """Fill ``out`` ((T, H, D), contiguous) with the causal HSTU attention of a ``supported`` call."""
    batch, heads = offsets.numel() - 1, q.shape[1]
    grid = (programs(max_seq_len, True) * batch * heads,)
    order = seq_order if seq_order is not None else offsets  # SEQ_ORDER False: never read
    try:
        _hstu_fwd_gluon[grid](*descriptors(q, k, v), descriptor(out, BLOCK_ROWS), out, out.stride(0), offsets, order,
                              scale, heads, max_seq_len, STAGES=FORWARD_STAGES, SEQ_ORDER=seq_order is not None,
                              QBUF=FORWARD_QBUF, num_warps=4)
    except Exception as e:  # a compiler or driver failure: say how to run the Triton forward instead
        raise RuntimeError(f"the Gluon HSTU attention forward failed ({type(e).__name__}: {e}); set "
                           "RECFORGE_GLUON_HSTU=0 to use the Triton forward, and please report it") from e
    return out


def hstu_backward_gluon(do: Tensor, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int, scale: float,
                        seq_order: Tensor | None, dq: Tensor, dk: Tensor, dv: Tensor, dq_scale: float,
                        pre: tuple[Tensor, Tensor, Tensor] | None = None) -> None:  # fmt: skip
    """Fill ``dk``, ``dv`` ((T, H, D), heads packed in each row) with the gradients of a ``supported`` call given
    ``do`` (``tma_ready``), and ``dq`` with dQ * 2 / scale times ``dq_scale`` (``scale / 2``: dQ) in its dtype.

    ``pre``: (x_q, x_k, x_v) (``tma_ready``), the pre-activations of which q, k, v are the SiLU: then the three are the
    gradients of those instead, dQ SiLU'(x_q) and so on, each multiplied in at its store from tiles the loader
    prefetched (``hstu_silu.silu_attention_backward``: the HSTU projection's gradient without a pass of its own)."""
    batch, heads = offsets.numel() - 1, q.shape[1]
    order = seq_order if seq_order is not None else offsets  # SEQ_ORDER False: never read
    tiles = [descriptor(x, BLOCK_ROWS) for x in (q, do, k, v)]
    silu = pre is not None
    x_q, x_k, x_v = [descriptor(x, BLOCK_ROWS) for x in pre] if silu else tiles[:3]  # SILU False: never read
    d = q.shape[2]
    common = dict(SEQ_ORDER=seq_order is not None, SILU=silu, num_warps=4)
    try:
        _hstu_bwd_dkdv_gluon[(programs(max_seq_len, False) * batch * heads,)](
            *tiles, x_k, x_v, dk, dv, dk.stride(0), dv.stride(0), offsets, order, scale, heads, max_seq_len,
            STAGES=DKDV_STAGES[d], **common)
        _hstu_bwd_dq_gluon[(programs(max_seq_len, True) * batch * heads,)](
            *tiles, x_q, dq, dq.stride(0), offsets, order, dq_scale, heads, max_seq_len, STAGES=DQ_STAGES[d],
            QBUF=DQ_QBUF[d], **common)
    except Exception as e:  # a compiler or driver failure: say how to run the Triton backward instead
        raise RuntimeError(f"the Gluon HSTU attention backward failed ({type(e).__name__}: {e}); set "
                           "RECFORGE_GLUON_HSTU=0 to use the Triton kernels, and please report it") from e
