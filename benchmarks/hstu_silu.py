"""The HSTU block's SiLU + attention, forward and backward: two steps against one op (``ops.hstu_silu_attention``).

Usage:
    PYTHONPATH=. python benchmarks/hstu_silu.py --out benchmarks/results/hstu_silu-h200.json \
        [--seq-lens 1024 2048 4096 8192] [--tokens 65536] [--heads 4]

For each maximum sequence length L, one jagged bf16 batch of ~``--tokens`` tokens (``attention.make_lengths``), a
projection ``pre`` of H (2 Dv + 2 Dqk) columns (head dims 128), a causal mask and no relative bias: what the HSTU block
hands its attention on NVIDIA recsys-examples' shape. Both variants are compiled (``torch.compile``, as
``train.compile`` runs the step) and timed forward + backward as GPU time per call (calls queued behind a GPU sleep,
CUDA events around them, median of rounds, the two variants alternated):

- "two steps": ``u, v, q, k = split(SiLU(pre))`` and ``hstu_attention`` (its custom op); Inductor fuses SiLU's
  forward, and its backward with the concatenation of du, dv, dq, dk, into a kernel each.
- "one op": ``hstu_silu_attention`` (``recforge.ops.triton.hstu_silu``): the Gluon backward multiplies dQ, dK, dV by
  SiLU' as it stores them into the projection's gradient.

"kernels" rows: the Gluon backward's two kernels alone, plain stores against SiLU'-multiplied stores into the
projection's gradient (``hstu_gluon.hstu_backward_gluon(pre=...)``).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from _machine import kernel_header, write_result
from attention import make_lengths

from recforge.jagged.index import offsets_from_lengths
from recforge.jagged.mask import AttentionMask
from recforge.ops.hstu_attention import hstu_attention, hstu_silu_attention

D = 128


def gpu_ms(fns: dict, calls: int = 10, rounds: int = 7) -> dict:
    """Median GPU ms per call of each ``fns`` value, the functions alternated round by round."""
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(50_000_000)  # the calls queue behind it: GPU time, not launch time
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def block_variants(pre: torch.Tensor, offsets: torch.Tensor, max_len: int, heads: int,
                   gen: torch.Generator) -> tuple[dict, float]:  # fmt: skip
    tokens, mask = pre.shape[0], AttentionMask()

    def two_steps(x):
        u, v, q, k = F.silu(x).split(heads * D, dim=-1)
        a = hstu_attention(*(t.view(tokens, heads, D) for t in (q, k, v)), offsets, max_len, mask, scale=1.0 / max_len,
                           kernel="triton")  # fmt: skip
        return u, a

    def one_op(x):
        return hstu_silu_attention(x, heads, D, D, offsets, max_len, mask, scale=1.0 / max_len, kernel="triton")

    du = torch.randn(tokens, heads * D, generator=gen).to(pre.device, pre.dtype)
    da = torch.randn(tokens, heads, D, generator=gen).to(pre.device, pre.dtype)
    leaf = pre.detach().requires_grad_()
    out = {}
    for name, fn in (("two steps", two_steps), ("one op", one_op)):
        compiled = torch.compile(fn, dynamic=False)

        def step(compiled=compiled):
            leaf.grad = None
            torch.autograd.backward(compiled(leaf), (du, da))

        for _ in range(3):
            step()
        out[name] = step
    grads = {}
    for name, step in out.items():
        step()
        grads[name] = leaf.grad.float().clone()
    diff = float((grads["one op"] - grads["two steps"]).norm() / grads["two steps"].norm())
    return out, diff


def kernel_variants(pre: torch.Tensor, offsets: torch.Tensor, max_len: int, heads: int, gen) -> dict:
    from recforge.ops.triton import hstu_gluon
    from recforge.ops.triton.hstu import launch_order

    tokens, width = pre.shape[0], heads * D
    y = F.silu(pre[:, width:])
    cols = [t.view(tokens, heads, D) for t in y.split(width, dim=1)]  # v, q, k
    xs = [t.view(tokens, heads, D) for t in pre[:, width:].split(width, dim=1)]
    d_pre = torch.empty_like(pre)
    gs = [t.view(tokens, heads, D) for t in d_pre[:, width:].split(width, dim=1)]
    do = torch.randn(tokens, heads, D, generator=gen).to(pre.device, pre.dtype)
    plain = [torch.empty(tokens, heads, D, dtype=pre.dtype, device=pre.device) for _ in range(3)]
    order, scale = launch_order(offsets, max_len), 1.0 / max_len
    v, q, k = cols

    def stores():
        hstu_gluon.hstu_backward_gluon(do, q, k, v, offsets, max_len, scale, order, *plain, 0.5 * scale)

    def silu_stores():
        hstu_gluon.hstu_backward_gluon(do, q, k, v, offsets, max_len, scale, order, gs[1], gs[2], gs[0], 0.5 * scale,
                                       pre=(xs[1], xs[2], xs[0]))  # fmt: skip

    return {"plain stores": stores, "SiLU' stores": silu_stores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels-only", action="store_true", help="the kernels rows only (no compiled block)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    doc = {**kernel_header("hstu_silu", device), "tokens": args.tokens, "heads": args.heads, "head_dim": D, "rows": []}
    print(f"{doc['device']}, torch {doc['torch']}, triton {doc['triton']}: ms per call (GPU), forward + backward")
    for max_len in args.seq_lens:
        lengths = make_lengths(max_len, args.tokens, args.seed)
        offsets = offsets_from_lengths(torch.tensor(lengths)).to(device)
        gen = torch.Generator().manual_seed(args.seed + max_len)
        pre = torch.randn(sum(lengths), args.heads * 4 * D, generator=gen).to(device, torch.bfloat16)
        kern = gpu_ms(kernel_variants(pre, offsets, max_len, args.heads, gen))
        row = {"max_len": max_len, "tokens": sum(lengths), "sequences": len(lengths), "kernels_ms": kern}
        line = f"L {max_len:5d} ({row['tokens']} tokens): "
        if not args.kernels_only:
            steps, diff = block_variants(pre, offsets, max_len, args.heads, gen)
            ms = row["block_ms"] = gpu_ms(steps)
            row["grad_rel_diff"] = diff
            line += (f"two steps {ms['two steps']:.3f}, one op {ms['one op']:.3f} ({ms['two steps'] / ms['one op']:.3f}x; "
                     f"gradients differ by {diff:.1e}); ")
        doc["rows"].append(row)
        fused = kern["SiLU' stores"]
        print(line + f"Gluon backward kernels: plain stores {kern['plain stores']:.3f}, SiLU' stores {fused:.3f} "
              f"({fused / kern['plain stores']:.3f}x)", flush=True)
    if args.out:
        write_result(args.out, doc)


if __name__ == "__main__":
    main()
