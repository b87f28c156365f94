"""Where the fused dK/dV(+dQ) kernel's time goes: the kernel with parts of its work removed or done another way.

Usage (GPU; needs the kernel's ``ABL`` switches of commit "Experiment: dK/dV ablation switches", reverted after):
    PYTHONPATH=. python benchmarks/dkdv_ablation.py --seq-lens 2048 4096 8192 --abl 0 64 8 32 \
        --out benchmarks/results/dkdv_ablation-h200.json

On the jagged bf16 batches of ``attention.py`` (~65K tokens, 4 heads, head dim 128, causal) the fused dK/dV kernel
(``hstu.fused_dq``) is launched alone at each tile with each ``ABL`` bit set: 1 the dQ dot issued before the dK/dV
dots, its atomics after them; 2 / 16 dQ added by inline-PTX ``red.add.f32`` / ``red.add.v2.f32`` from the dot's own
register layout (no layout conversion); 4 the atomics skipped (the dot kept); 8 a plain store in place of the
atomics (wrong dQ, timing only); 32 no SiLU arithmetic (scores used as they are: wrong outputs, timing only); 64
dQ^T = K^T dS^T with both operands read from shared memory. Outputs are compared with the first variant's (``err``:
relative max difference of dK, dV, dQ); ``triton.testing.do_bench`` median. Share of peak: 5 matmuls over the
visible pairs against a bf16 matmul measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
from _machine import kernel_header, write_result
from attention import make_lengths, matmul_peak
from attention_tiles import collect_launches

from recforge.ops.triton import hstu as hstu_mod

NAMES = {0: "base", 1: "dq-dot-first", 2: "red-scalar-mma", 3: "red-scalar+dq-first", 4: "no-atomics(dot kept)",
         8: "store-not-atomic", 16: "red-v2-mma", 17: "red-v2+dq-first", 32: "no-silu-math", 64: "dqT-ss"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="*", default=[2048, 8192])
    p.add_argument("--abl", type=int, nargs="*", default=list(NAMES))
    p.add_argument("--tiles", nargs="*", default=["64,128,8,3", "64,128,8,4"], help="BLOCK_M,BLOCK_N,warps,stages")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dkdv_ablation.py times a CUDA kernel: no CUDA device here")
    peak = matmul_peak()
    doc = dict(kernel_header("dkdv_ablation", torch.device("cuda")), command=" ".join(sys.argv),
               matmul_peak_tflops=peak, rows=[])  # fmt: skip
    print(f"measured bf16 matmul peak {peak:.0f} TFLOP/s")
    for L in a.seq_lens:
        lengths = make_lengths(L, a.tokens, 0)
        pairs = sum(n * (n + 1) / 2 for n in lengths)
        kernel, _, batch, heads, max_seq_len, args, meta = collect_launches(128, lengths, 0, fused=True)["dkdv_fused"]
        reference = None
        for tile in (tuple(int(x) for x in t.split(",")) for t in a.tiles):
            bm, bn, warps, stages = tile
            blocks = -(-hstu_mod.max_len_bucket(max_seq_len) // bn)
            for abl in a.abl:
                def run(abl=abl):
                    kernel.fn[(blocks * batch * heads, 1, 1)](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                                              num_stages=stages, ABL=abl)  # fmt: skip
                row = dict(max_len=L, tile=list(tile), abl=abl, name=NAMES.get(abl, str(abl)))
                try:
                    for i in (4, 5, 6):
                        args[i].zero_()
                    run()
                    outs = [args[i].float().clone() for i in (4, 5, 6)]
                    reference = reference or outs
                    row["err"] = [float((o - r).abs().max() / r.abs().max().clamp_min(1e-6))
                                  for o, r in zip(outs, reference, strict=True)]  # fmt: skip
                    row["ms"] = triton.testing.do_bench(run, warmup=25, rep=150, return_mode="median")
                    row["share_of_peak"] = 5 * 2 * pairs * 128 * 4 / row["ms"] / 1e9 / peak
                except Exception as e:  # noqa: BLE001 - one variant's failure is a row
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
