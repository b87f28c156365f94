"""Ray Data backend: the same read units, row checks and map/filter functions, run on a Ray cluster.

::

    read units (file, row group, rows)  ->  ray.data.from_items  ->  map_batches(read + rules + map fns)
        ->  streaming_split(world_size)  ->  one iterator per trainer rank  ->  batch + collate

Rows are read by recforge's own Parquet reader inside Ray tasks rather than
``ray.data.read_parquet``, so every row keeps its ``__row_id__`` and the exactly-once
state (``PipelineState``) works unchanged: each rank's iterator marks the rows it hands
out, and a restart plans only the unconsumed rows. ``streaming_split(equal=False)``: Ray's
``equal=True`` drops rows to equalise the ranks, which would break exactly-once.

Ray is optional: ``ray_unavailable()`` is the one capability check; ``pip install
'ray[data]'`` (pinned in the ``test`` extra) to use this module.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from recforge.data.bad_rows import BadRowReport, RowRules, check_rows
from recforge.data.collate import row_ids_of
from recforge.data.parquet_source import ParquetSource, ReadUnit, one_batch
from recforge.data.resume import PipelineState
from recforge.data.stages import Stage, apply_row_stages

_log = logging.getLogger(__name__)
_SOURCES: dict[tuple, ParquetSource] = {}  # per Ray worker process: opened files, by (paths, columns)


def ray_unavailable() -> str | None:
    """None when Ray Data can be used, else why not (for messages and test skips)."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (pip install 'ray[data]')"
    return None


def _require_ray():
    reason = ray_unavailable()
    if reason:
        raise RuntimeError(f"the Ray Data backend needs Ray: {reason}")
    import ray
    import ray.data

    if not ray.is_initialized():
        raise RuntimeError("call ray.init(...) (or connect to a cluster) before building a Ray pipeline")
    return ray


def _reader(paths: tuple[str, ...], columns: tuple[str, ...] | None, rules: RowRules | None,
            stages: tuple[tuple[str, Callable], ...]) -> Callable[[pa.Table], pa.Table]:  # fmt: skip
    row_stages = tuple(Stage(kind, fn) for kind, fn in stages)

    def read(units: pa.Table) -> pa.Table:
        key = (paths, columns)
        if key not in _SOURCES:
            _SOURCES[key] = ParquetSource(list(paths), list(columns) if columns is not None else None)
        source = _SOURCES[key]
        out, report = [], BadRowReport()
        for u in units.to_pylist():
            rb = source.read(ReadUnit(u["file"], u["row_group"], u["start"], u["stop"]))
            keep = np.unpackbits(np.frombuffer(u["keep"], np.uint8), count=u["stop"] - u["start"]).astype(bool)
            if not keep.all():
                rb = rb.filter(pa.array(keep))
            if rules is not None:
                rb = check_rows(rb, rules, report, source.paths)
            out.append(apply_row_stages(rb, row_stages))  # empty batches too: they keep the block's schema
        if report.total:  # Ray tasks cannot update the driver's report: log (Ray forwards it to the driver)
            _log.warning("skipped %d malformed rows %s, e.g. %s", report.total, dict(report.counts), report.examples[:3])
        return pa.Table.from_batches(out)

    return read


class RayPipeline:
    """A Ray Data dataset of sample rows with row identity, split into one iterator per rank.

    Args:
        paths: Parquet files or directories.
        columns: column projection.
        map_fns: ``("map", fn)`` / ``("filter", fn)`` stages: the same functions ``Pipeline`` takes.
        rules: malformed-row checks (policy ``raise`` raises inside the Ray task, with file and row;
            ``skip`` logs each task's counts and examples as a warning, forwarded to the driver by Ray).
        state: exactly-once state to resume from (only unconsumed rows are read).

    Example:
        >>> ray.init(num_cpus=8)
        >>> rp = RayPipeline("samples/", map_fns=[("map", truncate_lists(["item_ids"], 200))])
        >>> its = rp.rank_iterators(world_size=4, batch_size=256, collate=JaggedCollate({"item_ids": "item_ids"}))
        >>> for batch in its[rank]: ...              # in trainer process ``rank``
    """

    def __init__(self, paths, columns: list[str] | None = None, *, map_fns: list[tuple[str, Callable]] = (),
                 rules: RowRules | None = None, state: PipelineState | dict | None = None):  # fmt: skip
        ray = _require_ray()
        self.source = ParquetSource(paths, columns)
        if isinstance(state, dict):
            state = PipelineState.from_dict(state)
        self.state = state if state is not None else PipelineState.fresh(self.source)
        units, keep = self.state.plan(self.source)
        for kind, _ in map_fns:
            if kind not in ("map", "filter"):
                raise ValueError(f"Ray stages are ('map', fn) or ('filter', fn), got {kind!r}")
        items = [{"file": u.file_index, "row_group": u.row_group, "start": u.start, "stop": u.stop,
                  "keep": np.packbits(k).tobytes()} for u, k in zip(units, keep, strict=True)]  # fmt: skip
        read = _reader(tuple(self.source.paths), tuple(columns) if columns is not None else None, rules, tuple(map_fns))
        self.dataset = ray.data.from_items(items, override_num_blocks=max(len(items), 1)).map_batches(
            read, batch_format="pyarrow", batch_size=1
        )

    def rank_iterators(self, world_size: int, batch_size: int, collate: Callable[[pa.RecordBatch], Any] | None = None) -> list[Iterator]:
        """``world_size`` iterators (hand one to each trainer rank); each marks ``self.state`` as it yields."""
        splits = self.dataset.streaming_split(world_size, equal=False)
        return [self._iterate(split, batch_size, collate) for split in splits]

    def _iterate(self, split, batch_size: int, collate) -> Iterator:
        for table in split.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
            rb = one_batch(table)
            if rb.num_rows == 0:
                continue
            row_ids = row_ids_of(rb)
            out = collate(rb) if collate is not None else rb
            self.state.mark(row_ids)
            yield out
