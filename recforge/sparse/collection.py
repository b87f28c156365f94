"""``EmbeddingCollection``: named features over dynamic tables; equal tables merge into one physical table.

Features name a logical table; logical tables whose configs are equal but for the name
(``TableConfig.physical()``) share one ``DynamicEmbedding`` and are told apart by a tag,
the second key column of its hash table, so ID 7 of ``item`` and ID 7 of ``category``
are different rows. All features on one physical table are looked up in one call (one
unique, one gather, one update).

A feature's input is jagged: ``values`` holds every bag's IDs back to back, ``offsets``
where each bag starts::

    bags:     [7, 7, 9]   []    [12]
    values:   [7, 7, 9, 12]
    offsets:  [0, 3, 3, 4]          (B + 1,)

``pooling="none"`` returns one embedding per value (total, d) (sequence features);
``sum``/``mean`` return one per bag (B, d) (an empty bag pools to zeros).

Example:
    >>> coll = EmbeddingCollection(
    ...     [TableConfig("item", dim=32), TableConfig("category", dim=32)],
    ...     [FeatureConfig("history", "item"), FeatureConfig("cats", "category", pooling="mean")],
    ... )
    >>> out = coll({"history": JaggedIds(values, offsets), "cats": JaggedIds(cat_values, cat_offsets)})
    >>> out["history"].shape, out["cats"].shape       # (total, 32), (B, 32)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from recforge.jagged.index import sequence_ids
from recforge.sparse.ids import check_ids
from recforge.sparse.table import DynamicEmbedding
from recforge.sparse.table_config import TableConfig

POOLINGS = ("none", "sum", "mean")


@dataclass
class FeatureConfig:
    """A feature: which logical table it reads and how its bags are reduced."""

    name: str
    table: str
    pooling: str = "none"  # none (per-token embeddings) | sum | mean


@dataclass
class JaggedIds:
    """IDs of a batch of variable-length bags: ``values`` (total,) int64, ``offsets`` (B + 1,) int64."""

    values: Tensor
    offsets: Tensor

    def validate(self, name: str = "feature") -> None:
        """Raise ``ValueError`` if the layout is inconsistent."""
        check_ids(self.values, f"{name} values")
        o = self.offsets
        if o.dim() != 1 or o.numel() < 1 or o.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name}: offsets must be a 1-D integer tensor of B + 1 entries, got {tuple(o.shape)} {o.dtype}")
        if int(o[0]) != 0 or int(o[-1]) != self.values.numel() or bool((o[1:] < o[:-1]).any()):
            raise ValueError(f"{name}: offsets must start at 0, not decrease and end at len(values)={self.values.numel()}")

    @property
    def lengths(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]


class EmbeddingCollection(nn.Module):
    """Several features over dynamic tables, equal tables merged (see module docstring).

    Args:
        tables: logical tables (distinct names).
        features: features (distinct names), each naming one of ``tables``.
        device: compute device of every table.
    """

    def __init__(self, tables: list[TableConfig], features: list[FeatureConfig], device: torch.device | str = "cpu") -> None:
        super().__init__()
        by_name = {t.name: t for t in tables}
        if len(by_name) != len(tables):
            raise ValueError("EmbeddingCollection: table names must be distinct")
        for f in features:
            if f.table not in by_name:
                raise ValueError(f"feature {f.name!r} reads table {f.table!r}, which is not among {sorted(by_name)}")
            if f.pooling not in POOLINGS:
                raise ValueError(f"feature {f.name!r}: pooling={f.pooling!r}, expected one of {POOLINGS}")
        groups: dict[tuple, list[TableConfig]] = {}
        for t in tables:
            groups.setdefault(t.physical(), []).append(t)
        self.tables = nn.ModuleDict()
        self.route: dict[str, tuple[str, int]] = {}  # logical table -> (physical table, tag)
        for members in groups.values():
            physical = "+".join(t.name for t in members)
            self.tables[physical] = DynamicEmbedding(dataclasses.replace(members[0], name=physical), device)
            for tag, t in enumerate(members):
                self.route[t.name] = (physical, tag)
        self.features = {f.name: f for f in features}

    def forward(self, features: dict[str, JaggedIds]) -> dict[str, Tensor]:
        """Embeddings per feature: (total, d) for ``pooling="none"``, (B, d) for sum/mean.

        ``features`` may also be a TorchRec ``KeyedJaggedTensor`` (see ``recforge.sparse.interop``).
        """
        if not isinstance(features, dict):
            from recforge.sparse.interop import from_keyed_jagged

            features = from_keyed_jagged(features)
        unknown = sorted(set(features) - set(self.features))
        if unknown:
            raise ValueError(f"unknown features {unknown}; this collection has {sorted(self.features)}")
        per_table: dict[str, list[str]] = {}
        for name in features:
            per_table.setdefault(self.route[self.features[name].table][0], []).append(name)
        out = {}
        for physical, names in per_table.items():
            values = [features[n].values for n in names]
            tags = [torch.full_like(v, self.route[self.features[n].table][1], dtype=torch.int64) for n, v in zip(names, values, strict=True)]
            emb = self.tables[physical](torch.cat(values), torch.cat(tags))  # (sum of totals, d)
            for name, part in zip(names, emb.split([v.numel() for v in values]), strict=True):
                out[name] = self._pool(part, features[name], self.features[name].pooling)
        return out

    @staticmethod
    def _pool(emb: Tensor, ids: JaggedIds, pooling: str) -> Tensor:
        if pooling == "none":
            return emb  # (total, d)
        lengths = ids.lengths.to(emb.device)
        bag = sequence_ids(ids.offsets.to(emb.device), emb.shape[0])  # (total,), no host sync
        pooled = torch.zeros(lengths.numel(), emb.shape[1], device=emb.device, dtype=emb.dtype).index_add(0, bag, emb)
        if pooling == "mean":
            pooled = pooled / lengths.clamp(min=1)[:, None].to(emb.dtype)
        return pooled  # (B, d)

    def table_of(self, logical: str) -> tuple[DynamicEmbedding, int]:
        """The physical table and tag of logical table ``logical``."""
        physical, tag = self.route[logical]
        return self.tables[physical], tag
