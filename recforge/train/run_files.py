"""A run directory's files: refusing to overwrite a run, and the JSON-lines logs (``train_log.jsonl``,
``evals.jsonl``) that a resume truncates to the checkpoint's step."""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path

import torch

from recforge.checkpoint import (CheckpointMismatchError, CorruptCheckpointError, checkpoint_dirs, load_checkpoint,
                                 resume_candidates)  # fmt: skip
from recforge.config import RunConfig
from recforge.io import atomic_file, atomic_write_json

log = logging.getLogger(__name__)


def prepare_run_dir(cfg: RunConfig, resume: bool) -> Path:
    """Create the run directory; refuse to overwrite an existing run unless resuming."""
    run_dir = cfg.run_dir
    holds_run = bool(checkpoint_dirs(run_dir)) or (run_dir / "checkpoints" / "latest.json").exists()
    if not resume and holds_run:
        raise ValueError(f"{run_dir} already holds a run; pass --resume to continue it or choose another name/output_dir")
    if resume and not checkpoint_dirs(run_dir):
        raise ValueError(f"--resume: {run_dir} has no checkpoint to resume from")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def load_for_resume(
    cfg: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[Path, dict]:
    """Load the newest readable checkpoint of ``cfg.run_dir``: (its directory, its manifest).

    A damaged checkpoint (truncated tensors, unreadable manifest or ``latest.json``) is skipped
    with a warning for the one before it; one that does not fit the model names the config keys
    that changed since it was written.
    """
    candidates, warnings = resume_candidates(cfg.run_dir)
    for message in warnings:
        log.warning("%s", message)
    damaged = []
    for ckpt in candidates:
        try:
            return ckpt, load_checkpoint(ckpt, model, optimizer, device)
        except CorruptCheckpointError as err:
            damaged.append(str(err.__cause__ or err))
            log.warning("--resume: %s; trying the checkpoint before it", err.__cause__ or err)
        except CheckpointMismatchError as err:
            raise ValueError(f"--resume: {err}. {_config_changes(ckpt, cfg)}") from err
    raise ValueError("--resume: no readable checkpoint in " + f"{cfg.run_dir / 'checkpoints'}: " + "; ".join(damaged))


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _config_changes(ckpt: Path, cfg: RunConfig) -> str:
    try:
        saved = json.loads((ckpt / "manifest.json").read_text()).get("config") or {}
    except (OSError, json.JSONDecodeError):
        saved = {}
    before, now = _flat(saved), _flat(cfg.to_dict())
    changed = [k for k in now if k in before and before[k] != now[k] and k.split(".")[0] not in ("train", "dist", "eval")]
    if not changed:
        return "Resume with the settings the run was trained with (RUN_DIR/config.yaml), or start a new run."
    diff = ", ".join(f"{k}={before[k]!r} (now {now[k]!r})" for k in changed)
    return (f"The run was trained with {diff}: resume with those values, or start a new run under another name "
            "(or train.output_dir) to train with the new ones.")  # fmt: skip


def invoked_command() -> str:
    """The command line of this process as the user typed it (``recforge train ...``), for run records."""
    argv = list(sys.argv)
    if argv and (argv[0].endswith(os.sep + "recforge") or argv[0] == "recforge"):
        argv[0] = "recforge"
    elif argv and argv[0].endswith(os.path.join("recforge", "cli.py")):
        argv[0:1] = [Path(sys.executable).name, "-m", "recforge.cli"]
    return shlex.join(argv)


def append_jsonl(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Drop log rows written after the checkpoint we resume from (they will be replayed)."""
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= max_step]
        with atomic_file(path) as tmp:
            tmp.write_text("".join(r + "\n" for r in rows))


def format_metrics(metrics: dict, keys: tuple[str, ...] | None = None) -> str:
    keys = keys or tuple(k for k, v in metrics.items() if isinstance(v, float))
    return "  ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics)


def eval_file(run_dir: Path, split: str) -> Path:
    """Where ``evaluate_run`` writes a split's result: ``eval.json`` (test), ``eval-valid.json`` (valid)."""
    return Path(run_dir) / ("eval.json" if split == "test" else f"eval-{split}.json")


def check_eval_split(cfg: RunConfig, split: str) -> None:
    """Refuse to evaluate a split the run trained on (its score would measure memorisation, not ranking)."""
    if split not in ("test", "valid"):
        raise ValueError(f"split={split!r}: expected test or valid")
    if split != "valid":
        return
    if cfg.recipe == "ranking" and cfg.ranking.refit:
        raise ValueError("--split valid: this run has ranking.refit=true, so it trained on the validation impressions; "
                         "evaluate --split test, or the run that chose the epoch count (without refit)")  # fmt: skip
    if cfg.recipe != "ranking" and cfg.data.protocol == "paper":
        raise ValueError("--split valid: this run uses data.protocol=paper, which trains on every item but each user's "
                         "last one, so the validation target (the second-to-last item) was trained on; evaluate "
                         "--split test, or train with data.protocol=clean to hold a validation item out")  # fmt: skip


def write_eval(run_dir: Path, split: str, result: dict) -> Path:
    """Write an evaluation result atomically to ``eval_file(run_dir, split)``; return the path."""
    path = eval_file(run_dir, split)
    atomic_write_json(path, result)
    return path
