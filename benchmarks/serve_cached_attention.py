"""Engine time with the Triton cached attention kernel vs the einsum path (the op's PyTorch reference).

Usage (the lead's H200 run; a few minutes):
    python benchmarks/serve_cached_attention.py --device cuda --out benchmarks/results/serve_cached_attention-h200.json
CPU smoke run (the reference only: Triton needs CUDA):
    python benchmarks/serve_cached_attention.py --device cpu --shapes 200x50 --dtypes float32 --kernels pytorch

The engine of ``serve_prefix_cache.py`` (d=64, 2 HSTU blocks x 2 heads of 32, time + position bias,
4 contextual tokens, max_seq_len 4096), one engine per (dtype, kernel), all in the same process:

- kernel "triton": ``ops.cached_hstu_attention`` runs the Triton forward kernel;
- kernel "pytorch": the same op's PyTorch reference, an einsum over the new tokens x (cache + new)
  keys with the visibility and bias of ``AttentionMask.rows`` (what the engine did before, in
  padded form).

Both run through the same engine code (CUDA graphs of the engine's shape buckets on CUDA,
``--cuda-graphs 0`` for eager passes). Per shape L (history events) x C (candidates):

- request: ``rank_encoded`` of a cold request (prefill of L + 4 tokens in chunks, then C candidates);
- candidates: only the candidates after a cached prefix (``RankEngine.score``), the per-request
  cost with a KV-cache hit.

Median of ``--repeats`` runs after two warm-up runs (CUDA graph capture, Triton autotuning). The
two kernels' scores must agree (max |diff| is reported; bf16 within 5e-2, float32 within 1e-3).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from recforge.serve.layout import candidate_tokens
from _machine import cpu_model
from serve_prefix_cache import build_engine, make_request

TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}


def _time(fn, device: str, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs, after two warm-up runs."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(device: str, dtype: str, kernel: str, shapes: list[tuple[int, int]], repeats: int, graphs: int,
            chunk: int) -> dict:  # fmt: skip
    engine = build_engine(device, dtype, cuda_graphs=graphs)
    engine.config.prefill_chunk = chunk
    engine.model.encoder.cfg.kernel = kernel  # every block shares the config
    rows = {}
    for events, cands in shapes:
        req = make_request(events, cands, seed=events + cands)
        state = engine.prefix_state(req)
        cand = candidate_tokens(req)
        rows[(events, cands)] = {
            "request_ms": _time(lambda: engine.rank_encoded(req), device, repeats),
            "candidates_ms": _time(lambda: engine.score(state, cand), device, repeats),
            "scores": engine.rank_encoded(req).scores,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kernels", default="triton,pytorch", help="the first is compared with the others")
    parser.add_argument("--shapes", default="2000x1000,2000x200,500x1000,4000x500,200x50",
                        help="LxC pairs: history events x candidates")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cuda-graphs", type=int, default=32, help="EngineConfig.cuda_graphs on CUDA (0: eager)")
    parser.add_argument("--prefill-chunk", type=int, default=1024)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_cached_attention-<device>.json)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda but CUDA is not available here; use --device cpu --kernels pytorch")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    kernels = args.kernels.split(",")
    graphs = args.cuda_graphs if args.device.startswith("cuda") else 0
    results = []
    header = f"{'dtype':9} {'L':>5} {'C':>5} " + " ".join(f"{k + ' req ms':>16} {k + ' cand ms':>17}" for k in kernels)
    if len(kernels) > 1:
        header += f" {'req speedup':>11} {'cand speedup':>12} {'max|diff|':>10}"
    print(header)
    for dtype in args.dtypes.split(","):
        by_kernel = {k: measure(args.device, dtype, k, shapes, args.repeats, graphs, args.prefill_chunk) for k in kernels}
        for shape in shapes:
            row = {"dtype": dtype, "events": shape[0], "candidates": shape[1]}
            line = f"{dtype:9} {shape[0]:5d} {shape[1]:5d} "
            for k in kernels:
                r = by_kernel[k][shape]
                row[f"{k}_request_ms"], row[f"{k}_candidates_ms"] = round(r["request_ms"], 3), round(r["candidates_ms"], 3)
                line += f"{r['request_ms']:16.2f} {r['candidates_ms']:17.2f} "
            if len(kernels) > 1:
                first, base = by_kernel[kernels[0]][shape], by_kernel[kernels[1]][shape]
                diff = max(float((by_kernel[k][shape]["scores"] - first["scores"]).abs().max()) for k in kernels[1:])
                row["request_speedup"] = round(base["request_ms"] / first["request_ms"], 3)
                row["candidates_speedup"] = round(base["candidates_ms"] / first["candidates_ms"], 3)
                row["max_abs_score_diff"] = diff
                row["scores_agree"] = diff <= TOLERANCE[dtype]
                line += f"{row['request_speedup']:11.2f} {row['candidates_speedup']:12.2f} {diff:10.2e}"
                if not row["scores_agree"]:
                    line += "  SCORES DISAGREE"
            print(line)
            results.append(row)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_model()
    out = Path(args.out or f"benchmarks/results/serve_cached_attention-{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "serve_cached_attention", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "device": device_name, "torch": torch.__version__, "cuda_graphs": graphs, "prefill_chunk": args.prefill_chunk,
        "repeats": args.repeats, "kernels": kernels, "results": results,
    }, indent=1))  # fmt: skip
    print(f"wrote {out}")
    if not all(r.get("scores_agree", True) for r in results):
        sys.exit("the kernels' scores disagree (see SCORES DISAGREE above)")


if __name__ == "__main__":
    main()
