"""The sparse input of step i+1 runs while step i computes: ID all-to-all, owner dedup, host-tier fetch.

The stages of a pipelined step (``dist.pipeline=true``; TorchRec's ``TrainPipelineSparseDist`` idea)::

    input thread:   fetch(i+1) -> build(i+1) -> H2D(i+1) on a side stream           (recforge.train.inputs)
    main thread:    forward(i) -> start(i+1) -> backward(i) -> dense optimizer(i) -> wait -> sparse optimizer(i)
                    -> forward(i+1): its staged lookups read their rows, no host sync -> ...
    sparse worker:                  distribute(i+1) -> stage(i+1)
                                    (a thread of its own, its own process group and CUDA stream)

``distribute`` dedups the IDs and sends them to their owners; ``stage`` dedups them there, finds
their rows and brings the host tier's missing rows into the device cache, holding those slots
(``ShardedDynamicEmbedding``). Neither changes table state, so step i's optimizer may still update
the rows: the lookup in forward(i+1) reads their values then, after the update. An eviction in
between, or an ID without a row, makes that lookup redo the owner's part the ordinary way, so
pipelined training equals unpipelined training. The worker starts only after step i's forward
(every lookup of step i done) and the main thread waits for it before step i's sparse optimizer,
so table state is never touched by two threads at once; its collectives use their own process
group (never interleaved with the main thread's) and, on CUDA, its kernels a side stream that
waits only for forward(i).

Which batch tensors feed which table is learned on the first step: every ID tensor a table's
``forward`` receives that *is* a tensor of the batch (``batch.item_ids``, ``batch.labels[...]``,
passed unchanged) or of its draws (``recforge.train.step_draws``: the sampled negatives, drawn
before the step, at path ``("draws", field)``) is staged ahead from then on; IDs made inside the
model take the usual path. The next batch's draws are made by the worker too, first, on its stream
(``stage_draws``; off: they are drawn and looked up at the step). Every rank stages the same lookups
in the same order (a rank without data stages its stand-in batch), so the collectives match;
handles no lookup used are dropped after the step's first forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recforge.sparse.sharded import DistributedIds, ShardedDynamicEmbedding

log = logging.getLogger(__name__)
Path = tuple[str, ...]  # where a tensor sits in a batch: ("features", "item_ids"), ("labels", "next_item")


class AheadTable(ShardedDynamicEmbedding):
    """``ShardedDynamicEmbedding`` whose ``forward`` uses a lookup distributed and staged ahead for the same IDs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ahead: list[tuple[Tensor, DistributedIds]] = []
        self._seen: list[Tensor] | None = None  # IDs received while the batch mapping is learned
        self.lookups_ahead = 0  # lookups that used a staged handle (for logs and tests)
        self.ahead_reads = 0  # ... of them, those that read the staged rows with no host sync

    def drop_ahead(self) -> None:
        """Forget handles no lookup used, and the cache slots they held."""
        if self._ahead:
            self._ahead.clear()
            self.shard.store.release_staged()

    def forward(self, ids: Tensor, tags: Tensor | None = None, admit: bool = True) -> Tensor:
        if self._seen is not None:
            self._seen.append(ids)
        if tags is None and self._ahead and self._ahead[0][0] is ids:
            self.lookups_ahead += 1
            reads = self.staged_reads
            out = self.lookup(self._ahead.pop(0)[1], admit)
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


class LookAhead:
    """Learns which batch tensors feed which ``AheadTable``; distributes and stages them for the next batch.

    Args:
        tables: the model's ``AheadTable``s by module path.
        device: this rank's device (CUDA: the worker's side stream lives there).
        announce: log what is staged (rank 0).
    """

    def __init__(self, tables: dict[str, AheadTable], device: torch.device, announce: bool) -> None:
        self.tables, self.device, self.announce = tables, device, announce
        self.paths: dict[str, list[Path]] | None = None  # table name -> batch paths, in lookup order
        # a group of its own (created on every rank, in the same order): the worker's collectives never
        # interleave with the main thread's (DDP, the embeddings' all-to-all) on any rank
        self.group = dist.new_group() if dist.is_available() and dist.is_initialized() else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="recforge-sparse-dist")
        self._job: Future | None = None
        self.stage_draws = True  # the worker also makes the next batch's draws and stages their lookups
        self.stats: list[dict[str, float]] = []  # per staged batch: worker draw_s, distribute_s, stage_s; main wait_s

    def learning(self) -> bool:
        return self.paths is None

    def begin(self) -> None:
        for table in self.tables.values():
            table._seen = []

    def end(self, batch: Any, draws: Any = None) -> None:
        """After the first forward: keep the lookups whose IDs were the batch's (or its draws') own tensors."""
        by_id = {id(t): path for path, t in named_tensors(batch, draws)}
        self.paths = {}
        for name, table in self.tables.items():
            seen, table._seen = table._seen or [], None
            self.paths[name] = [by_id[id(ids)] for ids in seen if id(ids) in by_id]
        if self.announce:
            staged = {n: [".".join(p) for p in ps] for n, ps in self.paths.items() if ps}
            log.info("sparse input staged one step ahead: %s", staged or "none")

    def start(self, batch: Any, standin: bool, draw: Callable[[], Drawn] | None = None) -> None:
        """Begin distributing and staging ``batch``'s lookups in the worker (after this step's forward).

        ``standin``: the batch is this rank's stand-in (its IDs are sent with 0 occurrences). ``draw``: makes the
        batch's draws (``StepDraws.ahead``), run first by the worker (with ``stage_draws``); ``wait`` returns them.
        """
        assert self._job is None, "a staged batch was neither used nor dropped"
        draw = draw if self.stage_draws else None
        paths = {name: [p for p in ps if draw is not None or p[0] != "draws"] for name, ps in (self.paths or {}).items()}
        if not any(paths.values()):
            return
        ready = None
        if self.stream is not None:  # the worker's stream waits for this step's forward, not for its backward
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._job = self._pool.submit(self._stage, batch, paths, draw, standin, ready)

    def _stage(self, batch: Any, paths: dict[str, list[Path]], draw: Callable[[], Drawn] | None, standin: bool,
               ready: torch.cuda.Event | None):  # fmt: skip
        """The worker: the draws, then every lookup's ID all-to-all (all in flight), then each owner's staging."""
        if self.stream is None:
            return self._run(batch, paths, draw, standin)
        torch.cuda.set_device(self.device)
        ready.synchronize()  # this worker's clock starts when forward(i) is done
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            out = self._run(batch, paths, draw, standin)
        self.stream.synchronize()
        return out

    def _run(self, batch: Any, paths: dict[str, list[Path]], draw: Callable[[], Drawn] | None, standin: bool):
        with torch.no_grad():
            t0 = time.perf_counter()
            drawn = draw() if draw is not None else None
            tensors = dict(named_tensors(batch, drawn[2] if drawn is not None else None))
            work = [(table, tensors[path]) for name, table in self.tables.items() for path in paths[name]]
            t1 = time.perf_counter()
            handles = [(table, ids, table.distribute(ids, group=self.group, standin=standin)) for table, ids in work]
            t2 = time.perf_counter()
            for table, _, handle in handles:
                table.stage(handle)
            t3 = time.perf_counter()
        return handles, drawn, {"draw_s": t1 - t0, "distribute_s": t2 - t1, "stage_s": t3 - t2}

    def wait(self) -> Drawn | None:
        """Main thread: finish the staging in flight and hand its handles to the tables (before the sparse
        optimizer touches them); return the batch's draws if the worker made them. Raises what the worker raised."""
        if self._job is None:
            return None
        t0 = time.perf_counter()
        job, self._job = self._job, None
        handles, drawn, times = job.result()
        if self.stream is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self.stream)
            made = [t for _, _, handle in handles for t in handle.tensors()]
            made += [t for _, t in named_tensors(drawn[2])] if drawn is not None else []
            for t in made:  # memory made on the worker's stream is used on the compute stream
                if t.is_cuda:
                    t.record_stream(main)
        for table, ids, handle in handles:
            table._ahead.append((ids, handle))
        self.stats.append({**times, "wait_s": time.perf_counter() - t0})
        return drawn

    def drop(self) -> None:
        """Finish any staging in flight and forget every handle no lookup used."""
        try:
            self.wait()
        finally:
            for table in self.tables.values():
                table.drop_ahead()

    def close(self) -> None:
        self.drop()
        self._pool.shutdown(wait=True)

