"""Where a sharded table's rows live and how a lookup's IDs and rows move between ranks: the owner function,
a shard's config, the rows' all-to-all (with its reverse as backward), and the handles of a lookup in flight
(``DistributedIds``: distributed, waiting for ``lookup``; ``StagedRows``: the owner's part, staged).
``recforge.sparse.sharded`` (``ShardedDynamicEmbedding``) runs the lookups."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from recforge.sparse.hash_table import mix
from recforge.sparse.table_config import TableConfig

_RANK_SEED = 0x9E3779B97F4A7C15 & (2**62 - 1)  # spreads the row-initialisation seeds of shards > 0


def owner_of(keys: Tensor, tags: Tensor, world_size: int) -> Tensor:
    """Owning rank of each (key, tag): ``mix(mix(key, tag), 0) mod world_size`` (int64, in [0, W)). Never change it:
    sharded checkpoints and running jobs rely on it."""
    return torch.remainder(mix(mix(keys, tags), torch.zeros_like(keys)), world_size)


def shard_config(cfg: TableConfig, world_size: int, owns_rows: bool = True) -> TableConfig:
    """The config of one rank's shard: the row budgets (capacity, max_rows) divided by ``world_size``.

    ``cache_rows`` is a per-device budget and stays as given. A rank that owns no rows of a
    table-wise table (``owns_rows=False``) gets a one-row, one-tier placeholder.
    """
    if not owns_rows:
        return dataclasses.replace(cfg, capacity=1, cache_rows=0)
    return dataclasses.replace(cfg, capacity=math.ceil(cfg.capacity / world_size),
                               max_rows=math.ceil(cfg.max_rows / world_size))  # fmt: skip


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows (S, d) -> (sum(out_splits), d); backward: the reverse all-to-all.

    (``torch.distributed.nn.functional.all_to_all_single`` does the same but is deprecated in torch 2.13.)
    """

    @staticmethod
    def forward(ctx, rows: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = grad.new_empty(sum(ctx.in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


@dataclass
class StagedRows:
    """The owner's part of a lookup, prepared by ``ShardedDynamicEmbedding.stage`` without changing the table."""

    keys: Tensor  # (G,) distinct received keys (ascending without tags: torch.unique's order)
    tags: Tensor | None  # (G,) their tags (tagged lookups)
    occurrences: Tensor  # (G,) summed over senders
    inverse: Tensor | None  # (R,) each received key's index in ``keys`` (None: one sender, ``keys`` are the received ones)
    rows: Tensor  # (G,) each key's row when staged, -1 where it had none
    slots: Tensor  # (G,) the rows' cache slots (held until the lookup), -1 where not cached
    ready: bool  # every key had a row, was asked for by a real batch and is cached: the lookup needs no sync
    n_ids: int  # occurrences in all (the lookup's ``ids`` count)
    epoch: tuple[int, int, int]  # (table.stage_epoch, store.generation, table.builds) when staged: evictions since
    # (stage_epoch) may have taken ``rows``' IDs, a rewrite (generation) moved ``slots``, a rebuild (builds) made both stale


@dataclass
class DistributedIds:
    """The first phase of a sharded lookup (``ShardedDynamicEmbedding.distribute``), waiting for ``lookup``.

    ``local`` handles (no process group) carry only ``ids``/``tags``; the others carry the
    local dedup, the owner order and the in-flight all-to-all of unique keys.
    """

    shape: torch.Size  # the ids' shape (a combined lookup: (N,), all parts' ids flat, back to back)
    parts: list[torch.Size] | None = None  # a combined lookup: each part's shape
    bounds: list[int] | None = None  # ... and where each part starts in the flat ids (then N)
    ids: Tensor | None = None  # local: the ids themselves
    tags: Tensor | None = None  # local: their tags (or None)
    has_tags: bool = False
    position: Tensor | None = None  # (N,) each id's row in the owner-sorted unique keys
    send_splits: list[int] | None = None  # unique keys sent to each rank
    recv_splits: list[int] | None = None  # keys received from each rank
    received: Tensor | None = None  # (R, 4) int64: key, tag, occurrences, first part (valid after ``wait``)
    work: dist.Work | None = None
    staged: StagedRows | None = None  # the owner's part, once ``stage`` ran
    rows: Tensor | None = None  # (U, d) this rank's distinct keys' embeddings, once the first part is read (autograd)

    def tensors(self) -> list[Tensor]:
        """The device tensors this handle holds (a pipeline hands them from a side stream to the compute stream)."""
        held = [self.ids, self.tags, self.position, self.received]
        if self.staged is not None:
            held += [self.staged.keys, self.staged.tags, self.staged.occurrences, self.staged.inverse, self.staged.rows,
                     self.staged.slots]  # fmt: skip
        return [t for t in held if t is not None]

    def wait(self) -> None:
        """Block until the key all-to-all has landed (on CUDA: order the current stream after it)."""
        if self.work is not None:
            self.work.wait()
            self.work = None


__all__ = ["DistributedIds", "StagedRows", "owner_of", "shard_config"]
