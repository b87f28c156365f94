"""A sharding planner: which dynamic tables are split row-wise over all ranks, which live whole on one rank.

Each table's size is estimated from its config: ``rows x bytes per row``, rows = ``max_rows``
(or ``capacity`` when unbounded), a row = the weight (``dim`` float32), its optimizer state
(``optim.state_spec``), its policy counters and its index entry. Then:

- a table of at least ``row_wise_min_bytes`` (default 64 MiB), or more than an even share of all
  tables over the ranks, is sharded **row-wise** (every rank owns the IDs that hash to it);
- the others are placed **table-wise**, largest first, each on the rank with the fewest bytes
  so far (counting every rank's share of the row-wise tables).

Both kinds are looked up through the same all-to-all (``ShardedDynamicEmbedding``; a table-wise
table has ``owner_rank`` set). The plan prints as a table and round-trips through JSON.

Example:
    >>> plan = plan_sharding([TableConfig("item", dim=128, max_rows=50_000_000), TableConfig("genre", dim=16)], world_size=4)
    >>> print(plan)          # item row_wise over ranks 0-3, genre table_wise on rank 0
    >>> plan.save("ckpt/sharding_plan.json"); ShardingPlan.load("ckpt/sharding_plan.json") == plan
    True
    >>> tables = {name: plan.build(cfg, device) for name, cfg in ...}   # ShardedDynamicEmbedding per table
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from recforge.io import atomic_write_json
from recforge.sparse.optim import state_spec
from recforge.sparse.table_config import TableConfig

KINDS = ("row_wise", "table_wise")
_COUNTER_BYTES = 8 + 8 + 8 + 4 + 4  # count, last_step, last_time, show, click (policies.RowCounters)
_INDEX_BYTES = 8 + 8 + 8 + 8  # row_key, row_tag, free stack, index entry


def row_bytes(cfg: TableConfig) -> int:
    """Bytes one row of ``cfg`` takes: weight, optimizer state, counters, index."""
    state = 0
    for shape, dtype in state_spec(cfg.optimizer.kind, cfg.dim).values():
        numel = 1
        for s in shape:
            numel *= s
        state += numel * torch.empty(0, dtype=dtype).element_size()
    return cfg.dim * 4 + state + _COUNTER_BYTES + _INDEX_BYTES


@dataclass
class TablePlacement:
    """Where one table lives: ``row_wise`` over ``ranks`` (all of them) or ``table_wise`` on ``ranks[0]``."""

    kind: str
    ranks: list[int]
    rows: int  # the rows the estimate assumed (max_rows, or capacity when unbounded)
    bytes: int  # estimated bytes of the whole table

    @property
    def owner_rank(self) -> int | None:
        """The one rank of a table-wise table; ``None`` for row-wise."""
        return self.ranks[0] if self.kind == "table_wise" else None


@dataclass
class ShardingPlan:
    """Placement of every dynamic table over ``world_size`` ranks (see module docstring)."""

    world_size: int
    tables: dict[str, TablePlacement] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"sharding plan over {self.world_size} rank(s)", f"{'table':<24} {'kind':<10} {'ranks':<12} {'rows':>14} {'MiB':>10}"]
        for name, p in self.tables.items():
            ranks = f"0-{self.world_size - 1}" if p.kind == "row_wise" and self.world_size > 1 else ",".join(map(str, p.ranks))
            lines.append(f"{name:<24} {p.kind:<10} {ranks:<12} {p.rows:>14,} {p.bytes / 2**20:>10.1f}")
        per_rank = self.bytes_per_rank()
        lines.append("bytes per rank (MiB): " + " ".join(f"{b / 2**20:.1f}" for b in per_rank))
        return "\n".join(lines)

    def bytes_per_rank(self) -> list[float]:
        """Estimated bytes each rank holds."""
        out = [0.0] * self.world_size
        for p in self.tables.values():
            for r in p.ranks:
                out[r] += p.bytes / len(p.ranks)
        return out

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "tables": {k: asdict(v) for k, v in self.tables.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> ShardingPlan:
        """Rebuild (and check) a plan from ``to_dict`` output."""
        plan = cls(int(data["world_size"]), {k: TablePlacement(**v) for k, v in data["tables"].items()})
        for name, p in plan.tables.items():
            if p.kind not in KINDS or not p.ranks or any(not 0 <= r < plan.world_size for r in p.ranks):
                raise ValueError(f"sharding plan: table {name!r} has kind {p.kind!r} on ranks {p.ranks}; expected one of "
                                 f"{KINDS} on ranks of 0..{plan.world_size - 1}")  # fmt: skip
        return plan

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (atomically)."""
        atomic_write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> ShardingPlan:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def build(self, cfg: TableConfig, device: torch.device | str = "cpu", group=None, cls: type | None = None) -> nn.Module:
        """The ``ShardedDynamicEmbedding`` (or its subclass ``cls``) of table ``cfg.name`` as this plan places it."""
        from recforge.sparse.sharded import ShardedDynamicEmbedding

        if cfg.name not in self.tables:
            raise ValueError(f"sharding plan has no table {cfg.name!r} (it plans {sorted(self.tables)}); re-plan with this table")
        return (cls or ShardedDynamicEmbedding)(cfg, device, group, owner_rank=self.tables[cfg.name].owner_rank)


def plan_sharding(tables: list[TableConfig], world_size: int, row_wise_min_bytes: int = 64 << 20) -> ShardingPlan:
    """Place ``tables`` over ``world_size`` ranks (see module docstring)."""
    if world_size < 1:
        raise ValueError(f"plan_sharding: world_size={world_size}, must be >= 1")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"plan_sharding: table names must be distinct, got {names}")
    sizes = {t.name: (t.max_rows or t.capacity, (t.max_rows or t.capacity) * row_bytes(t)) for t in tables}
    even_share = sum(b for _, b in sizes.values()) / world_size
    plan = ShardingPlan(world_size)
    load = [0.0] * world_size
    big = [n for n, (_, b) in sizes.items() if b >= row_wise_min_bytes or (world_size > 1 and b > even_share)]
    for name in big:
        rows, nbytes = sizes[name]
        plan.tables[name] = TablePlacement("row_wise", list(range(world_size)), rows, nbytes)
        load = [x + nbytes / world_size for x in load]
    for name in sorted(set(sizes) - set(big), key=lambda n: (-sizes[n][1], n)):
        rows, nbytes = sizes[name]
        rank = min(range(world_size), key=lambda r: (load[r], r))
        plan.tables[name] = TablePlacement("table_wise", [rank], rows, nbytes)
        load[rank] += nbytes
    plan.tables = {n: plan.tables[n] for n in names}  # the callers' order
    return plan


def shard_collection(collection: nn.Module, plan: ShardingPlan | None = None, group=None, **plan_kw) -> ShardingPlan:
    """Replace each physical table of an ``EmbeddingCollection`` by its ``ShardedDynamicEmbedding`` (in place).

    Call right after building the collection (the tables must still be empty). ``plan``: made
    by ``plan_sharding`` over the collection's physical tables when not given. Returns the plan.
    """
    import torch.distributed as dist

    configs = [t.cfg for t in collection.tables.values()]
    if any(t.num_live for t in collection.tables.values()):
        raise ValueError("shard_collection: the collection's tables already hold rows; shard it right after building "
                         "it and load rows with load_sharded_checkpoint")  # fmt: skip
    if plan is None:
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        plan = plan_sharding(configs, world, **plan_kw)
    for name, table in list(collection.tables.items()):
        collection.tables[name] = plan.build(table.cfg, table.device, group)
    return plan
