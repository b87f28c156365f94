"""Recipe: next-item retrieval training (HSTU or SASRec) with sampled softmax.

    cfg = load_config("configs/ml1m-hstu.yaml")
    summary = train(cfg)                  # setup -> epochs of steps -> checkpoints -> final eval
    metrics = evaluate_run(cfg.run_dir)   # what `recforge eval RUN_DIR` runs

Every step re-seeds the RNGs from (seed, global step), and the epoch's user order is
derived from (seed, epoch): a resumed run replays exactly the steps an uninterrupted
run would have taken, with no RNG state to save.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from recforge.config import RunConfig, load_config, save_config
from recforge.data.dataset import load_dataset
from recforge.data.sequences import PROTOCOL_HOLDOUT, UserSequences
from recforge.models.builders import build_retrieval_model
from recforge.models.retrieval import RetrievalModel
from recforge.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from recforge.train.evaluate import evaluate_ranking, model_scorer
from recforge.train.losses import sampled_softmax_loss


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device={name!r} but CUDA is not available; use train.device=cpu")
    return torch.device(name)


@dataclass
class Setup:
    cfg: RunConfig
    seqs: UserSequences
    model: RetrievalModel
    optimizer: torch.optim.Optimizer
    device: torch.device
    holdout: int


def setup(cfg: RunConfig) -> Setup:
    """Load data, build the model and optimizer (deterministically from ``cfg.train.seed``)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    seqs = UserSequences.from_dataset(load_dataset(cfg.data.path))
    torch.manual_seed(cfg.train.seed)
    model = build_retrieval_model(cfg.model, seqs.num_items, cfg.data.max_seq_len).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    return Setup(cfg, seqs, model, optimizer, device, PROTOCOL_HOLDOUT[cfg.data.protocol])


def _evaluate(s: Setup, target_from_end: int) -> dict[str, float]:
    metrics, _ = evaluate_ranking(
        s.seqs,
        model_scorer(s.model),
        target_from_end=target_from_end,
        max_seq_len=s.cfg.data.max_seq_len,
        ks=s.cfg.eval_ks,
        batch_size=s.cfg.eval.batch_size,
        device=s.device,
    )
    return metrics


def _train_step(s: Setup, samples: torch.Tensor) -> tuple[float, int]:
    cfg = s.cfg
    batch = s.seqs.training_batch(samples, cfg.data.max_seq_len).to(s.device)
    user_vectors = s.model(batch)  # (T, d)
    loss = sampled_softmax_loss(
        user_vectors,
        batch.labels["next_item"],
        s.model.item_vectors,
        s.seqs.num_items,
        negatives=cfg.loss.negatives,
        num_negatives=cfg.loss.num_negatives,
        in_batch_negatives=cfg.loss.in_batch_negatives,
        temperature=cfg.loss.temperature,
    )
    s.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(s.model.parameters(), cfg.optim.grad_clip)
    s.optimizer.step()
    return loss.item(), batch.num_tokens


def _append_jsonl(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _truncate_jsonl(path: Path, max_step: int) -> None:
    """Drop log rows written after the checkpoint we resume from (they will be replayed)."""
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= max_step]
        path.write_text("".join(r + "\n" for r in rows))


def train(cfg: RunConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Train per ``cfg``; return a summary with the final evaluation.

    Args:
        cfg: the run configuration; the run directory is ``cfg.run_dir``.
        resume: continue from the run directory's latest checkpoint.
        progress: show tqdm progress bars.
    """
    run_dir = cfg.run_dir
    if not resume and find_checkpoint(run_dir) is not None:
        raise ValueError(f"{run_dir} already holds a run; pass --resume to continue it or choose another name/output_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    s = setup(cfg)
    steps_log, evals_log = run_dir / "train_log.jsonl", run_dir / "evals.jsonl"
    state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "best_value": None}
    if resume:
        ckpt = find_checkpoint(run_dir)
        if ckpt is None:
            raise ValueError(f"--resume: {run_dir} has no checkpoint to resume from")
        state.update(load_checkpoint(ckpt, s.model, s.optimizer, s.device)["train_state"])
        _truncate_jsonl(steps_log, state["global_step"])
        _truncate_jsonl(evals_log, state["global_step"])
    else:
        for path in (steps_log, evals_log):
            path.unlink(missing_ok=True)
    save_config(cfg, run_dir / "config.yaml")

    samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
    steps_per_epoch = math.ceil(samples.shape[0] / cfg.train.batch_size)
    writer = SummaryWriter(str(run_dir / "tb"))
    started = time.monotonic()
    stop = False

    def checkpoint(best: bool = False) -> None:
        manifest = {"train_state": dict(state), "config": cfg.to_dict(), "num_items": s.seqs.num_items}
        save_checkpoint(
            run_dir, step=state["global_step"], model=s.model, optimizer=s.optimizer,
            manifest=manifest, keep=cfg.train.keep_checkpoints, best=best,
        )  # fmt: skip

    s.model.train()
    while state["epoch"] < cfg.train.epochs and not stop:
        epoch = state["epoch"]
        order = samples[torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(cfg.train.seed * 7919 + epoch))]
        bar = tqdm(
            range(state["step_in_epoch"], steps_per_epoch), desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
            disable=not progress, leave=False, dynamic_ncols=True,
        )  # fmt: skip
        for step_in_epoch in bar:
            torch.manual_seed(cfg.train.seed * 1_000_003 + state["global_step"])
            t0 = time.perf_counter()
            loss, tokens = _train_step(s, order[step_in_epoch * cfg.train.batch_size : (step_in_epoch + 1) * cfg.train.batch_size])
            tokens_per_s = tokens / (time.perf_counter() - t0)
            state["global_step"] += 1
            state["step_in_epoch"] = step_in_epoch + 1
            _append_jsonl(steps_log, {"step": state["global_step"], "epoch": epoch, "loss": loss, "tokens_per_s": tokens_per_s})
            if state["global_step"] % cfg.train.log_every == 0:
                writer.add_scalar("train/loss", loss, state["global_step"])
                writer.add_scalar("train/tokens_per_s", tokens_per_s, state["global_step"])
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
            best = _log_eval(s, state, writer, evals_log, progress)
        checkpoint(best=best)
    writer.close()
    summary = evaluate_run(run_dir)
    summary["train_minutes"] = (time.monotonic() - started) / 60
    return summary


def _log_eval(s: Setup, state: dict, writer: SummaryWriter, evals_log: Path, progress: bool) -> bool:
    """Evaluate during training; return whether this is the best checkpoint so far.

    Paper protocol: the test target (as the HSTU reference code does). Clean: validation.
    """
    split = "test" if s.cfg.data.protocol == "paper" else "valid"
    metrics = _evaluate(s, target_from_end=1 if split == "test" else 2)
    for key, value in metrics.items():
        writer.add_scalar(f"{split}/{key}", value, state["global_step"])
    _append_jsonl(evals_log, {"step": state["global_step"], "epoch": state["epoch"], "split": split, **metrics})
    if progress:
        tqdm.write(f"epoch {state['epoch']} step {state['global_step']} {split}: " + format_metrics(metrics, ("hr@10", "ndcg@10", "mrr")))
    value = metrics[s.cfg.eval.select_metric]
    is_best = state["best_value"] is None or value > state["best_value"]
    if is_best:
        state["best_value"] = value
    return is_best


def format_metrics(metrics: dict, keys: tuple[str, ...] | None = None) -> str:
    keys = keys or tuple(k for k in metrics if k != "num_users")
    return "  ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics)


def evaluate_run(
    run_dir: str | Path, *, checkpoint: str = "auto", split: str = "test", command: str | None = None
) -> dict:
    """Evaluate a trained run on the test (or validation) target and write ``eval.json``.

    Args:
        run_dir: directory of a run made by ``train``.
        checkpoint: ``auto`` (best for the clean protocol, latest for the paper one), ``best``,
            ``latest`` or a checkpoint directory.
        split: ``test`` (each user's last item) or ``valid`` (second-to-last).
        command: the command line that asked for this evaluation, recorded in ``eval.json``.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} is not a recforge run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml")
    if split not in ("test", "valid"):
        raise ValueError(f"split={split!r}: expected test or valid")
    if checkpoint == "auto":
        checkpoint = "best" if cfg.data.protocol == "clean" else "latest"
    ckpt = find_checkpoint(run_dir, checkpoint) if checkpoint in ("best", "latest") else Path(checkpoint)
    if ckpt is None:
        raise ValueError(f"{run_dir} has no {checkpoint} checkpoint; train it first")
    s = setup(cfg)
    manifest = load_checkpoint(ckpt, s.model, device=s.device)
    started = time.perf_counter()
    metrics = _evaluate(s, target_from_end=1 if split == "test" else 2)
    result = {
        **metrics,
        "split": split,
        "protocol": cfg.data.protocol,
        "model": cfg.model.kind,
        "dataset": Path(cfg.data.path).name,
        "checkpoint": ckpt.name,
        "step": manifest["step"],
        "eval_seconds": time.perf_counter() - started,
        "command": command or f"recforge.train.retrieval.evaluate_run({str(run_dir)!r})",
    }
    (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
