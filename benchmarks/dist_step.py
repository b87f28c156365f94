"""Distributed training step, stage by stage, with the input pipeline (``dist.pipeline``) on vs off.

Usage (one GPU, NCCL at world size 1: the collectives and the sharded tables' all-to-alls run):
    python benchmarks/dist_step.py --device cuda --out benchmarks/results/dist_step-h200.json
    torchrun --nproc-per-node 8 benchmarks/dist_step.py --device cuda      # several GPUs (rank 0 reports)
    python benchmarks/dist_step.py --device cpu --steps 6 --warmup 2 --users 400 --items 800   # gloo smoke run

The retrieval recipe (configs/ml1m-hstu.yaml's model) on a synthetic dataset, with
``model.embedding=dynamic`` tables sharded by ``ShardedDynamicEmbedding`` and tiered: the item
table lives in host memory with ``--cache-fraction`` of its rows cached on the device. The modes
run in alternating blocks (off, on, off, on ...). Per step:

- ``fetch_s``, ``build_s``, ``h2d_s``: the input stages (sample ids -> JaggedBatch -> device copy,
  on a side CUDA stream when the pipeline is on), measured where they run;
- ``exposed_input_s``: how long the training loop waited for its input (all of the above when
  the pipeline is off; what compute did not hide when it is on);
- ``step_s``: forward + loss + backward + DDP all-reduce + optimizers, including the sharded
  tables' ID/embedding all-to-alls and host-tier row swaps (synchronised); with the pipeline on,
  the next step's ID all-to-all is started during this step's backward (``recforge.train.pipeline_step``);
- with CUDA, a ``torch.profiler`` pass over ``--profile-steps`` steps per mode gives the device
  time of NCCL kernels (``comm_kernel_s``) and host-to-device copies (``h2d_copy_s``, batch copies
  and tier swaps) per step.

``hidden_input_fraction`` = 1 - exposed_input_s / (fetch_s + build_s + h2d_s) with the pipeline on.
``step_breakdown``: one extra sequential block with synchronised timers around the tables'
``distribute`` (ID all-to-all) and ``lookup`` (owner lookup, tier swaps, embedding all-to-all)
and the optimizers' ``step``; the rest of ``step_s`` is forward + backward (+ DDP all-reduce and
the gradients' way back to the row owners).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from recforge.config import load_config
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train import retrieval
from recforge.train.distributed import init_distributed, shutdown_distributed
from recforge.train.inputs import StepInputs
from recforge.train.runtime import prepare_runtime

REPO = Path(__file__).resolve().parents[1]
STAGES = ("fetch_s", "build_s", "h2d_s", "exposed_input_s", "step_s", "wall_s")


def _join_world_of_one() -> None:
    """Run as rank 0 of 1 when not started by torchrun (the process group still forms: NCCL/gloo)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _profile(s, inputs: StepInputs, steps: int) -> dict[str, float]:
    """Device seconds per step of NCCL kernels and host-to-device copies (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            s.runner(next(inputs).micro)
        torch.cuda.synchronize()
    comm = h2d = 0.0
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        if "nccl" in event.key.lower():
            comm += us
        elif "memcpy htod" in event.key.lower():
            h2d += us
    return {"comm_kernel_s": comm / 1e6 / steps, "h2d_copy_s": h2d / 1e6 / steps}


class StageTimer:
    """Synchronised wall time of the sharded tables' ``distribute``/``lookup`` and of both optimizers' ``step``.

    Used only in an extra sequential block (the synchronisations would defeat the overlap being
    measured): it splits ``step_s`` into input distribution, lookup, optimizers and the rest."""

    def __init__(self, s) -> None:
        self.s, self.totals, self.saved = s, {}, []

    def _wrap(self, obj, attr: str, stage: str) -> None:
        real = getattr(obj, attr)
        sync = torch.cuda.synchronize if self.s.device.type == "cuda" else (lambda: None)

        def timed(*a, **kw):
            sync()
            t0 = time.perf_counter()
            out = real(*a, **kw)
            sync()
            self.totals[stage] = self.totals.get(stage, 0.0) + time.perf_counter() - t0
            return out

        self.saved.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, timed)

    def __enter__(self) -> StageTimer:
        for table in (self.s.runner.ahead.tables.values() if self.s.runner.ahead else []):
            self._wrap(table, "distribute", "input_dist_s")
            self._wrap(table, "lookup", "lookup_s")
        self._wrap(self.s.runner.optimizer, "step", "dense_optimizer_s")
        if self.s.sparse_optimizer is not None:
            self._wrap(self.s.sparse_optimizer, "step", "sparse_optimizer_s")
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, before in reversed(self.saved):
            if before is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, before)


def run_block(s, samples: torch.Tensor, pipeline: bool, steps: int, start: int) -> list[dict[str, float]]:
    bs, device = s.cfg.train.batch_size, s.device

    def raw():
        i = start
        while True:
            lo = (i * bs) % max(1, samples.shape[0] - bs)
            yield [torch.arange(lo, lo + bs)]
            i += 1

    inputs = StepInputs(raw(), build=lambda ids: s.seqs.training_batch(samples[ids], s.cfg.data.max_seq_len),
                        device=device, snapshot=None, prefetch=pipeline)  # fmt: skip
    rows = []
    s.runner.set_upcoming(inputs.peek if pipeline else None)  # on: the next step's ID all-to-all starts early
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            item = next(inputs)
            t1 = time.perf_counter()
            s.runner(item.micro)  # its loss all-reduce reads the loss: the step is finished on return
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            rows.append({**item.times, "exposed_input_s": t1 - t0, "step_s": t2 - t1, "wall_s": t2 - t0})
        if device.type == "cuda" and args.profile_steps:
            rows[-1].update(_profile(s, inputs, args.profile_steps))
    finally:
        s.runner.set_upcoming(None)
        inputs.close()
    return rows


def main() -> dict:
    _join_world_of_one()
    data_dir = Path(args.data or tempfile.mkdtemp(prefix="dist_step-")) / "synth"
    if not (data_dir / "dataset.json").is_file():
        write_synthetic(data_dir, SyntheticConfig(num_users=args.users, num_items=args.items, seed=0))
    cache_rows = max(1, int(args.items * args.cache_fraction))
    # shared negatives: one step touches its histories' items + 128 sampled ones, which the device cache must hold
    overrides = [f"data.path={data_dir}", f"train.device={args.device}", "model.embedding=dynamic", "loss.negatives=shared",
                 f"sparse.cache_rows={cache_rows}", f"train.batch_size={args.batch_size}",
                 f"train.output_dir={tempfile.mkdtemp(prefix='dist_step-run-')}/{{name}}", *args.set]  # fmt: skip
    cfg = load_config(REPO / "configs" / "ml1m-hstu.yaml", overrides)
    ctx = init_distributed(cfg, prepare_runtime(cfg))
    s = retrieval.setup(cfg, ctx)
    samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
    samples = samples[torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(0))]
    for pipeline in (False, True):  # warm-up: kernels, caches, allocator
        run_block(s, samples, pipeline, args.warmup, 0)
    per_mode: dict[str, list[dict]] = {"off": [], "on": []}
    for block in range(args.blocks):
        for mode in ("off", "on"):
            per_mode[mode] += run_block(s, samples, mode == "on", args.steps, block * args.steps)
    with StageTimer(s) as timer:  # the breakdown of one sequential step (synchronised stage timers)
        timed = run_block(s, samples, False, args.steps, 0)
    step_s = sum(r["step_s"] for r in timed) / len(timed)
    breakdown = {k: v / len(timed) for k, v in sorted(timer.totals.items())}
    breakdown["forward_backward_rest_s"] = step_s - sum(breakdown.values())
    breakdown = {"input_stages_s": statistics.median(r["fetch_s"] + r["build_s"] + r["h2d_s"] for r in timed),
                 **breakdown, "step_s": step_s}  # fmt: skip
    result = {"modes": {}, "step_breakdown": breakdown}
    for mode, rows in per_mode.items():
        summary = {k: statistics.median(r[k] for r in rows) for k in STAGES}
        for key in ("comm_kernel_s", "h2d_copy_s"):
            if any(key in r for r in rows):
                summary[key] = statistics.median(r[key] for r in rows if key in r)
        result["modes"][mode] = summary
    on = result["modes"]["on"]
    stages = on["fetch_s"] + on["build_s"] + on["h2d_s"]
    result["hidden_input_fraction"] = 1 - on["exposed_input_s"] / stages if stages else float("nan")
    result["speedup_on_vs_off"] = result["modes"]["off"]["wall_s"] / on["wall_s"]
    # lookups whose ID all-to-all was started during the previous step (pipeline on only)
    result["lookups_ahead"] = {n: t.lookups_ahead for n, t in s.runner.ahead.tables.items()} if s.runner.ahead else {}
    if not ctx.is_main:  # under torchrun with several ranks: rank 0 reports
        shutdown_distributed()
        return result
    print(f"{'mode':<6}" + "".join(f"{k:>16}" for k in (*STAGES, "comm_kernel_s", "h2d_copy_s")))
    for mode, summary in result["modes"].items():
        cells = [summary.get(k) for k in (*STAGES, "comm_kernel_s", "h2d_copy_s")]
        print(f"{mode:<6}" + "".join(f"{c * 1e3:>14.3f}ms" if c is not None else f"{'-':>16}" for c in cells))
    print("step breakdown (sequential, synchronised): " + "  ".join(f"{k}={v * 1e3:.3f}ms" for k, v in breakdown.items()))
    print(f"pipeline on hides {result['hidden_input_fraction']:.1%} of the input stages; step wall time off/on = "
          f"{result['speedup_on_vs_off']:.3f}x; lookups with their IDs distributed a step ahead: {result['lookups_ahead']}")  # fmt: skip
    result.update(
        config={"users": args.users, "items": args.items, "batch_size": args.batch_size, "cache_rows": cache_rows,
                "steps_per_block": args.steps, "blocks": args.blocks, "set": args.set, "world_size": ctx.world_size,
                "backend": torch.distributed.get_backend() if ctx.initialized else None},
        machine={"platform": platform.platform(), "torch": torch.__version__,
                 "device": torch.cuda.get_device_name() if s.device.type == "cuda" else platform.processor()},
        command=" ".join(sys.argv), date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    shutdown_distributed()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--users", type=int, default=20000)
    parser.add_argument("--items", type=int, default=200000)
    parser.add_argument("--batch-size", type=int, default=128, help="sequences per rank per step")
    parser.add_argument("--cache-fraction", type=float, default=0.2, help="item rows cached on the device (tiered table)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block")
    parser.add_argument("--blocks", type=int, default=3, help="alternating off/on blocks")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=5, help="CUDA: profiled steps per block (0: none)")
    parser.add_argument("--data", default=None, help="directory to keep the synthetic dataset in (default: a temp dir)")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.num_blocks=4")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    main()
