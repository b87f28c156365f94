"""The training loop every recipe shares: epochs of steps, logs, evaluations, checkpoints, exact resume.

A recipe supplies the model, the optimizer, where the steps' inputs come from, a step
function and an evaluation function; the loop owns seeding, logging (``train_log.jsonl``,
``evals.jsonl``, TensorBoard), checkpoints and resuming. Inputs come one of two ways:

- memory (``num_samples``): each step takes the next ``train.batch_size`` sample ids, and each
  rank its slice of them (cut into ``dist.grad_accum`` micro-batches); the epoch's order is
  derived from (seed, epoch), so a resumed run, on any number of ranks, replays exactly the
  steps an uninterrupted run would have taken, with no data state to save.
- a ``BatchSource`` (``source``, e.g. the sample engine, reading this rank's rows): each step
  gets the source's next ``dist.grad_accum`` batches and the epoch ends when no rank has any
  left. The sources' states (rows consumed so far, merged over the ranks) go into every
  checkpoint and are handed back on resume, so each row is trained on exactly once per epoch
  across crashes and changes of world size (in a different order than an uninterrupted run).

Every step re-seeds the RNGs from (seed, global step). Each ``train_log.jsonl`` row records
``data_wait_s``, the time the step waited for its input, next to ``step_s``, the step call's host
time, and the input stages' times (``fetch_s``, ``build_s``, ``h2d_s``; see ``inputs.py``). Rows are
written once per ``train.log_every`` steps, whose last row carries the interval's ``tokens_per_s``,
``tflops`` and ``mfu`` (``step_log.py``: losses stay on the device until then, so a step never waits
for the GPU).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from recforge.checkpoint import save_checkpoint
from recforge.config import RunConfig, save_config
from recforge.io import atomic_write_json
from recforge.sparse.checkpoint import module_tables
from recforge.sparse.sharded import sharded_tables
from recforge.sparse.sharded_checkpoint import save_sharded_checkpoint
from recforge.train.async_save import BackgroundWriter, HostBuffers, host_snapshot
from recforge.train.distributed import DistContext, any_rank, full_dense_state, merged_data_state
from recforge.train.inputs import StepInputs
from recforge.train.flops import matmul_precision, peak_tflops
from recforge.train.progress import STOP_MESSAGES, Progress, progress_mode
from recforge.train.run_files import (append_jsonl, format_metrics, invoked_command, load_for_resume, prepare_run_dir,
                                      truncate_jsonl)  # fmt: skip
from recforge.train.step_log import StepLog
from recforge.train.tb_writer import BackgroundSummaryWriter

__all__ = ["BatchSource", "lr_at", "prepare_run_dir", "run_loop", "run_lr_scale"]

StepFn = Callable[[list, float], Any]  # (micro-batches, lr scale) -> StepResult, or None when no rank had data
EvalFn = Callable[[], tuple[str, dict[str, float]]]  # () -> (split name, metrics)


class BatchSource(Protocol):
    """A resumable stream of training batches (``train.loader=pipeline``), read epoch by epoch.

    ``state_dict()`` must describe exactly the batches already handed out by ``epoch_iter``
    (not those read ahead): the loop calls it between steps and saves it in the checkpoint.
    """

    num_steps_estimate: int  # steps per epoch, fixed for the run: sizes the learning-rate schedule and progress bar

    def epoch_iter(self, epoch: int, state: dict | None) -> Iterator[Any]:
        """The batches of ``epoch`` not consumed yet; ``state`` is a saved ``state_dict()`` on the first
        epoch after a resume, None to go on from the source's own state."""
        ...

    def state_dict(self) -> dict:
        """JSON-serialisable: the rows consumed so far (saved with each checkpoint)."""
        ...


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


def run_lr_scale(cfg: RunConfig, optimizer: torch.optim.Optimizer) -> float:
    """This step's learning rate over ``optim.lr`` (what ``optim.schedule`` set): the factor sparse
    tables apply on top of their own schedule, so ``model.embedding=dynamic`` follows the run's."""
    return optimizer.param_groups[0]["lr"] / cfg.optim.lr if cfg.optim.lr else 1.0


def run_loop(
    cfg: RunConfig,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    step: StepFn,
    build: Callable[[Any], Any],
    evaluate: EvalFn,
    manifest: dict,
    resume: bool,
    progress: bool,
    num_samples: int | None = None,
    source: BatchSource | None = None,
    show_keys: tuple[str, ...] | None = None,
    ctx: DistContext | None = None,
    lookahead: Callable[[Callable[[], list] | None], None] | None = None,
    flops: Callable[[Any], float] | None = None,
) -> dict:
    """Run ``cfg.train`` epochs of ``step``; return the final train state.

    Steps get this rank's micro-batches (``build`` turns a slice of shuffled sample ids of the
    global batch, ``num_samples``, or a batch of ``source`` into a CPU batch; exactly one of the
    two). ``evaluate`` runs every ``cfg.train.eval_every`` epochs and at the end; the checkpoint
    with the best ``cfg.eval.select_metric`` (higher is better) is marked ``best``. Under
    ``torchrun`` every rank runs this loop; rank 0 writes logs and checkpoints, and the data state
    of all ranks is merged into each checkpoint. ``lookahead`` receives the prefetched inputs'
    ``peek`` each epoch (None after it), for a step that starts the next step's input distribution.
    ``flops``: a CPU batch's training-step FLOPs (``recforge.train.flops.step_flops_counter``), for the
    ``tflops`` and ``mfu`` of the log; None logs tokens/s only.

    Example:
        >>> run_loop(cfg, model=model, optimizer=runner.optimizer, device=device, num_samples=len(samples),
        ...          build=lambda ids: make_batch(samples[ids]), step=runner, evaluate=evaluate, manifest={},
        ...          resume=False, progress=True)
    """
    if (num_samples is None) == (source is None):
        raise ValueError("run_loop needs exactly one of num_samples (memory loader) or source (a BatchSource)")
    ctx = ctx or DistContext()
    main = ctx.is_main
    run_dir = cfg.run_dir
    steps_log, evals_log = run_dir / "train_log.jsonl", run_dir / "evals.jsonl"
    state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "best_value": None}
    data_state = None  # the source's state to resume from (used by the first epoch that runs)
    if resume:
        ckpt, saved = load_for_resume(cfg, model, optimizer, device)
        state.update(saved["train_state"])
        data_state = saved.get("data_state")
        if (data_state is None) != (source is None):
            written, now = ("memory", "pipeline") if data_state is None else ("pipeline", "memory")
            raise ValueError(f"{ckpt} was written with train.loader={written}; resume it with that loader, not {now}")
        if main:
            truncate_jsonl(steps_log, state["global_step"])
            truncate_jsonl(evals_log, state["global_step"])
    elif main:
        for path in (steps_log, evals_log):
            path.unlink(missing_ok=True)
    if main:
        save_config(cfg, run_dir / "config.yaml")
        write_run_record(run_dir, stop_reason="running", stop_message="training (or killed while training)", state=state)
    if num_samples == 0:
        raise ValueError("the training split has no samples; check the dataset and the data/ranking settings")
    batch_size, accum = cfg.train.batch_size, cfg.dist.grad_accum
    steps_per_epoch = math.ceil(num_samples / batch_size) if source is None else source.num_steps_estimate
    total_steps = steps_per_epoch * cfg.train.epochs
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    # the main rank's TensorBoard writer is imported and opened on its own thread while training starts
    writer = BackgroundSummaryWriter(run_dir / "tb") if main else None
    peak = cfg.train.peak_tflops or peak_tflops(device, matmul_precision(cfg.train.precision))
    report = Progress(progress_mode(progress, main), epochs=cfg.train.epochs, total_steps=total_steps,
                      log_seconds=cfg.train.log_seconds, max_minutes=cfg.train.max_minutes)  # fmt: skip
    log = StepLog(steps_log, writer, cfg.train.log_every, peak, main, on_interval=report.interval)
    started = time.monotonic()
    writer_thread = BackgroundWriter()  # checkpoints of a single process are written off the training thread
    snapshot_buffers = HostBuffers()  # the host copies of those checkpoints, reused: pinned once, not per checkpoint
    stop = False
    stop_reason = "epochs"
    trained_state: dict | None = None  # the source's state after the last step trained (prefetch runs ahead)

    def checkpoint(best: bool = False) -> None:
        log.flush()  # raises on a non-finite loss before any checkpoint holds its weights
        data = {}
        if source is not None:  # only rows of the steps taken, from every rank
            data = {"data_state": merged_data_state(ctx, trained_state or source.state_dict())}
        sharded = None
        if tables := sharded_tables(model):  # a collective: every rank writes its shards
            sharded = save_sharded_checkpoint(run_dir / "checkpoints" / f".sparse-{state['global_step']:08d}", tables)
        weights, optimizer_state = full_dense_state(model, optimizer)  # FSDP2: gathered on every rank
        if main:
            save = dict(run_dir=run_dir, step=state["global_step"], model=model, optimizer=optimizer,
                        manifest={"train_state": dict(state), "config": cfg.to_dict(), "world_size": ctx.world_size,
                                  **manifest, **data},
                        keep=cfg.train.keep_checkpoints, best=best, sharded_sparse=sharded)  # fmt: skip
            # dynamic tables are not in the host snapshot (their rows, keys, free lists and counters change
            # every step): a run with any is written here, before the next step touches them
            if ctx.initialized or sharded is not None or module_tables(model):
                save_checkpoint(**save, weights=weights, optimizer_state=optimizer_state)
            else:  # one process, dense only: written in the background from a host copy taken now (async_save.py)
                writer_thread.wait()  # the previous write reads the buffers this snapshot overwrites (submit waited too)
                weights, optimizer_state = host_snapshot(model, optimizer, snapshot_buffers)
                writer_thread.submit(lambda: save_checkpoint(**save, weights=weights, optimizer_state=optimizer_state))
        ctx.barrier()  # no rank runs ahead of a checkpoint that is not complete yet (one process: being written)
        log.reset()  # the next interval's rate counts training only, not the checkpoint write

    def raw_steps(epoch: int) -> Iterator[list]:
        """This rank's micro-batches of each step, then [None] * K forever (the step agrees when all ranks are done)."""
        nonlocal data_state
        if source is not None:
            batches, data_state = source.epoch_iter(epoch, data_state), None
            try:
                while True:
                    yield [next(batches, None) for _ in range(accum)]
            finally:
                if hasattr(batches, "close"):
                    batches.close()  # stops a source's read-ahead thread
        order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(cfg.train.seed * 7919 + epoch))
        share = slice(ctx.rank * accum, (ctx.rank + 1) * accum)
        for i in range(state["step_in_epoch"], steps_per_epoch):
            parts = order[i * batch_size : (i + 1) * batch_size].tensor_split(ctx.world_size * accum)[share]
            yield [p if p.numel() else None for p in parts]
        while True:
            yield [None] * accum

    def log_eval() -> bool:
        log.flush()
        split, metrics = evaluate()  # every rank: evaluation is sharded and gathered
        if main:
            for key, value in metrics.items():
                if isinstance(value, float):
                    writer.add_scalar(f"{split}/{key}", value, state["global_step"])
            append_jsonl(evals_log, {"step": state["global_step"], "epoch": state["epoch"], "split": split,
                                     "elapsed_s": time.monotonic() - started, "time": time.time(), **metrics})  # fmt: skip
        report.evaluation(state["global_step"], state["epoch"], split, format_metrics(metrics, show_keys))
        value = metrics[cfg.eval.select_metric]
        is_best = state["best_value"] is None or value > state["best_value"]
        if is_best:
            state["best_value"] = value
        return is_best

    model.train()
    try:
        while state["epoch"] < cfg.train.epochs and not stop:
            epoch = state["epoch"]
            snapshot = source.state_dict if source is not None else None
            inputs = StepInputs(raw_steps(epoch), build=build, device=device, snapshot=snapshot, prefetch=cfg.dist.pipeline,
                                count=flops)  # fmt: skip
            if lookahead is not None and cfg.dist.pipeline:
                lookahead(inputs.peek)  # the step may start the next step's input distribution early
            report.start_epoch(epoch, steps_per_epoch, state["step_in_epoch"], state["global_step"])
            exhausted = False
            try:
                while True:
                    t0 = time.perf_counter()
                    item = next(inputs)  # a source hands out batches here: from now on their rows count as consumed
                    data_wait_s = time.perf_counter() - t0
                    torch.manual_seed(cfg.train.seed * 1_000_003 + state["global_step"])
                    lr = lr_at(cfg, state["global_step"], total_steps)
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    t0 = time.perf_counter()
                    result = step(item.micro, run_lr_scale(cfg, optimizer))
                    step_s = time.perf_counter() - t0
                    if item.data_state is not None:
                        trained_state = item.data_state
                    if result is None:  # no rank had data left
                        exhausted = True
                        break
                    state["global_step"] += 1
                    state["step_in_epoch"] += 1
                    # the loss may be a device scalar: read (and checked) with the interval's others, see step_log.py
                    log.add({"step": state["global_step"], "epoch": epoch, "lr": lr, "tokens": result.tokens, "step_s": step_s,
                             "data_wait_s": data_wait_s, **item.times}, result.loss, result.tokens, item.flops)  # fmt: skip
                    report.step(state["global_step"], state["step_in_epoch"], result.tokens)
                    if cfg.train.max_steps and state["global_step"] >= cfg.train.max_steps:
                        stop, stop_reason = True, "max_steps"
                    elif cfg.train.max_minutes and any_rank(ctx, time.monotonic() - started >= cfg.train.max_minutes * 60):
                        stop, stop_reason = True, "max_minutes"
                    if stop:
                        break
                    if cfg.train.checkpoint_every and state["global_step"] % cfg.train.checkpoint_every == 0:
                        checkpoint()
            except BaseException:
                log.salvage()  # the rows of the steps that did run
                raise
            finally:  # also on an exception: no prefetch or read-ahead thread outlives the loop
                report.close()
                if lookahead is not None:
                    lookahead(None)
                inputs.close()  # rows prefetched but not trained stay unconsumed in the saved state
            # memory: the epoch's step count is known, so a budget stop on its last step also ends the epoch (as before)
            if exhausted or (source is None and state["step_in_epoch"] >= steps_per_epoch):
                state["epoch"] += 1
                state["step_in_epoch"] = 0
            log.flush()  # the epoch's losses, for its summary line
            report.end_epoch(state["global_step"], completed=state["step_in_epoch"] == 0)
            finished = stop or state["epoch"] >= cfg.train.epochs
            due = cfg.train.eval_every and state["epoch"] % cfg.train.eval_every == 0
            best = False
            if finished or due:
                model.eval()
                best = log_eval()
                model.train()
            checkpoint(best=best)  # resets the throughput interval: the next rate counts training only
    except BaseException:
        with contextlib.suppress(Exception):  # the error being raised is the one to report
            writer_thread.wait()  # a checkpoint being written when training failed is complete on disk
        with contextlib.suppress(Exception):
            if writer is not None:
                writer.close()  # the scalars logged so far are on disk
        raise
    writer_thread.wait()  # every checkpoint is on disk before the loop returns (an error in one is raised here)
    log.flush()
    tb_error = None
    if writer is not None:
        try:
            writer.close()
        except RuntimeError as err:  # raised once the run record is written: the trained run is complete
            tb_error = err
    if stop and state["epoch"] >= cfg.train.epochs:  # the budget ran out on the very last step
        stop_reason = "epochs"
    message = STOP_MESSAGES[stop_reason].format(epochs=cfg.train.epochs, max_steps=cfg.train.max_steps,
                                                max_minutes=cfg.train.max_minutes, epoch=state["epoch"] + 1)  # fmt: skip
    report.stopped(stop_reason, message)
    state["train_minutes"] = (time.monotonic() - started) / 60
    if main:
        write_run_record(run_dir, stop_reason=stop_reason, stop_message=message, state=state)
    if tb_error is not None:
        raise tb_error
    return {**state, "stop_reason": stop_reason, "stop_message": message}


def write_run_record(run_dir, *, stop_reason: str, stop_message: str, state: dict | None = None) -> None:
    """``RUN_DIR/run.json``: why the last training session ended (``running`` while it runs, and after a
    kill), where it got to, and the command that ran it."""
    record = {"stop_reason": stop_reason, "stop_message": stop_message, "command": invoked_command(),
              "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
    if state is not None:
        record.update({"epochs_completed": state["epoch"], "global_step": state["global_step"],
                       "train_minutes": round(state.get("train_minutes", 0.0), 4)})  # fmt: skip
    atomic_write_json(run_dir / "run.json", record)

