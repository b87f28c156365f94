"""The training loop every recipe shares: epochs of steps, logs, evaluations, checkpoints, exact resume.

A recipe supplies the model, the optimizer, how many samples an epoch has, a step function
over a slice of sample ids and an evaluation function; the loop owns the order of samples,
seeding, logging (``train_log.jsonl``, ``evals.jsonl``, TensorBoard), checkpoints and
resuming. Every step re-seeds the RNGs from (seed, global step), and the epoch's sample
order is derived from (seed, epoch): a resumed run replays exactly the steps an
uninterrupted run would have taken, with no RNG state to save.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from recforge.config import RunConfig, save_config
from recforge.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint

StepFn = Callable[[torch.Tensor], tuple[float, int]]  # sample ids -> (loss, tokens processed)
EvalFn = Callable[[], tuple[str, dict[str, float]]]  # () -> (split name, metrics)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but CUDA is not available; use train.device=cpu")
    return torch.device(name)


def prepare_runtime(cfg: RunConfig) -> torch.device:
    """Apply ``train.threads``, resolve ``train.device`` (TF32 matmuls on CUDA) and return it."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return device


def make_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over every parameter, per ``cfg.optim``."""
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )


def lr_at(cfg: RunConfig, step: int, total_steps: int) -> float:
    """Learning rate of global step ``step`` (0-based) of ``total_steps``, per ``cfg.optim``.

    A pure function of the step, so a resumed run follows the same schedule with no state saved.
    """
    opt = cfg.optim
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    span = max(1, total_steps - opt.warmup_steps)
    progress = min(1.0, max(0, step - opt.warmup_steps) / span)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if opt.schedule == "cosine" else 1.0 - progress
    return opt.lr * (opt.min_lr_fraction + (1.0 - opt.min_lr_fraction) * shape)


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


def _truncate_jsonl(path: Path, max_step: int) -> None:
    """Drop log rows written after the checkpoint we resume from (they will be replayed)."""
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= max_step]
        path.write_text("".join(r + "\n" for r in rows))


def format_metrics(metrics: dict, keys: tuple[str, ...] | None = None) -> str:
    keys = keys or tuple(k for k, v in metrics.items() if isinstance(v, float))
    return "  ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics)


def run_loop(
    cfg: RunConfig,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    num_samples: int,
    step: StepFn,
    evaluate: EvalFn,
    manifest: dict,
    resume: bool,
    progress: bool,
    show_keys: tuple[str, ...] | None = None,
) -> dict:
    """Run ``cfg.train`` epochs of ``step`` over shuffled sample ids; return the final train state.

    ``evaluate`` runs every ``cfg.train.eval_every`` epochs and at the end; the checkpoint
    with the best ``cfg.eval.select_metric`` (higher is better) is marked ``best``.
    """
    run_dir = cfg.run_dir
    steps_log, evals_log = run_dir / "train_log.jsonl", run_dir / "evals.jsonl"
    state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "best_value": None}
    if resume:
        state.update(load_checkpoint(find_checkpoint(run_dir), model, optimizer, device)["train_state"])
        _truncate_jsonl(steps_log, state["global_step"])
        _truncate_jsonl(evals_log, state["global_step"])
    else:
        for path in (steps_log, evals_log):
            path.unlink(missing_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    if num_samples == 0:
        raise ValueError("the training split has no samples; check the dataset and the data/ranking settings")
    batch_size = cfg.train.batch_size
    steps_per_epoch = math.ceil(num_samples / batch_size)
    total_steps = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    writer = SummaryWriter(str(run_dir / "tb"))
    started = time.monotonic()
    stop = False

    def checkpoint(best: bool = False) -> None:
        save_checkpoint(
            run_dir, step=state["global_step"], model=model, optimizer=optimizer,
            manifest={"train_state": dict(state), "config": cfg.to_dict(), **manifest},
            keep=cfg.train.keep_checkpoints, best=best,
        )  # fmt: skip

    def log_eval() -> bool:
        split, metrics = evaluate()
        for key, value in metrics.items():
            if isinstance(value, float):
                writer.add_scalar(f"{split}/{key}", value, state["global_step"])
        append_jsonl(evals_log, {"step": state["global_step"], "epoch": state["epoch"], "split": split, **metrics})
        if progress:
            tqdm.write(f"epoch {state['epoch']} step {state['global_step']} {split}: " + format_metrics(metrics, show_keys))
        value = metrics[cfg.eval.select_metric]
        is_best = state["best_value"] is None or value > state["best_value"]
        if is_best:
            state["best_value"] = value
        return is_best

    model.train()
    while state["epoch"] < cfg.train.epochs and not stop:
        epoch = state["epoch"]
        order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(cfg.train.seed * 7919 + epoch))
        bar = tqdm(
            range(state["step_in_epoch"], steps_per_epoch), desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
            disable=not progress, leave=False, dynamic_ncols=True,
        )  # fmt: skip
        for step_in_epoch in bar:
            torch.manual_seed(cfg.train.seed * 1_000_003 + state["global_step"])
            lr = lr_at(cfg, state["global_step"], total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            loss, tokens = step(order[step_in_epoch * batch_size : (step_in_epoch + 1) * batch_size])
            tokens_per_s = tokens / (time.perf_counter() - t0)
            state["global_step"] += 1
            state["step_in_epoch"] = step_in_epoch + 1
            append_jsonl(steps_log, {"step": state["global_step"], "epoch": epoch, "loss": loss, "tokens_per_s": tokens_per_s})
            if state["global_step"] % cfg.train.log_every == 0:
                writer.add_scalar("train/loss", loss, state["global_step"])
                writer.add_scalar("train/tokens_per_s", tokens_per_s, state["global_step"])
                writer.add_scalar("train/lr", lr, state["global_step"])
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
            out_of_budget = (cfg.train.max_steps and state["global_step"] >= cfg.train.max_steps) or (
                cfg.train.max_minutes and time.monotonic() - started >= cfg.train.max_minutes * 60
            )
            if out_of_budget:
                stop = True
                break
            if cfg.train.checkpoint_every and state["global_step"] % cfg.train.checkpoint_every == 0:
                checkpoint()
        if state["step_in_epoch"] >= steps_per_epoch:
            state["epoch"] += 1
            state["step_in_epoch"] = 0
        finished = stop or state["epoch"] >= cfg.train.epochs
        due = cfg.train.eval_every and state["epoch"] % cfg.train.eval_every == 0
        best = False
        if finished or due:
            model.eval()
            best = log_eval()
            model.train()
        checkpoint(best=best)
    writer.close()
    state["train_minutes"] = (time.monotonic() - started) / 60
    return state
