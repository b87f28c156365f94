"""Prefix-cached ranking vs naive per-candidate scoring, over history length L and candidates C.

Usage:
    python benchmarks/serve_prefix_cache.py --out benchmarks/results/serve_prefix_cache-cpu-2core.json
    python benchmarks/serve_prefix_cache.py --device cuda --dtype bfloat16 --out benchmarks/results/serve_prefix_cache-h100.json

A randomly initialised ranking model shaped like ``configs/ranking-ml100k-hstu.yaml`` (d=64,
2 HSTU blocks x 2 heads of 32, MLP heads, time + position bias; max_seq_len 4096 so L=2000
fits) scores C candidates after an L-event history (sum action encoding, 4 contextual tokens):

- cached: ``RankEngine.rank_encoded`` — the history once through the blocks (K/V kept), then
  every candidate attends to it and to itself. Median of ``--repeats`` runs.
- naive: ``RankEngine.rank_naive`` — ``RankingModel.forward`` (the training path) on one
  [history, candidate] sequence per candidate, ``--naive-batch`` sequences per call. It runs
  once over all C candidates unless ``--naive-candidates`` caps it (then the row says so and
  the time is per-candidate time x C). The training path's reference attention materialises
  padded N x N scores and masks, so this is slower per FLOP than the engine.
- warm: only the candidates, after a prefix already cached (a KV-cache pool hit).
- graphs (CUDA only): cached and warm again with ``EngineConfig.cuda_graphs`` (each pass
  replayed as a CUDA graph of its shape bucket; captured in the warm-up, not timed).
- recompute: the engine's own kernels without the cache — for each candidate, the history is
  computed again (``prefix_state`` from scratch) and then that one candidate scored. Same code
  per FLOP as "cached", so its ratio tracks the FLOP ratio.

Both must agree within 1e-4; FLOPs count multiply-adds x 2 of the linear layers and of the
visible attention pairs (a causal history: L(L+1)/2 pairs per block and head).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from recforge.models import HSTUConfig, HSTUEncoder
from recforge.models.ranking import MultiTaskMLP, RankingModel, RankingPrefix
from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.layout import EncodedRequest, candidate_tokens
from recforge.io import atomic_write_json
from _machine import cpu_model

NUM_ITEMS, NUM_CONTEXT, DIM, BLOCKS, HEADS, DQK, DV, MAX_LEN = 100_000, 4, 64, 2, 2, 32, 32, 4096


def build_engine(device: str, dtype: str, cuda_graphs: int = 0) -> RankEngine:
    torch.manual_seed(0)
    prefix = RankingPrefix(NUM_ITEMS, 5, 1000, DIM)
    encoder = HSTUEncoder(HSTUConfig(dim=DIM, num_blocks=BLOCKS, num_heads=HEADS, dqk=DQK, dv=DV, dropout=0.0,
                                     max_seq_len=MAX_LEN, num_time_buckets=128, kernel="pytorch"))  # fmt: skip
    for block in encoder.blocks:
        nn.init.normal_(block.pos_weights, std=0.1)
        nn.init.normal_(block.time_weights, std=0.1)
    model = RankingModel(prefix, encoder, MultiTaskMLP(DIM, 3, hidden=128))
    manifest = {"tasks": [{"name": n, "kind": "binary"} for n in ("click", "like", "buy")], "action_encoding": "sum",
                "num_contextual": NUM_CONTEXT, "user_features": [f"f{i}" for i in range(NUM_CONTEXT)]}  # fmt: skip
    return RankEngine(model, manifest, None, EngineConfig(device=device, dtype=dtype, max_candidates=100_000,
                                                               cuda_graphs=cuda_graphs))  # fmt: skip


def make_request(events: int, candidates: int, seed: int) -> EncodedRequest:
    g = torch.Generator().manual_seed(seed)
    ts = 1_600_000_000 + torch.cumsum(torch.randint(1, 3600, (events,), generator=g), 0)
    return EncodedRequest(
        user="bench", context_ids=torch.randint(1, 1001, (NUM_CONTEXT,), generator=g),
        items=torch.randint(1, NUM_ITEMS + 1, (events,), generator=g), actions=torch.randint(1, 6, (events,), generator=g),
        timestamps=ts, candidates=torch.randint(1, NUM_ITEMS + 1, (candidates,), generator=g),
        request_time=int(ts[-1]) + 60 if events else 1_600_000_000,
    )  # fmt: skip


def flops(prefix_tokens: int, candidates: int) -> tuple[float, float]:
    """(naive, cached) FLOPs of the encoder + heads: linear layers and visible attention pairs."""
    per_token = BLOCKS * 2 * DIM * (HEADS * (2 * DV + 2 * DQK) + HEADS * DV) + 2 * (DIM * 128 + 128 * 3)
    per_pair = BLOCKS * HEADS * 2 * (DQK + DV)
    n = prefix_tokens
    prefix = n * per_token + n * (n + 1) / 2 * per_pair
    candidate = per_token + (n + 1) * per_pair
    return candidates * (prefix + candidate), prefix + candidates * candidate


def timed(fn, repeats: int, sync) -> tuple[float, object]:
    times, value = [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        value = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), value



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="250,500,1000,2000", help="history lengths L (events)")
    parser.add_argument("--candidates", default="100,1000", help="candidate counts C")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--naive-batch", type=int, default=8, help="naive sequences per forward call")
    parser.add_argument("--naive-candidates", type=int, default=0, help="time naive on at most this many candidates (0: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()[0]
    engine = build_engine(args.device, args.dtype)
    device = engine.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    engine.rank_encoded(make_request(100, 10, 0))  # warm-up
    graphs = build_engine(args.device, args.dtype, cuda_graphs=64) if device.type == "cuda" else None
    engine.rank_naive(make_request(100, 2, 0))
    tol = 1e-4 if args.dtype == "float32" else 5e-2
    rows = []
    for events in [int(x) for x in args.lengths.split(",")]:
        for count in [int(x) for x in args.candidates.split(",")]:
            req = make_request(events, count, seed=events + count)
            cached_s, cached = timed(lambda: engine.rank_encoded(req).scores, args.repeats, sync)
            state = engine.prefix_state(req)
            cands = candidate_tokens(req)
            warm_s, warm = timed(lambda: engine.score(state, cands), args.repeats, sync)
            graph_row = {}
            if graphs is not None:
                graphs.rank_encoded(req)  # captures this shape's buckets
                graph_s, graph_scores = timed(lambda: graphs.rank_encoded(req).scores, args.repeats, sync)
                warm_graph_s, warm_graph = timed(lambda: graphs.score(state, cands), args.repeats, sync)
                graph_diff = max(float((graph_scores - cached).abs().max()), float((warm_graph - warm).abs().max()))
                graph_row = {"graph_ms": graph_s * 1e3, "warm_graph_ms": warm_graph_s * 1e3, "graph_max_abs_diff": graph_diff,
                             "graph_speedup": cached_s / graph_s, "warm_graph_speedup": warm_s / warm_graph_s}  # fmt: skip
            measured = count if not args.naive_candidates else min(count, args.naive_candidates)
            part = EncodedRequest(**{**req.__dict__, "candidates": req.candidates[:measured]})
            naive_s, naive = timed(lambda: engine.rank_naive(part, args.naive_batch), 1, sync)
            naive_s *= count / measured

            def recompute(part=part):
                cands = candidate_tokens(part)
                return torch.cat([engine.score(engine.prefix_state(part), {k: v[i : i + 1] for k, v in cands.items()})
                                  for i in range(part.num_candidates)])  # fmt: skip

            recompute_s, recomputed = timed(recompute, 1, sync)
            recompute_s *= count / measured
            diff = max(float((cached[:measured] - naive).abs().max()), float((cached[:measured] - recomputed).abs().max()),
                       float((warm - cached).abs().max()), graph_row.get("graph_max_abs_diff", 0.0))  # fmt: skip
            naive_f, cached_f = flops(NUM_CONTEXT + events, count)
            rows.append({"L": events, "C": count, "cached_ms": cached_s * 1e3, "naive_ms": naive_s * 1e3,
                         "speedup": naive_s / cached_s, "recompute_ms": recompute_s * 1e3,
                         "recompute_speedup": recompute_s / cached_s, "flop_ratio": naive_f / cached_f,
                         "naive_measured_candidates": measured, "max_abs_diff": diff, "warm_ms": warm_s * 1e3,
                         **graph_row})  # fmt: skip
            r = rows[-1]
            print(f"L={events:>5} C={count:>5}  cached {r['cached_ms']:9.1f} ms  naive {r['naive_ms']:11.1f} ms "
                  f"{r['speedup']:7.1f}x  recompute {r['recompute_ms']:11.1f} ms {r['recompute_speedup']:7.1f}x  "
                  f"(FLOP ratio {r['flop_ratio']:.0f}x, |diff| {diff:.1e})  warm {r['warm_ms']:.2f} ms"
                  + (f"  graphs: cached {r['graph_ms']:.2f} ms, warm {r['warm_graph_ms']:.2f} ms" if graph_row else ""),
                  flush=True)  # fmt: skip
            if not diff <= tol:
                sys.exit(f"cached and naive scores disagree by {diff} > {tol}")
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads")  # fmt: skip
    print(f"\nprefix-cached vs naive per-candidate ranking on {machine}, {args.dtype}, torch {torch.__version__}")
    print(f"model: d={DIM}, {BLOCKS} HSTU blocks x {HEADS} heads ({DQK}), {NUM_CONTEXT} contextual tokens; naive = "
          f"RankingModel.forward, {args.naive_batch} [history, candidate] sequences per call")  # fmt: skip
    print(f"{'L':>6}{'C':>6}{'cached ms':>12}{'naive ms':>13}{'speedup':>10}{'recompute ms':>15}{'speedup':>10}"
          f"{'FLOP ratio':>12}{'max |diff|':>12}")  # fmt: skip
    for r in rows:
        note = "" if r["naive_measured_candidates"] == r["C"] else f"  (baselines timed on {r['naive_measured_candidates']}, x C)"
        print(f"{r['L']:>6}{r['C']:>6}{r['cached_ms']:>12.1f}{r['naive_ms']:>13.1f}{r['speedup']:>9.1f}x"
              f"{r['recompute_ms']:>15.1f}{r['recompute_speedup']:>9.1f}x{r['flop_ratio']:>11.0f}x{r['max_abs_diff']:>12.1e}{note}")  # fmt: skip
    print("\nwarm = candidates only, after a cached prefix (a KV-cache pool hit)")
    if graphs is not None:
        print("graphs = the same passes replayed as CUDA graphs (EngineConfig.cuda_graphs); ratio = eager / graphs")
        print(f"{'L':>6}{'C':>6}{'cached ms':>12}{'graphs ms':>12}{'ratio':>8}{'warm ms':>10}{'graphs ms':>12}{'ratio':>8}")
        for r in rows:
            print(f"{r['L']:>6}{r['C']:>6}{r['cached_ms']:>12.2f}{r['graph_ms']:>12.2f}{r['graph_speedup']:>7.1f}x"
                  f"{r['warm_ms']:>10.2f}{r['warm_graph_ms']:>12.2f}{r['warm_graph_speedup']:>7.1f}x")  # fmt: skip
    else:
        print(f"{'L':>6}{'C':>6}{'cached ms':>12}{'warm ms':>10}")
        for r in rows:
            print(f"{r['L']:>6}{r['C']:>6}{r['cached_ms']:>12.2f}{r['warm_ms']:>10.2f}")
    print(f"1-min load average at start {load_at_start:.2f}")
    if args.out:
        payload = {
            "benchmark": "serve_prefix_cache",
            "command": "python " + " ".join(sys.argv),
            "machine": machine,
            "dtype": args.dtype,
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "load_average_1m_at_start": load_at_start,
            "rows": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), payload)


if __name__ == "__main__":
    main()
