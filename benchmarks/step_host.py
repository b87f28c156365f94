"""Host cost of one eager retrieval training step: ms per step and ops per step, source trees side by side.

Usage (from the repo root; ML-1M prepared at data/ml-1m):
    # CPU, tiny widths: compute is negligible, so the step is dispatch and Python (what a GPU step's host pays)
    python benchmarks/step_host.py --tree new=. --tree base=/tmp/base --repeats 5 \
        --out benchmarks/results/step_host-cpu-2core.json
    # GPU: the real config's widths, per-step wall time with the device synchronised each step
    python benchmarks/step_host.py --tree new=. --tree base=/tmp/base --device cuda --set model.dim=128 model.dqk=64 \
        model.dv=64 train.batch_size=256 loss.chunk_size=8192 --repeats 3 --out benchmarks/results/step_host-h200.json

Each measurement is a child process (``--child``) with the tree's root on PYTHONPATH, so that tree's
``recforge`` runs: it builds the retrieval recipe's setup (``recforge.train.retrieval.setup``: model, optimizer,
``StepRunner``) for the config with ``--set`` overrides, makes one training batch as the recipe does, runs
``--warmup`` steps, then times ``--steps`` steps (median ms per step; the device is synchronised each step) and
counts the ops of one step with ``torch.profiler`` (``aten::`` ops dispatched, all and top-level) and, on CUDA,
its CUDA kernels. ``ms_min`` (the fastest step of each run, median over runs) is the steadier number on a shared
machine. ``--attention triton-host`` (CPU) runs the Triton attention path with every kernel launch
replaced by a no-op (``TRITON_INTERPRET=1`` passes the dispatcher's device check): the host work of that path
(argument set-up, allocation, launch plans) without its compute; its outputs are uninitialised, so its losses
are meaningless and only the times and op counts count. Trees alternate within each repeat; medians are reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _machine import source_trees
from recforge.io import atomic_write_json

# ops that only make a view (no kernel, no copy): left out of ``non_view_ops``
VIEW_OPS = {f"aten::{name}" for name in ("slice", "select", "unsqueeze", "squeeze", "reshape", "view", "t", "transpose",
                                         "expand", "expand_as", "as_strided", "detach", "numpy_T", "alias", "permute",
                                         "split", "split_with_sizes", "_reshape_alias", "lift_fresh")}  # fmt: skip
CPU_TINY = ["model.dim=16", "model.dqk=8", "model.dv=8", "train.batch_size=2", "loss.chunk_size=32",
            "model.dropout=0.3", "train.threads=1"]  # fmt: skip


def _child(args: argparse.Namespace) -> None:
    import torch

    if args.attention == "triton-host":
        from recforge.ops.triton import hstu

        hstu.launch = lambda *a, **k: None  # the host path without the kernels (see the module docstring)
    from recforge.config import load_config
    from recforge.train import retrieval

    overrides = [f"data.path={args.data}", f"train.device={args.device}", "train.eval_every=0", *args.set]
    if args.attention == "triton-host":
        overrides.append("model.kernel=triton")
    cfg = load_config(args.config, overrides)
    s = retrieval.setup(cfg)
    samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(samples.shape[0], generator=gen)[: cfg.train.batch_size]
    batch = s.seqs.training_batch(samples[ids], cfg.data.max_seq_len).to(s.device)
    sync = torch.cuda.synchronize if s.device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        s.runner([batch], 1.0)
    sync()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        result = s.runner([batch], 1.0)
        sync()
        times.append(time.perf_counter() - start)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if s.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        s.runner([batch], 1.0)
        sync()
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]

    def in_optimizer(e) -> bool:
        while e is not None and not e.name.startswith("Optimizer.step"):
            e = e.cpu_parent
        return e is not None

    if args.cprofile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.runcall(lambda: [s.runner([batch], 1.0) for _ in range(10)])
        pstats.Stats(profile, stream=sys.stderr).sort_stats(args.cprofile).print_stats(40)
    if args.list_ops:
        from collections import Counter

        for name, count in Counter(e.name for e in top).most_common(args.list_ops):
            print(f"{count:6d} {name}", file=sys.stderr)
    times.sort()
    print(json.dumps({"ms_per_step": 1e3 * times[len(times) // 2], "ms_min": 1e3 * times[0],
                      "aten_ops": len(aten), "top_level_aten_ops": len(top), "non_view_ops": sum(e.name not in VIEW_OPS for e in top),
                      "optimizer_aten_ops": sum(map(in_optimizer, aten)),
                      "cuda_kernels": len(kernels),
                      "tokens": int(batch.num_tokens), "loss": float(result.loss)}))  # fmt: skip


def _measure(tree: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--config", str(Path(args.config).resolve()),
               "--data", str(Path(args.data).resolve()), "--device", args.device, "--attention", args.attention,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--set", *args.set]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree))
    if args.attention == "triton-host":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: the child failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/ml1m-hstu-plus-d128.yaml")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH", help="a source tree to time")
    parser.add_argument("--data", default="data/ml-1m", help="data.path")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention", default="config", choices=["config", "triton-host"],
                        help="triton-host: the Triton attention path with no-op launches (CPU)")
    parser.add_argument("--set", nargs="*", default=None, metavar="KEY=VALUE",
                        help=f"config overrides (default on CPU: {' '.join(CPU_TINY)})")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--list-ops", type=int, default=0, metavar="N", help="with --child: the N most frequent top-level ops")
    parser.add_argument("--cprofile", default=None, metavar="SORT", help="with --child: print cProfile stats, sorted so")
    args = parser.parse_args()
    if args.set is None:
        args.set = CPU_TINY if args.device == "cpu" else []
    if args.child:
        return _child(args)
    trees = source_trees(args.tree or ["new=."], holds="recforge/cli.py")
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        for name, tree in trees.items():
            result = _measure(tree, args)
            runs[name].append(result)
            print(f"repeat {repeat} {name:>8}: {result['ms_per_step']:7.2f} ms/step, {result['aten_ops']} aten ops "
                  f"({result['top_level_aten_ops']} top-level, {result['non_view_ops']} of them not views; "
                  f"{result['optimizer_aten_ops']} in the optimizer), "
                  f"{result['cuda_kernels']} CUDA kernels", flush=True)  # fmt: skip
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    summary = {name: {key: median([r[key] for r in rs]) for key in ("ms_per_step", "ms_min", "aten_ops", "top_level_aten_ops",
                                                                     "non_view_ops", "optimizer_aten_ops", "cuda_kernels")}
               for name, rs in runs.items()}  # fmt: skip
    names = list(trees)
    for name in names:
        print(f"{name:>8}: median {summary[name]['ms_per_step']:.2f} ms/step (of the fastest steps {summary[name]['ms_min']:.2f}), "
              f"{summary[name]['aten_ops']} aten ops, {summary[name]['non_view_ops']} top-level non-view ops")
    if len(names) == 2:
        a, b = names
        print(f"{b}/{a} ms per step: {summary[b]['ms_per_step'] / summary[a]['ms_per_step']:.2f}x")
    if args.out:
        result = {"benchmark": "step_host", "config": args.config, "overrides": args.set, "device": args.device,
                  "attention": args.attention, "trees": {k: str(v) for k, v in trees.items()}, "median": summary,
                  "runs": runs, "torch": _torch_version(), "date": datetime.date.today().isoformat()}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), result)


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
