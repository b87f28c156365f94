"""Every HSTU attention kernel at every tile of a grid, each launched alone: which tile is fastest per shape.

Usage:
    PYTHONPATH=. python benchmarks/attention_tiles.py --head-dims 64 128 --seq-lens 2048 8192 --workers 14 \
        --out benchmarks/results/attention_tiles-h200.json

The autotuning lists in ``recforge.ops.triton.tuning`` can only pick among the tiles they hold; this sweep
times tiles they do not hold. For each head dim and maximum length L, the jagged bf16 batch of
``benchmarks/attention.py`` (~``--tokens`` tokens, causal, 4 heads, no relative bias); each kernel
(``fwd``, ``dq``, ``dkdv``, and ``dkdv_fused``: dK/dV with dQ by float32 atomics) is launched with one
(BLOCK_M, BLOCK_N, warps, stages) tile at a time, exactly as ``tuning.launch`` launches an autotuned
kernel (two loops: ``SPLIT_LOOPS``). Each tile's outputs are first checked against the first tile's
(a tile that compiles wrongly is reported, not timed); then ``triton.testing.do_bench`` (median,
warmup 25 ms, rep 100 ms). TFLOP/s count the kernel's matmuls over the visible (query, key) pairs:
2 (fwd), 3 (dq: scores, dA, dQ), 4 (dkdv), 5 (dkdv_fused). A tile that needs more shared memory than the
GPU has is reported as such. ``--workers N`` compiles all tiles in N processes first (Triton's disk cache).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time

import torch
import triton
from _machine import kernel_header, write_result
from attention import inputs_for, make_lengths, matmul_peak

from recforge.jagged.mask import AttentionMask
from recforge.ops.triton import hstu as hstu_mod

KERNELS = ("fwd", "dq", "dkdv", "dkdv_fused")
MATMULS = {"fwd": 2, "dq": 3, "dkdv": 4, "dkdv_fused": 5}


def default_tiles(kernel: str, dim: int) -> list[tuple[int, int, int, int]]:
    """The grid swept for ``kernel`` at head dim ``dim``: (BLOCK_M, BLOCK_N, warps, stages)."""
    if kernel == "fwd" or kernel == "dq":  # row blocks: BLOCK_M queries walk keys in BLOCK_N tiles
        ms, ns = (64, 128), (32, 64, 128)
    else:  # key blocks: BLOCK_N keys walk queries in BLOCK_M tiles
        ms, ns = (32, 64, 128), (64, 128)
    tiles = []
    for bm, bn, warps, stages in itertools.product(ms, ns, (4, 8), (2, 3, 4)):
        if bm * bn >= 128 * 128 and warps == 4:  # 64 KB of float32 scores per warp group: spills
            continue
        if dim > 64 and bm * bn <= 32 * 64 and warps == 8:
            continue
        tiles.append((bm, bn, warps, stages))
    return tiles


def collect_launches(dim: int, lengths: list[int], seed: int, fused: bool) -> dict[str, tuple]:
    """kernel name -> (kernel, grid_blocks, batch, heads, max_seq_len, args, meta) of one forward and backward
    (nothing launched: ``hstu.launch`` is replaced while the calls run)."""
    (q, k, v), offsets = inputs_for(lengths, dim, seed)
    calls: dict[str, tuple] = {}

    def collect(kernel, grid_blocks, batch, heads, max_seq_len, args, meta):
        name = {"_hstu_fwd": "fwd", "_hstu_bwd_dq": "dq", "_hstu_bwd_dkdv": "dkdv"}[kernel.fn.__name__]
        if name == "dkdv" and meta.get("FUSED_DQ"):
            name = "dkdv_fused"
        calls[name] = (kernel, grid_blocks, batch, heads, max_seq_len, args, dict(meta, SPLIT_LOOPS=True))

    saved, saved_fused = hstu_mod.launch, hstu_mod.fused_dq
    hstu_mod.launch, hstu_mod.fused_dq = collect, fused
    try:
        L = max(lengths)
        out = hstu_mod.hstu_forward(q, k, v, offsets, L, hstu_mod.mask_args(AttentionMask(), offsets), 1.0 / L,
                                    None, None, None, 0)  # fmt: skip
        hstu_mod.hstu_backward(torch.randn_like(out), q, k, v, offsets, L, hstu_mod.mask_args(AttentionMask(), offsets),
                               1.0 / L, None, None, None, 0, False, False)  # fmt: skip
    finally:
        hstu_mod.launch, hstu_mod.fused_dq = saved, saved_fused
    return calls


def all_launches(dim: int, lengths: list[int], seed: int, kernels: list[str]) -> dict[str, tuple]:
    calls = collect_launches(dim, lengths, seed, fused=False)
    if "dkdv_fused" in kernels:
        calls.update(collect_launches(dim, lengths, seed, fused=True))
    return {k: calls[k] for k in kernels}


def run_tile(call: tuple, tile: tuple[int, int, int, int]) -> None:
    kernel, grid_blocks, batch, heads, max_seq_len, args, meta = call
    bm, bn, warps, stages = tile
    blocks = -(-hstu_mod.max_len_bucket(max_seq_len) // (bm if grid_blocks == "m" else bn))
    kernel.fn[(blocks * batch * heads, 1, 1)](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                              num_stages=stages)  # fmt: skip


OUTPUTS = {"fwd": (3,), "dq": (4,), "dkdv": (4, 5), "dkdv_fused": (4, 5, 6)}  # positions in args


def outputs_of(name: str, call: tuple, tile: tuple) -> list[torch.Tensor]:
    args = call[5]
    for i in OUTPUTS[name]:
        args[i].zero_()
    run_tile(call, tile)
    return [args[i].float().clone() for i in OUTPUTS[name]]


def compile_worker(spec: dict) -> None:
    """Child: compile (not run) this worker's share of every (shape, kernel, tile)."""
    jobs = []
    for dim in spec["dims"]:
        lengths = make_lengths(spec["seq_lens"][0], 4096, spec["seed"])  # any batch: same specialization
        for name, call in all_launches(dim, lengths, spec["seed"], spec["kernels"]).items():
            jobs += [(call, tile) for tile in default_tiles(name, dim)]
    for call, (bm, bn, warps, stages) in jobs[spec["index"]::spec["count"]]:
        kernel, _, _, _, _, args, meta = call
        try:
            kernel.fn.warmup(*args, grid=(1,), **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        except Exception as e:  # noqa: BLE001 - the timed process reports it
            print(f"compile {kernel.fn.__name__} {bm, bn, warps, stages}: {type(e).__name__}", flush=True)


def precompile(workers: int, spec: dict) -> None:
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--_compile-worker",
                               json.dumps(dict(spec, index=i, count=workers))]) for i in range(workers)]  # fmt: skip
    codes = [p.wait() for p in procs]
    print(f"compiled the tiles in {workers} processes: {time.perf_counter() - start:.0f} s, exit codes {codes}",
          flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    p.add_argument("--seq-lens", type=int, nargs="*", default=[2048, 8192])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--workers", type=int, default=0, help="compile every tile in N processes first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--_compile-worker", dest="compile_worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.compile_worker:
        compile_worker(json.loads(a.compile_worker))
        return
    if not torch.cuda.is_available():
        raise SystemExit("attention_tiles.py times CUDA kernels: no CUDA device here")
    if a.workers:
        precompile(a.workers, {"dims": a.head_dims, "seq_lens": a.seq_lens, "seed": a.seed, "kernels": a.kernels})
    peak = matmul_peak()
    doc = dict(kernel_header("attention_tiles", torch.device("cuda")), matmul_peak_tflops=peak, rows=[])
    print(f"measured bf16 matmul peak {peak:.0f} TFLOP/s")
    for dim, L in itertools.product(a.head_dims, a.seq_lens):
        lengths = make_lengths(L, a.tokens, a.seed)
        pairs = sum(n * (n + 1) / 2 for n in lengths)
        for name, call in all_launches(dim, lengths, a.seed, a.kernels).items():
            tiles = default_tiles(name, dim)
            reference = None
            results = []
            for tile in tiles:
                row = {"dim": dim, "max_len": L, "tokens": sum(lengths), "kernel": name, "tile": list(tile)}
                try:
                    outs = outputs_of(name, call, tile)
                    if reference is None:
                        reference = outs
                    err = max(float((o - r).abs().max() / r.abs().max().clamp_min(1e-6))
                              for o, r in zip(outs, reference, strict=True))  # fmt: skip
                    row["rel_err_vs_first_tile"] = err
                    if err > 0.05:
                        row["error"] = f"outputs differ from the first tile's ({err:.3g} relative)"
                    else:
                        ms = triton.testing.do_bench(lambda: run_tile(call, tile), warmup=25, rep=100,
                                                     return_mode="median")  # fmt: skip
                        tflops = MATMULS[name] * 2 * pairs * dim * 4 / ms / 1e9
                        row.update(ms=ms, tflops=tflops, share_of_peak=tflops / peak)
                except triton.runtime.errors.OutOfResources as e:
                    row["error"] = f"out of resources: {str(e)[:120]}"
                except Exception as e:  # noqa: BLE001 - one tile's failure is a row
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                doc["rows"].append(row)
                results.append(row)
            timed = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
            print(f"D {dim} L {L} {name}: " + "  ".join(f"{tuple(r['tile'])} {r['ms']:.3f} ms {r['share_of_peak']:.0%}"
                                                         for r in timed[:5]), flush=True)  # fmt: skip
            failed = [r for r in results if "error" in r]
            if failed:
                print(f"  {len(failed)} tiles not timed, e.g. {tuple(failed[0]['tile'])}: {failed[0]['error'][:100]}")
    if a.out:
        write_result(a.out, doc)


if __name__ == "__main__":
    main()
