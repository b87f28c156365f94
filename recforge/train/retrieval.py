"""Recipe: next-item retrieval training (HSTU or SASRec) with sampled softmax.

    cfg = load_config("configs/ml1m-hstu.yaml")
    summary = train(cfg)                  # setup -> epochs of steps -> checkpoints -> final eval
    metrics = evaluate_run(cfg.run_dir)   # what `recforge eval RUN_DIR` runs

Every step re-seeds the RNGs from (seed, global step), and the epoch's user order is
derived from (seed, epoch): a resumed run replays exactly the steps an uninterrupted
run would have taken, with no RNG state to save. The sampled negatives are drawn before
each step from their own generator, seeded from the step's seed (``_draw``,
``recforge.train.step_draws``), so a pipelined step can draw and look them up a step ahead.

With ``train.loader=pipeline`` the sample engine streams the training samples instead, built
by its reader workers as it reads them (``retrieval_sample_source``; nothing is written to
disk); a resumed run then trains each sample exactly once per epoch (in a new order), and
``train.token_budget`` > 0 cuts batches by tokens with a token-weighted loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recforge.checkpoint import find_checkpoint, load_checkpoint
from recforge.config import RunConfig, load_config
from recforge.data.dataset import load_dataset
from recforge.data.pipeline import PipelineSource
from recforge.data.retrieval_samples import retrieval_sample_source, retrieval_source, sample_tokens
from recforge.data.sequences import PROTOCOL_HOLDOUT, UserSequences
from recforge.data.token_batching import steps_per_epoch
from recforge.jagged.batch import JaggedBatch
from recforge.models.builders import build_retrieval_model
from recforge.models.retrieval import RetrievalModel
from recforge.sparse import SparseOptimizer
from recforge.train.distributed import DistContext, init_distributed, shard_dynamic_tables, shard_source, split_budget
from recforge.train.evaluate import evaluate_ranking, model_scorer
from recforge.train.flops import step_flops_counter
from recforge.train.loop import prepare_run_dir, run_loop, run_lr_scale
from recforge.train.losses import SampledNegatives, draw_negatives, sampled_softmax_loss, token_loss_scale
from recforge.train.run_files import check_eval_split, invoked_command, write_eval
from recforge.train.runtime import prepare_runtime
from recforge.train.step import StepResult, StepRunner
from recforge.train.step_draws import rank_seed
from recforge.train.step_padding import RetrievalPadding, loss_weights


@dataclass
class Setup:
    cfg: RunConfig
    seqs: UserSequences
    model: RetrievalModel
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    holdout: int
    sparse_optimizer: SparseOptimizer | None = None  # the dynamic item table's (model.embedding=dynamic)
    ctx: DistContext = field(default_factory=DistContext)
    runner: StepRunner | None = None  # the training step (dense wrapper + optimizers)
    eval_cache: dict = field(default_factory=dict)  # evaluation batches on the device, built once (evaluate_ranking)


def setup(cfg: RunConfig, ctx: DistContext | None = None, device: torch.device | None = None) -> Setup:
    """Load data, build the model, its step and optimizers (deterministically from ``cfg.train.seed``).

    ``ctx``: the ``torchrun`` job this process is part of (None: one process); ``device``: the one
    ``prepare_runtime`` already resolved (None: resolve it here)."""
    device = device or prepare_runtime(cfg)
    ctx = ctx or DistContext()
    seqs = UserSequences.from_dataset(load_dataset(cfg.data.path))
    torch.manual_seed(cfg.train.seed)
    model = build_retrieval_model(cfg.model, seqs.num_items, cfg.data.max_seq_len, cfg.sparse).to(device)
    shard_dynamic_tables(model, cfg, ctx)
    sparse = SparseOptimizer([model]) if cfg.model.embedding == "dynamic" else None
    s = Setup(cfg, seqs, model, None, device, PROTOCOL_HOLDOUT[cfg.data.protocol], sparse, ctx)
    s.runner = StepRunner(cfg, model, device, ctx, loss_fn=lambda batch, *draws: _loss(s, batch, *draws),
                          units_fn=lambda batch: batch.labels["next_item"].numel(), summed=bool(cfg.train.token_budget),
                          sparse_optimizer=sparse, draw=None if cfg.loss.negatives == "full" else lambda b, seed: _draw(s, b, seed),
                          pad=_padding(cfg, seqs.num_items))  # fmt: skip
    s.optimizer = s.runner.optimizer  # dense parameters; a dynamic item table steps with its own optimizer
    return s


def _padding(cfg: RunConfig, num_items: int) -> RetrievalPadding:
    """How the CUDA-graph step (``train.cuda_graphs``) pads this recipe's batches."""
    return RetrievalPadding(cfg.loss, num_items, cfg.train.graph_bucket_ratio, summed=bool(cfg.train.token_budget))


def _evaluate(s: Setup, target_from_end: int) -> dict[str, float]:
    with s.runner.full_weights():
        return _evaluate_whole(s, target_from_end)


def _evaluate_whole(s: Setup, target_from_end: int) -> dict[str, float]:
    metrics, _ = evaluate_ranking(
        s.seqs,
        model_scorer(s.model),
        target_from_end=target_from_end,
        max_seq_len=s.cfg.data.max_seq_len,
        ks=s.cfg.eval_ks,
        batch_size=s.cfg.eval.batch_size,
        device=s.device,
        ctx=s.ctx,
        cache=s.eval_cache,
    )
    return metrics


def _draw(s: Setup, batch: JaggedBatch, seed: int) -> SampledNegatives:
    """The sampled negatives of ``batch`` (on the device), drawn before its step from ``seed``
    (``recforge.train.step_draws``): per-position negatives differ per rank, a shared set is the same on every
    rank (so N ranks score the set one process would)."""
    cfg = s.cfg.loss
    targets = batch.labels["next_item"]
    if cfg.negatives == "per_position":
        seed = rank_seed(seed, s.ctx.rank)
    return draw_negatives(targets, s.seqs.num_items, negatives=cfg.negatives, num_negatives=cfg.num_negatives,
                          in_batch_negatives=cfg.in_batch_negatives, chunk_size=cfg.chunk_size,
                          exact_distinct=_counts_lookups(s), generator=torch.Generator(targets.device).manual_seed(seed))  # fmt: skip


def _counts_lookups(s: Setup) -> bool:
    """The item table counts the ids it is given (a dynamic table: admission, LFU, stats)."""
    return not isinstance(s.model.prefix.item_embedding, torch.nn.Embedding)


def _loss(s: Setup, batch: JaggedBatch, sampled: SampledNegatives | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective to minimise, mean loss per target) of ``batch`` (already on the device); ``sampled``: its
    negatives drawn before the step (``_draw``), None: drawn in the loss."""
    cfg = s.cfg
    user_vectors = s.model(batch)  # (T, d)
    weights = loss_weights(batch)  # a padded batch (train.step_padding): 0 at the padding positions
    loss = sampled_softmax_loss(
        user_vectors,
        batch.labels["next_item"],
        s.model.item_vectors,
        s.seqs.num_items,
        negatives=cfg.loss.negatives,
        num_negatives=cfg.loss.num_negatives,
        in_batch_negatives=cfg.loss.in_batch_negatives,
        temperature=cfg.loss.temperature,
        chunk_size=cfg.loss.chunk_size,
        exact_distinct=_counts_lookups(s),
        sampled=sampled,
        weights=weights,
        matmul=cfg.loss.matmul,
    )  # mean over the batch's T (real) targets
    if not cfg.train.token_budget:
        return loss, loss
    # token-budget batches vary in T: weight every target 1/budget (as a fixed batch does), not 1/T
    num_targets = batch.labels["next_item"].numel() if weights is None else weights.sum()  # a device count: no sync
    return loss * (num_targets * token_loss_scale(cfg.train.token_budget)), loss


def _train_step(s: Setup, batch: JaggedBatch) -> tuple[float, int]:
    """One optimizer step of this process on one batch: (loss, tokens)."""
    result = s.runner([batch.to(s.device)], run_lr_scale(s.cfg, s.optimizer))
    return float(result.loss), result.tokens


def _step(s: Setup, micro: list[JaggedBatch | None], lr_scale: float) -> StepResult | None:
    """The training loop's step: this rank's micro-batches (see ``recforge.train.step``)."""
    return s.runner(micro, lr_scale)


def train(cfg: RunConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Train per ``cfg``; return a summary with the final evaluation.

    Under ``torchrun`` every rank calls this; rank 0 evaluates the final checkpoint (single-process,
    as ``recforge eval`` does) and the other ranks return only ``train_minutes``.

    Args:
        cfg: the run configuration; the run directory is ``cfg.run_dir``.
        resume: continue from the run directory's latest checkpoint (on any number of ranks).
        progress: show tqdm progress bars.
    """
    device = prepare_runtime(cfg)
    ctx = init_distributed(cfg, device)
    run_dir = prepare_run_dir(cfg, resume)
    ctx.barrier()  # every rank has checked the run directory before any writes to it
    s = setup(cfg, ctx, device)
    samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
    if cfg.train.loader == "pipeline":
        inputs = {"source": _pipeline_source(s, samples), "build": lambda batch: batch}
    else:
        inputs = {"num_samples": samples.shape[0],
                  "build": lambda ids: s.seqs.training_batch(samples[ids], cfg.data.max_seq_len)}  # fmt: skip
    state = run_loop(
        cfg,
        model=s.model,
        optimizer=s.optimizer,
        device=s.device,
        step=lambda micro, lr_scale: _step(s, micro, lr_scale),
        **inputs,
        evaluate=lambda: _eval_during_training(s),
        manifest={"num_items": s.seqs.num_items},
        resume=resume,
        progress=progress,
        show_keys=("hr@10", "ndcg@10", "mrr"),
        ctx=ctx,
        lookahead=s.runner.set_upcoming,
        flops=step_flops_counter(cfg.model, cfg.loss, s.seqs.num_items),
    )
    ctx.barrier()
    if not ctx.is_main:
        return {"is_main": False, "train_minutes": state["train_minutes"]}  # rank 0 evaluates and reports
    summary = evaluate_run(run_dir)
    summary.update({k: state[k] for k in ("train_minutes", "stop_reason", "stop_message")})
    return summary


def _pipeline_source(s: Setup, samples: torch.Tensor) -> PipelineSource:
    """Stream the training samples through the sample engine, built as they are read. Every rank (and a
    resumed run) builds the same rows from the dataset, so a saved pipeline state names the same rows."""
    cfg = s.cfg
    if samples.shape[0] == 0:
        raise ValueError("the training split has no samples; check the dataset and the data settings")
    t = cfg.train
    batch_size, token_budget = split_budget(cfg, s.ctx)  # this rank's micro-batches
    source = retrieval_source(
        retrieval_sample_source(s.seqs, samples, cfg.data.max_seq_len), cfg.data.max_seq_len, batch_size,
        timestamps=s.seqs.timestamps is not None, num_workers=t.loader_workers, token_budget=token_budget, seed=t.seed,
        num_steps_estimate=steps_per_epoch(sample_tokens(samples, cfg.data.max_seq_len), t.batch_size, t.token_budget, t.seed),
    )  # fmt: skip
    return shard_source(source, s.ctx)


def _eval_during_training(s: Setup) -> tuple[str, dict[str, float]]:
    """Paper protocol: the test target (as the HSTU reference code does). Clean: validation."""
    split = "test" if s.cfg.data.protocol == "paper" else "valid"
    return split, _evaluate(s, target_from_end=1 if split == "test" else 2)


def evaluate_run(
    run_dir: str | Path, *, checkpoint: str = "auto", split: str = "test", command: str | None = None
) -> dict:
    """Evaluate a trained run on the test (or validation) target and write ``eval.json``
    (``eval-valid.json`` for the validation split).

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
    check_eval_split(cfg, split)
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
        "command": command or invoked_command(),
    }
    write_eval(run_dir, split, result)
    return result
