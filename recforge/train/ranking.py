"""Recipe: multi-task ranking (HSTU or a DLRM-style baseline) on aggregated user-period samples.

    cfg = load_config("configs/ranking-ml100k-hstu.yaml")
    summary = train(cfg)                  # epochs -> best checkpoint by validation AUC -> test eval
    metrics = evaluate_run(cfg.run_dir)   # what `recforge eval RUN_DIR` runs

Loss: per task, BCE with logits (binary tasks) or MSE (regression), weighted by
``ranking.task_weights``; optionally plus ``ranking.listwise_weight`` x a softmax
cross-entropy over each sample's candidates for the first binary task. Metrics per
binary task: AUC, GAUC (per-user AUC weighted by impressions; one-class users skipped),
log loss; per regression task: RMSE. When the dataset carries the generating
probabilities (``p_<column>``, as synthetic data does), the Bayes-optimal AUC/GAUC of
those probabilities is reported beside the model's.

After training, the best checkpoint is exported as prefix/encoder/postfix slices to
``RUN_DIR/model`` (see ``recforge.models.ranking.save_slices``) for serving.

With ``train.loader=pipeline`` the sample engine streams the training samples, each row built
by its reader workers with everything its batch needs (``ranking_sample_source``; nothing is
written to disk; same batches per sample as the memory loader); a resumed run then trains each
sample exactly once per epoch, and ``train.token_budget`` > 0 cuts batches by tokens with a label-weighted loss (see
``recforge.data.ranking_samples.TokenReference``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from recforge.checkpoint import find_checkpoint, load_checkpoint
from recforge.config import RunConfig, load_config
from recforge.data.dataset import load_dataset
from recforge.data.pipeline import PipelineSource
from recforge.data.ranking import RankingData, RankingSamples
from recforge.data.ranking_samples import (
    TokenReference,
    ranking_sample_source,
    ranking_source,
    sample_tokens,
    token_reference,
)
from recforge.data.token_batching import steps_per_epoch
from recforge.jagged.batch import JaggedBatch
from recforge.models.builders import build_ranking_model
from recforge.models.ranking import (
    CandidateTower,
    RankingModel,
    RankingPrefix,
    save_slices,
)
from recforge.sparse import SparseOptimizer
from recforge.train.distributed import DistContext, even_batches, init_distributed, shard_dynamic_tables, shard_source, split_budget
from recforge.train.loop import prepare_run_dir, run_loop, run_lr_scale
from recforge.train.losses import listwise_loss, pointwise_loss, token_weighted_ranking_loss
from recforge.train.metrics import auc, gauc
from recforge.train.run_files import check_eval_split, invoked_command, write_eval
from recforge.train.runtime import prepare_runtime
from recforge.train.step import StepResult, StepRunner


@dataclass
class Setup:
    cfg: RunConfig
    data: RankingData
    model: RankingModel
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    weights: list[float]
    reference: TokenReference | None = None  # token-budget batches: the loss weights' denominators
    sparse_optimizer: SparseOptimizer | None = None  # the dynamic item/context tables' (model.embedding=dynamic)
    ctx: DistContext = field(default_factory=DistContext)
    runner: StepRunner | None = None  # the training step (dense wrapper + optimizers)

    @property
    def kinds(self) -> list[str]:
        return [t.kind for t in self.data.tasks]


def load_ranking_data(cfg: RunConfig) -> RankingData:
    r = cfg.ranking
    return RankingData.from_dataset(
        load_dataset(cfg.data.path),
        r.tasks,
        action_column=r.action_column,
        user_features=r.user_features,
        item_features=r.item_features,
        valid_fraction=r.valid_fraction,
        test_fraction=r.test_fraction,
    )


def setup(cfg: RunConfig, ctx: DistContext | None = None, device: torch.device | None = None) -> Setup:
    """Load data, build the model, its step and optimizers (deterministically from ``cfg.train.seed``).

    ``ctx``: the ``torchrun`` job this process is part of (None: one process); ``device``: the one
    ``prepare_runtime`` already resolved (None: resolve it here)."""
    device = device or prepare_runtime(cfg)
    ctx = ctx or DistContext()
    data = load_ranking_data(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_ranking_model(
        cfg.model,
        max_seq_len=cfg.data.max_seq_len,
        num_tasks=len(data.tasks),
        num_items=data.num_items,
        num_actions=data.num_actions,
        num_context_values=data.num_context_values,
        item_feature_width=data.item_features.shape[1],
        num_item_feature_values=data.num_item_feature_values,
        sparse=cfg.sparse,
    )
    model.prefix.item_features.copy_(data.item_features)
    model = model.to(device)
    shard_dynamic_tables(model, cfg, ctx)
    sparse = SparseOptimizer([model]) if cfg.model.embedding == "dynamic" else None
    weights = list(cfg.ranking.task_weights) or [1.0] * len(data.tasks)
    s = Setup(cfg, data, model, None, device, weights, sparse_optimizer=sparse, ctx=ctx)
    # units: impressions; the pointwise loss averages over known labels, so ranks weigh exactly when all are known
    s.runner = StepRunner(cfg, model, device, ctx, loss_fn=lambda batch: _loss(s, batch),
                          units_fn=lambda batch: batch.labels["tasks"].shape[0], summed=bool(cfg.train.token_budget),
                          sparse_optimizer=sparse)  # fmt: skip
    s.optimizer = s.runner.optimizer  # dense parameters; dynamic tables step with their own optimizer
    return s


def _samples(s: Setup, split: str) -> RankingSamples:
    return s.data.samples(split, s.cfg.ranking.period_seconds, s.cfg.ranking.max_targets)


def _training_samples(s: Setup) -> RankingSamples:
    """The training split's samples; with ``ranking.refit`` the validation split's follow them
    (the usual refit for time splits: the epoch count comes from a run that held validation out)."""
    train = _samples(s, "train")
    if not s.cfg.ranking.refit:
        return train
    valid = _samples(s, "valid")
    return RankingSamples(
        torch.cat([train.user, valid.user]),
        torch.cat([train.offsets, valid.offsets[1:] + train.offsets[-1]]),
        torch.cat([train.events, valid.events]),
    )


def _batch(s: Setup, samples: RankingSamples, ids: torch.Tensor):
    return s.data.batch(samples, ids, s.cfg.data.max_seq_len, s.cfg.ranking.action_encoding).to(s.device)


def _loss(s: Setup, batch: JaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective to minimise, the loss with per-batch means) of ``batch`` (already on the device)."""
    labels = batch.labels["tasks"]
    x = s.model.postfix_inputs(batch)
    if isinstance(s.model.postfix, CandidateTower):  # each tower learns the tasks on its own (config: pointwise only)
        main, candidate = s.model.postfix.parts(x)
        loss = pointwise_loss(main, labels, s.kinds, s.weights)[0] + pointwise_loss(candidate, labels, s.kinds, s.weights)[0]
        return loss, loss
    outputs = s.model.postfix(x)  # (N, K)
    if s.reference is not None:
        return token_weighted_ranking_loss(outputs, labels, batch.mask.num_targets, s.kinds, s.weights, s.reference,
                                           s.cfg.ranking.listwise_weight)
    loss, _ = pointwise_loss(outputs, labels, s.kinds, s.weights)
    if s.cfg.ranking.listwise_weight:
        k = s.kinds.index("binary")
        loss = loss + s.cfg.ranking.listwise_weight * listwise_loss(
            outputs[:, k : k + 1], labels[:, k : k + 1], batch.mask.num_targets
        )
    return loss, loss


def _train_step(s: Setup, batch: JaggedBatch) -> tuple[float, int]:
    """One optimizer step of this process on one batch: (loss, tokens)."""
    result = s.runner([batch.to(s.device)], run_lr_scale(s.cfg, s.optimizer))
    return float(result.loss), result.tokens


def _step(s: Setup, micro: list[JaggedBatch | None], lr_scale: float) -> StepResult | None:
    """The training loop's step: this rank's micro-batches (see ``recforge.train.step``)."""
    return s.runner(micro, lr_scale)


def predict(s: Setup, split: str) -> dict[str, torch.Tensor]:
    """Model outputs for every impression of ``split``: outputs, labels, users, events (CPU tensors)."""
    with s.runner.full_weights():
        return _predict(s, split)


@torch.no_grad()
def _predict(s: Setup, split: str) -> dict[str, torch.Tensor]:
    samples = _samples(s, split)
    was_training = s.model.training
    s.model.eval()
    parts: dict[str, list[torch.Tensor]] = {"outputs": [], "labels": [], "users": [], "events": []}
    step = s.cfg.eval.batch_size
    first, end = s.ctx.shard(len(samples))  # each rank predicts its share; gathered in sample order below
    for lo in range(first, first + even_batches(len(samples), step, s.ctx) * step, step):
        if lo >= end:  # this rank is done: a stand-in batch keeps sharded tables' collectives matched
            s.model(_batch(s, samples, torch.arange(1)))
            continue
        batch = _batch(s, samples, torch.arange(lo, min(lo + step, end)))
        parts["outputs"].append(s.model(batch).float().cpu())
        parts["labels"].append(batch.labels["tasks"].cpu())
        parts["users"].append(batch.labels["users"].cpu())
        parts["events"].append(batch.labels["events"].cpu())
    s.model.train(was_training)
    k = len(s.data.tasks)
    empty = {"outputs": torch.zeros(0, k), "labels": torch.zeros(0, k)}
    return {
        name: s.ctx.gather_rows(torch.cat(chunks) if chunks else empty.get(name, torch.zeros(0, dtype=torch.int64)))
        for name, chunks in parts.items()
    }


def task_metrics(s: Setup, pred: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-task AUC / GAUC / log loss (binary) or RMSE (regression), plus Bayes-optimal AUC when known."""
    out: dict[str, float] = {"impressions": float(pred["events"].numel())}
    for k, task in enumerate(s.data.tasks):
        y, z = pred["labels"][:, k], pred["outputs"][:, k]  # float32: the fast single-sort GAUC path
        known = ~torch.isnan(y)
        if task.kind == "regression":
            err = (z - y)[known].double()
            out[f"{task.name}/rmse"] = float((err**2).mean().sqrt()) if bool(known.any()) else float("nan")
            continue
        out[f"{task.name}/auc"] = auc(z, y, mask=known)
        out[f"{task.name}/gauc"], users = gauc(z, y, pred["users"], mask=known)
        out[f"{task.name}/gauc_users"] = float(users)
        out[f"{task.name}/logloss"] = (
            float(F.binary_cross_entropy_with_logits(z[known], y[known])) if bool(known.any()) else float("nan")
        )
        out[f"{task.name}/positive_rate"] = float(y[known].mean()) if bool(known.any()) else float("nan")
        if s.data.oracle is not None:
            p = s.data.oracle[pred["events"], k]
            out[f"{task.name}/bayes_auc"] = auc(p, y, mask=known)
            out[f"{task.name}/bayes_gauc"] = gauc(p, y, pred["users"], mask=known)[0]
    return out


def _show_keys(s: Setup) -> tuple[str, ...]:
    keys = []
    for task in s.data.tasks:
        keys += [f"{task.name}/rmse"] if task.kind == "regression" else [f"{task.name}/auc", f"{task.name}/gauc"]
    return tuple(keys)


def train(cfg: RunConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Train per ``cfg``; export the best checkpoint's slices; return the test evaluation."""
    device = prepare_runtime(cfg)
    ctx = init_distributed(cfg, device)
    run_dir = prepare_run_dir(cfg, resume)
    ctx.barrier()  # every rank has checked the run directory before any writes to it
    s = setup(cfg, ctx, device)
    samples = _training_samples(s)
    if cfg.train.loader == "pipeline":
        inputs = {"source": _pipeline_source(s, samples), "build": lambda batch: batch}
    else:
        r = cfg.ranking
        build = lambda ids: s.data.batch(samples, ids, cfg.data.max_seq_len, r.action_encoding)  # noqa: E731
        inputs = {"num_samples": len(samples), "build": build}
    state = run_loop(
        cfg,
        model=s.model,
        optimizer=s.optimizer,
        device=s.device,
        step=lambda micro, lr_scale: _step(s, micro, lr_scale),
        ctx=ctx,
        lookahead=s.runner.set_upcoming,
        **inputs,
        evaluate=lambda: ("valid", task_metrics(s, predict(s, "valid"))),
        manifest={"num_items": s.data.num_items},
        resume=resume,
        progress=progress,
        show_keys=_show_keys(s),
    )
    ctx.barrier()
    if not ctx.is_main:
        return {"is_main": False, "train_minutes": state["train_minutes"]}  # rank 0 evaluates and reports
    summary = evaluate_run(run_dir)
    summary.update({k: state[k] for k in ("train_minutes", "stop_reason", "stop_message")})
    return summary


def _pipeline_source(s: Setup, samples: RankingSamples) -> PipelineSource:
    """Stream the training samples through the sample engine, built as they are read (every rank, and a
    resumed run, builds the same rows); with a token budget, set the loss references."""
    cfg, t = s.cfg, s.cfg.train
    if len(samples) == 0:
        raise ValueError("the training split has no samples; check the dataset and the data/ranking settings")
    tokens = sample_tokens(s.data, samples, cfg.data.max_seq_len, cfg.ranking.action_encoding)
    if t.token_budget:
        list_task = s.kinds.index("binary") if cfg.ranking.listwise_weight else None
        s.reference = token_reference(s.data, samples, tokens, t.token_budget, list_task)
    batch_size, token_budget = split_budget(cfg, s.ctx)  # this rank's micro-batches
    rows = ranking_sample_source(s.data, samples, cfg.data.max_seq_len, cfg.ranking.action_encoding, tokens)
    source = ranking_source(
        rows, cfg.data.max_seq_len, batch_size, action_encoding=cfg.ranking.action_encoding,
        num_workers=t.loader_workers, token_budget=token_budget, seed=t.seed,
        num_steps_estimate=steps_per_epoch(tokens, t.batch_size, t.token_budget, t.seed),
    )  # fmt: skip
    return shard_source(source, s.ctx)


def export_model(s: Setup, out_dir: Path, manifest: dict) -> Path:
    """Write the model's prefix/encoder/postfix slices with the task list, training step and the
    raw-ID vocabularies (``vocab.json``: item IDs, action values, user feature values).

    A prefix with dynamic tables (``model.embedding=dynamic``) is written as its static
    ``RankingPrefix`` (``to_static()``), so the slices load and serve as any other."""
    tasks = [{"name": t.name, "kind": t.kind, "column": t.column, "op": t.op, "value": t.value} for t in s.data.tasks]
    extra = {
        "step": manifest["step"],
        "action_encoding": s.cfg.ranking.action_encoding,
        "max_seq_len": s.cfg.data.max_seq_len,
        "num_contextual": s.data.num_contextual,
        "user_features": list(s.cfg.ranking.user_features),
        "item_features": list(s.cfg.ranking.item_features),
    }
    model = s.model
    if isinstance(model.prefix, RankingPrefix) and s.cfg.model.embedding == "dynamic":
        model = RankingModel(model.prefix.to_static(), model.encoder, model.postfix)
    return save_slices(model, out_dir, tasks=tasks, extra=extra, json_files={"vocab.json": s.data.vocab})


def evaluate_run(run_dir: str | Path, *, checkpoint: str = "auto", split: str = "test", command: str | None = None) -> dict:
    """Evaluate a trained ranking run, write ``eval.json`` (``eval-valid.json`` for the validation split)
    and (re)export ``RUN_DIR/model``.

    Args:
        run_dir: directory of a run made by ``train``.
        checkpoint: ``auto`` (``best``, or ``latest`` for a ``ranking.refit`` run, whose validation
            impressions were trained on), ``best`` (best validation), ``latest`` or a checkpoint directory.
        split: ``test`` or ``valid``.
        command: the command line recorded in ``eval.json``.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} is not a recforge run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml")
    check_eval_split(cfg, split)
    which = ("latest" if cfg.ranking.refit else "best") if checkpoint == "auto" else checkpoint
    ckpt = find_checkpoint(run_dir, which) if which in ("best", "latest") else Path(checkpoint)
    if ckpt is None:
        raise ValueError(f"{run_dir} has no {which} checkpoint; train it first")
    s = setup(cfg)
    manifest = load_checkpoint(ckpt, s.model, device=s.device)
    started = time.perf_counter()
    metrics = task_metrics(s, predict(s, split))
    result = {
        **metrics,
        "split": split,
        "model": cfg.model.kind,
        "head": cfg.model.head,
        "action_encoding": cfg.ranking.action_encoding,
        "tasks": list(cfg.ranking.tasks),
        "dataset": Path(cfg.data.path).name,
        "checkpoint": ckpt.name,
        "step": manifest["step"],
        "eval_seconds": time.perf_counter() - started,
        "command": command or invoked_command(),
    }
    if checkpoint in ("auto", "best"):
        export_model(s, run_dir / "model", manifest)
    write_eval(run_dir, split, result)
    return result
