"""Training throughput (tokens/s) of the retrieval recipe's step on real ML-1M batches.

Usage:
    python benchmarks/train_throughput.py --device cpu --steps 10
    python benchmarks/train_throughput.py --device cuda --steps 50 --out benchmarks/results/train_throughput-h100.json

Times whole training steps (batch assembly, forward, loss, backward, AdamW) for each
config in configs/, median over steps after warm-up, and prints one table.

``--compare launch-plans`` (CUDA): alternate steps with the Triton launch plans of
``recforge.ops.triton.tuning`` on and off in one loop; ``--compare precision``: float32 and
bfloat16 (``train.precision``) steps of the same model; both report each mode and the ratio.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from recforge.config import load_config
from recforge.train.retrieval import _train_step, setup
from recforge.io import atomic_write_json

CONFIGS = ["configs/ml1m-sasrec.yaml", "configs/ml1m-hstu.yaml", "configs/ml1m-hstu-large.yaml", "configs/ml1m-hstu-large-full.yaml"]


def _modes(compare: str, s) -> dict[str, Callable[[], None]]:
    """What one step of each compared mode sets before it runs (``--compare``)."""
    if compare == "launch-plans":
        from recforge.ops.triton import tuning

        return {f"launch plans {'on' if on else 'off'}": functools.partial(setattr, tuning.plans, "enabled", on)
                for on in (True, False)}  # fmt: skip
    if compare == "precision":
        return {p: functools.partial(setattr, s.cfg.train, "precision", p) for p in ("float32", "bfloat16")}
    return {"": lambda: None}


def bench(config: str, device: str, steps: int, warmup: int, data: str | None, compare: str = "none",
          extra: list[str] | None = None) -> dict:
    overrides = [f"train.device={device}"] + ([f"data.path={data}"] if data else []) + list(extra or [])
    s = setup(load_config(config, overrides))
    samples = s.seqs.training_samples(s.holdout, s.cfg.data.max_seq_len, s.cfg.data.train_windows)
    order = samples[torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(0))]
    bs = s.cfg.train.batch_size
    modes = _modes(compare, s)
    names = list(modes)
    times: dict[str, list[float]] = {m: [] for m in names}
    tokens: dict[str, list[int]] = {m: [] for m in names}
    for i in range((warmup + steps) * len(names)):  # the modes take turns, step by step
        mode = names[i % len(names)]
        modes[mode]()
        batch_samples = order[((i // len(names)) * bs) % samples.shape[0] :][:bs]  # each mode gets the same batches
        if s.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, n = _train_step(s, s.seqs.training_batch(batch_samples, s.cfg.data.max_seq_len))
        if s.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup * len(names):
            times[mode].append(time.perf_counter() - t0)
            tokens[mode].append(n)
    modes[names[0]]()
    row = {"config": config, "overrides": list(extra or []), "model": s.cfg.model.kind, "blocks": s.cfg.model.num_blocks, "negatives": s.cfg.loss.negatives}
    for mode in names:
        suffix = f" ({mode})" if mode else ""
        row[f"median_step_ms{suffix}"] = statistics.median(times[mode]) * 1e3
        row[f"tokens_per_step{suffix}"] = statistics.mean(tokens[mode])
        row[f"tokens_per_s{suffix}"] = sum(tokens[mode]) / sum(times[mode])
    if len(names) == 2:
        row["modes"] = names
        row["second_over_first"] = row[f"median_step_ms ({names[1]})"] / row[f"median_step_ms ({names[0]})"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", default=None, help="override data.path (default: the configs' data/ml-1m)")
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--compare", choices=["none", "launch-plans", "precision"], default="none",
                        help="alternate steps between Triton launch plans on/off, or float32/bfloat16 training")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every config")
    args = parser.parse_args()
    rows = [bench(c, args.device, args.steps, args.warmup, args.data, args.compare, args.set) for c in args.configs]
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"training throughput on {machine}, torch {torch.__version__}" + (f"; overrides {args.set}" if args.set else ""))
    print(f"{'config':<36}{'step ms':>10}{'tokens/step':>13}{'tokens/s':>12}")
    for r in rows:
        for mode in r.get("modes", [""]):
            suffix = f" ({mode})" if mode else ""
            label = r["config"] if not mode or mode == r["modes"][0] else f"  {mode}"
            print(f"{label:<36}{r[f'median_step_ms{suffix}']:>10.1f}{r[f'tokens_per_step{suffix}']:>13.0f}"
                  f"{r[f'tokens_per_s{suffix}']:>12,.0f}" + (f"   ({mode})" if mode == r.get("modes", [""])[0] and mode else ""))
        if "second_over_first" in r:
            print(f"  step time {r['modes'][1]} / {r['modes'][0]}: {r['second_over_first']:.2f}x")
    if args.out:
        payload = {
            "benchmark": "train_throughput",
            "command": "python benchmarks/train_throughput.py " + " ".join(sys.argv[1:]),
            "machine": machine,
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "rows": rows,
        }
        atomic_write_json(Path(args.out), payload)


if __name__ == "__main__":
    main()
