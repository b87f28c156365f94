"""Triton kernels of the dynamic tables' CUDA path (optional: every caller has a torch path).

- ``lazy_adam_rows``: the whole lazy Adam/AdamW row update (read weight, moments and per-row
  step at ``slots``, update, write back) in one kernel instead of ~20 gathers, elementwise ops
  and scatters; rows with a non-finite gradient are left untouched and counted on the device
  (no host synchronisation).
- ``swap_rows``: the tiered store's cache traffic. For each victim cache slot: write the old row
  back to the host table if it is dirty, then load the missing row from the host table. The host
  table is pinned memory that the GPU reads and writes directly (unified virtual addressing), so
  only those rows cross PCIe, in both directions at once, with no gather on the CPU and no
  staging copy.

``available(device)``: a CUDA device and an importable Triton. On a CPU the kernels run only
under Triton's interpreter (``TRITON_INTERPRET=1``, what the unit tests use).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
from torch import Tensor

HAS_TRITON = importlib.util.find_spec("triton") is not None


def available(device: torch.device) -> bool:
    """Whether the tables use these kernels on ``device`` (CUDA with Triton)."""
    return HAS_TRITON and device.type == "cuda"


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def lazy_adam_kernel(W, M, V, S, SLOTS, G, BAD, n, dim, sw, sm, sv, ss, lr, beta1, beta2, log2_beta1, log2_beta2, eps, wd,
                         L2: tl.constexpr, DECOUPLED: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = r < n
        slot = tl.load(SLOTS + r, mask=rmask, other=0).to(tl.int64)
        c = tl.arange(0, BLOCK_D)
        cmask = c < dim
        mask = rmask[:, None] & cmask[None, :]
        g = tl.load(G + r.to(tl.int64)[:, None] * dim + c[None, :], mask=mask, other=0.0).to(tl.float32)
        nonfinite = tl.sum(((tl.abs(g) < float("inf")) == 0).to(tl.int32), axis=1)  # NaN and inf fail the test
        good = rmask & (nonfinite == 0)
        tl.atomic_add(BAD, tl.sum((rmask & (nonfinite > 0)).to(tl.int64), axis=0))
        mask = mask & good[:, None]
        w = tl.load(W + slot[:, None] * sw + c[None, :], mask=mask, other=0.0)  # row strides: a tiered store's
        m = tl.load(M + slot[:, None] * sm + c[None, :], mask=mask, other=0.0)  # fields share one record per row
        v = tl.load(V + slot[:, None] * sv + c[None, :], mask=mask, other=0.0)
        step = tl.load(S + slot * ss, mask=good, other=0) + 1
        tl.store(S + slot * ss, step, mask=good)
        if L2:
            g = g + wd * w
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * (g * g)
        if DECOUPLED:
            w = w * (1.0 - lr * wd)
        stepf = step.to(tl.float32)
        bias1 = 1.0 - tl.exp2(stepf * log2_beta1)
        bias2_sqrt = tl.sqrt(1.0 - tl.exp2(stepf * log2_beta2))
        w = w - (lr / bias1)[:, None] * m / (tl.sqrt(v) / bias2_sqrt[:, None] + eps)
        tl.store(W + slot[:, None] * sw + c[None, :], w, mask=mask)
        tl.store(M + slot[:, None] * sm + c[None, :], m, mask=mask)
        tl.store(V + slot[:, None] * sv + c[None, :], v, mask=mask)

    @triton.jit
    def swap_rows_kernel(CACHE, HOST, SLOTS, WB, LOAD, n, width,
                         HAS_WB: tl.constexpr, HAS_LOAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = r < n
        slot = tl.load(SLOTS + r, mask=rmask, other=0).to(tl.int64)
        if HAS_WB:
            wb = tl.load(WB + r, mask=rmask, other=-1).to(tl.int64)
        if HAS_LOAD:
            ld = tl.load(LOAD + r, mask=rmask, other=-1).to(tl.int64)
        for chunk in tl.static_range(CHUNKS):
            c = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
            cmask = c < width
            coff = slot[:, None] * width + c[None, :]
            # both loads first (the host read is the slow one; a victim's row is never the missed row)
            if HAS_LOAD:  # missing row -> cache
                lmask = (ld >= 0)[:, None] & cmask[None, :]
                y = tl.load(HOST + ld[:, None] * width + c[None, :], mask=lmask)
            if HAS_WB:  # dirty victim -> host (read before the slot is overwritten)
                wmask = (wb >= 0)[:, None] & cmask[None, :]
                x = tl.load(CACHE + coff, mask=wmask)
                tl.store(HOST + wb[:, None] * width + c[None, :], x, mask=wmask)
            if HAS_LOAD:
                tl.store(CACHE + coff, y, mask=lmask)

    return lazy_adam_kernel, swap_rows_kernel


def lazy_adam_rows(weight: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, slots: Tensor, grad: Tensor, *,
                   lr: float, betas: tuple[float, float], eps: float, weight_decay: float, decoupled: bool, bad: Tensor) -> None:  # fmt: skip
    """Lazy Adam (``decoupled``: AdamW) on ``weight[slots]`` and its state, in place; ``bad`` (1,) int64 += non-finite rows.

    Same math as ``optim.apply_update`` (per-row step count, bias corrections per row).
    ``weight``/moments: (R, d) float32 with unit column stride (rows may be strided); ``step``: (R,)
    int64; ``grad``: (U, d).
    """
    n, dim = grad.shape
    if n == 0:
        return
    lazy_adam_kernel, _ = _kernels()
    block = 1 << max(0, dim - 1).bit_length()
    rows_per = max(1, 2048 // block)
    beta1, beta2 = betas
    lazy_adam_kernel[(math.ceil(n / rows_per),)](
        weight, exp_avg, exp_avg_sq, step, slots.contiguous(), grad.contiguous(), bad, n, dim,
        weight.stride(0), exp_avg.stride(0), exp_avg_sq.stride(0), step.stride(0), lr, beta1, beta2, math.log2(beta1) if beta1 > 0 else -1e30, math.log2(beta2) if beta2 > 0 else -1e30, eps, weight_decay,
        L2=bool(weight_decay) and not decoupled, DECOUPLED=bool(weight_decay) and decoupled, ROWS=rows_per, BLOCK_D=block,
    )  # fmt: skip


SWAP_WARPS = 4  # warps per program of swap_rows (benchmarks/sparse_embedding.py --modes uva compares)


def swap_rows(cache: Tensor, host: Tensor, slots: Tensor, write_back: Tensor | None, load: Tensor | None,
              num_warps: int = 0, tile: int = 4096) -> None:  # fmt: skip
    """For each i: ``host[write_back[i]] = cache[slots[i]]`` (where >= 0), then ``cache[slots[i]] = host[load[i]]`` (where >= 0).

    ``cache``: (C, ...) on the GPU; ``host``: (R, ...) pinned host memory, same row shape and dtype.
    ``num_warps`` (0: ``SWAP_WARPS``) and ``tile`` (elements per program) only tune the speed.
    """
    n = slots.numel()
    if n == 0:
        return
    _, swap_rows_kernel = _kernels()
    width = cache[0].numel() if cache.shape[0] else 1
    block = min(1024, 1 << max(0, width - 1).bit_length())
    rows_per = max(1, tile // block)
    dummy = slots
    swap_rows_kernel[(math.ceil(n / rows_per),)](
        cache, host, slots, dummy if write_back is None else write_back, dummy if load is None else load, n, width,
        HAS_WB=write_back is not None, HAS_LOAD=load is not None, ROWS=rows_per, BLOCK_D=block, CHUNKS=math.ceil(width / block),
        num_warps=num_warps or SWAP_WARPS,
    )  # fmt: skip
