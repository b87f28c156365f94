"""The training step before / after the copy-free sampled softmax (issue 18), side by side in one run.

Usage:
    python benchmarks/step_copies.py --device cpu --case small --out benchmarks/results/step_copies-cpu.json
    python benchmarks/step_copies.py --case large --variants fp32-eager bf16-eager bf16-compile \\
        --out benchmarks/results/step_copies-h200.json

``before`` scores per-position negatives as ``sampled_softmax_loss`` did until issue 18: every draw's row looked
up and L2-normalised ((T, K, d) normalisations, forward and backward) and scored by einsum, whose gradient of the
lookup came out transposed and was copied whole before the embedding scatter. ``after`` is today's loss (rows of
the once-normalised table, one lookup of [target | negatives], bmm). Both train the same model from the same
weights on the same batches and draws (``benchmarks/train_mfu.py``'s cases and variants); their first steps' losses
must agree (rel. 1e-5 fp32, 1e-2 otherwise), then steps alternate before / after and the medians are compared.
The profiled step lists the copies (``train_mfu.copy_ops``: aten copies, fills and scatters, MB per step).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import train_mfu as tm  # benchmarks/ is sys.path[0] when run as a script
from recforge.io import atomic_write_json


def per_draw_loss(user, targets, item_vectors, num_items, *, negatives, num_negatives, temperature, chunk_size,
                  sampled, weights):  # fmt: skip
    """``sampled_softmax_loss`` as it was (per-position, unchunked): each draw's row normalised, einsum."""
    if negatives != "per_position" or chunk_size or sampled is None:
        raise ValueError("per_draw_loss: the unchunked per-position loss with drawn negatives only")
    with torch.autocast(user.device.type, enabled=False):
        dtype = torch.promote_types(user.dtype, torch.float32)
        user = user.to(dtype)
        pos = (user * item_vectors(targets).to(dtype)).sum(-1, keepdim=True) / temperature
        neg = torch.einsum("td,tkd->tk", user, item_vectors(sampled.ids).to(dtype)) / temperature
        logits = torch.cat([pos, neg.masked_fill(sampled.ids == targets[:, None], float("-inf"))], 1)
        nll = -F.log_softmax(logits, dim=1)[:, 0]
        return nll.mean() if weights is None else (nll * weights.to(dtype)).sum() / weights.to(dtype).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--case", default="large", choices=list(tm.CASES))
    parser.add_argument("--variants", nargs="*", default=["fp32-eager"], choices=list(tm.VARIANTS))
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each, alternating")
    parser.add_argument("--copies", type=int, default=6, help="top copy ops listed per side")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    torch._inductor.config.fallback_random = True  # as train_mfu: compiled variants score the same draws as eager
    for name in ("cache_size_limit", "recompile_limit"):  # two objectives per variant, one compile each
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    opts = argparse.Namespace(chunk_size=0, bucket_ratio=1.125)
    batches = [b.to(device) for b in tm.make_batches(args.case, 2, seed=1)]
    rows = []
    for variant in args.variants:
        sides = {"before": tm.make_runner(args.case, variant, device, opts, loss=per_draw_loss)[0],
                 "after": tm.make_runner(args.case, variant, device, opts)[0]}  # fmt: skip
        losses = {k: [float(r([batches[i % 2]]).loss) for i in range(3)] for k, r in sides.items()}  # also warm-up
        diff = max(abs(a - b) / abs(a) for a, b in zip(losses["before"], losses["after"], strict=True))
        row = {"case": args.case, "variant": variant, "losses": losses, "max_rel_loss_diff": diff}
        if diff > (1e-5 if variant.startswith("fp32-eager") else 1e-2):
            row["error"] = f"before and after disagree: relative loss difference {diff:.3g}"
            print(f"{variant}: FAILED: {row['error']}", flush=True)
            rows.append(row)
            continue
        times: dict[str, list[float]] = {k: [] for k in sides}
        for i in range(args.steps):
            for name, runner in sides.items():
                tm._sync(device)
                t0 = time.perf_counter()
                runner([batches[i % 2]])
                tm._sync(device)
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name, runner in sides.items():
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities, record_shapes=True) as prof:
                runner([batches[0]])
                tm._sync(device)
            ops = tm.copy_ops(prof, 1, 1000)
            row[name] = {"step_ms": statistics.median(times[name]), "step_ms_all": times[name],
                         "copy_mb": sum(op["mb"] for op in ops), "top_copies": ops[: args.copies]}  # fmt: skip
        row["speedup"] = row["before"]["step_ms"] / row["after"]["step_ms"]
        rows.append(row)
        print(f"{args.case} {variant}: before {row['before']['step_ms']:.1f} ms, after {row['after']['step_ms']:.1f} ms "
              f"(x{row['speedup']:.2f}); copy ops {row['before']['copy_mb']:.0f} -> {row['after']['copy_mb']:.0f} MB/step; "
              f"loss diff {diff:.1e}", flush=True)  # fmt: skip
        for name in sides:
            for op in row[name]["top_copies"]:
                print(f"  {name:<7}{op['mb']:9.1f} MB {op['calls']:4.0f}x {op['op']:<32}{op['shape']:<22}"
                      f"{op['called_from'][:90]}", flush=True)  # fmt: skip
        del sides
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        atomic_write_json(Path(args.out), {
            "benchmark": "step_copies", "command": "python benchmarks/step_copies.py " + " ".join(sys.argv[1:]),
            "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "rows": rows,
        })  # fmt: skip


if __name__ == "__main__":
    main()
