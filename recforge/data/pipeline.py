"""The sample engine: a chain of vectorised stages over Arrow RecordBatches.

::

    Pipeline.from_parquet(paths, columns=[...], num_workers=4)   parallel reads (worker processes)
      | Pipeline.from_samples(SampleSource(...))                 or rows built in memory as they are read
        .map(truncate_lists(["item_ids"], 200))                  RecordBatch -> RecordBatch (pyarrow.compute)
        .filter(lambda rb: pc.greater(...))                      RecordBatch -> bool mask
        .shuffle(buffer_rows=65536)                              windowed shuffle, seeded
        .batch(256)  |  .batch(token_budget=32768, length_column="item_ids")
        .collate(JaggedCollate({"item_ids": "item_ids"}))        whole batch -> JaggedBatch, zero-copy
        .prefetch(4)                                             background thread, bounded queue
        .take(1000)

The leading ``map``/``filter`` stages, the ``shuffle`` right after them and the ``batch`` right
after that run inside the reader workers (forked processes by default), one task of about a
shuffle window of rows at a time, in parallel; the consumer only slices the finished batches
(zero-copy from shared memory), merges each task's under-full rest, and runs the remaining
stages (collate, ...) in order in the thread that iterates (the prefetch thread when there is
one). See ``recforge.data.read_tasks`` and ``recforge.data.workers``.

Row identity and exactly-once resume: every row carries ``__row_id__``; when a batch is
*handed to the caller* its rows are marked consumed in ``pipeline.state``. Save
``pipeline.state_dict()`` with the model after the step that used the batch, and pass it
back as ``state=`` when resuming (see ``recforge.data.resume``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from recforge.data.bad_rows import BadRowReport, RowRules
from recforge.data.parquet_source import ParquetSource
from recforge.data.read_tasks import TaskRunner, WorkerPlan, make_tasks, task_items
from recforge.data.resume import PipelineState
from recforge.data.sample_source import SampleSource
from recforge.data.stages import STAGES, Item, Stage
from recforge.data.workers import resolve_mode, run_tasks

MapFn = Callable[[pa.RecordBatch], pa.RecordBatch]
FilterFn = Callable[[pa.RecordBatch], Any]  # -> bool array / mask per row


class Pipeline:
    """An immutable chain of stages; each method returns a new pipeline. Iterate it for one epoch.

    Example:
        >>> pipe = (Pipeline.from_parquet("samples/", columns=["user_id", "item_ids"], num_workers=2)
        ...         .map(truncate_lists(["item_ids"], 200)).shuffle(65536).batch(256)
        ...         .collate(JaggedCollate({"item_ids": "item_ids"})).prefetch(4))
        >>> for batch in pipe:                       # JaggedBatch, batch.dense["row_ids"]
        ...     train_step(batch); save(model, pipe.state_dict())
    """

    def __init__(self, source: ParquetSource | SampleSource, *, num_workers: int, rules: RowRules | None, seed: int,
                 rank: int, world_size: int, stages: tuple[Stage, ...] = (), state: PipelineState | None = None,
                 worker_mode: str = "thread"):  # fmt: skip
        self.source = source
        self.num_workers = num_workers
        resolve_mode(worker_mode)  # checks the name now; "auto" is resolved where the pipeline is iterated
        self.worker_mode = worker_mode
        self.rules = rules
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.stages = stages
        self.state = state if state is not None else PipelineState.fresh(source, seed)
        self.bad_rows = BadRowReport()

    @staticmethod
    def from_parquet(
        paths: Iterable | str | os.PathLike,
        columns: list[str] | None = None,
        *,
        num_workers: int = 2,
        rules: RowRules | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        state: dict | PipelineState | None = None,
        worker_mode: str = "thread",
    ) -> Pipeline:
        """Start a pipeline over Parquet files.

        Args:
            paths: files or directories of ``*.parquet``.
            columns: column projection (None = all).
            num_workers: reader workers: row groups are read, transformed, shuffled and cut into
                batches in parallel (see ``recforge.data.read_tasks``).
            worker_mode: ``"thread"`` (the default: threads in this process), ``"process"`` (forked
                worker processes: scales with cores; map/filter functions run there, so changes to
                their own state stay there), or ``"auto"``: processes where fork and memfd exist
                (Linux) and this is not a daemonic process, else threads (logged once). Output is
                the same. Processes are opt-in: they are forked from this process every epoch, so
                in a trainer holding large host tables every page written during the epoch is
                copied (copy-on-write). Randomness in map/filter functions: draw from
                ``task_rng()`` (``recforge.data.stages``; the same draws in both modes); in
                processes the global ``random``/``numpy.random``/``torch`` generators are also
                seeded per task from ``(seed, epoch, resumes, rank, task)``.
            rules: malformed-row checks and policy (see ``recforge.data.bad_rows``).
            seed: shuffle seed.
            rank, world_size: this rank's even share of the (unconsumed) rows: by rows, or by tokens
                with ``batch(token_budget=...)`` (ranks' batch counts then differ by about 1 at most),
                counted after the maps that declare how they change lengths (see ``map``).
            state: a saved ``state_dict()`` (or several ranks' states merged) to resume from.
        """
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        source = ParquetSource(paths if isinstance(paths, (str, os.PathLike)) else list(paths), columns)
        source.check_types(set(rules.types) if rules is not None else set())
        if isinstance(state, dict):
            state = PipelineState.from_dict(state)
        if state is not None:
            state.check(source)
        return Pipeline(source, num_workers=num_workers, rules=rules, seed=seed, rank=rank, world_size=world_size,
                        state=state, worker_mode=worker_mode)  # fmt: skip

    @staticmethod
    def from_samples(source: SampleSource, *, num_workers: int = 2, seed: int = 0, rank: int = 0, world_size: int = 1,
                     state: dict | PipelineState | None = None, worker_mode: str = "thread") -> Pipeline:  # fmt: skip
        """Start a pipeline over samples built in memory (``recforge.data.sample_source``): the rows a
        recipe builds are streamed as they are built, with no file written and read back. The
        arguments are those of ``from_parquet``; a ``state`` saved for other samples is refused."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if isinstance(state, dict):
            state = PipelineState.from_dict(state)
        if state is not None:
            source.check_state(state.paths)
            state.check(source)
            state.paths = list(source.paths)  # a legacy file-based state names the samples now: later resumes check them
        return Pipeline(source, num_workers=num_workers, rules=None, seed=seed, rank=rank, world_size=world_size,
                        state=state, worker_mode=worker_mode)  # fmt: skip

    def _with(self, stage: Stage) -> Pipeline:
        if stage.kind in ("map", "filter", "shuffle", "batch", "collate") and any(s.kind == "collate" for s in self.stages):
            raise ValueError(f"{stage.kind}() after collate(): Arrow stages must come before collate (which ends the Arrow part)")
        out = Pipeline(self.source, num_workers=self.num_workers, rules=self.rules, seed=self.seed, rank=self.rank,
                       world_size=self.world_size, stages=(*self.stages, stage), state=self.state,
                       worker_mode=self.worker_mode)  # fmt: skip
        out.bad_rows = self.bad_rows
        return out

    # -- the chain ---------------------------------------------------------------------
    def map(self, fn: MapFn, *, token_lengths: Callable[[dict], dict] | None = None) -> Pipeline:
        """Vectorised RecordBatch -> RecordBatch transform; must keep the ``__row_id__`` column.

        ``token_lengths`` (default: ``fn.token_lengths``, which ``truncate_lists`` and
        ``next_item_targets`` carry) says how ``fn`` changes list lengths: a dict of per-row lengths
        by column name -> the same after ``fn`` (columns it leaves alone passed through). With
        ``batch(token_budget=...)`` ranks' shares are balanced on the lengths after the maps; a map
        that changes lengths without saying how is balanced on the lengths before it.
        """
        return self._with(Stage("map", fn, token_lengths if token_lengths is not None else getattr(fn, "token_lengths", None)))

    def filter(self, fn: FilterFn) -> Pipeline:
        """Keep the rows where ``fn(batch)`` (a boolean array) is True."""
        return self._with(Stage("filter", fn))

    def shuffle(self, buffer_rows: int) -> Pipeline:
        """Shuffle within windows of ``buffer_rows`` rows (read units are also visited in random order)."""
        if buffer_rows < 1:
            raise ValueError(f"shuffle buffer must be >= 1 row, got {buffer_rows}")
        return self._with(Stage("shuffle", buffer_rows))

    def batch(self, batch_size: int | None = None, *, token_budget: int | None = None, length_column: str = "item_ids",
              max_rows: int | None = None, drop_last: bool = False) -> Pipeline:  # fmt: skip
        """Group rows: ``batch_size`` rows each, or as many rows as fit ``token_budget`` tokens
        (per row: the length of list column ``length_column``, or its value for an integer column)."""
        if (batch_size is None) == (token_budget is None):
            raise ValueError("batch() needs exactly one of batch_size or token_budget")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self._with(Stage("batch", (batch_size, token_budget, length_column, max_rows, drop_last)))

    def collate(self, fn: Callable[[pa.RecordBatch], Any]) -> Pipeline:
        """Turn each batch into the trainer's type (e.g. ``JaggedCollate``); runs once per whole batch."""
        return self._with(Stage("collate", fn))

    def prefetch(self, depth: int) -> Pipeline:
        """Run everything upstream in a background thread, keeping up to ``depth`` items ready."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        return self._with(Stage("prefetch", depth))

    def take(self, n: int) -> Pipeline:
        """Stop after ``n`` items."""
        return self._with(Stage("take", n))

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The exactly-once state (JSON-serialisable); save it with the model checkpoint."""
        return self.state.to_dict()

    # -- execution -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        state = self.state
        if state.share_done or (state.complete and state.num_rows):
            state.next_epoch()
        plan = WorkerPlan.split(self.stages)
        units, keep = state.plan(self.source, self.rank, self.world_size, token_column=self._token_column(),
                                 token_maps=self._token_maps())  # fmt: skip
        rng = np.random.default_rng([self.seed, state.epoch, state.resumes, self.rank])
        if any(s.kind == "shuffle" for s in self.stages):
            order = rng.permutation(len(units))
            units, keep = [units[i] for i in order], [keep[i] for i in order]
        mode = resolve_mode(self.worker_mode)
        run = TaskRunner(self.source, units, keep, self.rules, plan, (self.seed, state.epoch, state.resumes, self.rank),
                         use_threads=mode == "thread", seed_globals=mode == "process")  # fmt: skip
        done: list = []
        results = run_tasks(run, make_tasks(keep, plan.task_rows), self.num_workers, mode)
        stream: Iterator[Item] = task_items(results, plan, self.bad_rows, done)
        for stage in plan.consumer_stages:
            stream = STAGES[stage.kind](stream, stage.arg, rng)
        for item in stream:
            state.mark(item.row_ids)
            yield item.data
        if done:  # the whole share was read: rows filtered or dropped on the way count as consumed
            for unit, k in zip(units, keep, strict=True):
                first = int(self.source.row_group_rows[unit.file_index][: unit.row_group].sum())
                state.consumed[unit.file_index][first + unit.start : first + unit.stop] |= k
            state.share_done = True

    def _token_column(self) -> str | None:
        """With token-budget batches, the column of the files that ranks' shares are balanced by
        (see ``ParquetSource.token_column``); None (an even split by rows) otherwise."""
        batch = next((s for s in self.stages if s.kind == "batch"), None)
        if batch is None or batch.arg[1] is None:
            return None
        return self.source.token_column(batch.arg[2])

    def _token_maps(self) -> tuple[Callable[[dict], dict], ...]:
        """The declared length effects of the maps before the batch (see ``map``), ending with the pick of
        the batch's length column; () when no map declares one."""
        batch = next((i for i, s in enumerate(self.stages) if s.kind == "batch"), len(self.stages))
        maps = tuple(s.token_lengths for s in self.stages[:batch] if s.kind == "map" and s.token_lengths is not None)
        return (*maps, _pick(self.stages[batch].arg[2])) if maps and batch < len(self.stages) else ()


def _pick(length_column: str) -> Callable[[dict], dict]:
    """The last step of a token-lengths chain: the batch's length column (or, made by a map that did not
    declare it, the files' column that stands in for it: see ``ParquetSource.token_column``)."""

    def pick(lengths: dict) -> dict:
        return {length_column: lengths[length_column] if length_column in lengths else next(iter(lengths.values()))}

    return pick


class PipelineSource:
    """A ``Pipeline`` as the training loop's ``BatchSource``: one pipeline for the whole run, its
    ``PipelineState`` saved in every checkpoint. ``build(state)`` makes the pipeline (resuming from
    ``state`` when given); the recipes' sources are ``retrieval_source`` and ``ranking_source``.

    Rows are marked consumed when the pipeline hands a batch to the loop, and the loop asks for the
    next batch only when it is about to train on it, so ``state_dict()`` between steps holds exactly
    the rows of the steps taken; batches still in the prefetch queue stay unconsumed.
    """

    def __init__(self, build: Callable[[dict | None], Pipeline], num_steps_estimate: int) -> None:
        self.build = build
        self.num_steps_estimate = num_steps_estimate  # batches per epoch (see token_batching.steps_per_epoch)
        self.pipeline: Pipeline | None = None  # built by the first epoch_iter, kept for the run

    def epoch_iter(self, epoch: int, state: dict | None) -> Iterator[Any]:
        if state is not None or self.pipeline is None:
            self.pipeline = self.build(state)
        s = self.pipeline.state
        finished = s.share_done or (s.complete and s.num_rows > 0)  # every row of s.epoch is consumed
        if finished and s.epoch == epoch:
            # saved after the epoch's last batch but before its end was seen (a budget stop or checkpoint_every)
            return iter(())
        if s.epoch + finished != epoch:
            raise RuntimeError(
                f"the pipeline state is in epoch {s.epoch} (finished={finished}) but training is in epoch {epoch}: "
                "the checkpoint's data_state and train_state disagree; resume from an unmodified checkpoint"
            )
        return iter(self.pipeline)  # a new epoch starts (all rows unconsumed) when the state's epoch is finished

    def state_dict(self) -> dict:
        if self.pipeline is None:
            raise RuntimeError(f"{type(self).__name__}.state_dict() before the first epoch_iter(); there is no state yet")
        return self.pipeline.state_dict()


def replay(batches: list, steps: int) -> Iterator:
    """IO-free mode: cycle over batches already in memory for ``steps`` steps.

    Feeding the trainer from memory measures the model's own ceiling; the gap to the real
    pipeline is the time the trainer waits for data.

    Example:
        >>> cached = list(pipe.take(8))
        >>> for batch in replay(cached, 1000): train_step(batch)
    """
    if not batches:
        raise ValueError("replay needs at least one batch (the pipeline produced none)")
    for i in range(steps):
        yield batches[i % len(batches)]
