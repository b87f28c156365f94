"""Copy a run's eval.json into results/ with the metadata RESULTS.md rows cite.

    python scripts/collect_result.py runs/ranking-ml100k-hstu results/ml-100k-ranking-hstu.json \
        --config configs/ranking-ml100k-hstu.yaml --train-command "recforge train ..." --hardware "2-core CPU"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", required=True, help="the config file the run was trained from")
    parser.add_argument("--train-command", required=True)
    parser.add_argument("--hardware", required=True)
    args = parser.parse_args()
    result = json.loads((args.run_dir / "eval.json").read_text())
    evals = [json.loads(line) for line in (args.run_dir / "evals.jsonl").read_text().splitlines() if line]
    steps = [json.loads(line) for line in (args.run_dir / "train_log.jsonl").read_text().splitlines() if line]
    result.update(
        config=args.config,
        train_command=args.train_command,
        hardware=args.hardware,
        epochs_completed=max((e["epoch"] for e in evals), default=0),
        steps=steps[-1]["step"] if steps else 0,
        eval_history=evals,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
