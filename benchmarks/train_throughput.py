"""Training throughput (tokens/s) of the retrieval recipe's step on real ML-1M batches.

Usage:
    python benchmarks/train_throughput.py --device cpu --steps 10
    python benchmarks/train_throughput.py --device cuda --steps 50 --out benchmarks/results/train_throughput-h100.json

Times whole training steps (batch assembly, forward, loss, backward, AdamW) for each
config in configs/, median over steps after warm-up, and prints one table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from recforge.config import load_config
from recforge.train.retrieval import _train_step, setup

CONFIGS = ["configs/ml1m-sasrec.yaml", "configs/ml1m-hstu.yaml", "configs/ml1m-hstu-large.yaml", "configs/ml1m-hstu-large-full.yaml"]


def bench(config: str, device: str, steps: int, warmup: int, data: str | None) -> dict:
    overrides = [f"train.device={device}"] + ([f"data.path={data}"] if data else [])
    s = setup(load_config(config, overrides))
    samples = s.seqs.training_samples(s.holdout, s.cfg.data.max_seq_len, s.cfg.data.train_windows)
    order = samples[torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(0))]
    bs = s.cfg.train.batch_size
    times, tokens = [], []
    for i in range(warmup + steps):
        batch_samples = order[(i * bs) % samples.shape[0] :][:bs]
        if s.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, n = _train_step(s, batch_samples)
        if s.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(n)
    step_s = statistics.median(times)
    return {
        "config": config,
        "model": s.cfg.model.kind,
        "blocks": s.cfg.model.num_blocks,
        "negatives": s.cfg.loss.negatives,
        "median_step_ms": step_s * 1e3,
        "tokens_per_step": statistics.mean(tokens),
        "tokens_per_s": sum(tokens) / sum(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", default=None, help="override data.path (default: the configs' data/ml-1m)")
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    rows = [bench(c, args.device, args.steps, args.warmup, args.data) for c in args.configs]
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"training throughput on {machine}, torch {torch.__version__}")
    print(f"{'config':<36}{'step ms':>10}{'tokens/step':>13}{'tokens/s':>12}")
    for r in rows:
        print(f"{r['config']:<36}{r['median_step_ms']:>10.1f}{r['tokens_per_step']:>13.0f}{r['tokens_per_s']:>12,.0f}")
    if args.out:
        payload = {
            "benchmark": "train_throughput",
            "command": "python benchmarks/train_throughput.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v and k != "configs"),
            "machine": machine,
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
