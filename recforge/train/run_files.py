"""A run directory's files: refusing to overwrite a run, and the JSON-lines logs (``train_log.jsonl``,
``evals.jsonl``) that a resume truncates to the checkpoint's step."""

from __future__ import annotations

import json
from pathlib import Path

from recforge.checkpoint import find_checkpoint
from recforge.config import RunConfig


def prepare_run_dir(cfg: RunConfig, resume: bool) -> Path:
    """Create the run directory; refuse to overwrite an existing run unless resuming."""
    run_dir = cfg.run_dir
    if not resume and find_checkpoint(run_dir) is not None:
        raise ValueError(f"{run_dir} already holds a run; pass --resume to continue it or choose another name/output_dir")
    if resume and find_checkpoint(run_dir) is None:
        raise ValueError(f"--resume: {run_dir} has no checkpoint to resume from")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def append_jsonl(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Drop log rows written after the checkpoint we resume from (they will be replayed)."""
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= max_step]
        path.write_text("".join(r + "\n" for r in rows))


def format_metrics(metrics: dict, keys: tuple[str, ...] | None = None) -> str:
    keys = keys or tuple(k for k, v in metrics.items() if isinstance(v, float))
    return "  ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics)
