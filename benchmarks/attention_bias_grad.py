"""HSTU attention backward with learned position and time biases: the per-tile bias-gradient sums
(``recforge.ops.triton.bias_grad``) against the per-pair atomics of earlier releases, one run.

Usage (one H200; mostly compiling, estimated under 10 minutes on a machine with a cold Triton cache):
    PYTHONPATH=. python benchmarks/attention_bias_grad.py --out benchmarks/results/attention_bias_grad-h200.json
    PYTHONPATH=. python benchmarks/attention_bias_grad.py --lengths 1024 --dims 64 --tokens 8192   # quick
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/attention_bias_grad.py --device cpu --lengths 40 --dims 16 \
        --tokens 100 --reference-lengths 30 7 1 --reps 1   # smoke test of the script on a CPU

1. Correctness: on a small jagged batch (contextual tokens, targets, distances past P, long and
   short time gaps) the Triton gradients of q, k, v, pos_weights and time_weights, float32 and
   bfloat16, against the float64 PyTorch reference (relative error, explicit tolerances).
2. Timing, per max length L (256: the one-loop fixed-tile launch of short sequences, as ML-1M)
   and head dim: a jagged causal batch of ~``--tokens`` tokens (one sequence of L, the rest
   N(0.6 L, 0.25 L), as ``benchmarks/attention.py``), bf16, 4 heads,
   P = L position weights and 128 + 1 time buckets (as ``models.hstu``), timestamps 1 s - 1 h
   apart (as ``benchmarks/long_seq.py``). One backward (the dQ and dK/dV kernels) is timed:
   ``per-tile`` (per-tile sums, the time buckets computed twice, the fixed tile's 4 warps),
   ``per-tile, unrolled`` (``hstu.time_loop_in_masked_tiles`` off: the masked tiles' time buckets
   also unrolled, every tile loop software-pipelined), ``per-tile, reused buckets``
   (``hstu.reuse_time_bucket``: the time buckets of the scores reused for the gradient), ``per-tile,
   8 warps`` (``tuning.bias_grad_fixed_warps``: the fixed-tile launch of L <= 256 with 8 warps instead
   of 4; the same as ``per-tile`` on longer, autotuned launches), ``per-tile, reused buckets, 8 warps``
   (both: this release's default), ``per-pair`` (``hstu.pair_atomics``: earlier releases) and
   ``no bias grad`` (the weights frozen: POS_GRAD/TIME_GRAD off, the lower bound), and per-tile with
   only one of the two weights trained (``pos grad only``, ``time grad only``); the variants not named
   after the two switches run with this release's defaults. Per-tile and
   per-pair bias gradients must agree (float32 sums in another order). Every kernel is autotuned
   over the first three tiles of its list (``--autotune``: the whole list, many minutes of
   compiling); the autotuning key holds no variant flag, so all variants run the tile tuned first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from _machine import call_ms, kernel_header
from attention import HEADS, flops, make_lengths

from recforge.io import atomic_write_json
from recforge.jagged.index import offsets_from_lengths
from recforge.jagged.mask import AttentionMask
from recforge.ops.hstu_attention import hstu_attention, hstu_attention_reference
from recforge.ops.triton import hstu as hstu_kernels
from recforge.ops.triton import tuning

NUM_BUCKETS = 128
TOL = {torch.float32: {"qkv": 2e-5, "weights": 2e-4}, torch.bfloat16: {"qkv": 2e-2, "weights": 2e-2}}
VARIANTS = ("per-tile", "per-tile, unrolled", "per-tile, reused buckets", "per-tile, 8 warps",
            "per-tile, reused buckets, 8 warps",
            "per-pair", "no bias grad", "pos grad only", "time grad only")
SWITCHES = {  # variant: (hstu.reuse_time_bucket, tuning.bias_grad_fixed_warps)
    "per-tile": (False, None), "per-tile, reused buckets": (True, None), "per-tile, 8 warps": (False, 8),
    "per-tile, reused buckets, 8 warps": (True, 8),
}


def timestamps(gen: torch.Generator, total: int) -> torch.Tensor:
    return 1_700_000_000 + torch.cumsum(torch.randint(1, 3600, (total,), generator=gen), 0)


def reference_check(dim: int, device: torch.device, seed: int, lengths: list[int]) -> list[dict]:
    """Relative errors of every gradient against the float64 reference, fp32 and bf16 (CUDA only)."""
    gen = torch.Generator().manual_seed(seed)
    total, max_len = sum(lengths), max(lengths)
    offsets = offsets_from_lengths(torch.tensor(lengths))
    contextual = [min(n, [3, 0, 5, 1][s % 4]) for s, n in enumerate(lengths)]
    targets = [min(n - c, [7, 2, 0, 4][s % 4]) for s, (n, c) in enumerate(zip(lengths, contextual))]
    mask = AttentionMask(num_contextual=torch.tensor(contextual), num_targets=torch.tensor(targets))
    ts = timestamps(gen, total)
    rows = []
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        q, k, v, grad = (torch.randn(total, 2, dim, generator=gen) for _ in range(4))
        pos_w, time_w = torch.randn(300, generator=gen), torch.randn(NUM_BUCKETS + 1, generator=gen)
        low = [x.to(device, dtype if n < 3 else torch.float32).requires_grad_() for n, x in enumerate((q, k, v, pos_w, time_w))]
        ref_in = [x.detach().double().requires_grad_() for x in low]
        args = (offsets.to(device), max_len, mask.to(device))
        out = hstu_attention(*low[:3], *args, scale=1 / max_len, pos_weights=low[3], timestamps=ts.to(device),
                             time_weights=low[4], kernel="triton")
        ref = hstu_attention_reference(*ref_in[:3], *args, 1 / max_len, ref_in[3], ts.to(device), ref_in[4])
        g = grad.to(device, dtype)
        got = torch.autograd.grad(out, low, g)
        want = torch.autograd.grad(ref, ref_in, g.double())
        errors = {name: float((a.double() - b).norm() / b.norm())
                  for name, a, b in zip(("q", "k", "v", "pos_weights", "time_weights"), got, want)}
        ok = all(e <= TOL[dtype]["weights" if n.endswith("weights") else "qkv"] for n, e in errors.items())
        rows.append({"dtype": str(dtype).removeprefix("torch."), "head_dim": dim, "relative_errors": errors, "ok": ok})
        print(rows[-1], flush=True)
    return rows


def time_backward(run, reps: int, budget_s: float, device: torch.device) -> tuple[float, int]:
    """Median ms of run() (one backward), at least one call, at most ``reps`` or ``budget_s`` seconds."""
    run()  # compile / autotune / warm up
    times = []
    start = time.perf_counter()
    while len(times) < reps and (not times or time.perf_counter() - start < budget_s):
        times.append(call_ms(run, device))
    return sorted(times)[len(times) // 2], len(times)


def timing_case(max_len: int, dim: int, tokens: int, seed: int, reps: int, budget_s: float,
                device: torch.device, variants: tuple[str, ...] = VARIANTS) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's bf16 is wrong
    gen = torch.Generator().manual_seed(seed + max_len + dim)
    lengths = make_lengths(max_len, tokens, seed)
    total = sum(lengths)
    offsets = offsets_from_lengths(torch.tensor(lengths)).to(device)
    q, k, v, grad = (torch.randn(total, HEADS, dim, generator=gen).to(device, dtype) for _ in range(4))
    ts = timestamps(gen, total).to(device)
    pos_w = (torch.randn(max_len, generator=gen) * 0.1).to(device)
    time_w = (torch.randn(NUM_BUCKETS + 1, generator=gen) * 0.1).to(device)
    fl_fwd, fl_all = flops(lengths, dim)
    head = {"max_len": max_len, "head_dim": dim, "sequences": len(lengths), "tokens": total, "heads": HEADS}
    rows, bias_grads = [], {}
    defaults = [(module, name, getattr(module, name)) for module, name in (
        (hstu_kernels, "pair_atomics"), (hstu_kernels, "time_loop_in_masked_tiles"), (hstu_kernels, "reuse_time_bucket"),
        (tuning, "bias_grad_fixed_warps"))]  # fmt: skip
    reuse, warps = hstu_kernels.reuse_time_bucket, tuning.bias_grad_fixed_warps

    def backward_of(variant: str) -> tuple[float, int, list[torch.Tensor]]:
        """(median ms, calls timed, bias gradients) of one variant's backward."""
        hstu_kernels.pair_atomics = variant == "per-pair"
        hstu_kernels.time_loop_in_masked_tiles = variant != "per-tile, unrolled"
        # the four per-tile variants set both switches; every other variant runs with this release's defaults
        hstu_kernels.reuse_time_bucket, tuning.bias_grad_fixed_warps = SWITCHES.get(variant, (reuse, warps))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        wants = {"no bias grad": (False, False), "pos grad only": (True, False), "time grad only": (False, True)}
        weights = [w.detach().requires_grad_(want) for w, want in zip((pos_w, time_w), wants.get(variant, (True, True)))]
        out = hstu_attention(*leaves, offsets, max_len, AttentionMask(), scale=1 / max_len, pos_weights=weights[0],
                             timestamps=ts, time_weights=weights[1], kernel="triton")
        wanted = leaves + [w for w in weights if w.requires_grad]
        grads = []

        def run():
            grads[:] = torch.autograd.grad(out, wanted, grad, retain_graph=True)

        ms, calls = time_backward(run, reps if variant != "per-pair" else min(reps, 3), budget_s, device)
        return ms, calls, [g.float() for g in grads[3:]]

    for variant in variants:
        ms, calls, bias_grads[variant] = backward_of(variant)
        rows.append({**head, "variant": variant, "backward_ms": ms, "calls_timed": calls,
                     "backward_tflops": (fl_all - fl_fwd) / ms / 1e9})
        print(rows[-1], flush=True)
    for module, name, value in defaults:
        setattr(module, name, value)
    old = bias_grads.get("per-pair")
    agree = {f"{variant}: {name}": float((a - b).norm() / b.norm().clamp_min(1e-30))
             for variant in VARIANTS[:5]
             if variant in bias_grads and old is not None
             for name, a, b in zip(("pos", "time"), bias_grads[variant], old)}
    by = {r["variant"]: r["backward_ms"] for r in rows}
    for r in rows:
        r["per_tile_vs_per_pair_relative_diff"] = agree
        r["agree"] = all(e <= 1e-3 for e in agree.values())
        r["speedup_vs_per_pair"] = by["per-pair"] / by[r["variant"]] if "per-pair" in by else float("nan")
        if "no bias grad" in by:
            r["ms_over_no_bias_grad"] = r["backward_ms"] - by["no bias grad"]
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384],
                   help="max tokens per sequence (<= 256: the fixed-tile, one-loop launch, as ML-1M training)")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="head dims")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per batch")
    p.add_argument("--reps", type=int, default=10, help="timed backward calls (per-pair: 3)")
    p.add_argument("--budget", type=float, default=5.0, help="seconds of timed calls per case and variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="variants timed")
    p.add_argument("--device", default="cuda", help="cuda; cpu: a smoke test under TRITON_INTERPRET=1")
    p.add_argument("--reference-lengths", type=int, nargs="+", default=[700, 333, 1, 512, 90],
                   help="the jagged batch checked against the reference")
    p.add_argument("--autotune", action="store_true", help="autotune tiles over the whole candidate lists")
    p.add_argument("--out", default="")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for a smoke test)", file=sys.stderr)
        return 2
    if not args.autotune:
        tuning.shorten_hstu_candidates(3)  # short compiles
    checks = reference_check(args.dims[0], device, args.seed, args.reference_lengths)
    rows: list[dict] = []

    def result() -> dict:
        return {
            **kernel_header("attention_bias_grad", device), "autotuned": args.autotune,
            "time_steps": hstu_kernels.TIME_STEPS, "reference_checks": checks, "rows": rows, "correct": all(c["ok"] for c in checks) and all(r["agree"] for r in rows),
        }  # fmt: skip

    for L in args.lengths:
        for dim in args.dims:
            rows += timing_case(L, dim, args.tokens, args.seed, args.reps, args.budget, device, tuple(args.variants))
            if args.out:  # after every case: a run stopped by a time limit keeps what it measured
                atomic_write_json(Path(args.out), result())
    print(f"\n{'L':>6} {'D':>4} {'variant':>18} {'bwd ms':>9} {'TFLOP/s':>8} {'vs per-pair':>11} {'agree':>6}")
    for r in rows:
        print(f"{r['max_len']:>6} {r['head_dim']:>4} {r['variant']:>18} {r['backward_ms']:>9.2f} "
              f"{r['backward_tflops']:>8.1f} {r['speedup_vs_per_pair']:>10.1f}x {str(r['agree']):>6}")
    correct = result()["correct"]
    if not correct:
        print("FAILED: a gradient is off the reference, or per-tile and per-pair bias gradients differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
