"""Sampled softmax's per-position gather-dot, ``logits[n, r] = q[n] . table[idx[n, r]]``: the fused Triton kernels
(``recforge.ops.gather_dot``) against PyTorch's gather + bmm, forward + backward, one run.

Usage (one H200, about two minutes):
    PYTHONPATH=. python benchmarks/gather_dot.py --out benchmarks/results/gather_dot-h200.json
    PYTHONPATH=. python benchmarks/gather_dot.py --dtypes float32 --tiles 2048 4096 8192 \
        --out benchmarks/results/gather_dot-tiles-h200.json            # the kernels' tile size
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/gather_dot.py --device cpu --shapes 40x9x24 --rows 50 \
        --reps 1 --iters 1 --variants pytorch fused   # smoke test of the script on a CPU
    PYTHONPATH=. python benchmarks/gather_dot.py --dtypes float32 --variants pytorch fused fusedsplit --hot-share 0.1 \
        --out benchmarks/results/gather_dot-split-h200.json    # a skewed sample: long rows split (split_segments)

Shapes (``--shapes``, N x R x D): 16384x129x1024 (``benchmarks/train_mfu.py``'s ``large``: 16K positions, the
target and 128 negatives each, d 1024) and 4096x129x512 (its ``medium``), over a ``--rows`` (100,001) row table,
indices uniform. ``--dtypes``: float32 is what ``sampled_softmax_loss`` runs (it computes in float32 also under
bf16 autocast), bfloat16 the half-width case. Variants: ``pytorch`` (``bmm(F.embedding(idx, table), q)``, what
the loss ran before; its backward writes the (N, R, D) gradient and scatters it), ``compiled`` (that through
``torch.compile``: Inductor's own fusion, not run by default) and ``fused`` (``fused@T`` with ``--tiles``: T
elements per program's tile).

1. Correctness: each variant's logits and gradients (q, table) against the same computation in float32 from the
   inputs' values (PyTorch, TF32 off), relative errors under explicit tolerances.
2. Timing: CUDA-event medians of ``--reps`` samples of ``--iters`` calls each: forward, forward + backward
   (``torch.autograd.grad`` of both inputs), and for ``fused`` each backward kernel alone (dq, dtable with its
   sort); peak memory of one forward + backward; the fused forward's effective bandwidth (gathered bytes / time).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
from _machine import call_ms, kernel_header, relative_error

from recforge.io import atomic_write_json
from recforge.ops.gather_dot import gather_dot_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # relative error vs float32 math
SPLIT = 4096  # ``fusedsplit``: the kernels' split_segments (pairs per program at most); --split sets it
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_inputs(n: int, r: int, d: int, rows: int, dtype: torch.dtype, device: torch.device, seed: int,
                hot_share: float = 0.0):  # fmt: skip
    """``hot_share``: that fraction of the pairs on row 1 (a skewed sample), the rest uniform."""
    gen = torch.Generator(device).manual_seed(seed)
    q = torch.randn(n, d, generator=gen, device=device).to(dtype).requires_grad_()
    table = torch.randn(rows, d, generator=gen, device=device).to(dtype).requires_grad_()
    idx = torch.randint(0, rows, (n, r), generator=gen, device=device)
    if hot_share:
        idx = torch.where(torch.rand(n, r, generator=gen, device=device) < hot_share, 1, idx)
    grad = torch.randn(n, r, generator=gen, device=device)
    return q, table, idx, grad


@contextlib.contextmanager
def accumulation(variant: str):
    """``fused2d`` variants: the kernels' ``accumulate_2d`` switch on for the duration (``fused``: off)."""
    from recforge.ops.triton import gather_dot as kernels

    before = kernels.accumulate_2d, kernels.split_segments
    kernels.accumulate_2d = variant.startswith("fused2d")
    kernels.split_segments = SPLIT if variant.startswith("fusedsplit") else 0
    try:
        yield
    finally:
        kernels.accumulate_2d, kernels.split_segments = before


def variant_fn(variant: str):
    """``fn(q, table, idx) -> (N, R) float32 logits`` with autograd."""
    if variant.startswith("fused"):
        from recforge.ops.triton.gather_dot import TILE, gather_dot_forward, gather_rows_sum, scatter_rows_sum

        tile = int(variant.partition("@")[2] or TILE)

        class Fused(torch.autograd.Function):  # GatherDot with this tile and accumulation
            @staticmethod
            def forward(ctx, q, table, idx):
                ctx.save_for_backward(q, table, idx)
                with accumulation(variant):
                    return gather_dot_forward(q, table, idx, tile)

            @staticmethod
            def backward(ctx, g):
                q, table, idx = ctx.saved_tensors
                with accumulation(variant):
                    return gather_rows_sum(g, table, idx, tile), scatter_rows_sum(g, q, idx, table.shape[0], tile), None

        return Fused.apply
    return torch.compile(gather_dot_reference, dynamic=False) if variant == "compiled" else gather_dot_reference


def expected_results(q, table, idx, grad):
    """Logits and gradients in float32 from the inputs' values (the oracle; TF32 off)."""
    q32, t32 = q.detach().float().requires_grad_(), table.detach().float().requires_grad_()
    logits = gather_dot_reference(q32, t32, idx)
    return (logits.detach(), *torch.autograd.grad(logits, [q32, t32], grad))


def check(fn, inputs, expected) -> dict:
    q, table, idx, grad = inputs
    logits = fn(q, table, idx)
    got = (logits, *torch.autograd.grad(logits, [q, table], grad))
    errors = {name: relative_error(g, e) for name, g, e in zip(("logits", "dq", "dtable"), got, expected, strict=True)}
    return {"errors": errors, "ok": max(errors.values()) < TOL[q.dtype]}


def timed(run, reps: int, iters: int, device: torch.device) -> float:
    """Median ms per call of ``run`` (``iters`` calls per sample)."""
    times = [call_ms(run, device) / iters for _ in range(reps)]
    return sorted(times)[len(times) // 2]


def time_variant(variant: str, fn, inputs, reps: int, iters: int, device: torch.device) -> dict:
    q, table, idx, grad = inputs

    def forward():
        for _ in range(iters):
            with torch.no_grad():
                fn(q, table, idx)

    def forward_backward():
        for _ in range(iters):
            torch.autograd.grad(fn(q, table, idx), [q, table], grad)

    forward_backward()  # compile / warm up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        torch.autograd.grad(fn(q, table, idx), [q, table], grad)
        torch.cuda.synchronize(device)
    row = {"fwd_ms": timed(forward, reps, iters, device), "fwd_bwd_ms": timed(forward_backward, reps, iters, device)}
    if device.type == "cuda":
        row["peak_extra_gb"] = (torch.cuda.max_memory_allocated(device) - base) / 1e9
    if variant.startswith("fused"):
        from recforge.ops.triton.gather_dot import TILE, gather_rows_sum, scatter_rows_sum, sort_pairs

        tile = int(variant.partition("@")[2] or TILE)
        qd, td = q.detach(), table.detach()
        parts = {"dq_ms": lambda: gather_rows_sum(grad, td, idx, tile),
                 "dtable_ms": lambda: scatter_rows_sum(grad, qd, idx, td.shape[0], tile),
                 "sort_ms": lambda: sort_pairs(idx, td.shape[0])}  # fmt: skip
        for key, run in parts.items():
            with accumulation(variant):
                row[key] = timed(lambda run=run: [run() for _ in range(iters)], reps, iters, device)
        gathered = idx.numel() * q.shape[1] * q.element_size()
        row["fwd_gathered_gb_per_s"] = gathered / (row["fwd_ms"] * 1e-3) / 1e9
    return row


def main() -> int:
    global SPLIT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["16384x129x1024", "4096x129x512"], help="N x R x D")
    parser.add_argument("--rows", type=int, default=100_001, help="table rows (items + the padding row)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--variants", nargs="+", default=["pytorch", "fused"], help="pytorch, compiled, fused, fused2d (fused with the kernels' accumulate_2d), fusedsplit (with split_segments)")
    parser.add_argument("--hot-share", type=float, default=0.0, help="fraction of the pairs on one row (skew)")
    parser.add_argument("--split", type=int, default=SPLIT, help="fusedsplit: pairs per dtable program at most")
    parser.add_argument("--tiles", type=int, nargs="*", default=[], help="fused variants fused@T, T elements per tile")
    parser.add_argument("--reps", type=int, default=10, help="timed samples per variant")
    parser.add_argument("--iters", type=int, default=5, help="calls per sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cuda; cpu: a smoke test under TRITON_INTERPRET=1")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for a smoke test)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle and the pytorch variant in full float32
    SPLIT = args.split
    tiled = [v for v in args.variants if v in ("fused", "fused2d", "fusedsplit")] if args.tiles else []
    variants = [v for v in args.variants if v not in tiled] + [f"{v}@{t}" for v in tiled for t in args.tiles]
    bad = [v for v in variants if v.partition("@")[0] not in ("pytorch", "compiled", "fused", "fused2d", "fusedsplit")]
    if bad:
        parser.error(f"unknown variants {bad} (expected pytorch, compiled, fused, fused2d, fusedsplit)")
    rows = []
    for shape in args.shapes:
        n, r, d = (int(s) for s in shape.split("x"))
        for dtype_name in args.dtypes:
            inputs = make_inputs(n, r, d, args.rows, DTYPES[dtype_name], device, args.seed, args.hot_share)
            expected = expected_results(*inputs)
            for variant in variants:
                fn = variant_fn(variant)
                row = {"n": n, "r": r, "d": d, "rows": args.rows, "dtype": dtype_name, "variant": variant,
                       "hot_share": args.hot_share, "split": SPLIT if variant.startswith("fusedsplit") else 0}
                row.update(check(fn, inputs, expected))
                row.update(time_variant(variant, fn, inputs, args.reps, args.iters, device))
                rows.append(row)
                print(row, flush=True)
            del inputs, expected
            if device.type == "cuda":
                torch.cuda.empty_cache()
    base = {(r["n"], r["r"], r["d"], r["dtype"]): r for r in rows if r["variant"] == "pytorch"}
    print(f"\n{'shape':>16} {'dtype':>9} {'variant':>11} {'fwd ms':>8} {'fwd+bwd ms':>10} {'vs pytorch':>10} "
          f"{'peak GB':>8} {'max rel err':>11} {'ok':>4}")  # fmt: skip
    for r in rows:
        ref = base.get((r["n"], r["r"], r["d"], r["dtype"]))
        r["speedup_vs_pytorch"] = ref["fwd_bwd_ms"] / r["fwd_bwd_ms"] if ref else None
        print(f"{r['n']:>6}x{r['r']}x{r['d']:<5} {r['dtype']:>9} {r['variant']:>11} {r['fwd_ms']:>8.3f} "
              f"{r['fwd_bwd_ms']:>10.3f} {r['speedup_vs_pytorch'] or float('nan'):>9.2f}x "
              f"{r.get('peak_extra_gb', float('nan')):>8.2f} {max(r['errors'].values()):>11.2e} {str(r['ok']):>4}")  # fmt: skip
    correct = all(r["ok"] for r in rows)
    result = {
        **kernel_header("gather_dot", device), "rows": rows, "correct": correct,
    }  # fmt: skip
    if args.out:
        atomic_write_json(Path(args.out), result)
    if not correct:
        print("FAILED: a variant's logits or gradients are off float32 math", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
