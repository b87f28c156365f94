"""Registers and spills of the HSTU attention kernels as ptxas builds them, on any machine (no GPU needed).

Usage:
    python benchmarks/kernel_spills.py --out benchmarks/results/kernel_spills-sm90.json
    python benchmarks/kernel_spills.py --kernel dkdv --dims 64 --tiles 64,64,4,2 64,64,8,2 --set REUSE_BUCKET=True

Each (kernel, head dim, tile, variant) is compiled by Triton for the target GPU (``--arch``, default sm_90 as
the H100/H200) and the PTX assembled by the ptxas Triton ships, with ``-v``: its registers per thread and
spill-store bytes. A kernel that spills keeps part of its tiles in local memory (L1/L2 traffic on every
tile), so on a CPU machine this shows which variants and tiles can be fast before any GPU time is spent. It
is static: the Triton here may allocate differently from the GPU machine's (this file records its version),
and only the GPU's timing decides (``benchmarks/attention_bias_grad.py``).

Variants of the dK/dV kernel (``--variants``): ``grads`` (position and time-weight gradients, as training
with learned biases, the time buckets computed a second time), ``grads-reused`` (the same with
``reuse_time_bucket``, the default since the H200 timings), ``no-grads`` (biases frozen), ``pos-grad``,
``time-grad``. Integer arguments are compiled as 32-bit, pointers and strides as 16-byte aligned (as
PyTorch's contiguous tensors are specialised at launch).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from recforge.io import atomic_write_json
from recforge.ops.triton import hstu

KERNELS = {"fwd": hstu._hstu_fwd, "dq": hstu._hstu_bwd_dq, "dkdv": hstu._hstu_bwd_dkdv}
DATA = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV_"}  # bf16 tensors
INT64 = {"offsets", "seq_order", "num_targets", "num_contextual", "seg_ends", "ts_mask", "ts_bias", "time_thr"}
FP32 = {"pos_w", "time_w", "dpos", "dtime", "DQ32"}
VARIANTS = {
    "grads": dict(POS_GRAD=True, TIME_GRAD=True),
    "grads-reused": dict(POS_GRAD=True, TIME_GRAD=True, REUSE_BUCKET=True),
    "no-grads": dict(POS_GRAD=False, TIME_GRAD=False),
    "pos-grad": dict(POS_GRAD=True, TIME_GRAD=False),
    "time-grad": dict(POS_GRAD=False, TIME_GRAD=True),
}


def constexprs(dim: int, block_m: int, block_n: int, split_loops: bool, overrides: dict) -> dict:
    """A causal jagged batch with learned position and time biases, bf16, as ``configs/ml1m-hstu-plus-d128.yaml``."""
    meta = dict(S=1, FULL_BITS=0, CAUSAL=True, HAS_TARGETS=False, HAS_CONTEXT=False, HAS_WINDOW=False, HAS_TS=False,
                HAS_POS=True, HAS_TIME=True, POS_GRAD=True, TIME_GRAD=True, PAIR_ATOMICS=False, NB_PAD=256,
                TIME_STEPS=hstu.TIME_STEPS, TIME_LOOP=True, REUSE_BUCKET=False, DQK=dim, DV=dim, BD_QK=dim, BD_V=dim,
                DOT_PREC="tf32", FAST_SIGMOID=True, SPLIT_LOOPS=split_loops, FUSED_DQ=False, SEQ_ORDER=True,
                BLOCK_M=block_m, BLOCK_N=block_n)  # fmt: skip
    return {**meta, **overrides}


def ptxas_info(kernel: str, meta: dict, warps: int, stages: int, arch: int) -> dict:
    fn = KERNELS[kernel]
    names = fn.arg_names
    sig, attrs = {}, {}
    for idx, name in enumerate(names):
        if name in meta:
            sig[name] = "constexpr"
        elif name in DATA or name in INT64 or name in FP32:
            sig[name] = "*bf16" if name in DATA else "*i64" if name in INT64 else "*fp32"
            attrs[(idx,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
            if name.startswith("s") and "_" in name:  # strides
                attrs[(idx,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in meta.items() if k in names},
                    attrs=attrs)  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        Path(ptx).write_text(compiled.asm["ptx"])
        suffix = "a" if arch == 90 else ""
        out = subprocess.run([str(ptxas), f"-arch=sm_{arch}{suffix}", "-v", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    return {"registers": int(regs[0]) if regs else None, "spill_store_bytes": int(spills[0]) if spills else None,
            "shared_bytes": compiled.metadata.shared}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel", choices=list(KERNELS), default="dkdv")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tiles", nargs="+", default=["64,64,4,2", "64,64,8,2", "32,64,4,2", "64,128,8,2"],
                   help="BLOCK_M,BLOCK_N,warps,stages (64,64,4,2: the fixed tile of bf16 launches at L <= 256)")
    p.add_argument("--variants", nargs="+", default=["grads", "grads-reused", "no-grads", "time-grad"],
                   choices=list(VARIANTS))
    p.add_argument("--split-loops", action="store_true", help="two tile loops (autotuned launches); default one loop")
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="more constexpr overrides")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--out", default="")
    args = p.parse_args()
    extra = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        extra[k] = {"True": True, "False": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)
    rows = []
    for dim in args.dims:
        for tile in args.tiles:
            bm, bn, warps, stages = (int(x) for x in tile.split(","))
            for variant in args.variants if args.kernel == "dkdv" else ["forward-or-dq"]:
                overrides = {**VARIANTS.get(variant, {}), **extra}
                info = ptxas_info(args.kernel, constexprs(dim, bm, bn, args.split_loops, overrides), warps, stages, args.arch)
                rows.append({"kernel": args.kernel, "head_dim": dim, "tile": tile, "variant": variant, **info})
                print(f"{args.kernel} D {dim:>3} tile {tile:>11} {variant:>13}: {info['registers']} registers, "
                      f"{info['spill_store_bytes']} bytes spilled, {info['shared_bytes']} B shared", flush=True)
    if args.out:
        atomic_write_json(Path(args.out), {
            "benchmark": "kernel_spills", "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "triton": triton.__version__, "arch": f"sm_{args.arch}", "split_loops": args.split_loops,
            "command": " ".join(sys.argv), "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
