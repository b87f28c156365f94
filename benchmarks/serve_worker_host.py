"""The batching worker's host work per request (issue 14), before and after, side by side in one run.

Usage (``--before-src``: a source tree to compare with, e.g. main before the change):
    mkdir -p /tmp/before && git -C /work/main archive HEAD recforge | tar -x -C /tmp/before
    python benchmarks/serve_worker_host.py --before-src /tmp/before --out benchmarks/results/serve_worker_host-cpu-2core.json
    python benchmarks/serve_worker_host.py --device cuda --before-src /tmp/before --out benchmarks/results/serve_worker_host-h200.json

On CUDA the engine's ops are real kernel launches and allocations (the stubbed passes are not captured as
graphs: their copies run as they would around a replay); the worker's CPU time there also counts the
one synchronisation per pass (reading the scores back).

An engine (``serve_load.py``'s model shrunk to 2 HSTU blocks x 2 heads of ``--dqk`` = 4, d = 16, float32:
keys and values so small that copying them costs next to nothing on the CPU, as on a GPU, where
they are device copies; what is left is the per-request host work) with a KV-cache pool
(``--device-mb`` / ``--host-mb``: small enough that users move between the tiers, as under a burst)
serves returning users through the real ``BatchRunner`` (its worker thread, its ``Scheduler``) on
the CPU, ``--batch`` requests admitted together per round. Users are ``serve_overload.py``'s:
``--history``-event histories that grow by 0-2 events per request, ``--candidates`` candidates,
1 in 10 requests from a new user. The passes go through the CUDA-graph path (``graphs.py``'s padded
passes, run eagerly), with each padded pass's compute replaced by a fixed output: what is left is
the worker's host work around the model (scheduling, KV lookup / materialise / write-back, staging,
copies), the part a replayed graph leaves on the host of a GPU server.

Each tree runs in its own process (``--rounds`` times, alternating, so a busy moment of a shared
machine hits both alike) and reports:

- ``host_us_per_request``: the worker thread's CPU time (``BatchRunner`` counters' ``worker_cpu_s``)
  per request, over ``--requests`` requests after a warm-up that brings every user in;
- ``ops_per_request``: PyTorch operator calls (aten ops, views included; a ``TorchDispatchMode``
  on the worker thread) per request, over a separate, shorter counted stretch, and
  ``kernel_ops_per_request``: those that are not views (on a GPU each is a kernel launch or an
  allocation, the costly part of the host work there);
- ``scores_sha256``: a digest of the scores of ``--check`` requests computed with the real model
  (not stubbed). Both trees must give the same bytes, else the run fails.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(args: argparse.Namespace) -> dict:
    """One tree's measurements (runs in its own process, with ``args.src`` first on ``sys.path``)."""
    sys.path.insert(0, str(args.src))
    import numpy as np
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from recforge.serve.engine import EngineConfig, RankEngine
    from recforge.serve.graphs import GraphRunner, PaddedPass
    from recforge.serve.kv_pool import KVCachePool, PoolConfig
    from recforge.serve.runner import BatchRunner
    from recforge.serve.scheduler import SchedulerConfig
    from recforge.models import HSTUConfig, HSTUEncoder
    from recforge.models.ranking import MultiTaskMLP, RankingModel, RankingPrefix, save_slices
    from serve_load import ACTIONS, NUM_ITEMS, VOCAB, returning_history

    import recforge

    assert Path(recforge.__file__).resolve().is_relative_to(Path(args.src).resolve()), recforge.__file__
    torch.set_num_threads(1)
    torch.manual_seed(0)  # serve_load.export_model's model and vocabulary, at a tiny width
    dim = args.dqk * 4
    model = RankingModel(RankingPrefix(NUM_ITEMS, len(ACTIONS), 1010, dim),
                         HSTUEncoder(HSTUConfig(dim=dim, num_blocks=2, num_heads=2, dqk=args.dqk, dv=args.dqk, dropout=0.0,
                                                max_seq_len=args.history * 2 + 64)),
                         MultiTaskMLP(dim, 2, hidden=32))  # fmt: skip
    vocab = VOCAB
    with tempfile.TemporaryDirectory() as tmp:
        save_slices(model, Path(tmp) / "model", tasks=[{"name": "click", "kind": "binary"}, {"name": "buy", "kind": "binary"}],
                    extra={"step": 0, "action_encoding": "sum", "max_seq_len": args.history * 2 + 64, "num_contextual": 2,
                           "user_features": ["user_id", "gender"]}, json_files={"vocab.json": vocab})  # fmt: skip
        engine = RankEngine.from_run(tmp, EngineConfig(device=args.device, cuda_graphs=0))
    engine.pool = KVCachePool.for_engine(engine, PoolConfig(device_mb=args.device_mb, host_mb=args.host_mb))
    engine.graphs = GraphRunner(engine, limit=64, capture=False)  # the GPU path, eager
    real_compute = PaddedPass.compute
    rng = np.random.default_rng(args.seed)
    histories: dict[int, list] = {}
    next_new = args.users

    def request(user: int | None = None):
        nonlocal next_new
        if user is None:
            if rng.random() < 0.1:
                user, next_new = next_new, next_new + 1
            else:
                user = int(rng.integers(args.users))
        events = histories[user] = returning_history(rng, histories.get(user), args.history)
        return engine.encode(f"user{user}", {"items": list(events[0]), "timestamps": list(events[1]), "actions": list(events[2])},
                             rng.integers(1, NUM_ITEMS + 1, args.candidates).tolist(),
                             user_features={"user_id": str(user % 1000), "gender": "f"}, timestamp=events[1][-1] + 60)  # fmt: skip

    runner = BatchRunner(engine, SchedulerConfig(token_budget=16384, max_wait_ms=0.0, max_queue_ms=1e9))

    def serve(reqs: list) -> list:
        """Admit ``reqs`` in rounds of ``--batch`` (all at once: the worker's lock held while submitting)."""
        out = []
        for i in range(0, len(reqs), args.batch):
            with runner._cond:
                futures = [runner.submit(r) for r in reqs[i : i + args.batch]]
            out += [f.result(timeout=600) for f in futures]
        return out

    # the correctness check: real passes, the same requests in both trees
    results = serve([request() for _ in range(args.check)])
    digest = hashlib.sha256(b"".join(r.scores.numpy().tobytes() for r in results)).hexdigest()

    fixed: dict = {}

    def stub(self):  # the padded pass's compute replaced by a fixed output: host work only
        if self.kind != "targets":
            return None
        return fixed.setdefault(self.m, torch.zeros(self.m, len(engine.tasks), device=engine.device))

    PaddedPass.compute = stub
    serve([request(u) for u in range(args.users)])  # warm-up: every user cached (and evicted, as they go round)
    serve([request() for _ in range(args.requests // 4)])
    reqs = [request() for _ in range(args.requests)]
    gc.collect()  # the model, the pool and the warm-up's objects out of the collector's way: a full collection
    gc.freeze()  # over them lands on whichever pass it interrupts, in one tree's run and not the other's
    before = runner.stats()
    t0 = time.perf_counter()
    serve(reqs)
    wall = time.perf_counter() - t0
    after = runner.stats()

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()
            self.kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            # views (slice, select, transpose, detach, ...) and lift_fresh (a tensor made from host data) move and
            # allocate nothing; every other op is a kernel launch or an allocation on a GPU
            self.kernels += not func.is_view and func.overloadpacket is not torch.ops.aten.lift_fresh
            return func(*args, **(kwargs or {}))

    counter = Count()
    iteration = runner._iteration

    def counted() -> bool:
        with counter:
            return iteration()

    counted_reqs = [request() for _ in range(args.requests // 4)]
    runner._iteration = counted
    serve(counted_reqs)
    runner._iteration = iteration
    runner.close()
    PaddedPass.compute = real_compute
    n = args.requests
    pool = engine.pool.report()
    return {"host_us_per_request": (after["worker_cpu_s"] - before["worker_cpu_s"]) / n * 1e6,
            "wall_us_per_request": wall / n * 1e6, "passes": after["passes"] - before["passes"],
            "ops_per_request": sum(counter.ops.values()) / len(counted_reqs),
            "kernel_ops_per_request": counter.kernels / len(counted_reqs),
            "top_ops": {k: v / len(counted_reqs) for k, v in counter.ops.most_common(16)},
            "scores_sha256": digest, "scores": torch.cat([r.scores for r in results]).tolist(), "device_hits": pool["device_hits"], "host_hits": pool["host_hits"],
            "evicted_to_host": pool["evicted_to_host"], "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before-src", type=Path, default=None, help="a tree holding the old recforge/ to compare with")
    parser.add_argument("--history", type=int, default=500)
    parser.add_argument("--candidates", type=int, default=200)
    parser.add_argument("--users", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16, help="requests admitted together")
    parser.add_argument("--requests", type=int, default=1600, help="timed requests per process")
    parser.add_argument("--check", type=int, default=32, help="requests scored with the real model, compared")
    parser.add_argument("--dqk", type=int, default=4, help="per-head key/value width (d = 4 x dqk)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--device-mb", type=float, default=16.0)
    parser.add_argument("--host-mb", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, default=HERE.parent, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    trees = {"after": HERE.parent}
    if args.before_src is not None:
        if not (args.before_src / "recforge" / "serve" / "runner.py").exists():
            raise SystemExit(f"--before-src {args.before_src}: no recforge/serve/runner.py; "
                             f"e.g. `git archive HEAD recforge | tar -x -C {args.before_src}`")  # fmt: skip
        trees = {"before": args.before_src, **trees}
    passthrough = [a for a in sys.argv[1:] if a != "--out" and not a.startswith("--out=")]
    if "--out" in sys.argv:
        i = sys.argv.index("--out")
        passthrough = sys.argv[1:i] + sys.argv[i + 2 :]
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, src in sorted(trees.items(), reverse=bool(r % 2)):
            out = subprocess.run([sys.executable, str(HERE / "serve_worker_host.py"), *passthrough, "--child", "--src", str(src)],
                                 check=True, capture_output=True, text=True, cwd=HERE)  # fmt: skip
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            row = runs[name][-1]
            print(f"round {r} {name:6s} host {row['host_us_per_request']:7.0f} us/request  ops {row['ops_per_request']:6.1f}/request "
                  f"(not views {row['kernel_ops_per_request']:5.1f})  "
                  f"device hits {row['device_hits']} host hits {row['host_hits']}", flush=True)  # fmt: skip
    digests = {name: {row["scores_sha256"] for row in rows} for name, rows in runs.items()}
    diff = 0.0  # the largest score difference from the first run (0: every run's scores the same bytes)
    if len(set().union(*digests.values())) != 1:
        first = runs["after"][0]["scores"]
        diff = max(abs(a - b) for rows in runs.values() for row in rows for x, y in zip(first, row["scores"]) for a, b in zip(x, y))
        if args.device == "cpu" or diff > 1e-5:  # CUDA kernels may round differently run to run; the CPU's must not
            raise SystemExit(f"scores differ between the trees (or runs) by up to {diff:.2e}: {digests}")
    for rows in runs.values():
        for row in rows:
            del row["scores"]
    summary = {name: {"host_us_per_request_median": statistics.median(r["host_us_per_request"] for r in rows),
                      "host_us_per_request_min": min(r["host_us_per_request"] for r in rows),
                      "ops_per_request": rows[0]["ops_per_request"], "kernel_ops_per_request": rows[0]["kernel_ops_per_request"],
                      "top_ops": rows[0]["top_ops"]}
               for name, rows in runs.items()}  # fmt: skip
    for name, s in summary.items():
        print(f"{name:6s} host {s['host_us_per_request_median']:7.0f} us/request (median; min {s['host_us_per_request_min']:.0f}), "
              f"{s['ops_per_request']:.1f} ops/request "
              f"({s['kernel_ops_per_request']:.1f} not views)")
    if "before" in summary:
        b, a = summary["before"], summary["after"]
        print(f"after / before: host {a['host_us_per_request_median'] / b['host_us_per_request_median']:.2f}x "
              f"(min {a['host_us_per_request_min'] / b['host_us_per_request_min']:.2f}x), "
              f"ops {a['ops_per_request'] / b['ops_per_request']:.2f}x (not views {a['kernel_ops_per_request'] / b['kernel_ops_per_request']:.2f}x); "
              + (f"scores identical (sha256 {next(iter(digests['after']))[:12]})" if not diff else f"scores within {diff:.1e}"))
    if args.out:
        sys.path.insert(0, str(HERE))
        from _machine import cpu_model, write_result

        write_result(args.out, {"benchmark": "serve_worker_host", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                                "cpu": cpu_model(), "device": args.device, "torch": runs["after"][0]["torch"],
                                "gpu": runs["after"][0]["gpu"], "max_score_difference": diff,
                                "args": {k: str(v) for k, v in vars(args).items() if k not in ("child", "src")},
                                "summary": summary, "runs": runs})  # fmt: skip


if __name__ == "__main__":
    main()
