"""One combined lookup per table and step, and the pipeline that makes it during the previous step.

A step looks a table up several times (the retrieval recipe's item table: the history
``features.item_ids``, the targets ``labels.next_item``, the sampled negatives ``draws.ids``), with
heavily overlapping IDs. ``LookAhead`` learns on the first step which batch tensors feed which
table; from then on, before each micro-batch's forward, every table gets ONE combined lookup of
all those tensors (``ShardedDynamicEmbedding.distribute([...])``: one dedup, one ID all-to-all,
one staging from the host tier, one owner lookup, one embedding all-to-all, one row gradient per
ID sent back to its owner) and each of the forward's lookups of one of them reads its rows
through its part of the inverse index (``AheadTable``). Admission and eviction see each distinct
ID once per step, its occurrences summed over the lookups (see ``recforge.sparse.sharded``). IDs
made inside the model take the usual path.

With the pipeline on (``dist.pipeline=true``; TorchRec's ``TrainPipelineSparseDist`` idea), the next
step's combined lookups are distributed and staged while this step computes::

    input thread:   fetch(i+1) -> build(i+1) -> H2D(i+1) on a side stream           (recforge.train.inputs)
    main thread:    forward(i) -> start(i+1) -> backward(i) -> dense optimizer(i) -> wait -> sparse optimizer(i)
                    -> prepare(i+1): the staged lookups -> forward(i+1): their rows are read, no host sync -> ...
    sparse worker:                  draws(i+1) -> distribute(i+1) -> stage(i+1), one of each per table
                                    (a thread of its own, its own process group and CUDA stream)

``stage`` only reads the table, so step i's optimizer may still update the rows: the lookup in
forward(i+1) reads their values then, after the update. An eviction in between, or an ID without a
row, makes that lookup look those IDs up again (only those: ``recforge.sparse.staging.rows_now``). Without the pipeline (or for the
micro-batches after the first), ``prepare`` distributes and stages the same combined lookup on the
main thread just before the forward, so pipelined training equals unpipelined training bit for
bit. The worker starts only after step i's forward (every lookup of step i done) and the main
thread waits for it before step i's sparse optimizer, so table state is never touched by two
threads at once; its collectives use their own process group (never interleaved with the main
thread's) and, on CUDA, its kernels a high-priority side stream that waits only for forward(i).

The next batch's draws (``recforge.train.step_draws``: the sampled negatives) are made by the worker
too, first, on its stream. A staged lookup is used only if the step's tensors are the very tensors
it was made for (the same batch, the draws made ahead): otherwise (another seed, another batch)
``prepare`` makes it again. Every rank makes the same combined lookups in the same order (a rank
without data its stand-in batch's, with 0 occurrences), so the collectives match.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recforge.sparse.routing import DistributedIds
from recforge.sparse.sharded import ShardedDynamicEmbedding
from recforge.train.distributed import several_ranks

log = logging.getLogger(__name__)
Path = tuple[str, ...]  # where a tensor sits in a batch: ("features", "item_ids"), ("labels", "next_item")
Parts = list[tuple[Path, Tensor]]  # a table's combined lookup: its tensors (distinct objects) and their paths


class AheadTable(ShardedDynamicEmbedding):
    """``ShardedDynamicEmbedding`` whose ``forward`` of a tensor of the installed combined lookup reads its part."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parts: Parts = []  # the installed combined lookup's tensors
        self._handle: DistributedIds | None = None
        self._from_worker = False  # the installed lookup was staged a step ahead
        self._read: list[bool] = []
        self._seen: list[Tensor] | None = None  # IDs received while the batch mapping is learned
        self.combined_lookups = 0  # lookups that read a combined lookup (for logs and tests)
        self.lookups_ahead = 0  # ... of them, those whose combined lookup was staged a step ahead
        self.ahead_reads = 0  # combined lookups staged ahead whose rows were read with no host sync

    def install(self, parts: Parts, handle: DistributedIds, from_worker: bool) -> None:
        """Lookups of ``parts``' tensors read ``handle`` (``distribute([...])`` of them, in that order) until ``uninstall``."""
        self._parts, self._handle, self._from_worker, self._read = parts, handle, from_worker, [False] * len(parts)

    def uninstall(self) -> list[Path]:
        """Take the combined lookup off (its rows stay in the autograd graph); return the paths no lookup read."""
        handle, unread = self._handle, [path for (path, _), read in zip(self._parts, self._read, strict=True) if not read]
        if handle is not None and handle.rows is None:  # never looked up: free the cache slots its staging held
            self.shard.store.release_staged()
        self._parts, self._handle, self._read = [], None, []
        return unread

    def forward(self, ids: Tensor, tags: Tensor | None = None, admit: bool = True) -> Tensor:
        if tags is None and admit:
            if self._seen is not None:
                self._seen.append(ids)
            for part, (_, tensor) in enumerate(self._parts):
                if tensor is ids:
                    reads = self.staged_reads
                    out = self.lookup(self._handle, admit, part)
                    self._read[part] = True
                    self.combined_lookups += 1
                    if self._from_worker:
                        self.lookups_ahead += 1
                        self.ahead_reads += self.staged_reads - reads
                    return out
        return super().forward(ids, tags, admit)


def named_tensors(batch: Any, draws: Any = None) -> Iterator[tuple[Path, Tensor]]:
    """The tensors of a batch and their paths: attributes, and values of dict attributes; then those of its
    draws (``draws`` an object with attributes, e.g. ``SampledNegatives``) under ``("draws", ...)``."""
    for name, value in vars(batch).items():
        if torch.is_tensor(value):
            yield (name,), value
        elif isinstance(value, dict):
            for key, item in value.items():
                if torch.is_tensor(item):
                    yield (name, key), item
    if draws is not None:
        for path, item in named_tensors(draws):
            yield ("draws", *path), item


Drawn = tuple[Any, int, Any]  # (batch, seed, draws): what ``StepDraws.ahead``'s function returns


def _worker_group() -> dist.ProcessGroup | None:
    """The sparse worker's own process group (every rank makes it, at the same step), None without one.

    Under NCCL its communicator runs on high-priority streams, as the worker's own stream does: the worker's two
    host syncs per table (the split sizes', the staging's) wait for its ID all-to-all, which would otherwise
    queue behind the backward's kernels on the GPU.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
        return dist.new_group(backend="nccl", pg_options=options)
    return dist.new_group()


@dataclass
class _Staged:
    """The worker's combined lookups of the next step's first micro-batch, waiting for ``prepare``."""

    standin: bool
    lookups: dict[str, tuple[Parts, DistributedIds]]


class LookAhead:
    """Learns which batch tensors feed which ``AheadTable``; makes each table's combined lookup per micro-batch
    (``prepare``), for the next step's first micro-batch in a worker thread (``start``/``wait``: the pipeline).

    Args:
        tables: the model's ``AheadTable``s by module path (those without a process group are left alone).
        device: this rank's device (CUDA: the worker's side stream lives there).
        announce: log what is combined and staged (rank 0).
    """

    def __init__(self, tables: dict[str, AheadTable], device: torch.device, announce: bool) -> None:
        self.tables = {name: t for name, t in tables.items() if t.collective}
        self.device, self.announce = device, announce
        self.paths: dict[str, list[Path]] | None = None  # table name -> batch paths, in first-lookup order
        self.group: dist.ProcessGroup | None = None  # the worker's own (made at its first start, on every rank)
        self.stream: torch.cuda.Stream | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future | None = None
        self._staged: _Staged | None = None
        self.started = False  # the worker has run (the pipeline is on)
        self._warned_unread = False
        self.remade = 0  # staged lookups not used (another batch or other draws): made again at the step
        self.stats: list[dict[str, float]] = []  # per staged batch: worker draw_s, distribute_s, stage_s; main wait_s

    def learning(self) -> bool:
        return self.paths is None and bool(self.tables)

    def begin(self) -> None:
        for table in self.tables.values():
            table._seen = []

    def end(self, batch: Any, draws: Any = None) -> None:
        """After the first forward: keep the lookups whose IDs were the batch's (or its draws') own tensors."""
        by_id = {id(t): path for path, t in named_tensors(batch, draws)}
        self.paths = {}
        for name, table in self.tables.items():
            seen, table._seen = table._seen or [], None
            paths = [by_id[id(ids)] for ids in seen if id(ids) in by_id]
            self.paths[name] = list(dict.fromkeys(paths))  # a tensor looked up twice is one part
        if self.announce:
            log.info("sparse lookups combined, one per table and step: %s", self._described() or "none")

    def _described(self) -> dict[str, list[str]]:
        return {n: [".".join(p) for p in ps] for n, ps in (self.paths or {}).items() if ps}

    def _parts(self, batch: Any, draws: Any) -> dict[str, Parts]:
        """Each table's tensors of ``batch`` and ``draws`` at its learned paths (each tensor once)."""
        tensors = dict(named_tensors(batch, draws))
        out = {}
        for name, paths in (self.paths or {}).items():
            parts: Parts = []
            for path in paths:
                tensor = tensors.get(path)
                if tensor is not None and not any(tensor is t for _, t in parts):
                    parts.append((path, tensor))
            if parts:
                out[name] = parts
        return out

    def prepare(self, batch: Any, draws: Any = None) -> None:
        """Before a micro-batch's forward: install each table's combined lookup of ``batch`` (and its ``draws``):
        the one the worker staged if it was made for these very tensors, else one made now on this thread.
        Call inside ``standin_lookups`` (a stand-in's IDs are sent with 0 occurrences)."""
        staged, self._staged = self._staged, None
        for name, parts in self._parts(batch, draws).items():
            table = self.tables[name]
            made = staged.lookups.pop(name, None) if staged is not None else None
            if made is not None and staged.standin == table.standin_here and len(made[0]) == len(parts) and all(
                    a is b for (_, a), (_, b) in zip(made[0], parts, strict=True)):  # fmt: skip
                table.install(parts, made[1], from_worker=True)
                continue
            if made is not None:  # staged for other tensors (another seed's draws, another batch): made again
                table.shard.store.release_staged()
                self.remade += 1
            handle = table.distribute([t for _, t in parts])
            table.stage(handle)
            table.install(parts, handle, from_worker=False)
        for name in staged.lookups if staged is not None else ():
            self.tables[name].shard.store.release_staged()

    def finish(self) -> None:
        """After a micro-batch's forward: take the combined lookups off the tables. A learned path that no lookup
        read (the model did not look it up this time) is dropped in one process (its IDs were counted once, for
        nothing); with several ranks it is kept, since every rank must make the same combined lookups."""
        several = several_ranks()
        for name, table in self.tables.items():
            unread = table.uninstall()
            if not unread or self.paths is None:
                continue
            if several:  # every rank must keep combining the same paths (the same collectives): kept, counted
                if not self._warned_unread:
                    self._warned_unread = True
                    log.warning("table %r: the step's lookups did not read %s on this rank; still combined (the "
                                "ranks' lookups must match)", name, [".".join(p) for p in unread])  # fmt: skip
                continue
            self.paths[name] = [p for p in self.paths[name] if p not in unread]
            log.warning("table %r: the step's lookups did not read %s; no longer combined", name,
                        [".".join(p) for p in unread])  # fmt: skip

    def start(self, batch: Any, standin: bool, draw: Callable[[], Drawn] | None = None) -> None:
        """Begin the worker's combined lookups of ``batch`` (after this step's forward; the next step's first
        micro-batch). ``standin``: the batch is this rank's stand-in. ``draw``: makes the batch's draws
        (``StepDraws.ahead``), run first by the worker; ``wait`` returns them."""
        assert self._job is None, "a staged batch was neither used nor dropped"
        if not any((self.paths or {}).values()):
            return
        if not self.started:  # every rank gets here at the same step: the group is made on all of them
            self.started = True
            self.group = _worker_group()
            # high priority: the worker's small kernels and syncs do not queue behind the backward's
            self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="recforge-sparse-dist")
            if self.announce:
                log.info("sparse input staged one step ahead: %s", self._described())
        ready = None
        if self.stream is not None:  # the worker's stream waits for this step's forward, not for its backward
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._job = self._pool.submit(self._stage, batch, draw, standin, ready)

    def _stage(self, batch: Any, draw: Callable[[], Drawn] | None, standin: bool, ready: torch.cuda.Event | None):
        """The worker: the draws, then every table's ID all-to-all (all in flight), then each owner's staging."""
        if self.stream is None:
            return self._run(batch, draw, standin)
        torch.cuda.set_device(self.device)
        ready.synchronize()  # this worker's clock starts when forward(i) is done
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            out = self._run(batch, draw, standin)
        self.stream.synchronize()
        return out

    def _run(self, batch: Any, draw: Callable[[], Drawn] | None, standin: bool):
        with torch.no_grad():
            t0 = time.perf_counter()
            drawn = draw() if draw is not None else None
            parts = self._parts(batch, drawn[2] if drawn is not None else None)
            t1 = time.perf_counter()
            handles = {name: self.tables[name].distribute([t for _, t in ps], group=self.group, standin=standin)
                       for name, ps in parts.items()}  # fmt: skip
            t2 = time.perf_counter()
            for name, handle in handles.items():
                self.tables[name].stage(handle)
            t3 = time.perf_counter()
        staged = _Staged(standin, {name: (parts[name], handle) for name, handle in handles.items()})
        return staged, drawn, {"draw_s": t1 - t0, "distribute_s": t2 - t1, "stage_s": t3 - t2}

    def wait(self) -> Drawn | None:
        """Main thread: finish the staging in flight and keep its lookups for ``prepare`` (before the sparse
        optimizer touches the tables); return the batch's draws if the worker made them. Raises what the worker raised."""
        if self._job is None:
            return None
        t0 = time.perf_counter()
        job, self._job = self._job, None
        staged, drawn, times = job.result()
        if self.stream is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self.stream)
            made = [t for _, handle in staged.lookups.values() for t in handle.tensors()]
            made += [t for _, t in named_tensors(drawn[2])] if drawn is not None else []
            for t in made:  # memory made on the worker's stream is used on the compute stream
                if t.is_cuda:
                    t.record_stream(main)
        self._staged = staged
        self.stats.append({**times, "wait_s": time.perf_counter() - t0})
        return drawn

    def drop(self) -> None:
        """Finish any staging in flight and forget every combined lookup not used, and the cache slots they held."""
        try:
            self.wait()
        finally:
            staged, self._staged = self._staged, None
            for name in staged.lookups if staged is not None else ():
                self.tables[name].shard.store.release_staged()
            for table in self.tables.values():
                table.uninstall()

    def close(self) -> None:
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
