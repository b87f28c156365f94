"""The pipelined step's sparse input on the host: the worker's distribute + stage and the main thread's read, old vs new.

Usage (CPU, gloo world of one; ``--before-src`` is a ``git archive`` of the recforge tree to compare with):
    git archive 58e233e recforge | tar -x -C /tmp/before
    python benchmarks/sparse_stage.py --before-src /tmp/before --out benchmarks/results/sparse_stage-cpu-2core.json
    python benchmarks/sparse_stage.py --device cuda --before-src /tmp/before --out benchmarks/results/sparse_stage-h200.json

One ``ShardedDynamicEmbedding`` item table (the retrieval recipe's: d=50, lazy Adam), tiered (``--cache-fraction``
of its rows cached on the device), every catalogue item admitted (``warm_start``), looked up as
``recforge.train.pipeline_step`` does: per step ONE combined lookup of three parts (the history, its next
items as targets, 128 shared negatives; IDs drawn Zipf-like over the catalogue), made in the order of the
pipelined step on one thread, so the numbers carry no contention between the two threads::

    read(i): lookup(handle_i, part=k) for each part  [main_read_s]  -> loss
    distribute(i+1) [worker_distribute_s] -> stage(i+1) [worker_stage_s]      (no_grad, the worker's process group)
    backward(i) -> apply_gradients(i)

Each variant (``before``: the tree at ``--before-src``; ``after``: this checkout) runs in its own
process (the two trees are both ``recforge``), in alternating rounds; medians over all steps of all rounds.
The embeddings and the table's rows after the run are compared between the variants (bit for bit).
``aten ops``: the ops one more step's read and distribute + stage dispatch (each a kernel launch on CUDA).
``--index sorted`` runs the CUDA index (a sorted array) on the CPU; the CPU default is the hash table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMERS = ("worker_distribute_s", "worker_stage_s", "worker_s", "main_read_s")


def _parts(step: int, args: argparse.Namespace):
    """The step's combined lookup: history (N,), targets (N,) (the history's next items), negatives (128,)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    weights = torch.arange(1, args.items + 1, dtype=torch.float64).pow(-args.zipf)
    stream = torch.multinomial(weights, args.history + 1, replacement=True, generator=gen) + 1  # item IDs 1..items
    negatives = torch.randint(1, args.items + 1, (args.negatives,), generator=gen)
    return [stream[:-1].clone(), stream[1:].clone(), negatives]


def run_variant(args: argparse.Namespace) -> dict:
    """One process: the timed loop on the ``recforge`` found first on ``sys.path`` (see ``--src``)."""
    import torch
    import torch.distributed as dist

    import recforge
    from recforge.sparse.optim import SparseOptimConfig
    from recforge.sparse.sharded import ShardedDynamicEmbedding
    from recforge.sparse.table_config import TableConfig

    torch.set_num_threads(args.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if device.type == "cuda" else "gloo"  # a world of one: the collectives still run
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg = TableConfig("item", dim=args.dim, capacity=args.items + 1, cache_rows=max(1, int(args.items * args.cache_fraction)),
                      optimizer=SparseOptimConfig(kind="adam", lr=1e-3), seed=0, index=args.index)  # fmt: skip
    table = ShardedDynamicEmbedding(cfg, device)
    ids = torch.arange(1, args.items + 1)
    table.warm_start(torch.randn(ids.numel(), args.dim, generator=torch.Generator().manual_seed(0)) * 0.01, ids)
    table.train()
    worker_group = dist.new_group()
    proj = torch.randn(args.dim, generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def stage(step: int, count=None):
        parts = [t.to(device) for t in _parts(step, args)]
        sync()
        with count or contextlib.nullcontext():
            return _staged(parts)

    def _staged(parts):
        t0 = time.perf_counter()
        with torch.no_grad():
            handle = table.distribute(parts, group=worker_group, standin=False)
            sync()
            t1 = time.perf_counter()
            table.stage(handle)
        sync()
        return handle, t1 - t0, time.perf_counter() - t1

    rows, digest = [], hashlib.sha256()
    handle, _, _ = stage(0)
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        embs = [table.lookup(handle, part=k) for k in range(3)]
        sync()
        read_s = time.perf_counter() - t0
        loss = sum((e @ proj).square().sum() * (k + 1) for k, e in enumerate(embs))
        handle, dist_s, stage_s = stage(step + 1)
        loss.backward()
        table.apply_gradients()
        for e in embs:
            digest.update(e.detach().cpu().numpy().tobytes())
        if step >= args.warmup:
            rows.append({"worker_distribute_s": dist_s, "worker_stage_s": stage_s, "worker_s": dist_s + stage_s,
                         "main_read_s": read_s})  # fmt: skip
    ops = _count_ops(table, handle, stage, args.warmup + args.steps + 1, proj)
    live = table.shard.live_rows()
    weight, _ = table.shard.store.host_rows(live)
    digest.update(weight.cpu().numpy().tobytes())
    dist.destroy_process_group()
    return {"src": str(Path(recforge.__file__).parents[1]), "rows": rows, "digest": digest.hexdigest(),
            "staged_reads": table.staged_reads, "stats": dict(table.stats), "ops": ops}  # fmt: skip


def _count_ops(table, handle, stage, step: int, proj) -> dict[str, int]:
    """Aten ops (each a kernel launch on CUDA) of one more step's read, distribute and stage (views included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as read:
        embs = [table.lookup(handle, part=k) for k in range(3)]
    staging = Count()
    stage(step, staging)
    sum((e @ proj).sum() for e in embs).backward()
    table.apply_gradients()
    return {"read_ops": read.n, "distribute_stage_ops": staging.n}


CONFIG = ("device", "items", "history", "negatives", "dim", "cache_fraction", "zipf", "steps", "warmup", "threads", "index")


def _child_args(args: argparse.Namespace) -> list[str]:
    """The options a variant's process runs with (the driver's own: ``--before-src``, ``--rounds``, ``--out``, left out)."""
    return [item for key in CONFIG for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


def _spawn(src: Path, args: argparse.Namespace, passthrough: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, "--variant", *passthrough]
    out = subprocess.run(cmd, env=env, cwd=src, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the {src} variant failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace, passthrough: list[str]) -> dict:
    variants = {"after": REPO}
    if args.before_src:
        before = Path(args.before_src).resolve()
        if not (before / "recforge" / "__init__.py").is_file():
            raise SystemExit(f"--before-src {before}: no recforge/ package there; make one with "
                             f"`git archive <commit> recforge | tar -x -C {before}`")  # fmt: skip
        variants = {"before": before, "after": REPO}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, src in variants.items():
            runs[name].append(_spawn(src, args, passthrough))
    result: dict = {"variants": {}}
    for name, rs in runs.items():
        steps = [row for r in rs for row in r["rows"]]
        result["variants"][name] = {
            **{k: statistics.median(row[k] for row in steps) for k in TIMERS},
            "src": rs[0]["src"], "digest": rs[0]["digest"], "staged_reads_per_run": rs[0]["staged_reads"],
            "stats": rs[0]["stats"], "steps": len(steps), **rs[0]["ops"],
        }  # fmt: skip
    v = result["variants"]
    print(f"{'variant':<10}" + "".join(f"{k[:-2]:>22}" for k in TIMERS))
    for name, row in v.items():
        print(f"{name:<10}" + "".join(f"{row[k] * 1e3:>20.3f}ms" for k in TIMERS)
              + f"   aten ops: distribute+stage {row['distribute_stage_ops']}, read {row['read_ops']}")
    if "before" in v:
        result["ratio_before_over_after"] = {k: v["before"][k] / v["after"][k] for k in TIMERS}
        result["same_embeddings_and_rows"] = v["before"]["digest"] == v["after"]["digest"]
        print(f"{'before/after':<10}" + "".join(f"{result['ratio_before_over_after'][k]:>21.2f}x" for k in TIMERS))
        print(f"same embeddings and updated rows, bit for bit: {result['same_embeddings_and_rows']}")
    sys.path.insert(0, str(Path(__file__).parent))
    from _machine import cpu_model, write_result

    result.update(
        config={k: getattr(args, k) for k in (*CONFIG, "rounds")},
        machine={"platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count()},
        command=" ".join(sys.argv), date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )  # fmt: skip
    if args.out:
        write_result(args.out, result, indent=2)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--history", type=int, default=6400, help="history IDs per step (the targets as many)")
    parser.add_argument("--negatives", type=int, default=128)
    parser.add_argument("--dim", type=int, default=50)
    parser.add_argument("--cache-fraction", type=float, default=0.3, help="rows cached on the device (tiered table)")
    parser.add_argument("--zipf", type=float, default=0.9, help="item popularity exponent")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (before, after, before, ...)")
    parser.add_argument("--index", default="auto", help="the ID index: auto (hash on CPU, sorted on CUDA) | sorted | hash")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the worker shares the host)")
    parser.add_argument("--before-src", default=None, help="folder holding the old recforge/ (git archive), compared")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--variant", action="store_true", help=argparse.SUPPRESS)  # internal: one process, prints JSON
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
    else:
        main(args, _child_args(args))
