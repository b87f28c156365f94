"""Long histories on one GPU: peak memory and tokens/s of full training steps at 4K-100K tokens per user.

Usage (one H200, < 4 minutes):
    python benchmarks/long_seq.py --out benchmarks/results/long_seq-h200.json
    python benchmarks/long_seq.py --device cpu --lengths 256 512 --blocks 2 --dim 64 --steps 2   # smoke test

Each step is what ``recforge train`` runs for the retrieval recipe: the HSTU retrieval model
(``models.builders.build_retrieval_model``) forward under bf16 autocast, the sampled-softmax
loss (per-position negatives), backward and AdamW, on jagged batches of random users holding
``--tokens`` tokens in all (one user of 100K tokens; 8 users of 16K; ...). Three variants per
length, side by side: ``long`` (activation checkpointing on every block, loss in chunks of
``--chunk`` positions), ``chunked-loss`` (no checkpointing) and ``plain`` (neither); a variant that
runs out of memory is reported as OOM. The model FLOPs (``model_tflops``: linear layers, causal attention, loss; forward + backward,
no recomputation) give TFLOP/s. Correctness: the variants' first-step losses on the same batch,
weights and negatives must agree (``loss_match``), and every loss must be finite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from recforge.config import ModelConfig
from recforge.io import atomic_write_json
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import offsets_from_lengths
from recforge.models.builders import build_retrieval_model
from recforge.ops.triton import tuning
from recforge.train.losses import sampled_softmax_loss

# name -> (checkpoint every block, chunked loss)
VARIANTS = {"long": (True, True), "chunked-loss": (False, True), "plain": (False, False)}


def model_tflops(lengths: list[int], cfg: ModelConfig, num_negatives: int) -> float:
    """Training FLOPs (forward + backward = 3 x forward) of one step, in TFLOP: per block the uvqk and output
    projections and the causal attention (q.k and a.v over i >= j pairs), plus the loss dot products."""
    h, d = cfg.num_heads, cfg.dim
    tokens = sum(lengths)
    linear = 2 * tokens * d * (2 * h * cfg.dv + 2 * h * cfg.dqk) + 2 * tokens * h * cfg.dv * d
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    attention = 2 * pairs * h * (cfg.dqk + cfg.dv)
    loss = 2 * tokens * (num_negatives + 1) * d
    return 3 * (cfg.num_blocks * (linear + attention) + loss) / 1e12


def make_batch(users: int, length: int, num_items: int, device: torch.device, gen: torch.Generator) -> JaggedBatch:
    offsets = offsets_from_lengths(torch.full((users,), length, dtype=torch.int64))
    total = users * length
    gaps = torch.randint(1, 3600, (total,), generator=gen)
    features = {"item_ids": torch.randint(1, num_items + 1, (total,), generator=gen),
                "timestamps": 1_700_000_000 + torch.cumsum(gaps, 0)}  # fmt: skip
    batch = JaggedBatch(offsets, features, length)
    batch.labels["next_item"] = torch.randint(1, num_items + 1, (total,), generator=gen)
    return batch.to(device)


def run_variant(args, length: int, variant: str, batch: JaggedBatch) -> dict:
    checkpointed, chunked = VARIANTS[variant]
    device = torch.device(args.device)
    cfg = ModelConfig(kind="hstu", dim=args.dim, num_blocks=args.blocks, num_heads=args.heads, dqk=args.head_dim,
                      dv=args.head_dim, dropout=0.0, checkpoint_blocks=checkpointed)  # fmt: skip
    torch.manual_seed(0)  # the same weights in both variants
    model = build_retrieval_model(cfg, args.items, length).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.manual_seed(step)  # the same negatives in both variants
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            user = model(batch)
            loss = sampled_softmax_loss(user, batch.labels["next_item"], model.item_vectors, args.items,
                                        num_negatives=args.negatives, chunk_size=args.chunk if chunked else 0)  # fmt: skip
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))  # synchronises
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        if time.perf_counter() - started > args.max_seconds and len(times) >= 1:
            break
    step_s = statistics.median(times)
    tokens = batch.num_tokens
    flops = model_tflops(batch.lengths.tolist(), cfg, args.negatives)
    row = {"variant": variant, "checkpoint_blocks": checkpointed, "loss_chunk": args.chunk if chunked else 0,
           "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s, "model_tflop_per_step": flops,
           "model_tflops_per_s": flops / step_s, "first_loss": losses[0], "losses_finite": all(map(math.isfinite, losses)),
           "steps_timed": len(times)}  # fmt: skip
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768, 100_000], help="tokens per user")
    p.add_argument("--tokens", type=int, default=131_072, help="tokens per step (users = max(1, tokens // length))")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--negatives", type=int, default=128)
    p.add_argument("--chunk", type=int, default=8192, help="loss positions per chunk (the long variant)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-seconds", type=float, default=15.0, help="per variant and length: stop timing after this")
    p.add_argument("--tiles", type=int, default=0,
                   help="cut each attention kernel's autotuning list to its first N tiles (0: all). At 100K tokens "
                        "per user every candidate is compiled and timed on a ~10-s step: --tiles 2 keeps that short")  # fmt: skip
    p.add_argument("--out", default="")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.tiles:
        tuning.shorten_hstu_candidates(args.tiles)
    rows = []
    for length in args.lengths:
        users = max(1, args.tokens // length)
        batch = make_batch(users, length, args.items, device, torch.Generator().manual_seed(length))
        first_losses = {}
        for variant in args.variants:
            head = {"length": length, "users": users, "tokens": users * length}
            try:
                row = {**head, **run_variant(args, length, variant, batch)}
                first_losses[variant] = row["first_loss"]
            except torch.OutOfMemoryError:
                row = {**head, "variant": variant, "oom": True}
            torch.cuda.empty_cache() if device.type == "cuda" else None
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # after every row: a run stopped by a time limit keeps what it measured
                atomic_write_json(Path(args.out), {"benchmark": "long_seq", "partial": True, "command": " ".join(sys.argv),
                                                   "rows": rows})  # fmt: skip
        if len(first_losses) >= 2:  # same weights (seed 0), batch and negatives: the loss must agree
            a, *others = first_losses.values()
            rows[-1]["loss_match"] = all(abs(a - b) <= 2e-2 * max(1.0, abs(a)) for b in others)  # bf16, op order
    print(f"\n{'length':>7} {'users':>5} {'variant':>12} {'peak GiB':>9} {'tokens/s':>10} {'step ms':>8} {'TFLOP/s':>8}")
    for r in rows:
        if r.get("oom"):
            print(f"{r['length']:>7} {r['users']:>5} {r['variant']:>12} {'OOM':>9}")
        else:
            print(f"{r['length']:>7} {r['users']:>5} {r['variant']:>12} {r.get('peak_gib', float('nan')):>9.2f} "
                  f"{r['tokens_per_s']:>10.0f} {r['step_ms']:>8.1f} {r['model_tflops_per_s']:>8.1f}")  # fmt: skip
    bad = [r for r in rows if not r.get("oom") and (not r["losses_finite"] or r.get("loss_match") is False)]
    result = {
        "benchmark": "long_seq", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "model": {"blocks": args.blocks, "dim": args.dim, "heads": args.heads,
        "head_dim": args.head_dim, "items": args.items, "negatives": args.negatives, "precision": "bfloat16"},
        "tokens_per_step": args.tokens, "rows": rows, "correct": not bad,
    }  # fmt: skip
    if args.out:
        atomic_write_json(Path(args.out), {**result, "tiles": args.tiles, "command": " ".join(sys.argv)})
    if bad:
        print(f"FAILED: non-finite or mismatched losses in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
