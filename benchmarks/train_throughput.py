"""Training throughput (tokens/s) of the retrieval recipe's step on real ML-1M batches.

Usage:
    python benchmarks/train_throughput.py --device cpu --steps 10
    python benchmarks/train_throughput.py --device cuda --steps 50 --out benchmarks/results/train_throughput-h100.json

Times whole training steps (batch assembly, forward, loss, backward, AdamW) for each
config in configs/, median over steps after warm-up, and prints one table.

``--launch-plans both`` (CUDA): alternate steps with the Triton launch plans of
``recforge.ops.triton.tuning`` on and off in one loop, and report both and their ratio.
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


def bench(config: str, device: str, steps: int, warmup: int, data: str | None, launch_plans: str = "on") -> dict:
    overrides = [f"train.device={device}"] + ([f"data.path={data}"] if data else [])
    s = setup(load_config(config, overrides))
    samples = s.seqs.training_samples(s.holdout, s.cfg.data.max_seq_len, s.cfg.data.train_windows)
    order = samples[torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(0))]
    bs = s.cfg.train.batch_size
    modes = ["on", "off"] if launch_plans == "both" else [launch_plans]
    plans = None
    if launch_plans != "on":
        from recforge.ops.triton import tuning

        plans = tuning.plans
    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[int]] = {m: [] for m in modes}
    for i in range((warmup + steps) * len(modes)):
        mode = modes[i % len(modes)]
        if plans is not None:
            plans.enabled = mode == "on"
        batch_samples = order[(i * bs) % samples.shape[0] :][:bs]
        if s.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, n = _train_step(s, s.seqs.training_batch(batch_samples, s.cfg.data.max_seq_len))
        if s.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup * len(modes):
            times[mode].append(time.perf_counter() - t0)
            tokens[mode].append(n)
    if plans is not None:
        plans.enabled = True
    row = {"config": config, "model": s.cfg.model.kind, "blocks": s.cfg.model.num_blocks, "negatives": s.cfg.loss.negatives}
    for mode in modes:
        suffix = "" if mode == modes[0] else "_launch_plans_off"
        row[f"median_step_ms{suffix}"] = statistics.median(times[mode]) * 1e3
        row[f"tokens_per_step{suffix}"] = statistics.mean(tokens[mode])
        row[f"tokens_per_s{suffix}"] = sum(tokens[mode]) / sum(times[mode])
    if len(modes) == 2:
        row["off_over_on"] = row["median_step_ms_launch_plans_off"] / row["median_step_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", default=None, help="override data.path (default: the configs' data/ml-1m)")
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--launch-plans", choices=["on", "off", "both"], default="on",
                        help="Triton launch plans (CUDA): on, off, or both in alternating steps")
    args = parser.parse_args()
    rows = [bench(c, args.device, args.steps, args.warmup, args.data, args.launch_plans) for c in args.configs]
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"training throughput on {machine}, torch {torch.__version__}")
    print(f"{'config':<36}{'step ms':>10}{'tokens/step':>13}{'tokens/s':>12}")
    for r in rows:
        print(f"{r['config']:<36}{r['median_step_ms']:>10.1f}{r['tokens_per_step']:>13.0f}{r['tokens_per_s']:>12,.0f}")
        if "off_over_on" in r:
            print(f"{'  launch plans off':<36}{r['median_step_ms_launch_plans_off']:>10.1f}"
                  f"{r['tokens_per_step_launch_plans_off']:>13.0f}{r['tokens_per_s_launch_plans_off']:>12,.0f}"
                  f"   (off / on step time {r['off_over_on']:.2f}x)")
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
