"""Start-up of ``recforge train``: wall clock from launch to the first (and K-th) trained step, source trees side by side.

Usage (from the repo root; ML-1M prepared at data/ml-1m):
    python benchmarks/train_startup.py configs/ml1m-hstu-plus-d128.yaml --tree new=. --tree base=/path/to/old/checkout \
        --repeats 3 --out benchmarks/results/train_startup-h200.json
    # CPU: a small batch, so the step's own compute does not hide the start-up
    python benchmarks/train_startup.py configs/ml1m-hstu-plus-d128.yaml --data /tmp/ml-1m --set train.batch_size=8 \
        --tree new=. --tree base=/tmp/base --repeats 3

Each run starts ``python -m recforge.cli --no-progress train CONFIG`` in the tree's root (so that tree's ``recforge``
is imported) with ``train.log_every=1``, reads its ``train_log.jsonl`` as it grows and stops it once step
``--steps`` is logged. ``first_step_s`` is the launch-to-first-step time: Python start-up and imports, the
device's start, data loading, model building, and the first step (kernel compilation and autotuning
included); ``step_k_s`` the time to step K. Trees alternate within each repeat, so a busy machine slows them
alike; medians are reported. The config and data paths are made absolute, so every tree trains the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from time_to_quality import _rows  # a growing JSON-lines file's complete rows


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


def _launch(tree: Path, config: Path, data: Path, overrides: list[str], steps: int, timeout: float,
            importtime: bool = False) -> dict:  # fmt: skip
    name = f"startup-bench-{os.getpid()}"
    run_dir = tree / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "recforge.cli", "--no-progress", "train", str(config), f"name={name}",
               f"data.path={data}", "train.log_every=1", "train.eval_every=0", *overrides]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(tree))
    launched = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # not a pipe: a chatty child (-X importtime) would block on a full one
    child = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    marks: dict[int, float] = {}
    while child.poll() is None and time.perf_counter() - launched < timeout and steps not in marks:
        time.sleep(0.02)
        for row in _rows(run_dir / "train_log.jsonl"):
            marks.setdefault(row["step"], time.perf_counter() - launched)
    if child.poll() is None:
        child.kill()
    child.wait()
    log.seek(0)
    output = log.read()
    log.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    if 1 not in marks:
        raise SystemExit(f"{tree}: no step logged in {timeout:.0f} s (exit {child.returncode}):\n{output[-3000:]}")
    result = {"first_step_s": marks[1], "step_k_s": marks.get(steps)}
    if importtime:
        result["imports_s"] = _heavy_imports(output, 0.05)
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
    parser.add_argument("--importtime", action="store_true",
                        help="run under python -X importtime and record the imports of >= 50 ms (slows the launch)")
    args = parser.parse_args()
    trees = {}
    for item in args.tree:
        key, sep, path = item.partition("=")
        if not sep or not (Path(path) / "recforge" / "cli.py").is_file():
            raise SystemExit(f"--tree {item!r}: expected NAME=PATH with PATH a checkout holding recforge/cli.py")
        trees[key] = Path(path).resolve()
    config, data = Path(args.config).resolve(), Path(args.data).resolve()
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        for name, tree in trees.items():
            result = _launch(tree, config, data, args.set, args.steps, args.timeout, args.importtime)
            runs[name].append(result)
            print(f"repeat {repeat} {name:>8}: first step {result['first_step_s']:6.2f} s, "
                  f"step {args.steps} {result['step_k_s'] or float('nan'):6.2f} s", flush=True)  # fmt: skip
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    summary = {name: {"first_step_s": median([r["first_step_s"] for r in rs]),
                      "step_k_s": median([r["step_k_s"] for r in rs if r["step_k_s"] is not None])}
               for name, rs in runs.items()}  # fmt: skip
    for name, s in summary.items():
        print(f"{name:>8}: median first step {s['first_step_s']:.2f} s, step {args.steps} {s['step_k_s'] or float('nan'):.2f} s")
    if args.out:
        result = {"benchmark": "train_startup", "config": args.config, "overrides": args.set, "steps": args.steps,
                  "trees": {k: str(v) for k, v in trees.items()}, "median": summary, "runs": runs,
                  "python": sys.version.split()[0], "date": datetime.date.today().isoformat()}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
