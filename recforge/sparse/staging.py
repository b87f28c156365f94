"""Phase 2a of a sharded lookup, on the owner: staging its rows ahead, and reading them back at use.

``stage`` only reads the table, so it may run a step early (``recforge.train.pipeline_step``: on a
side stream, in a worker thread, with its own process group) while the previous step's optimizer is
still to update the rows: ``lookup`` reads the rows' values when it runs, after that update. After an
eviction between ``stage`` and ``lookup`` (``DynamicEmbedding.stage_epoch``), ``lookup`` checks which staged
rows still hold their IDs (``row_key``): if all do, it reads them as staged; otherwise, or for IDs that had no
row, it looks only those IDs up again and finishes the owner's part the ordinary way (admission, cache), so a
staged lookup equals one made at use. A rewrite of rows (``TieredStore.generation``) or a rebuilt table redoes it all.

Functions of a ``ShardedDynamicEmbedding`` (``table``), which calls them: ``stage`` for ``table.stage``,
``staged_rows`` for the owner's part of ``table.lookup`` in training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from recforge.sparse.ids import unique_keys
from recforge.sparse.lookup import GatherRows
from recforge.sparse.routing import DistributedIds, StagedRows
from recforge.sparse.storage import TieredStore, _positions

if TYPE_CHECKING:
    from recforge.sparse.sharded import ShardedDynamicEmbedding


def stage(table: ShardedDynamicEmbedding, handle: DistributedIds) -> None:
    """``table.stage``: dedup the received keys, find their rows, bring missing host-tier rows into the device
    cache and hold their slots until ``lookup`` (one host sync; changes no table state)."""
    if handle.ids is not None or handle.staged is not None:
        return
    handle.wait()
    shard, store = table.shard, table.shard.store
    with torch.no_grad():
        recv_keys, recv_tags, recv_occ, _ = handle.received.unbind(1)  # (R,) each
        r = recv_keys.numel()
        if handle.has_tags or r == 0:  # tagged (a collection's shared table): unique_keys, a sync of its own
            keys, tags, inverse, _ = unique_keys(recv_keys, recv_tags if handle.has_tags else None)
            tags = tags if handle.has_tags else None
            occ = torch.zeros(keys.numel(), dtype=torch.int64, device=keys.device).index_add_(0, inverse, recv_occ)
            found = distinct_rows = shard.index.lookup(keys, tags)  # (G,)
            distinct, absent = occ.new_full((1,), keys.numel()), (found < 0).sum().view(1)
            smallest_occ = occ.min().view(1) if occ.numel() else occ.new_ones(1)
        elif len(handle.recv_splits) == 1:  # one sender (world size 1): its keys are distinct and ascending already
            keys, tags, occ, inverse = recv_keys, None, recv_occ, None  # G = R: each received key is its own row
            found = distinct_rows = shard.index.lookup(keys, None)  # (G,)
            distinct, absent = occ.new_full((1,), r), (found < 0).sum().view(1)
            smallest_occ = occ.min().view(1)
        else:  # sort-based dedup: G is read at the one sync below, with everything else
            sorted_keys, order = torch.sort(recv_keys)
            start = torch.ones(r, dtype=torch.bool, device=recv_keys.device)
            start[1:] = sorted_keys[1:] != sorted_keys[:-1]
            group = torch.cumsum(start, 0) - 1  # (R,) distinct-key index of each sorted key
            occ = torch.zeros(r, dtype=torch.int64, device=recv_keys.device).index_add_(0, group, recv_occ[order])
            found = shard.index.lookup(sorted_keys, None)  # (R,) duplicates find the same row
            distinct_rows = torch.where(start, found, -1)  # (R,) each row once
            inverse = torch.empty_like(group).index_copy_(0, order, group)
            distinct, absent = group[-1:] + 1, ((found < 0) & start).sum().view(1)
            smallest_occ = torch.where(torch.arange(r, device=occ.device) < distinct, occ, 1 << 62).min().view(1)
        facts = torch.cat([distinct, absent, occ.sum().view(1), smallest_occ])
        if isinstance(store, TieredStore):  # the rows go to the cache on this (side) stream, in the same sync
            facts, cached, slots = store.stage_rows(distinct_rows, facts)  # slots (G,) or, sort-based, (R,)
        else:
            facts, cached, slots = facts.tolist(), True, found  # one tier: slots are rows
        g, n_absent, n_ids, smallest_occ = facts
        if not (handle.has_tags or r == 0 or inverse is None):
            keys = sorted_keys.new_empty(g).scatter_(0, group, sorted_keys)  # a group's writes are all equal
            found = found.new_empty(g).scatter_(0, group, found)
            occ, tags = occ[:g], None
            slots = store.row_to_slot[torch.where(found >= 0, found, shard.num_rows)] if isinstance(store, TieredStore) else found
    ready = n_absent == 0 and smallest_occ > 0 and cached
    handle.staged = StagedRows(keys, tags, occ, inverse, found, slots, ready, n_ids, (shard.stage_epoch, store.generation, shard.builds))


def staged_rows(table: ShardedDynamicEmbedding, handle: DistributedIds, admit: bool) -> Tensor:
    """The owner's rows (G, d) of a lookup in training, staged now if it was not: read as staged when they all
    exist, are cached and are still theirs (no host sync), else through the shard's full lookup."""
    table.stage(handle)
    staged, shard = handle.staged, table.shard
    train = table.training and torch.is_grad_enabled()
    now = (shard.stage_epoch, shard.store.generation, shard.builds)
    current, looked_up = staged.epoch == now, None
    if train and not (staged.ready and current) and staged.epoch[1:] == now[1:] and not table.standin_anywhere:
        # IDs evicted since the staging (stage_epoch), or without a row then: only those are looked up again
        rows, n_absent, lost = rows_now(table, staged, evicted=not current)
        current = lost == 0  # no staged row lost its ID: the staged rows and held slots are still theirs
        looked_up = (rows, n_absent)
    if staged.ready and current and train:
        return read_staged(table, staged)  # (G, d), no host sync
    if current:
        shard.store.unstage(staged.slots)
    else:  # the slots may hold other rows now: drop every hold (a step stages one batch)
        shard.store.release_staged()
    first = None
    if handle.parts is not None and len(handle.parts) > 1:  # each key's first part, over all senders
        first = handle.received[:, 3] if staged.inverse is None else torch.full_like(staged.keys, len(
            handle.parts)).scatter_reduce_(0, staged.inverse, handle.received[:, 3], "amin")  # fmt: skip
    return table._owner_rows(staged.keys, staged.tags, staged.occurrences, admit, first, looked_up)  # (G, d)


def read_staged(table: ShardedDynamicEmbedding, staged: StagedRows) -> Tensor:
    """The rows of a staged lookup whose rows all exist, are cached and are still theirs (G, d): no host sync."""
    shard = table.shard
    table.staged_reads += 1
    if staged.rows.numel():  # as DynamicEmbedding._rows, which counts only lookups with keys
        shard._stats["lookups"] += 1
        shard._stats["ids"] += staged.n_ids
    shard._touch(staged.rows, staged.occurrences)  # what the full lookup counts for the eviction policy
    shard.store.claim_staged(staged.slots)  # held until this step's optimizer update, as ensure(pin=True)
    return GatherRows.apply(shard._anchor, shard, staged.slots, staged.rows)


def rows_now(table: ShardedDynamicEmbedding, staged: StagedRows, evicted: bool) -> tuple[Tensor, int, int]:
    """(rows, how many are -1, how many staged rows lost their ID) of the staged keys as the index has them now.

    A staged row still holding its key (``row_key``) is its key's row (admission and eviction keep the index and
    ``row_key`` in step); only the keys whose row was evicted since (``evicted``: the table's ``stage_epoch``
    moved) or that had none when staged (admitted since, e.g. by another lookup) are looked up again.
    """
    shard, rows = table.shard, staged.rows
    lost = torch.zeros((), dtype=torch.int64, device=rows.device)
    if evicted:
        at = rows.clamp(min=0)
        kept = (rows >= 0) & (shard.row_key[at] == staged.keys)
        kept &= shard.row_tag[at] == (staged.tags if staged.tags is not None else 0)  # untagged = tag 0
        lost = ((rows >= 0) & ~kept).sum()
        rows = torch.where(kept, rows, -1)
    if not evicted:  # no staged row lost its key: one index lookup of every key and one host sync
        now = shard.index.lookup(staged.keys, staged.tags)
        n_redo, n_absent = torch.stack([(rows < 0).sum(), (now < 0).sum()]).tolist()
        table.relooked_up += n_redo
        return now, n_absent, 0
    n_lost, n_redo = torch.stack([lost, (rows < 0).sum()]).tolist()  # one host sync
    if n_redo == 0:
        return rows, 0, n_lost
    redo = _positions(rows < 0, n_redo)
    rows = rows.clone()
    rows[redo] = shard.index.lookup(staged.keys[redo], None if staged.tags is None else staged.tags[redo])
    table.relooked_up += n_redo
    return rows, int((rows < 0).sum()), n_lost
