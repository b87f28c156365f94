"""Input distribution one step ahead: step i+1's ID all-to-all runs while step i computes its backward.

The stages of a pipelined step (``dist.pipeline=true``)::

    thread:  fetch(i+1) -> build(i+1) -> H2D(i+1) on a side stream         (recforge.train.inputs)
    main:    forward(i) -> distribute(i+1) [ID all-to-all, async] -> backward(i) -> optimizers(i)
             forward(i+1): lookup(i+1) uses the IDs already at their owners -> ...

The tables are ``AheadTable``s (a ``ShardedDynamicEmbedding`` that accepts a distribution
started ahead). Which batch features feed which table is learned on the first step: every ID
tensor a table's ``forward`` receives that *is* a tensor of the batch's ``features`` (the model
passes it unchanged, e.g. ``batch.item_ids``) is distributed ahead from then on; lookups of IDs
made inside the model (targets, sampled negatives) take the usual path. Every rank starts the
same distributions in the same order (the stand-in batch of a rank without data included), so the
collectives match; unconsumed ones are dropped after the step's first forward.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor

from recforge.sparse.sharded import DistributedIds, ShardedDynamicEmbedding

log = logging.getLogger(__name__)


class AheadTable(ShardedDynamicEmbedding):
    """``ShardedDynamicEmbedding`` whose ``forward`` takes a distribution started by ``start`` for the same IDs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ahead: list[tuple[Tensor, DistributedIds]] = []
        self._seen: list[Tensor] | None = None  # IDs received while the feature mapping is learned
        self.lookups_ahead = 0  # lookups that used a distribution started ahead (for logs and tests)

    def start(self, ids: Tensor) -> None:
        """Begin the ID all-to-all of an upcoming ``forward(ids)`` (a collective: every rank, same order)."""
        self._ahead.append((ids, self.distribute(ids)))

    def drop_ahead(self) -> None:
        """Finish and forget distributions no lookup used."""
        for _, handle in self._ahead:
            handle.wait()
        self._ahead.clear()

    def forward(self, ids: Tensor, tags: Tensor | None = None, admit: bool = True) -> Tensor:
        if self._seen is not None:
            self._seen.append(ids)
        if tags is None and self._ahead and self._ahead[0][0] is ids:
            self.lookups_ahead += 1
            return self.lookup(self._ahead.pop(0)[1], admit)
        return super().forward(ids, tags, admit)


class LookAhead:
    """Learns which batch features feed which ``AheadTable`` and starts their distribution for the next batch."""

    def __init__(self, tables: dict[str, AheadTable], announce: bool) -> None:
        self.tables = tables
        self.features: dict[str, list[str]] | None = None  # table name -> feature keys, in lookup order
        self.announce = announce

    def learning(self) -> bool:
        return self.features is None

    def begin(self) -> None:
        for table in self.tables.values():
            table._seen = []

    def end(self, batch: Any) -> None:
        """After the first forward: keep the lookups whose IDs were the batch's own feature tensors."""
        self.features = {}
        for name, table in self.tables.items():
            seen, table._seen = table._seen or [], None
            keys = [next((k for k, v in batch.features.items() if v is ids), None) for ids in seen]
            self.features[name] = [k for k in keys if k is not None]
        if self.announce:
            log.info("input distribution one step ahead: %s", {n: k for n, k in self.features.items() if k} or "none")

    def start(self, batch: Any) -> None:
        for name, keys in (self.features or {}).items():
            for key in keys:
                self.tables[name].start(batch.features[key])

    def drop(self) -> None:
        for table in self.tables.values():
            table.drop_ahead()
