"""Start-up of ``recforge train``: wall clock from launch to the first (and K-th) trained step and to the first
checkpoint, and what the run imports, source trees side by side.

Usage (from the repo root; ML-1M prepared at data/ml-1m):
    python benchmarks/train_startup.py configs/ml1m-hstu-plus-d128.yaml --tree base=/path/to/old/checkout \
        --tree new=. --set train.precision=bfloat16 train.cuda_graphs=true --repeats 5 --checkpoint --importtime \
        --out benchmarks/results/train_startup-h200.json
    # CPU: a small model and batch, so the steps' own compute does not hide the start-up
    python benchmarks/train_startup.py configs/ml1m-hstu-plus-d128.yaml --data /tmp/ml-1m \
        --tree base=/tmp/base --tree new=. --set train.batch_size=8 model.dim=16 model.dqk=8 model.dv=8 \
        train.threads=1 --steps 3 --repeats 9 --checkpoint --importtime --out benchmarks/results/train_startup-cpu.json
    # where the seconds go, phase by phase (both trees)
    python benchmarks/train_startup.py configs/ml1m-hstu-plus-d128.yaml --tree base=/tmp/base --tree new=. \
        --set train.precision=bfloat16 train.cuda_graphs=true --steps 20 --repeats 5 --checkpoint --phases

Each run starts ``python -m recforge.cli --no-progress train CONFIG`` in the tree's root (so that tree's
``recforge`` is imported) with ``train.log_every=1``, reads its ``train_log.jsonl`` as it grows and stops it once
step ``--steps`` is logged. ``first_step_s`` is the launch-to-first-step time: Python start-up and imports, the
device's start, data loading, model building, and the first step (kernel compilation and autotuning
included); ``step_k_s`` the time to step K. ``--checkpoint``: the run checkpoints at step K
(``train.checkpoint_every``, no evaluation before it) and is timed to that checkpoint's directory (``checkpoint_s``:
what a run pays on its way to a checkpoint, the first checkpoint's own imports included). Trees alternate within
each repeat, so a busy machine slows them alike; medians are reported. ``--importtime``: one more launch per tree
under ``python -X importtime`` (not timed): the number of modules imported, the cumulative import seconds of the
``WATCHED`` modules (null: not imported; nested ones overlap) and the outermost imports of >= 50 ms. ``--phases``:
every run goes through ``_startup_phases.py``, which times the start-up's phases where the retrieval recipe calls
them (imports, device, dataset load, sequences, model, step runner, the first three steps' host time, the
checkpoint's snapshot and write; medians per tree, ``phases`` in the JSON). The config and data paths are made
absolute, so every tree trains the same run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import source_trees
from time_to_quality import _rows  # a growing JSON-lines file's complete rows
from recforge.io import atomic_write_json

# heavy modules an eager run need not import (the seconds each costs when it does)
WATCHED = ("torch", "torch._dynamo", "torch._inductor", "sympy", "triton", "torch.distributed.tensor", "pandas",
           "pyarrow.dataset", "torch.utils.tensorboard", "fastapi", "recforge.train.retrieval")  # fmt: skip


def _heavy_imports(output: str, threshold_s: float) -> dict[str, float]:
    """Outermost imports of a ``python -X importtime`` log that took at least ``threshold_s`` (cumulative, seconds):
    what start-up pays for, by the module that pulled it in first (indented deeper = imported by the one above)."""
    heavy = {}
    for line in output.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        if cumulative.strip().isdigit() and len(name) - len(name.lstrip()) <= 3 and int(cumulative) >= threshold_s * 1e6:
            heavy[name.strip()] = int(cumulative) / 1e6  # outermost (root) and their direct imports
    return dict(sorted(heavy.items(), key=lambda kv: -kv[1]))


def _import_profile(output: str) -> dict:
    """A ``python -X importtime`` log as: modules imported, the ``WATCHED`` ones' cumulative seconds, the heavy ones."""
    cumulative = {}
    for line in output.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, total, name = line.split("|")
            if total.strip().isdigit():
                cumulative.setdefault(name.strip(), int(total) / 1e6)
    return {"modules": len(cumulative), "watched_s": {name: cumulative.get(name) for name in WATCHED},
            "heavy_s": _heavy_imports(output, 0.05)}  # fmt: skip


def _phase_summary(path: Path) -> dict[str, dict[str, float]]:
    """``_startup_phases.py``'s rows as phase (``#2``, ``#3``: its later calls) -> start and host seconds."""
    out = {}
    for row in _rows(path):
        key = row["phase"] if row["call"] == 1 else f"{row['phase']} #{row['call']}"
        out[key] = {"start_s": row["start_s"], "seconds": row["seconds"]}
    return out


def _launch(tree: Path, config: Path, data: Path, overrides: list[str], steps: int, timeout: float,
            checkpoint: bool = False, importtime: bool = False, phases: bool = False) -> dict:  # fmt: skip
    name = f"startup-bench-{os.getpid()}"
    run_dir = tree / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    stop = [f"train.checkpoint_every={steps}"] if checkpoint else []
    phases_file = Path(tempfile.gettempdir()) / f"{name}-phases.jsonl"
    phases_file.unlink(missing_ok=True)
    program = [str(Path(__file__).resolve().parent / "_startup_phases.py"), str(phases_file)] if phases else ["-m", "recforge.cli"]
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), *program, "--no-progress", "train", str(config), f"name={name}",
               f"data.path={data}", "train.log_every=1", "train.eval_every=0", *overrides, *stop]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(tree))
    launched = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # not a pipe: a chatty child (-X importtime) would block on a full one
    child = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    marks: dict[int, float] = {}
    saved = None  # seconds to the first complete checkpoint directory (written atomically: it appears whole)

    def done() -> bool:
        return saved is not None if checkpoint else steps in marks

    while child.poll() is None and time.perf_counter() - launched < timeout and not done():
        time.sleep(0.02)
        for row in _rows(run_dir / "train_log.jsonl"):
            marks.setdefault(row["step"], time.perf_counter() - launched)
        if checkpoint and saved is None and any((run_dir / "checkpoints").glob("step_*")):
            saved = time.perf_counter() - launched
    waited = time.perf_counter()  # --phases: the background checkpoint write's own row, after the times are taken
    while phases and checkpoint and child.poll() is None and time.perf_counter() - waited < 5:
        if any(row["phase"] == "checkpoint write" for row in _rows(phases_file)):
            break
        time.sleep(0.02)
    if child.poll() is None:
        child.kill()
    child.wait()
    log.seek(0)
    output = log.read()
    log.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    if 1 not in marks or (checkpoint and saved is None):
        raise SystemExit(f"{tree}: no step or checkpoint in {timeout:.0f} s "
                         f"(exit {child.returncode}):\n{output[-3000:]}")  # fmt: skip
    result = {"first_step_s": marks[1], "step_k_s": marks.get(steps), "checkpoint_s": saved}
    if importtime:
        result["imports"] = _import_profile(output)
    if phases:
        result["phases"] = _phase_summary(phases_file)
        phases_file.unlink(missing_ok=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH", help="a source tree to time")
    parser.add_argument("--data", default="data/ml-1m", help="data.path")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--steps", type=int, default=20, help="also time the launch to this step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--checkpoint", action="store_true",
                        help="checkpoint at step --steps (train.checkpoint_every) and time each run to it")
    parser.add_argument("--importtime", action="store_true",
                        help="one more (untimed) launch per tree under python -X importtime: what the run imports")
    parser.add_argument("--phases", action="store_true",
                        help="time the start-up's phases in every run (_startup_phases.py: data, model, device, "
                             "first steps, checkpoint) and report their medians")
    args = parser.parse_args()
    trees = source_trees(args.tree, holds="recforge/cli.py")
    config, data = Path(args.config).resolve(), Path(args.data).resolve()
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        for name, tree in trees.items():
            result = _launch(tree, config, data, args.set, args.steps, args.timeout, args.checkpoint, phases=args.phases)
            runs[name].append(result)
            print(f"repeat {repeat} {name:>8}: first step {result['first_step_s']:6.2f} s, "
                  f"step {args.steps} {result['step_k_s'] or float('nan'):6.2f} s, "
                  f"checkpoint {result['checkpoint_s'] or float('nan'):6.2f} s", flush=True)  # fmt: skip
    imports = {}
    if args.importtime:
        for name, tree in trees.items():
            profiled = _launch(tree, config, data, args.set, args.steps, args.timeout, args.checkpoint, importtime=True)
            imports[name] = profiled["imports"]
            watched = ", ".join(f"{k} {v:.2f} s" for k, v in imports[name]["watched_s"].items() if v is not None)
            print(f"{name:>8} imports {imports[name]['modules']} modules; {watched}", flush=True)
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    keys = ("first_step_s", "step_k_s", "checkpoint_s")
    summary = {name: {key: median([r[key] for r in rs if r[key] is not None]) for key in keys}
               for name, rs in runs.items()}  # fmt: skip
    for name, s in summary.items():
        print(f"{name:>8}: median first step {s['first_step_s']:.2f} s, "
              f"step {args.steps} {s['step_k_s'] or float('nan'):.2f} s, "
              f"checkpoint {s['checkpoint_s'] or float('nan'):.2f} s")  # fmt: skip
    phase_medians = {}
    if args.phases:
        for name, rs in runs.items():
            phase_keys = dict.fromkeys(k for r in rs for k in r.get("phases", {}))
            phase_medians[name] = {k: {f: median([r["phases"][k][f] for r in rs if k in r.get("phases", {})])
                                       for f in ("start_s", "seconds")} for k in phase_keys}  # fmt: skip
        for key in dict.fromkeys(k for m in phase_medians.values() for k in m):
            cells = "  ".join(f"{name} " + (f"at {m[key]['start_s']:6.2f} s took {m[key]['seconds']:6.3f} s" if key in m else "-")
                              for name, m in phase_medians.items())  # fmt: skip
            print(f"  {key:<34} {cells}")
    ratios = {}
    if len(trees) == 2:
        a, b = trees
        ratios = {key: summary[b][key] / summary[a][key] for key in keys if summary[a][key] and summary[b][key]}
        print(f"{b}/{a}: " + ", ".join(f"{key} {value:.2f}x" for key, value in ratios.items()))
    if args.out:
        result = {"benchmark": "train_startup", "config": args.config, "overrides": args.set, "steps": args.steps,
                  "checkpoint": args.checkpoint,
                  "trees": {k: str(v) for k, v in trees.items()}, "median": summary, "ratios": ratios,
                  "runs": runs, "imports": imports, "phases": phase_medians, "torch": _torch_version(),
                  "python": sys.version.split()[0], "date": datetime.date.today().isoformat()}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), result)


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
