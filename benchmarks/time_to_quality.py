"""Wall clock from the start of ``recforge train`` to a checkpoint at a target quality (ML-1M: the paper's HSTU-large).

Usage (on the GPU machine, from the repo root, ML-1M prepared as data/ml-1m):
    python benchmarks/time_to_quality.py configs/ml1m-hstu-plus-d128.yaml --set train.eval_every=5 \
        --out benchmarks/results/time_to_quality-h200.json
    python benchmarks/time_to_quality.py configs/ml1m-hstu-large.yaml --no-stop     # the whole run's time too
    python benchmarks/time_to_quality.py configs/ml1m-hstu-plus-d128.yaml --name d128-graphs \
        --set train.cuda_graphs=true --out benchmarks/results/time_to_quality-graphs-h200.json   # the whole step graphed
    python benchmarks/time_to_quality.py configs/ml1m-hstu-plus-d128.yaml --name ng --seeds 1 2 3 \
        --set train.eval_every=5 train.precision=bfloat16 train.cuda_graphs=true \
        --variants chain:RECFORGE_FUSED_NORM_GATE=0 fused:RECFORGE_FUSED_NORM_GATE=1 --out ttq-ab.json   # A/B, 6 runs
    python benchmarks/time_to_quality.py configs/ml1m-hstu-plus-d128.yaml --name cg --warm-caches 40 \
        --set train.eval_every=5 train.precision=bfloat16 train.cuda_graphs=true train.compile=default  # a second run

Starts ``python -m recforge.cli train CONFIG`` as a child process and reads its ``evals.jsonl`` as it
grows. The quality is what the run itself evaluates (``evals.jsonl``: the test target under
``data.protocol=paper``, as the paper and its reference code report it); the harness only watches,
it changes nothing in training, so the checkpoint it times is the one an uninterrupted run writes
at that step. Reached: the first evaluation at or above every ``--target``, once its checkpoint
directory is complete; then the child is stopped (``--no-stop``: it runs to the end and its total
time is reported). Times are from the child's launch, so they include Python start-up, data loading,
model building, compilation and every evaluation. ``--warm-caches STEPS``: first, per variant, one untimed run of
STEPS steps with the same settings fills the on-disk compile caches (Inductor, AOTAutograd, Triton autotuning), so
the timed runs measure what a user's second run of a config pays; its seconds are in the JSON (``warm_up_s``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from recforge.io import atomic_write_json

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
    return statistics.median(values) if values else None


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


def _parse_variants(items: list[str]) -> list[tuple[str, dict[str, str]]]:
    """``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` (environment variables of that variant's runs)."""
    out = []
    for item in items:
        name, _, env = item.partition(":")
        pairs = [kv.partition("=") for kv in env.split(",") if kv]
        if not name or any(not sep for _, sep, _ in pairs):
            raise SystemExit(f"--variants {item!r}: expected NAME or NAME:KEY=VALUE[,KEY=VALUE]")
        out.append((name, {k: v for k, _, v in pairs}))
    return out


def _child(args, name: str, overrides: list[str], extra_env: dict[str, str]) -> tuple[list[str], dict, Path]:
    """(command, environment, log path) of one ``recforge train`` child named ``name`` (refused if its run exists)."""
    if (Path("runs") / name).exists():
        raise SystemExit(f"runs/{name} exists: remove it or pass another --name")
    command = [sys.executable, "-m", "recforge.cli", "--no-progress", "train", args.config, f"name={name}",
               f"data.path={args.data}", *overrides]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.environ.get("PYTHONPATH", str(Path.cwd())), **extra_env)
    log_path = Path("runs") / f"{name}.log"
    log_path.parent.mkdir(exist_ok=True)
    return command, env, log_path


def run_once(args, targets: dict[str, float], name: str, overrides: list[str], extra_env: dict[str, str]) -> dict:
    """One ``recforge train`` child watched to the target (see the module doc); its result row."""
    command, env, log_path = _child(args, name, overrides, extra_env)
    run_dir = Path("runs") / name
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
        "benchmark": "time_to_quality", "command": " ".join(command), "env": extra_env, "config": args.config,
        "targets": targets, "reached": reached is not None and "checkpoint_s" in reached,
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
        print(f"{name}: {targets} reached at step {reached['step']}; checkpoint {reached['checkpoint_s']:.1f} s after launch")
    else:
        print(f"{name}: {targets} not reached in {total:.0f} s (returncode {child.returncode}; see {log_path})")
    return result


def warm_up(args, name: str, overrides: list[str], extra_env: dict[str, str]) -> float:
    """One untimed ``recforge train`` child of ``args.warm_caches`` steps (its run dir ``runs/NAME``); its seconds."""
    command, env, log_path = _child(args, name, [*overrides, f"train.max_steps={args.warm_caches}"], extra_env)
    started = time.time()
    with log_path.open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout)
    if done.returncode:
        raise SystemExit(f"the cache warm-up run failed (code {done.returncode}); see {log_path}")
    seconds = time.time() - started
    print(f"{name}: caches warmed by {args.warm_caches} steps in {seconds:.1f} s")
    return seconds


def summarize(rows: list[dict]) -> dict:
    """Per variant: runs, how many reached the target, and the median time of those that did (compare the
    counts first: a variant that reached the target in fewer runs can show a lower median)."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        times = [r["time_to_quality_s"] for r in mine if r["reached"]]
        out[variant] = {"runs": len(mine), "reached": len(times), "median_time_to_quality_s": _median(times),
                        "times_s": times}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--name", default=None, help="run name (default: the config's name + '-ttq'); with --seeds "
                        "or --variants, the prefix of each run's name")  # fmt: skip
    parser.add_argument("--data", default="data/ml-1m", help="data.path")
    parser.add_argument("--target", nargs="*", default=[], metavar="METRIC=VALUE",
                        help="default: the paper's HSTU-large, hr@10=0.3294 ndcg@10=0.1893")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--seeds", nargs="*", type=int, default=[], help="train.seed of each run (default: the "
                        "config's, one run): whether one seed crosses a target near the config's final quality is "
                        "chance, so compare variants over several")  # fmt: skip
    parser.add_argument("--variants", nargs="*", default=[], metavar="NAME[:KEY=VALUE,...]",
                        help="variants run alternately for each seed, each with its environment variables "
                        "(e.g. chain:RECFORGE_FUSED_NORM_GATE=0 fused:RECFORGE_FUSED_NORM_GATE=1)")  # fmt: skip
    parser.add_argument("--no-stop", action="store_true", help="let the run finish after the target is reached")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a child is stopped")
    parser.add_argument("--warm-caches", type=int, default=0, metavar="STEPS",
                        help="first one untimed run of STEPS steps per variant, same settings, to fill the compile "
                        "caches (a user's second run); 0: the timed runs start on the machine's caches as they are")  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    if args.warm_caches < 0:
        raise SystemExit(f"--warm-caches {args.warm_caches}: a number of steps (>= 0)")
    targets = _parse_targets(args.target)
    name = args.name or Path(args.config).stem + "-ttq"
    if not args.seeds and not args.variants:  # one run: its row is the whole output, as before
        warm = warm_up(args, f"{name}-warm", args.set, {}) if args.warm_caches else None
        result = run_once(args, targets, name, args.set, {}) | ({"warm_up_s": warm} if warm is not None else {})
        if args.out:
            atomic_write_json(Path(args.out), result)
        return
    variants = _parse_variants(args.variants) or [("run", {})]
    if len({v for v, _ in variants}) < len(variants):
        raise SystemExit(f"--variants: names must differ ({[v for v, _ in variants]}): each names its runs")
    warm = {variant: warm_up(args, f"{name}-{variant}-warm", args.set, env) for variant, env in variants} if args.warm_caches else {}
    rows = []
    for seed in args.seeds or [None]:
        for variant, env in variants:  # alternating: drifts of the machine fall on every variant alike
            seeded = [] if seed is None else [f"train.seed={seed}"]
            run_name = "-".join([name, variant] + ([] if seed is None else [f"s{seed}"]))
            rows.append(run_once(args, targets, run_name, [*args.set, *seeded], env) | {"variant": variant, "seed": seed})
            if args.out:  # after every run: a stopped benchmark keeps what it measured
                atomic_write_json(Path(args.out), {"benchmark": "time_to_quality", "config": args.config,
                                                   "targets": targets, "warm_up_s": warm or None,
                                                   "summary": summarize(rows), "runs": rows})  # fmt: skip
    for variant, row in summarize(rows).items():
        median = row["median_time_to_quality_s"]
        print(f"{variant}: reached {row['reached']} of {row['runs']}"
              + (f", median {median:.1f} s ({', '.join(f'{t:.1f}' for t in row['times_s'])})" if median else ""))


if __name__ == "__main__":
    main()
