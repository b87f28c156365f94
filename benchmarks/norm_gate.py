"""The HSTU block's ``dropout(layer_norm(a) * u)``: the fused Triton kernels (``recforge.ops.norm_gate``) against
the PyTorch chain, forward + backward, one run.

Usage (one H200, about a minute, most of it compiling the ``compiled`` variant):
    PYTHONPATH=. python benchmarks/norm_gate.py --out benchmarks/results/norm_gate-h200.json
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/norm_gate.py --device cpu --shapes 64x32 --reps 1 \
        --variants pytorch fused   # smoke test of the script on a CPU

Shapes (``--shapes``, tokens x width): 38000x128 (``configs/ml1m-hstu-plus-d128.yaml``: 256 users of up to 200
tokens, 2 heads of 64) and 16384x512 (``benchmarks/train_mfu.py``'s ``large``: 16K-token batches, 4 heads of
128). Inputs as in a bf16 training step: ``a`` and ``u`` bfloat16 (``u`` a slice of the uvqk projection),
the LayerNorm's weight and bias float32, everything under bf16 autocast, dropout p = 0 and 0.3 (the ML-1M
config's). Variants: ``pytorch`` (the chain ``HSTUBlock`` ran before: F.layer_norm, *, F.dropout),
``compiled`` (that chain through ``torch.compile``: Inductor's fusion, the bound to compare with) and ``fused``.

1. Correctness: each variant's output and gradients (a, u, weight, bias) against the chain in float32 math
   from the same inputs, dropout given the variant's own mask (read off its output), relative errors under
   explicit tolerances; the kept fraction within 5 standard deviations of 1 - p.
2. Timing: forward + backward (``torch.autograd.grad``), median of ``--reps`` samples, each ``--iters``
   calls. ``eager ms``: launched from Python (host time included, as in an uncaptured step); ``graphed
   ms``: the same calls captured in one CUDA graph and replayed (GPU time, as in ``train.cuda_graphs``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _machine import call_ms, kernel_header, relative_error

from recforge.io import atomic_write_json
from recforge.ops.norm_gate import norm_gate, norm_gate_reference

VARIANTS = ("pytorch", "compiled", "fused")
EPS = 1e-5
TOL = 2e-2  # relative error of bf16 results against float32 math (bf16 keeps 8 bits: ~4e-3 per element)


def make_inputs(tokens: int, width: int, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(tokens, width, generator=gen).to(device, torch.bfloat16).requires_grad_()
    proj = torch.randn(tokens, 4 * width, generator=gen).to(device, torch.bfloat16).requires_grad_()
    weight = (1 + 0.3 * torch.randn(width, generator=gen)).to(device).requires_grad_()
    bias = (0.3 * torch.randn(width, generator=gen)).to(device).requires_grad_()
    grad = torch.randn(tokens, width, generator=gen).to(device, torch.bfloat16)
    return a, proj, weight, bias, grad


def variant_fn(variant: str, p: float):
    """``fn(a, u, weight, bias) -> y`` of ``variant``, training mode."""
    if variant == "fused":
        return lambda a, u, w, b: norm_gate(a, u, w, b, eps=EPS, p=p, training=True, kernel="triton")
    chain = lambda a, u, w, b: norm_gate_reference(a, u, w, b, EPS, p, True)  # noqa: E731
    return torch.compile(chain, dynamic=False) if variant == "compiled" else chain


def check(fn, inputs, width: int, p: float, autocast) -> dict:
    """Relative errors of output and gradients against float32 math given the variant's mask; kept fraction."""
    a, proj, weight, bias, grad = inputs
    u = proj[:, width : 2 * width]
    leaves = [a, proj, weight, bias]
    with autocast():
        y = fn(a, u, weight, bias)
    got = torch.autograd.grad(y, leaves, grad.to(y.dtype))
    plain = F.layer_norm(a.float(), (width,), weight, bias, EPS) * u.float()
    keep = y.detach() != 0 if p > 0 else torch.ones_like(plain, dtype=torch.bool)
    expected = torch.where(keep, plain / (1 - p), 0.0)
    want = torch.autograd.grad(expected, leaves, grad.float())
    errors = {"y": relative_error(y, expected)}
    errors.update({name: relative_error(g, e) for name, g, e in zip(["a", "u", "weight", "bias"], got, want, strict=True)})
    kept = float(keep.float().mean())
    kept_ok = p == 0 or abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / keep.numel())
    # with dropout the mask is read off the output, so an element whose value is 0 must not count as kept; at p = 0
    # every element is kept, and a product that is exactly 0 is no error (it failed the 66432 x 512 shape)
    misread = p > 0 and (keep & (plain.detach() == 0)).any().item()
    return {"errors": errors, "kept_fraction": kept, "ok": kept_ok and max(errors.values()) < TOL and not misread}


def timed(run, reps: int, iters: int, device: torch.device) -> float:
    """Median ms per call of ``run`` (``iters`` calls per sample)."""
    times = [call_ms(run, device) / iters for _ in range(reps)]
    return sorted(times)[len(times) // 2]


def time_variant(fn, inputs, width: int, reps: int, iters: int, device: torch.device, autocast) -> dict:
    a, proj, weight, bias, grad = inputs
    leaves = [a, proj, weight, bias]

    def calls():
        for _ in range(iters):
            with autocast():
                y = fn(a, proj[:, width : 2 * width], weight, bias)
            torch.autograd.grad(y, leaves, grad.to(y.dtype))

    calls()  # compile / warm up
    row = {"eager_ms": timed(calls, reps, iters, device)}
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            calls()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        row["graphed_ms"] = timed(graph.replay, reps, iters, device)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["38000x128", "16384x512"], help="tokens x width (H * Dv)")
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.3])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--reps", type=int, default=20, help="timed samples per variant")
    parser.add_argument("--iters", type=int, default=10, help="forward + backward calls per sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cuda; cpu: a smoke test under TRITON_INTERPRET=1")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    importlib.import_module("recforge.ops.norm_gate").fused = True  # the Triton path whatever RECFORGE_FUSED_NORM_GATE says
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1 for a smoke test)", file=sys.stderr)
        return 2
    autocast = lambda: torch.autocast(device.type, torch.bfloat16)  # noqa: E731
    rows = []
    for shape in args.shapes:
        tokens, width = (int(s) for s in shape.split("x"))
        inputs = make_inputs(tokens, width, device, args.seed)
        for p in args.dropout:
            for variant in args.variants:
                fn = variant_fn(variant, p)
                row = {"tokens": tokens, "width": width, "dropout": p, "variant": variant}
                row.update(check(fn, inputs, width, p, autocast))
                row.update(time_variant(fn, inputs, width, args.reps, args.iters, device, autocast))
                rows.append(row)
    base = {(r["tokens"], r["width"], r["dropout"]): r for r in rows if r["variant"] == "pytorch"}
    print(f"\n{'shape':>10} {'p':>4} {'variant':>9} {'eager ms':>9} {'graphed ms':>10} {'vs pytorch':>10} "
          f"{'max rel err':>11} {'ok':>4}")  # fmt: skip
    for r in rows:
        ref = base.get((r["tokens"], r["width"], r["dropout"]))
        key = "graphed_ms" if "graphed_ms" in r else "eager_ms"
        r["speedup_vs_pytorch"] = ref[key] / r[key] if ref else None
        print(f"{r['tokens']:>5}x{r['width']:<4} {r['dropout']:>4} {r['variant']:>9} {r['eager_ms']:>9.3f} "
              f"{r.get('graphed_ms', float('nan')):>10.3f} {r['speedup_vs_pytorch'] or float('nan'):>9.2f}x "
              f"{max(r['errors'].values()):>11.2e} {str(r['ok']):>4}")  # fmt: skip
    correct = all(r["ok"] for r in rows)
    result = {
        **kernel_header("norm_gate", device), "rows": rows, "correct": correct,
    }  # fmt: skip
    if args.out:
        atomic_write_json(Path(args.out), result)
    if not correct:
        print("FAILED: a variant's output or gradient is off float32 math, or its kept fraction is off 1 - p",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
