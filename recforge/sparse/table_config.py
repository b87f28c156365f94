"""``TableConfig``: what a dynamic table is (width, row budget, what unknown IDs read, policies, optimizer, tiers),
validated with errors that name the field. The table itself is ``recforge.sparse.table.DynamicEmbedding``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from recforge.sparse.optim import SparseOptimConfig
from recforge.sparse.policies import AdmissionConfig, EvictionConfig
from recforge.sparse.sorted_index import index_kind

DEFAULTS = ("zeros", "fixed", "learned")


@dataclass
class TableConfig:
    """A dynamic table: width, row budget, policies, optimizer, storage tiers."""

    name: str = "table"
    dim: int = 64
    capacity: int = 1024  # rows allocated at start; the table doubles when full (up to max_rows)
    max_rows: int = 0  # row limit (0: grow without limit); at the limit, eviction (or refusal) frees rows
    init_std: float = 0.01  # new rows ~ N(0, init_std)
    default: str = "zeros"  # what IDs without a row read: zeros | fixed (a random row) | learned (an nn.Parameter)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    optimizer: SparseOptimConfig = field(default_factory=SparseOptimConfig)
    cache_rows: int = 0  # > 0: full table in host memory, this many hot rows on the compute device
    seed: int = 0  # row initialisation and probability admission
    index: str = "auto"  # ID -> row index: auto (sorted array; see sorted_index.py) | sorted | hash

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field and how to fix it."""
        if self.dim <= 0 or self.capacity <= 0:
            raise ValueError(f"table {self.name!r}: dim and capacity must be > 0, got {self.dim}, {self.capacity}")
        if self.max_rows and self.max_rows < self.capacity:
            raise ValueError(f"table {self.name!r}: max_rows {self.max_rows} < capacity {self.capacity}; raise max_rows or use 0")
        if self.default not in DEFAULTS:
            raise ValueError(f"table {self.name!r}: default={self.default!r}, expected one of {DEFAULTS}")
        if self.cache_rows < 0:
            raise ValueError(f"table {self.name!r}: cache_rows must be >= 0")
        index_kind("cpu", self.index)
        self.admission.validate()
        self.eviction.validate()
        self.optimizer.validate()

    def physical(self) -> tuple:
        """Everything but the name: tables equal in this share one physical table in a collection."""
        return tuple(repr(v) for k, v in dataclasses.asdict(self).items() if k != "name")


__all__ = ["DEFAULTS", "TableConfig"]
