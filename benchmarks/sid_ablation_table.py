"""The SID ablation table: mean ± 95% t-interval over seeds of each run group's test metrics.

Reads ``WORK/*/eval.json`` (written by `recforge eval` / the end of `recforge train`), groups runs
named ``NAME-sSEED`` by NAME, and checks every run trained the same number of steps (its latest
checkpoint's step; ``--steps`` to require a value). Prints a Markdown table and writes it as JSON.

Usage:
    python benchmarks/sid_ablation_table.py runs/sid-ablation --steps 2000 --out benchmarks/results/sid_beauty_ablation.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recforge.io import atomic_write_json  # noqa: E402

METRICS = (("hr@5", "Recall@5"), ("ndcg@5", "NDCG@5"), ("hr@10", "Recall@10"), ("ndcg@10", "NDCG@10"))


def t_half_width(values: list[float], confidence: float = 0.95) -> float:
    """Half-width of the Student-t confidence interval of the mean (nan for fewer than 2 values)."""
    if len(values) < 2:
        return float("nan")
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values)))


def trained_steps(run_dir: Path) -> int | None:
    """Step of the run's latest checkpoint (None without one)."""
    latest = run_dir / "checkpoints" / "latest.json"
    if not latest.is_file():
        return None
    manifest = run_dir / "checkpoints" / json.loads(latest.read_text())["step_dir"] / "manifest.json"
    return json.loads(manifest.read_text())["step"]


def collect(work: Path) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for path in sorted(work.glob("*/eval.json")):
        match = re.fullmatch(r"(.+)-s(\d+)", path.parent.name)
        if match is None:
            continue
        result = json.loads(path.read_text())
        result["seed"], result["trained_steps"] = int(match.group(2)), trained_steps(path.parent)
        groups.setdefault(match.group(1), []).append(result)
    return groups


def summarize(groups: dict[str, list[dict]], steps: int | None) -> list[dict]:
    rows = []
    for name, runs in groups.items():
        row = {"group": name, "seeds": [r["seed"] for r in runs], "sids": runs[0].get("sids"),
               "trained_steps": sorted({r["trained_steps"] for r in runs}, key=str)}  # fmt: skip
        for key, _ in METRICS:
            values = [r[key] for r in runs]
            row[key] = {"mean": statistics.fmean(values), "ci95": t_half_width(values), "values": values}
        row["equal_steps"] = len(row["trained_steps"]) == 1 and (steps is None or row["trained_steps"] == [steps])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work", type=Path, help="directory holding one run directory per (group, seed)")
    p.add_argument("--steps", type=int, default=None, help="the step count every run must have trained")
    p.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = p.parse_args(argv)
    rows = summarize(collect(args.work), args.steps)
    if not rows:
        print(f"no {args.work}/*-sSEED/eval.json found", file=sys.stderr)
        return 1
    print("| runs (n seeds) | steps | " + " | ".join(label for _, label in METRICS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in METRICS) + " |")
    for row in rows:
        cells = [f"{row[k]['mean']:.4f} ± {row[k]['ci95']:.4f}" for k, _ in METRICS]
        steps = ",".join(str(s) for s in row["trained_steps"]) + ("" if row["equal_steps"] else " (UNEQUAL)")
        print(f"| {row['group']} ({len(row['seeds'])}) | {steps} | " + " | ".join(cells) + " |")
    if args.out is not None:
        atomic_write_json(args.out, {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                                     "work": str(args.work), "required_steps": args.steps, "rows": rows})  # fmt: skip
        print(f"wrote {args.out}")
    return 0 if all(row["equal_steps"] for row in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
