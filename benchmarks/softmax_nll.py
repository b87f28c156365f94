"""The sampled softmax's per-row loss and logit gradients (``recforge.ops.softmax_nll``): the Triton kernel's launch
configurations against PyTorch's ops compiled by Inductor, at the loss's shapes.

Usage:
    PYTHONPATH=. python benchmarks/softmax_nll.py --out benchmarks/results/softmax_nll-h200.json

Shapes (``--shapes``, T x K): 65,536 x 8,192 shared columns (the MFU benchmark's loss, ``benchmarks/train_mfu.py``),
65,536 x 129 per-position columns (the HSTU paper's sampled softmax), 16,384 x 20,000 shared columns (wider than a
program holds: two reads). float32 logits in, bfloat16 gradient out (``loss.matmul: float16``); accidental hits and
padding columns drawn as the loss has them. ``pytorch``: ``softmax_nll_reference`` under ``torch.compile`` (Inductor's
fusion of the logsumexp and the softmax). Each configuration (elements of a program's row block, row blocks per
program, warps, shared ids kept in registers; the default is ``recforge.ops.triton.softmax_nll``'s WIDE or
NARROW) is checked against the reference, then timed: median ms of ``--reps`` calls (CUDA events), the rounds
alternated over the variants; GB/s counts one read of the logits and one write of the gradient.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
from _machine import call_ms, kernel_header, write_result

from recforge.ops.softmax_nll import softmax_nll_reference
from recforge.ops.triton import softmax_nll as kernels

SHAPES = {"64k-8192-shared": (65536, 8192, False), "64k-129-own": (65536, 129, True),
          "16k-20000-shared": (16384, 20000, False)}  # fmt: skip


def _inputs(t: int, k: int, per_row: bool, device):
    gen = torch.Generator(device).manual_seed(0)
    logits = torch.randn(t, k, device=device, generator=gen) * 4
    pos = torch.randn(t, device=device, generator=gen) * 4
    ids = torch.randint(0, 100_000, (t, k) if per_row else (k,), device=device, generator=gen)
    targets = torch.randint(1, 100_000, (t,), device=device, generator=gen)
    targets[::7] = ids[..., 0] if not per_row else ids[::7, 0]  # some accidental hits
    share = torch.rand(t, device=device, generator=gen)
    return logits, pos, ids, targets, share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tiles", nargs="*", type=int, default=[8192, 16384, 32768])
    p.add_argument("--groups", nargs="*", type=int, default=[1, 4, 8])
    p.add_argument("--warps", nargs="*", type=int, default=[4, 8, 16])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device("cuda")
    doc = dict(kernel_header("softmax_nll", device), wide=list(kernels.WIDE), narrow=list(kernels.NARROW), rows=[])
    reference = torch.compile(lambda *x: softmax_nll_reference(*x, grad_dtype=torch.bfloat16))
    configs = [tuple(c) for c in itertools.product(a.tiles, a.groups, a.warps, (True, False))]
    for shape in a.shapes:
        t, k, per_row = SHAPES[shape]
        default = str(kernels.WIDE if k >= 4096 else kernels.NARROW)
        inputs = _inputs(t, k, per_row, device)
        want = reference(*inputs)
        runs = {"pytorch": lambda x=inputs: reference(*x)}
        kept = not per_row and k <= kernels.WHOLE_ROW  # shared ids in registers: else the flag is ignored
        for c in configs if kept else [c for c in configs if c[3]]:
            got = kernels.softmax_nll(*inputs, torch.bfloat16, config=c)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-5)
            runs[str(c)] = lambda x=inputs, c=c: kernels.softmax_nll(*x, torch.bfloat16, config=c)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(a.rounds):
            for name, run in runs.items():
                run()
                times[name] += [call_ms(run, device) for _ in range(a.reps)]
        gb = t * k * (4 + 2) / 1e9
        rows = sorted(((statistics.median(v), name) for name, v in times.items()))
        base = statistics.median(times["pytorch"])
        for ms, name in rows:
            doc["rows"].append({"shape": shape, "variant": name, "ms": ms, "gb_per_s": gb / ms * 1e3,
                                "speedup_vs_pytorch": base / ms, "default": name == default})  # fmt: skip
        print(f"{shape}: pytorch {base:.3f} ms; default {default} {statistics.median(times[default]):.3f} ms")
        for ms, name in rows[:8]:
            print(f"    {ms:7.3f} ms  {gb / ms * 1e3:7.0f} GB/s  {base / ms:5.2f}x  {name}")
    if a.out:
        write_result(a.out, doc)


if __name__ == "__main__":
    main()
