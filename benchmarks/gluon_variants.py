"""The Gluon HSTU kernels' schedule choices, timed kernel by kernel against the Triton kernels (issue 18).

For each head dim and max length, on a jagged bf16 batch of ~64K tokens (``attention.make_lengths``, 4 heads): the
Triton forward and backward (``RECFORGE_GLUON_HSTU=0``), and the Gluon kernels of ``recforge.ops.triton.hstu_gluon``
launched directly with each choice the module makes per head dim: the forward's key tile (``FORWARD_KEYS``), ring
depth and Q buffers, the dK/dV kernel's ring depth (``DKDV_STAGES``), the dQ kernel's ring depth and Q/dO buffers
(``DQ_STAGES``, ``DQ_QBUF``), those that fit in shared memory. GPU ms per call by CUDA
events (``attention.host_and_gpu_ms``: 20 calls queued behind a GPU sleep; the best of ``--rounds`` rounds of 3
medians, variants alternated), each output's relative difference from the Triton kernels', and the choice the module
takes marked with ``*``.

    PYTHONPATH=. python benchmarks/gluon_variants.py --head-dims 64 128 --seq-lens 2048 4096 8192 \\
        --out benchmarks/results/gluon_variants-h200.json
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from _machine import relative_error
from attention import host_and_gpu_ms, make_lengths

from recforge.io import atomic_write_json
from recforge.jagged.index import offsets_from_lengths
from recforge.jagged.mask import AttentionMask
from recforge.ops.triton import hstu as th
from recforge.ops.triton import hstu_gluon as g
from recforge.ops.triton._common import mask_args

HEADS = 4


def variants(dim: int, max_len: int) -> tuple[dict, dict]:
    """{name: launch} and {name: () -> (its output, the Triton kernels')} for one batch."""
    lengths = make_lengths(max_len, 65536, 0)
    gen = torch.Generator(device="cuda").manual_seed(max_len)
    total, batch, scale = sum(lengths), len(lengths), 1.0 / max_len
    q, k, v, do = (torch.randn(total, HEADS, dim, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.5
                   for _ in range(4))  # fmt: skip
    offsets = offsets_from_lengths(torch.tensor(lengths)).cuda()
    ma, order = mask_args(AttentionMask(causal=True), offsets), th.launch_order(offsets, max_len)
    g_order = order if order is not None else offsets  # SEQ_ORDER False (short batches): never read
    ref_out = th.hstu_forward(q, k, v, offsets, max_len, ma, scale, None, None, None, 0, order)
    ref_dq, ref_dk, ref_dv, _, _ = th.hstu_backward(do, q, k, v, offsets, max_len, ma, scale, None, None, None, 0,
                                                    False, False, seq_order=order)
    out, dk, dv = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    dq = torch.empty(total, HEADS, dim, device="cuda", dtype=torch.float32)
    rows = [g.descriptor(x, g.BLOCK_ROWS) for x in (q, do, k, v)]
    o_desc = g.descriptor(out, g.BLOCK_ROWS)
    row_grid, key_grid = (g.programs(max_len, True) * batch * HEADS,), (g.programs(max_len, False) * batch * HEADS,)
    launch = {
        "triton forward": lambda: th.hstu_forward(q, k, v, offsets, max_len, ma, scale, None, None, None, 0, order),
        "triton backward": lambda: th.hstu_backward(do, q, k, v, offsets, max_len, ma, scale, None, None, None, 0,
                                                    False, False, seq_order=order),
    }
    check = {}
    chosen = (g.FORWARD_KEYS[dim], g.FORWARD_STAGES, g.FORWARD_QBUF)
    for bn, stages, qbuf in sorted({chosen, (64, 4, 2), (128, 4, 2), (128, 3, 2), (g.FORWARD_KEYS[dim], 4, 1)}):
        if dim == 128 and bn * stages > 256:  # over the 227 KiB of shared memory
            continue
        name = f"gluon forward, {bn}-key tiles, {stages} stages, {qbuf} Q buffers" + (" *" if (bn, stages, qbuf) ==
                                                                                         chosen else "")  # fmt: skip
        kv = [g.descriptor(x, bn) for x in (k, v)]
        launch[name] = lambda stages=stages, qbuf=qbuf, kv=kv: g._hstu_fwd_gluon[row_grid](
            rows[0], *kv, o_desc, out, out.stride(0), offsets, g_order, scale, HEADS, max_len, STAGES=stages,
            SEQ_ORDER=order is not None, QBUF=qbuf, num_warps=4)
        check[name] = lambda: (out, ref_out)
    for stages in (2, 3):
        name = f"gluon dK/dV, {stages} stages" + (" *" if g.DKDV_STAGES[dim] == stages else "")
        launch[name] = lambda stages=stages: g._hstu_bwd_dkdv_gluon[key_grid](
            *rows, rows[2], rows[3], dk, dv, dk.stride(0), dv.stride(0), offsets, g_order, scale, HEADS, max_len,
            STAGES=stages, SEQ_ORDER=order is not None, SILU=False, num_warps=4)
        check[name] = lambda: (torch.cat([dk, dv]), torch.cat([ref_dk, ref_dv]))
    chosen = (g.DQ_STAGES[dim], g.DQ_QBUF[dim])
    for stages, qbuf in sorted({chosen, (3, 1), (4, 1), (3, 2), (4, 2), (5, 2)}):
        if dim == 128 and qbuf * 64 + stages * 32 > 192:  # over the 227 KiB of shared memory with the SILU tiles
            continue
        name = f"gluon dQ, {stages} stages, {qbuf} Q/dO buffers" + (" *" if (stages, qbuf) == chosen else "")
        launch[name] = lambda stages=stages, qbuf=qbuf: g._hstu_bwd_dq_gluon[row_grid](
            *rows, rows[0], dq, dq.stride(0), offsets, g_order, 0.5 * scale, HEADS, max_len, STAGES=stages,
            SEQ_ORDER=order is not None, SILU=False, QBUF=qbuf, num_warps=4)
        check[name] = lambda: (dq, ref_dq)
    return launch, check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the variants, alternated (best kept)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    if not (torch.cuda.is_available() and g.AVAILABLE and torch.cuda.get_device_capability() == (9, 0)):
        raise SystemExit("the Gluon HSTU kernels need a Hopper (sm_90) GPU and Triton with Gluon")
    os.environ["RECFORGE_GLUON_HSTU"] = "0"  # the Triton rows; the Gluon variants launch their kernels directly
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU ms per call (* the module's choice)")
    for dim in args.head_dims:
        for max_len in args.seq_lens:
            launch, check = variants(dim, max_len)
            times = {name: [] for name in launch}
            diffs = {}
            for _ in range(args.rounds):
                for name, fn in launch.items():
                    times[name].append(host_and_gpu_ms(fn, False, [], repeats=3)["gpu_ms"])
                    if name in check:
                        torch.cuda.synchronize()
                        diffs[name] = relative_error(*check[name]())
            for name, ms in times.items():
                row = {"dim": dim, "max_len": max_len, "variant": name, "gpu_ms": min(ms), "rounds_ms": ms,
                       "relative_difference_from_triton": diffs.get(name)}  # fmt: skip
                rows.append(row)
                diff = f"  (differs {diffs[name]:.1e})" if name in diffs else ""
                print(f"D {dim:3d}  L {max_len:5d}  {name:<72} {min(ms):7.3f}{diff}", flush=True)
    if args.out:
        atomic_write_json(Path(args.out), {"benchmark": "gluon_variants", "machine": torch.cuda.get_device_name(),
                                     "torch": torch.__version__, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
