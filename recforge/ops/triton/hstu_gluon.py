"""The HSTU attention forward in Gluon for Hopper (sm_90): warp-specialized, TMA-fed, asynchronous wgmma.

    out_i = scale * sum_{j <= i} SiLU(q_i . k_j) v_j        (causal mask, no relative bias)

Why a second forward: Triton's compiler waits on every wgmma right after issuing it, so one warpgroup's tensor cores
idle through its SiLU, and ``tl.range(warp_specialize=True)`` does nothing on sm_90. Gluon (``triton.experimental
.gluon``, Triton >= 3.6) states the schedule itself: one program per (block of 128 query rows, sequence, head), a
1-warp loader streams K/V tiles by TMA into a two-stage ring (ready/empty mbarriers), and two 4-warp consumer
warpgroups own 64 rows each and walk the same key tiles, so one warpgroup's SiLU runs while the other's wgmmas do.
On an H200 the Triton forward took 1.06x / 1.13x / 1.20x this kernel's time at L 2048 / 4096 / 8192 (head dim 128,
jagged 64K-token batches; level at 1,024, hence ``MIN_LEN``; BENCHMARKS.md, 22nd session); at head dim 64 the
prototype lost to Triton (0.57-0.98x), so it is not used there. The variants that lost are recorded there too (a
persistent grid; the next tile's scores issued before this tile's P.V inside a warpgroup; 64-key tiles).

The hot path only (``supported``): CUDA sm_90, bf16/fp16, head dims 128/128, a plain causal mask (no targets,
contextual tokens, segments, window or timestamps), no relative bias, heads packed in each row (stride(1) == 128,
the layout of ``(T, H, D)`` tensors and of slices of a fused projection). ``RECFORGE_GLUON_HSTU=0`` turns it off.
The backward stays Triton's (``recforge.ops.triton.hstu``): HSTU keeps no forward statistics, so the two forwards
are interchangeable.

Rows of another sequence that a TMA tile reads only meet rows past the causal diagonal (masked) or rows past the
sequence's end (never stored: the output is written with masked stores), and rows past the tensor read as zeros.
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

BLOCK_ROWS = 64  # query rows per consumer warpgroup (two per program)
BLOCK_KEYS = 128  # keys per K/V tile
STAGES = 2  # K/V ring depth
HEAD_DIM = 128
MIN_LEN = 1024  # shorter batches keep the Triton forward (level with it at 1,024 on the H200, faster above)


def supported(q: Tensor, k: Tensor, v: Tensor, max_seq_len: int, ma: MaskArgs, pos_w: Tensor | None,
              time_w: Tensor | None) -> bool:  # fmt: skip
    """Whether ``hstu_forward_gluon`` computes this call (see the module docstring), the switch included."""
    if gluon_hstu() is False or not AVAILABLE or not q.is_cuda or max_seq_len < MIN_LEN:  # the switch first: a typo
        return False  # in it raises wherever it runs
    if pos_w is not None or time_w is not None or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not ma.causal or ma.has_targets or ma.has_contextual or ma.has_window or ma.has_ts or ma.num_segments:
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    for x in (q, k, v):
        if x.dtype != q.dtype or x.shape[2] != HEAD_DIM or x.stride(2) != 1 or x.stride(1) != HEAD_DIM:
            return False
        if x.stride(0) % 8 or x.data_ptr() % 16:  # TMA: 16-byte aligned rows and base
            return False
    return True


if AVAILABLE:

    @gluon.jit
    def _tanh(x):
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _silu_tile(s, jb, i_lo, BN: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, dtype: gl.constexpr):
        """SiLU(s) as (s / 2)(1 + tanh(s / 2)), masked causally on a tile that crosses the diagonal, as a wgmma A."""
        h = s * 0.5
        p = gl.fma(h, _tanh(h), h)  # not h + h * tanh(h): that form crashes LLVM's SLP vectorizer in Triton 3.7.1
        if jb * BN + BN - 1 > i_lo:
            rows: gl.constexpr = s.shape[0]
            i = i_lo + gl.arange(0, rows, layout=gl.SliceLayout(1, s_layout))
            j = jb * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(j[None, :] <= i[:, None], p, 0.0)
        return gl.convert_layout(p.to(dtype), p_layout)

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, ready, empty, start, i0, col, nb):
        rows: gl.constexpr = q_desc.block_type.shape[0]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        stages: gl.constexpr = k_s.shape[0]
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start + i0, col], q_bar, q_s.index(0))
        tma.async_copy_global_to_shared(q_desc, [start + i0 + rows, col], q_bar, q_s.index(1))
        kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
        for jb in range(nb):
            st = jb % stages
            mbarrier.wait(empty.index(st), ((jb // stages) & 1) ^ 1)  # a fresh barrier passes parity 1
            mbarrier.expect(ready.index(st), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [start + jb * BN, col], ready.index(st), k_s.index(st))
            tma.async_copy_global_to_shared(v_desc, [start + jb * BN, col], ready.index(st), v_s.index(st))

    @gluon.jit
    def _consumer(q_s, k_s, v_s, q_bar, ready, empty, O, so_t, start, n, i0, col, nb, scale, CID: gl.constexpr):
        stages: gl.constexpr = k_s.shape[0]
        BN: gl.constexpr = k_s.shape[1]
        D: gl.constexpr = k_s.shape[2]
        rows: gl.constexpr = q_s.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        i_lo = i0 + CID * rows
        q_c = q_s.index(CID)
        mbarrier.wait(q_bar, 0)
        o = gl.zeros((rows, D), gl.float32, o_layout)
        for jb in range(nb):
            st = jb % stages
            mbarrier.wait(ready.index(st), (jb // stages) & 1)
            s_tok = warpgroup_mma(q_c, k_s.index(st).permute((1, 0)), gl.zeros((rows, BN), gl.float32, s_layout),
                                  use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s_tok, q_c, k_s.index(st)))[0]
            p = _silu_tile(s, jb, i_lo, BN, s_layout, p_layout, q_s.dtype)
            o_tok = warpgroup_mma(p, v_s.index(st), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o_tok, v_s.index(st)))[0]
            mbarrier.arrive(empty.index(st), count=1)
        r = i_lo + gl.arange(0, rows, layout=gl.SliceLayout(1, o_layout))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        ptrs = O + (start + r)[:, None].to(gl.int64) * so_t + col + c[None, :]
        gl.store(ptrs, (o * scale).to(O.dtype.element_ty), mask=(r < n)[:, None])

    @gluon.jit
    def _consumer0(q_s, k_s, v_s, q_bar, ready, empty, O, so_t, start, n, i0, col, nb, scale):
        _consumer(q_s, k_s, v_s, q_bar, ready, empty, O, so_t, start, n, i0, col, nb, scale, 0)
        return (nb,)  # Triton 3.6 wants a tuple from the default partition

    @gluon.jit
    def _consumer1(q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, ready, empty, O, so_t, start, n, i0, col, nb, scale):
        _consumer(q_s, k_s, v_s, q_bar, ready, empty, O, so_t, start, n, i0, col, nb, scale, 1)

    @gluon.jit
    def _loader_part(q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, ready, empty, O, so_t, start, n, i0, col, nb, scale):
        _loader(q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, ready, empty, start, i0, col, nb)

    @gluon.jit
    def _hstu_fwd_gluon(q_desc, k_desc, v_desc, O, so_t, offsets, seq_order, scale, num_heads, len_key,
                        STAGES: gl.constexpr, SEQ_ORDER: gl.constexpr):
        """One program per (128 query rows, sequence, head) in the block-major grid of ``recforge.ops.triton.tuning
        .launch`` (a group's longest key walk first; the sequences in ``seq_order`` when ``SEQ_ORDER``)."""
        rows: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        num_blocks = gl.cdiv(len_key, 2 * rows)
        pid = gl.program_id(0)
        blk = pid % num_blocks
        bh = pid // num_blocks
        b = bh // num_heads
        if SEQ_ORDER:
            b = gl.load(seq_order + b).to(gl.int32)
        start = gl.load(offsets + b).to(gl.int32)
        n = (gl.load(offsets + b + 1) - start).to(gl.int32)
        i0 = (num_blocks - 1 - blk) * 2 * rows
        if i0 < n:  # blocks past the sequence's end exit before any set-up
            nb = gl.cdiv(gl.minimum(i0 + 2 * rows, n), BN)
            col = (bh % num_heads) * D
            q_s = gl.allocate_shared_memory(q_desc.dtype, [2, rows, D], q_desc.layout)
            k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
            v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(ready.index(st), count=1)
                mbarrier.init(empty.index(st), count=2)  # both consumers release a stage
            mbarrier.init(q_bar, count=1)
            fence_async_shared()
            gl.warp_specialize(
                [(_consumer0, (q_s, k_s, v_s, q_bar, ready, empty, O, so_t, start, n, i0, col, nb, scale)),
                 (_loader_part, (q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, ready, empty, O, so_t, start, n, i0, col,
                                 nb, scale)),
                 (_consumer1, (q_desc, k_desc, v_desc, q_s, k_s, v_s, q_bar, ready, empty, O, so_t, start, n, i0, col, nb,
                               scale))],
                [1, 4], [24, 240])  # the loader's warp and the second consumer's four; registers (setmaxnreg where honoured)


def descriptors(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """TMA descriptors of q (64-row tiles), k and v (128-row tiles) as (T, H * D) matrices with their row strides."""
    def desc(x: Tensor, rows: int):
        layout = gl.NVMMASharedLayout.get_default_for([rows, HEAD_DIM], gl.bfloat16 if x.dtype == torch.bfloat16
                                                      else gl.float16)
        return TensorDescriptor(x, [x.shape[0], x.shape[1] * HEAD_DIM], [x.stride(0), 1], [rows, HEAD_DIM], layout)

    return desc(q, BLOCK_ROWS), desc(k, BLOCK_KEYS), desc(v, BLOCK_KEYS)


def hstu_forward_gluon(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int, scale: float,
                       seq_order: Tensor | None, out: Tensor) -> Tensor:  # fmt: skip
    """Fill ``out`` ((T, H, 128), contiguous) with the causal HSTU attention of a ``supported`` call."""
    batch, heads = offsets.numel() - 1, q.shape[1]
    grid = (triton.cdiv(max_seq_len, 2 * BLOCK_ROWS) * batch * heads,)
    order = seq_order if seq_order is not None else offsets  # SEQ_ORDER False: never read
    try:
        _hstu_fwd_gluon[grid](*descriptors(q, k, v), out, out.stride(0), offsets, order, scale, heads, max_seq_len,
                              STAGES=STAGES, SEQ_ORDER=seq_order is not None, num_warps=4)
    except Exception as e:  # a compiler or driver failure: say how to run the Triton forward instead
        raise RuntimeError(f"the Gluon HSTU attention forward failed ({type(e).__name__}: {e}); set "
                           "RECFORGE_GLUON_HSTU=0 to use the Triton forward, and please report it") from e
    return out
