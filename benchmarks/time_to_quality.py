"""Wall clock from the start of ``recforge train`` to a checkpoint at a target quality (ML-1M: the paper's HSTU-large).

Usage (on the GPU machine, from the repo root, ML-1M prepared as data/ml-1m):
    python benchmarks/time_to_quality.py configs/ml1m-hstu-plus-d128.yaml --set train.eval_every=5 \
        --out benchmarks/results/time_to_quality-h200.json
    python benchmarks/time_to_quality.py configs/ml1m-hstu-large.yaml --no-stop     # the whole run's time too
    python benchmarks/time_to_quality.py configs/ml1m-hstu-plus-d128.yaml --name d128-graphs \
        --set train.cuda_graphs=true --out benchmarks/results/time_to_quality-graphs-h200.json   # the whole step graphed

Starts ``python -m recforge.cli train CONFIG`` as a child process and reads its ``evals.jsonl`` as it
grows. The quality is what the run itself evaluates (``evals.jsonl``: the test target under
``data.protocol=paper``, as the paper and its reference code report it); the harness only watches,
it changes nothing in training, so the checkpoint it times is the one an uninterrupted run writes
at that step. Reached: the first evaluation at or above every ``--target``, once its checkpoint
directory is complete; then the child is stopped (``--no-stop``: it runs to the end and its total
time is reported). Times are from the child's launch, so they include Python start-up, data loading,
model building, compilation and every evaluation.
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

PAPER_HSTU_LARGE = {"hr@10": 0.3294, "ndcg@10": 0.1893}  # arXiv 2402.17152, ML-1M


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def _parse_targets(items: list[str]) -> dict[str, float]:
    if not items:
        return dict(PAPER_HSTU_LARGE)
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--target {item!r}: expected METRIC=VALUE, e.g. hr@10=0.3294")
        out[key] = float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--name", default=None, help="run name (default: the config's name + '-ttq')")
    parser.add_argument("--data", default="data/ml-1m", help="data.path")
    parser.add_argument("--target", nargs="*", default=[], metavar="METRIC=VALUE",
                        help="default: the paper's HSTU-large, hr@10=0.3294 ndcg@10=0.1893")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--no-stop", action="store_true", help="let the run finish after the target is reached")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the child is stopped")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    targets = _parse_targets(args.target)
    name = args.name or Path(args.config).stem + "-ttq"
    command = [sys.executable, "-m", "recforge.cli", "--no-progress", "train", args.config, f"name={name}",
               f"data.path={args.data}", *args.set]  # fmt: skip
    run_dir = Path("runs") / name
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: remove it or pass another --name")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.environ.get("PYTHONPATH", str(Path.cwd())))
    log_path = Path("runs") / f"{name}.log"
    log_path.parent.mkdir(exist_ok=True)
    launched = time.time()
    with log_path.open("w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        reached = None
        while child.poll() is None and time.time() - launched < args.timeout:
            time.sleep(0.2)
            if reached is None:
                for row in _rows(run_dir / "evals.jsonl"):
                    if all(row.get(k, float("-inf")) >= v for k, v in targets.items()):
                        reached = row
                        break
            if reached is not None:
                ckpt = run_dir / "checkpoints" / f"step_{reached['step']:08d}"
                if (ckpt / "manifest.json").is_file():
                    reached["checkpoint_s"] = (ckpt / "manifest.json").stat().st_mtime - launched
                    if not args.no_stop:
                        break
        timed_out = child.poll() is None and time.time() - launched >= args.timeout
        if child.poll() is None:
            child.terminate()
            child.wait(timeout=60)
    total = time.time() - launched
    evals = _rows(run_dir / "evals.jsonl")
    steps = _rows(run_dir / "train_log.jsonl")
    rated = [r for r in steps if "tokens_per_s" in r]
    result = {
        "benchmark": "time_to_quality", "command": " ".join(command), "config": args.config, "targets": targets,
        "reached": reached is not None and "checkpoint_s" in reached,
        "time_to_quality_s": reached.get("checkpoint_s") if reached else None,
        "eval_at_target": reached, "total_s": total, "stopped_at_target": reached is not None and not args.no_stop,
        "timed_out": timed_out, "returncode": child.returncode,
        "evals": [{k: r.get(k) for k in ("step", "epoch", "elapsed_s", *targets)} | {"since_launch_s": r.get("time", launched) - launched}
                  for r in evals],
        "median_tokens_per_s": _median([r["tokens_per_s"] for r in rated]),
        "median_mfu": _median([r["mfu"] for r in rated if "mfu" in r]),
        # train.cuda_graphs: shape buckets captured, and whether a capture failed (the run then went on eagerly)
        "graphs_captured": log_path.read_text().count("train.cuda_graphs: captured the step"),
        "graphs_failed": "train.cuda_graphs: capturing the step failed" in log_path.read_text(),
        "date": datetime.date.today().isoformat(), "log": str(log_path),
    }  # fmt: skip
    for r in result["evals"]:
        print(f"step {r['step']:>6} epoch {r['epoch']:>4} at {r['since_launch_s']:7.1f} s: "
              + " ".join(f"{k} {r[k]:.4f}" for k in targets if r.get(k) is not None))  # fmt: skip
    if result["reached"]:
        print(f"{args.config}: {targets} reached at step {reached['step']}; checkpoint {reached['checkpoint_s']:.1f} s after launch")
    else:
        print(f"{args.config}: {targets} not reached in {total:.0f} s (returncode {child.returncode}; see {log_path})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
