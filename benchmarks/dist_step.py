"""Distributed training step, stage by stage, with the input pipeline (``dist.pipeline``) on vs off.

Usage (one GPU, NCCL at world size 1: the collectives and the sharded tables' all-to-alls run):
    python benchmarks/dist_step.py --device cuda --out benchmarks/results/dist_step-h200.json
    torchrun --nproc-per-node 8 benchmarks/dist_step.py --device cuda      # several GPUs (rank 0 reports)
    python benchmarks/dist_step.py --device cpu --steps 6 --warmup 2 --blocks 1 --users 400 --items 800 --cache-fraction 1   # gloo smoke run

The retrieval recipe (configs/ml1m-hstu.yaml's model) on a synthetic dataset, with
``model.embedding=dynamic`` tables sharded by ``ShardedDynamicEmbedding`` and tiered: the item
table lives in host memory with ``--cache-fraction`` of its rows cached on the device. The modes
run in alternating blocks (off, on, off, ...). Both make ONE combined lookup per table and step
(``recforge.train.pipeline_step``: the item table's history, targets and sampled negatives in one
ID all-to-all and one staging); ``on`` makes the next batch's in the sparse worker a step ahead
(its negatives drawn there too, ``recforge.train.step_draws``), ``off`` at the step on the main
thread. Per step:

- ``fetch_s``, ``build_s``, ``h2d_s``: the input stages (sample ids -> JaggedBatch -> device copy,
  on a side CUDA stream when the pipeline is on), measured where they run;
- ``exposed_input_s``: how long the training loop waited for its input;
- ``step_s``/``wall_s``: the step (forward, loss, backward, DDP all-reduce, optimizers, the sparse
  input still on the main thread) and the step with its input wait;
- with CUDA, a ``torch.profiler`` pass gives the device time of NCCL kernels (``comm_kernel_s``) and
  host-to-device copies (``h2d_copy_s``: batch copies and host-tier row swaps) per step.

The sparse input per step, in an extra block per mode with stream-synchronised timers around the
main thread's calls (``sparse`` in the JSON): ``main_distribute_s`` (dedup + ID all-to-all),
``main_stage_s`` (owner dedup, index lookup, host tier -> device cache), ``main_lookup_s`` (reading
the rows, admission when IDs are new, the embeddings' all-to-all), ``main_read_s`` (the same for
staged lookups, the combined ones: with no new IDs only the read), ``main_wait_s`` (the main thread
waiting for the sparse worker); and the worker's own ``worker_distribute_s``/``worker_stage_s``
(pipeline on: the next step's combined lookups; ``worker_draw_s``: the worker drawing its negatives,
reported apart, not in ``work``). Then

    work    = h2d_s + main_(distribute + stage + lookup + read)_s + worker_(distribute + stage)_s
    exposed = (h2d_s off, or exposed_input_s on) + main_(distribute + stage + lookup + read + wait)_s
    hidden  = 1 - exposed / work        (issue 15: >= 80% with the pipeline on)

and ``hidden_vs_off`` = 1 - exposed(on) / work(off): how much of the sparse input made at the step
the pipeline takes off the main thread (``hidden`` alone falls when the worker gets faster).

``--warm-table`` (default) admits the whole catalogue before timing, so lookups find their IDs as
in a long run; a lookup of new IDs (or of IDs evicted since the staging) looks those up again at use
(``relooked_up``) and finishes the owner's part there (``staged_reads`` counts the combined lookups
staged ahead that did not). ``distributes_per_step`` counts each table's ID all-to-alls per step,
by thread (one per table and step, in the worker when ``on``). ``benchmarks/sparse_stage.py`` times
the worker's distribute + stage and the main thread's read alone, old tree vs new.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
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
MODES = ("off", "on")  # the sparse input (and the batch's fetch, build, H2D) made at the step, or a step ahead
STEP_SEEDS = itertools.count(1)  # every step re-seeds, as the training loop does: the negatives' seeds follow


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
            micro = next(inputs).micro
            torch.manual_seed(next(STEP_SEEDS))
            s.runner(micro)
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
    """Stream-synchronised wall time of the main thread's sparse-input calls (the worker's are in ``LookAhead.stats``).

    Used only in extra blocks (the synchronisations cost overlap): it says which part of the sparse input
    runs on the main thread, where it is exposed. Nested calls (``lookup`` calling ``stage``) count once.
    ``distributes`` counts the tables' ID all-to-alls by thread."""

    def __init__(self, s) -> None:
        self.s, self.totals, self.saved, self.stack = s, {}, [], []
        self.distributes = {"main": 0, "worker": 0}

    def _wrap(self, obj, attr: str, stage: str) -> None:
        real = getattr(obj, attr)
        cuda = self.s.device.type == "cuda"
        sync = (lambda: torch.cuda.current_stream().synchronize()) if cuda else (lambda: None)

        def timed(*a, **kw):
            main = threading.current_thread() is threading.main_thread()
            if attr == "distribute":
                self.distributes["main" if main else "worker"] += 1
            if not main:
                return real(*a, **kw)
            bucket = stage
            if attr == "lookup" and a and getattr(a[0], "staged", None) is not None:
                bucket = "main_read_s"  # a lookup the worker staged: reading the rows (+ admission if IDs are new)
            sync()
            self.stack.append(0.0)
            t0 = time.perf_counter()
            out = real(*a, **kw)
            sync()
            took, inner = time.perf_counter() - t0, self.stack.pop()
            self.totals[bucket] = self.totals.get(bucket, 0.0) + took - inner
            if self.stack:
                self.stack[-1] += took
            return out

        self.saved.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, timed)

    def __enter__(self) -> StageTimer:
        for table in _tables(self.s):
            self._wrap(table, "distribute", "main_distribute_s")
            self._wrap(table, "stage", "main_stage_s")
            self._wrap(table, "lookup", "main_lookup_s")
        if self.s.runner.ahead is not None:
            self._wrap(self.s.runner.ahead, "wait", "main_wait_s")
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, before in reversed(self.saved):
            if before is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, before)


def _tables(s) -> list:
    from recforge.sparse.sharded import sharded_tables

    return list(sharded_tables(s.model).values())


def sparse_block(s, samples: torch.Tensor, mode: str, steps: int) -> dict[str, float]:
    """Per-step sparse-input times of one timed block (see the module docstring)."""
    ahead = s.runner.ahead
    pipeline = mode == "on"
    before = len(ahead.stats) if ahead is not None else 0
    with StageTimer(s) as timer:
        rows = run_block(s, samples, mode, steps, 0)
    out = {k: 0.0 for k in ("main_distribute_s", "main_stage_s", "main_lookup_s", "main_read_s", "main_wait_s")}
    out.update({k: v / steps for k, v in timer.totals.items()})
    staged = ahead.stats[before:] if ahead is not None and pipeline else []
    for key in ("draw_s", "distribute_s", "stage_s"):
        out[f"worker_{key}"] = sum(t[key] for t in staged) / steps
    out["h2d_s"] = statistics.median(r["h2d_s"] for r in rows)
    out["exposed_input_s"] = statistics.median(r["exposed_input_s"] for r in rows)
    main = out["main_distribute_s"] + out["main_stage_s"] + out["main_lookup_s"] + out["main_read_s"]
    out["work_s"] = out["h2d_s"] + main + out["worker_distribute_s"] + out["worker_stage_s"]
    out["exposed_s"] = (min(out["h2d_s"], out["exposed_input_s"]) if pipeline else out["h2d_s"]) + main + out["main_wait_s"]
    out["hidden_fraction"] = 1 - out["exposed_s"] / out["work_s"] if out["work_s"] else float("nan")
    out["distributes_per_step"] = {k: v / steps for k, v in timer.distributes.items()}  # all tables
    return out


def run_block(s, samples: torch.Tensor, mode: str, steps: int, start: int) -> list[dict[str, float]]:
    bs, device = s.cfg.train.batch_size, s.device
    pipeline = mode == "on"

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
            torch.manual_seed(next(STEP_SEEDS))
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
    if args.switch_interval:  # how long a thread may hold the GIL while another waits (Python's default: 5 ms)
        sys.setswitchinterval(args.switch_interval)
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
    if args.warm_table:  # every catalogue item admitted (each rank keeps the rows it owns): a table in steady state
        gen = torch.Generator().manual_seed(0)
        for table in _tables(s):
            ids = torch.arange(1, s.seqs.num_items + 1)
            table.warm_start(torch.randn(ids.numel(), table.dim, generator=gen) * table.cfg.init_std, ids)
    samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
    samples = samples[torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(0))]
    for mode in MODES:  # warm-up: kernels, caches, allocator
        run_block(s, samples, mode, args.warmup, 0)
    per_mode: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for block in range(args.blocks):
        for mode in MODES:
            per_mode[mode] += run_block(s, samples, mode, args.steps, block * args.steps)
    sparse = {mode: sparse_block(s, samples, mode, args.steps) for mode in MODES}
    # the exposed sparse input with the pipeline on against all of it at the step (off): the share the pipeline
    # takes off the critical path (``hidden_fraction`` shrinks when the worker's hidden part gets faster)
    sparse["on"]["hidden_vs_off"] = 1 - sparse["on"]["exposed_s"] / sparse["off"]["work_s"] if sparse["off"]["work_s"] else float("nan")
    result = {"modes": {}, "sparse": sparse}
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
    # lookups that read a combined lookup made during the previous step (pipeline on only)
    result["lookups_ahead"] = {n: t.lookups_ahead for n, t in s.runner.ahead.tables.items()} if s.runner.ahead else {}
    result["staged_reads"] = {n: t.ahead_reads for n, t in s.runner.ahead.tables.items()} if s.runner.ahead else {}
    result["relooked_up"] = {n: getattr(t, "relooked_up", None) for n, t in s.runner.ahead.tables.items()} if s.runner.ahead else {}
    result["staged_paths"] = {n: [".".join(p) for p in ps] for n, ps in (s.runner.ahead.paths or {}).items()} if s.runner.ahead else {}
    result["negatives_drawn_ahead"] = s.runner.draws.reused if s.runner.draws is not None else 0
    result["remade"] = s.runner.ahead.remade if s.runner.ahead else 0
    if not ctx.is_main:  # under torchrun with several ranks: rank 0 reports
        shutdown_distributed()
        return result
    print(f"{'mode':<21}" + "".join(f"{k:>16}" for k in (*STAGES, "comm_kernel_s", "h2d_copy_s")))
    for mode, summary in result["modes"].items():
        cells = [summary.get(k) for k in (*STAGES, "comm_kernel_s", "h2d_copy_s")]
        print(f"{mode:<21}" + "".join(f"{c * 1e3:>14.3f}ms" if c is not None else f"{'-':>16}" for c in cells))
    keys = ("h2d_s", "main_distribute_s", "main_stage_s", "main_lookup_s", "main_read_s", "main_wait_s", "worker_draw_s",
            "worker_distribute_s", "worker_stage_s", "work_s", "exposed_s")  # fmt: skip
    print("sparse input per step (stream-synchronised main-thread timers; worker: its own clock)")
    print(f"{'mode':<21}" + "".join(f"{k[:-2]:>20}" for k in keys) + f"{'hidden':>9}")
    for mode, row in sparse.items():
        print(f"{mode:<21}" + "".join(f"{row[k] * 1e3:>18.3f}ms" for k in keys) + f"{max(row['hidden_fraction'], 0.0):>9.1%}")
    print(f"pipeline on hides {sparse['on']['hidden_fraction']:.1%} of H2D + ID distribution + lookup "
          f"(off: {max(sparse['off']['hidden_fraction'], 0.0):.1%}; exposed on vs all of it off: "
          f"{sparse['on']['hidden_vs_off']:.1%} hidden) and {result['hidden_input_fraction']:.1%} of the input stages; "
          f"step wall time off/on = {result['speedup_on_vs_off']:.3f}x; ID all-to-alls per step (all tables): "
          f"off {sparse['off']['distributes_per_step']}, on {sparse['on']['distributes_per_step']}")  # fmt: skip
    print(f"lookups read from a combined lookup staged a step ahead: {result['lookups_ahead']} ({result['staged_paths']}); "
          f"combined lookups staged ahead and read with no host sync: {result['staged_reads']} (staged IDs looked up again "
          f"at use: {result['relooked_up']}); made again at the step: "
          f"{result['remade']}; negatives drawn a step ahead and used: {result['negatives_drawn_ahead']}")  # fmt: skip
    result.update(
        config={"users": args.users, "items": args.items, "batch_size": args.batch_size, "cache_rows": cache_rows,
                "steps_per_block": args.steps, "blocks": args.blocks, "warm_table": args.warm_table, "set": args.set, "world_size": ctx.world_size,
                "switch_interval": sys.getswitchinterval(),
                "backend": torch.distributed.get_backend() if ctx.initialized else None},
        machine={"platform": platform.platform(), "torch": torch.__version__,
                 "device": torch.cuda.get_device_name() if s.device.type == "cuda" else platform.processor()},
        command=" ".join(sys.argv), date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )  # fmt: skip
    if args.out:
        from _machine import write_result  # this folder (the script's) is on sys.path

        write_result(args.out, result, indent=2)
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
    parser.add_argument("--warm-table", action=argparse.BooleanOptionalAction, default=True,
                        help="admit every catalogue item before timing (steady state; --no-warm-table: a cold table)")
    parser.add_argument("--data", default=None, help="directory to keep the synthetic dataset in (default: a temp dir)")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.num_blocks=4")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval seconds (the main thread, the sparse worker and the input thread share "
                             "the GIL; default: Python's 0.005)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    main()
