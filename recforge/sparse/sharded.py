"""``ShardedDynamicEmbedding``: one ``DynamicEmbedding`` shard per rank, rows owned by a hash of the ID.

A dynamic table over ``W`` ranks (``torch.distributed``: gloo on CPU, NCCL on GPU). The row of
(id, tag) lives on rank ``owner = f(f(id + tag * 0x9E3779B97F4A7C15)) mod W`` with ``f`` the
splitmix64 finaliser (``owner_of``: ``hash_table.mix`` applied twice, so the owner is independent
of the shard's own hash-table slot, which uses the low bits of one ``mix``; a fixed function,
recorded in sharded checkpoints). A table placed whole on one rank (table-wise, see
``planner.py``) has ``owner = owner_rank`` for every ID and goes through the same path.

One lookup on rank r, ids of any shape (N in all)::

    distribute  ids (N,) --sort, local dedup--> keys (U,) with occurrences, each id's position (N,)
                keys --by owner--> split sizes --all_to_all--> receive sizes (the sender's one host sync)
                (key, tag, occurrences, first part) (U, 4) --all_to_all_single (async)--> received (R, 4)
    stage       received --dedup across senders--> global keys (G,), occurrences summed
                --index lookup (read only)--> rows (G,) --host tier: missing rows -> device cache, slots
                held ("staged")--> (the owner's one host sync; no table state changes)
    lookup      staged rows, all found: count the lookup, gather the cached rows (G, d) (no sync)
                otherwise: the shard's full lookup (admission / eviction / tiers, as DynamicEmbedding)
                --per sender (R, d)--all_to_all_single (autograd)--> (U, d) --inverse--> ids.shape + (d,)

``stage`` only reads the table, so it may run a step early (``recforge.train.pipeline_step``: on a
side stream, in a worker thread, with its own process group) while the previous step's optimizer is
still to update the rows: ``lookup`` reads the rows' values when it runs, after that update. After an
eviction between ``stage`` and ``lookup`` (``DynamicEmbedding.stage_epoch``), ``lookup`` checks which staged
rows still hold their IDs (``row_key``): if all do, it reads them as staged; otherwise, or for IDs that had no
row, it looks only those IDs up again and finishes the owner's part the ordinary way (admission, cache), so a
staged lookup equals one made at use. A rewrite of rows (``TieredStore.generation``) or a rebuilt table redoes it all.
    backward    (N, d) -> summed per local key (U, d) -all_to_all-> (R, d) -summed per row-> (G, d)
                -> the owner shard's pending row gradients; ``apply_gradients`` updates only there.

Admission counts an ID's occurrences over the whole global batch (each sender sends its local
count), so count admission and the updated rows equal those of one process on the concatenated
batches.

A combined lookup (``distribute([ids_a, ids_b, ...])``, TorchRec's one lookup per table of all its
features) moves the union of several lookups' IDs once: one dedup, one ID all-to-all, one staging,
one owner lookup, one embedding all-to-all; ``lookup(handle, part=k)`` reads part k's rows through
its slice of the inverse index. Semantics: it is one lookup of the parts' concatenated IDs (each
distinct ID found, counted and touched once, its occurrences summed over the parts; one row
gradient per ID, the parts' gradients summed, sent to the owner once), except that new IDs are
admitted part by part, in the order of the first part that asks for them (``first`` column), so
rows, their initial values and admission draws are those of separate lookups whenever no ID
is in two parts (see ``DynamicEmbedding._admit_in_order`` for what differs otherwise).

Gradient accumulation: several forward/backward passes before one ``apply_gradients`` sum their
row gradients on the owner (``DynamicEmbedding`` keeps one pending list per step).

Every rank must call ``forward`` (or ``distribute`` + ``lookup``), ``backward`` and
``apply_gradients`` the same number of times in the same order: they are collectives. A rank with
nothing to look up that must still join (a stand-in batch, see ``standin_lookups``) sends its IDs
with 0 occurrences: an owner neither admits, touches nor updates a row whose occurrences sum to 0.
Without an initialised process group the table is a plain ``DynamicEmbedding`` (the shard is
the whole table and ``forward`` is exactly its forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from recforge.sparse.ids import check_ids, raise_negative, unique_keys
from recforge.sparse.storage import TieredStore, _positions
from recforge.sparse.routing import _RANK_SEED, DistributedIds, StagedRows, _AllToAll, owner_of, shard_config
from recforge.sparse.lookup import GatherRows
from recforge.sparse.table import DynamicEmbedding
from recforge.sparse.table_config import TableConfig

class ShardedDynamicEmbedding(nn.Module):
    """A dynamic table sharded row-wise (or placed whole on one rank) over a process group.

    A drop-in for ``DynamicEmbedding``: same ``forward(ids, tags, admit)``, ``apply_gradients``,
    ``zero_grad_rows``, ``prefetch``, ``stats`` (of this rank's shard); ``SparseOptimizer`` finds
    and steps the shard inside it.

    Args:
        cfg: the whole table's configuration (the shard gets ``shard_config(cfg, W)``).
        device: this rank's compute device (its GPU under NCCL).
        group: the process group; ``None``: the default group if one is initialised, else none
            (world size 1, no collectives).
        owner_rank: ``None``: row-wise by ID hash; a rank: the whole table lives on that rank (table-wise).

    Example:
        >>> dist.init_process_group("nccl")                           # torchrun sets rank/world size
        >>> table = ShardedDynamicEmbedding(TableConfig("item", dim=64, capacity=1 << 20), device="cuda")
        >>> handle = table.distribute(item_ids)                      # dedup + ID all-to-all (async)
        >>> emb = table.lookup(handle)                               # lookup + embedding all-to-all
        >>> loss_fn(emb).backward(); SparseOptimizer([table]).step()  # each row updated on its owner
    """

    def __init__(self, cfg: TableConfig, device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None,
                 owner_rank: int | None = None) -> None:  # fmt: skip
        super().__init__()
        cfg.validate()
        self.collective = dist.is_available() and dist.is_initialized()
        self.group = (group or dist.group.WORLD) if self.collective else None
        self.rank = dist.get_rank(self.group) if self.collective else 0
        self.world_size = dist.get_world_size(self.group) if self.collective else 1
        if owner_rank is not None and not 0 <= owner_rank < self.world_size:
            raise ValueError(f"table {cfg.name!r}: owner_rank={owner_rank} is not a rank of this group (world size {self.world_size})")
        if cfg.default == "learned" and self.world_size > 1:
            raise ValueError(f"table {cfg.name!r}: default='learned' is not supported sharded (each shard would learn its "
                             "own default row); use default='zeros' or 'fixed'")  # fmt: skip
        self.cfg, self.owner_rank, self.dim = cfg, owner_rank, cfg.dim
        owns = owner_rank is None or owner_rank == self.rank
        self.shard = DynamicEmbedding(shard_config(cfg, 1 if owner_rank is not None else self.world_size, owns), device)
        if self.rank and owner_rank is None:  # shard 0 draws exactly as the unsharded table; the others their own stream
            self.shard.generator.manual_seed((cfg.seed + self.rank * _RANK_SEED) & (2**63 - 1))
        self.standin_here = False  # this rank's lookups are a stand-in: their IDs are sent with 0 occurrences
        self.standin_anywhere = False  # some rank's are: owners look up 0-occurrence IDs read-only
        self.staged_reads = 0  # lookups that read staged rows with no host sync (for logs, benchmarks and tests)
        self.relooked_up = 0  # staged keys looked up again at use (evicted since, or without a row when staged)

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def stats(self) -> dict[str, int]:
        """This rank's shard's event counts (admitted, evicted, updated_rows, ...)."""
        return self.shard.stats

    def global_stats(self) -> dict[str, int]:
        """Event counts summed over every rank's shard (a collective)."""
        stats = self.shard.stats
        if not self.collective:
            return dict(stats)
        totals = torch.tensor(list(stats.values()), dtype=torch.int64, device=self.device)
        dist.all_reduce(totals, group=self.group)
        return dict(zip(stats, totals.tolist(), strict=True))

    @property
    def num_live(self) -> int:
        """Rows that hold an ID on this rank's shard."""
        return self.shard.num_live

    @property
    def step(self) -> int:
        return self.shard.step

    def owners(self, keys: Tensor, tags: Tensor) -> Tensor:
        """Owning rank of each (key, tag) in this table's layout."""
        if self.owner_rank is not None:
            return torch.full_like(keys, self.owner_rank)
        return owner_of(keys, tags, self.world_size)

    # ------------------------------------------------------------------------------ lookup

    def forward(self, ids: Tensor, tags: Tensor | None = None, admit: bool = True) -> Tensor:
        """Embeddings of ``ids`` (any shape) -> ``ids.shape + (dim,)``, as ``DynamicEmbedding.forward``.

        A collective: every rank calls it (with its own ids, possibly none), all with ``tags`` or all without.
        """
        return self.lookup(self.distribute(ids, tags), admit)

    def distribute(self, ids: Tensor | Sequence[Tensor], tags: Tensor | None = None, *, group: dist.ProcessGroup | None = None,
                   standin: bool | None = None) -> DistributedIds:  # fmt: skip
        """Phase 1: local dedup and the all-to-all of unique IDs to their owners (started, not awaited).

        ``ids``: one tensor, or a list of them (a combined lookup, untagged: read each with ``lookup(handle,
        part=k)``; see the module docstring). ``group``: the process group of the ID all-to-all (default: the
        table's; a pipeline passes its own, so the exchange never queues behind the dense all-reduce). ``standin``:
        this rank's IDs are a stand-in (sent with 0 occurrences; default: ``standin_lookups``' setting). One host
        synchronisation.
        """
        parts = bounds = None
        if isinstance(ids, (list, tuple)):
            if tags is not None:
                raise ValueError("ShardedDynamicEmbedding.distribute: a combined lookup (a list of id tensors) takes no tags")
            parts = [check_ids(t, negatives=False) for t in ids]
            flat = torch.cat([t.reshape(-1).to(self.device) for t in parts]) if parts else torch.zeros(0, dtype=torch.int64,
                                                                                                      device=self.device)  # fmt: skip
            bounds = [0]
            for t in parts:
                bounds.append(bounds[-1] + t.numel())
            shape, parts = flat.shape, [t.shape for t in parts]
        else:
            ids = check_ids(ids, negatives=False)  # negative IDs are caught at the split sizes' host sync
            flat, shape = ids.reshape(-1).to(self.device), ids.shape
        flat_tags = None if tags is None else tags.reshape(-1).to(self.device, torch.int64)
        if not self.collective:
            if parts is not None:
                raise ValueError("ShardedDynamicEmbedding.distribute: a combined lookup needs a process group (without one the "
                                 "table is a plain DynamicEmbedding: look each tensor up with forward)")  # fmt: skip
            return DistributedIds(shape, ids=flat, tags=flat_tags, has_tags=tags is not None)
        group = group or self.group
        standin = self.standin_here if standin is None else standin
        if flat_tags is None:
            send, position, owner_counts, smallest = self._sorted_send(flat, bounds)  # send: (u) -> (u, 4)
        else:
            keys, key_tags, inverse, occurrences = unique_keys(flat, flat_tags)
            owner = self.owners(keys, key_tags)  # (U,)
            order = torch.argsort(owner, stable=True)
            rows = torch.stack([keys[order], key_tags[order], occurrences[order], torch.zeros_like(keys)], 1)  # (U, 4)
            send = lambda u: rows  # noqa: E731
            position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))[inverse]
            owner_counts = torch.bincount(owner, minlength=self.world_size)
            smallest = keys.min().view(1) if keys.numel() else keys.new_zeros(1)
        send_splits, recv_splits, smallest = self._exchange_splits(owner_counts, smallest, group)
        if smallest < 0:
            raise_negative(flat)
        send = send(sum(send_splits))  # the distinct keys' rows, by owner
        if standin:
            send[:, 2] = 0  # (send is this call's own tensor)
        received = send.new_empty(sum(recv_splits), 4)
        work = dist.all_to_all_single(received, send, recv_splits, send_splits, group=group, async_op=True)
        return DistributedIds(shape, parts, bounds, has_tags=tags is not None, position=position, send_splits=send_splits,
                              recv_splits=recv_splits, received=received, work=work)  # fmt: skip

    def _sorted_send(self, flat: Tensor, bounds: list[int] | None = None) -> tuple[Callable[[int], Tensor], Tensor, Tensor, Tensor]:
        """Local dedup without a host sync: (``send(U)``: the (U, 4) rows (key, 0, occurrences, first part) of the U
        distinct keys ordered by owner then key, each id's index among them (N,), distinct keys per owner (W,),
        smallest id (1,)). ``bounds``: where each part of a combined lookup starts in ``flat``, then N (None or one
        part: all part 0). The rows are gathered only once U is known (the split sizes' sync): U, not N, of them.

        A stable sort puts each key's first occurrence first among its copies: its part is the lowest the key
        occurs in (parts are back to back in ``flat``), read for the U distinct keys only.
        """
        n, w = flat.numel(), self.world_size
        if n == 0:
            empty = flat.new_zeros(0)
            return lambda u: flat.new_zeros(0, 4), empty, flat.new_zeros(w), flat.new_zeros(1)
        several = bounds is not None and len(bounds) > 2
        sorted_ids, sort_order = torch.sort(flat, stable=several)
        start = torch.ones(n, dtype=torch.bool, device=flat.device)
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=start[1:])
        group = torch.cumsum(start, 0)
        group -= 1  # (N,) distinct-key index of each sorted id
        occurrences = torch.zeros(n, dtype=torch.int64, device=flat.device).index_add_(0, group, torch.ones_like(group))

        def rows(at: Tensor, occ: Tensor) -> Tensor:
            """(U, 4) send rows of the distinct keys whose first sorted ids are ``at`` and occurrences ``occ``."""
            out = torch.zeros(at.numel(), 4, dtype=torch.int64, device=flat.device)
            out[:, 0] = sorted_ids[at]
            out[:, 2] = occ
            if several:  # the part of each key's first occurrence: the part starts at or before it (no host copy)
                first = sort_order[at]
                for start_of_part in bounds[1:-1]:
                    out[:, 3] += first >= start_of_part
            return out

        if w == 1:  # one owner: the send order is the sorted order, each id's row is its key's index
            position = torch.empty_like(group).index_copy_(0, sort_order, group)  # (N,) in the ids' order
            firsts = torch.zeros(n + 1, dtype=torch.int64, device=flat.device)  # [g]: key g's first sorted id; [N]: scratch
            firsts.scatter_(0, torch.where(start, group, n), torch.arange(n, device=flat.device))
            return (lambda u: rows(firsts[:u], occurrences[:u])), position, group[-1:] + 1, sorted_ids[:1]
        owner = torch.where(start, self.owners(sorted_ids, torch.zeros_like(sorted_ids)), w)  # (N,) repeats: past the ranks
        order = torch.argsort(owner, stable=True)  # distinct keys by owner (ascending keys within), then the repeats
        index_of = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=flat.device))  # sorted id -> its row in send
        first = torch.cummax(torch.where(start, torch.arange(n, device=flat.device), 0), 0).values  # its key's first sorted id
        position = torch.empty_like(order).index_copy_(0, sort_order, index_of[first])  # (N,) in the ids' order

        def send(u: int) -> Tensor:
            at = order[:u]  # the distinct keys' first sorted ids, by owner
            return rows(at, occurrences[group[at]])

        counts = torch.zeros(w + 1, dtype=torch.int64, device=flat.device).index_add_(0, owner, torch.ones_like(owner))
        return send, position, counts[:w], sorted_ids[:1]  # (index_add_: bincount syncs on CUDA)

    def _exchange_splits(self, send_counts: Tensor, smallest: Tensor, group: dist.ProcessGroup | None = None,
                         ) -> tuple[list[int], list[int], int]:  # fmt: skip
        """(keys this rank sends to each rank, keys it receives from each, ``smallest`` (1,)): one all-to-all
        of counts, one host sync."""
        w = self.world_size
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group or self.group)
        facts = torch.cat([send_counts, recv_counts, smallest]).tolist()
        return facts[:w], facts[w : 2 * w], facts[-1]

    def stage(self, handle: DistributedIds) -> None:
        """Phase 2a, read-only: dedup the received keys, find their rows, bring missing rows of the host tier
        into the device cache and hold their slots until ``lookup`` (one host sync; changes no table state).

        May run a step ahead, before the previous step's optimizer update: ``lookup`` reads the values.
        """
        if handle.ids is not None or handle.staged is not None:
            return
        handle.wait()
        shard, store = self.shard, self.shard.store
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

    def lookup(self, handle: DistributedIds, admit: bool = True, part: int | None = None) -> Tensor:
        """Phase 2b: the owner's lookup (admission in training, as ``DynamicEmbedding``) and the embeddings' way back.

        A lookup staged earlier (``stage``) whose rows all exist, are cached and are still theirs reads them
        with no host sync; any other goes through the shard's full lookup. Outside training (``eval()`` or
        no_grad) an unstaged lookup is not staged: it reads the rows in place and leaves the device cache alone.
        ``part``: of a combined lookup, the embeddings of part ``part`` (its shape + (dim,)); the first call does the
        owner's lookup and the embedding all-to-all for every part, later ones only read (None: all ids, flat).
        """
        if handle.ids is not None:
            ids, tags = handle.ids.view(handle.shape), None if handle.tags is None else handle.tags.view(handle.shape)
            if self.standin_here and self.training:  # no other rank: a stand-in only reads
                with torch.no_grad():
                    self.shard.eval()
                    try:
                        return self.shard(ids, tags, admit)
                    finally:
                        self.shard.train()
            return self.shard(ids, tags, admit)
        if handle.rows is None:
            handle.rows = self._exchange(handle, admit)  # (U, d); backward: to the owners, once per key
        if part is None:
            return F.embedding(handle.position, handle.rows).view(*handle.shape, self.dim)
        lo, hi = handle.bounds[part], handle.bounds[part + 1]
        return F.embedding(handle.position[lo:hi], handle.rows).view(*handle.parts[part], self.dim)

    def _exchange(self, handle: DistributedIds, admit: bool) -> Tensor:
        """The owner's part of a lookup and the embedding all-to-all: this rank's distinct keys' rows (U, d)."""
        if handle.staged is None and not (self.training and torch.is_grad_enabled()):
            unique_emb, inverse = self._direct_rows(handle, admit)  # evaluation: no staging, the cache keeps its training rows
        else:
            self.stage(handle)
            staged, shard = handle.staged, self.shard
            train = self.training and torch.is_grad_enabled()
            now = (shard.stage_epoch, shard.store.generation, shard.builds)
            current, looked_up = staged.epoch == now, None
            if train and not (staged.ready and current) and staged.epoch[1:] == now[1:] and not self.standin_anywhere:
                # IDs evicted since the staging (stage_epoch), or without a row then: only those are looked up again
                rows, n_absent, lost = self._rows_now(staged, evicted=not current)
                current = lost == 0  # no staged row lost its ID: the staged rows and held slots are still theirs
                looked_up = (rows, n_absent)
            if staged.ready and current and train:
                unique_emb = self._read_staged(staged)  # (G, d), no host sync
            else:
                if current:
                    shard.store.unstage(staged.slots)
                else:  # the slots may hold other rows now: drop every hold (a step stages one batch)
                    shard.store.release_staged()
                first = None
                if handle.parts is not None and len(handle.parts) > 1:  # each key's first part, over all senders
                    first = handle.received[:, 3] if staged.inverse is None else torch.full_like(staged.keys, len(
                        handle.parts)).scatter_reduce_(0, staged.inverse, handle.received[:, 3], "amin")  # fmt: skip
                unique_emb = self._owner_rows(staged.keys, staged.tags, staged.occurrences, admit, first, looked_up)  # (G, d)
            inverse = staged.inverse
        # (R, d): each sender's keys, in the order it sent them (one sender: the staged order itself)
        sent_back = unique_emb if inverse is None else F.embedding(inverse, unique_emb)
        return _AllToAll.apply(sent_back, handle.send_splits, handle.recv_splits, self.group)  # (U, d); backward: to the owners

    def _read_staged(self, staged: StagedRows) -> Tensor:
        """The rows of a staged lookup whose rows all exist, are cached and are still theirs (G, d): no host sync."""
        shard = self.shard
        self.staged_reads += 1
        if staged.rows.numel():  # as DynamicEmbedding._rows, which counts only lookups with keys
            shard._stats["lookups"] += 1
            shard._stats["ids"] += staged.n_ids
        shard._touch(staged.rows, staged.occurrences)  # what the full lookup counts for the eviction policy
        shard.store.claim_staged(staged.slots)  # held until this step's optimizer update, as ensure(pin=True)
        return GatherRows.apply(shard._anchor, shard, staged.slots, staged.rows)

    def _rows_now(self, staged: StagedRows, evicted: bool) -> tuple[Tensor, int, int]:
        """(rows, how many are -1, how many staged rows lost their ID) of the staged keys as the index has them now.

        A staged row still holding its key (``row_key``) is its key's row (admission and eviction keep the index and
        ``row_key`` in step); only the keys whose row was evicted since (``evicted``: the table's ``stage_epoch``
        moved) or that had none when staged (admitted since, e.g. by another lookup) are looked up again.
        """
        shard, rows = self.shard, staged.rows
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
            self.relooked_up += n_redo
            return now, n_absent, 0
        n_lost, n_redo = torch.stack([lost, (rows < 0).sum()]).tolist()  # one host sync
        if n_redo == 0:
            return rows, 0, n_lost
        redo = _positions(rows < 0, n_redo)
        rows = rows.clone()
        rows[redo] = shard.index.lookup(staged.keys[redo], None if staged.tags is None else staged.tags[redo])
        self.relooked_up += n_redo
        return rows, int((rows < 0).sum()), n_lost

    def _direct_rows(self, handle: DistributedIds, admit: bool) -> tuple[Tensor, Tensor]:
        """The owner's rows without staging (evaluation, no_grad; reads host-tier rows in place): (G, d), inverse (R,)."""
        handle.wait()
        recv_keys, recv_tags, recv_occ, _ = handle.received.unbind(1)  # (R,) each
        if handle.has_tags:
            keys, tags, inverse, _ = unique_keys(recv_keys, recv_tags)
        else:  # the order DynamicEmbedding admits in (sorted keys)
            keys, inverse = torch.unique(recv_keys, return_inverse=True)
            tags = None
        occurrences = torch.zeros(keys.numel(), dtype=torch.int64, device=keys.device).index_add_(0, inverse, recv_occ)
        return self._owner_rows(keys, tags, occurrences, admit), inverse

    def _owner_rows(self, keys: Tensor, tags: Tensor | None, occurrences: Tensor, admit: bool, first: Tensor | None = None,
                    looked_up: tuple[Tensor, int] | None = None) -> Tensor:  # fmt: skip
        """The owner's rows of distinct ``keys`` (G, d): a training lookup, except for keys whose occurrences
        sum to 0 (only stand-in batches asked for them), which are read without admission, counters or gradient.
        ``first`` (G,): each key's first part in a combined lookup (new keys are admitted part by part).
        ``looked_up``: (rows, how many are -1) of ``keys`` from the index (``_rows_now``; no stand-in anywhere)."""
        if not (self.standin_anywhere and self.training):
            rows, absent = self.shard._rows(keys, tags, occurrences, self.training, admit, first=first, looked_up=looked_up)
            return self.shard._gather(rows, absent)
        live = occurrences > 0
        real, idle = live.nonzero().squeeze(1), (~live).nonzero().squeeze(1)
        rows, absent = self.shard._rows(keys[real], None if tags is None else tags[real], occurrences[real], True, admit,
                                        first=None if first is None else first[real])  # fmt: skip
        emb = self.shard._gather(rows, absent)  # (G_real, d), gradients flow to these rows only
        idle_rows = self.shard.index.lookup(keys[idle], None if tags is None else tags[idle])
        with torch.no_grad():
            idle_emb = self.shard._gather(idle_rows, int((idle_rows < 0).sum()))  # (G_idle, d)
        out = emb.new_zeros(keys.numel(), self.dim).index_copy(0, real, emb)
        return out.index_copy(0, idle, idle_emb.to(emb.dtype))

    # ------------------------------------------------------------- update, tiers, loading

    def apply_gradients(self, lr_scale: float = 1.0) -> None:
        """The owner's sparse step over the row gradients of every lookup since the last step (see ``DynamicEmbedding``)."""
        self.shard.apply_gradients(lr_scale)

    def zero_grad_rows(self) -> None:
        self.shard.zero_grad_rows()

    def prefetch(self, upcoming: list[Tensor]) -> int:
        """Load the owned rows of upcoming ID batches into each shard's device cache; return how many here.

        A collective (the IDs travel to their owners); a no-op without a host tier on any rank.
        """
        if not self.collective:
            return self.shard.prefetch(upcoming)
        batches = []
        for ids in upcoming:
            flat = torch.unique(check_ids(ids, "prefetch ids").reshape(-1).to(self.device))
            owner = self.owners(flat, torch.zeros_like(flat))
            order = torch.argsort(owner, stable=True)
            send_splits, recv_splits, _ = self._exchange_splits(torch.bincount(owner, minlength=self.world_size), flat.new_zeros(1))
            received = flat.new_empty(sum(recv_splits))
            dist.all_to_all_single(received, flat[order], recv_splits, send_splits, group=self.group)
            batches.append(received)
        return self.shard.prefetch(batches)

    def record_feedback(self, ids: Tensor, shows: Tensor, clicks: Tensor, tags: Tensor | None = None) -> None:
        """Add shows/clicks per ID occurrence to the rows (and admission candidates) of ``ids`` on their owners.

        A collective, as ``DynamicEmbedding.record_feedback`` over every rank's ``ids``.
        """
        if not self.collective:
            self.shard.record_feedback(ids, shows, clicks, tags)
            return
        flat = check_ids(ids, "feedback ids").reshape(-1).to(self.device)
        flat_tags = None if tags is None else tags.reshape(-1).to(self.device, torch.int64)
        keys, key_tags, inverse, _ = unique_keys(flat, flat_tags)
        feedback = torch.zeros(keys.numel(), 2, device=self.device)  # (U, 2): shows, clicks summed per key
        feedback.index_add_(0, inverse, torch.stack([shows.reshape(-1), clicks.reshape(-1)], 1).to(self.device, torch.float32))
        owner = self.owners(keys, key_tags)
        order = torch.argsort(owner, stable=True)
        send_splits, recv_splits, _ = self._exchange_splits(torch.bincount(owner, minlength=self.world_size), keys.new_zeros(1))
        recv_keys = keys.new_empty(sum(recv_splits), 2)
        dist.all_to_all_single(recv_keys, torch.stack([keys, key_tags], 1)[order], recv_splits, send_splits, group=self.group)
        recv_feedback = feedback.new_empty(sum(recv_splits), 2)
        dist.all_to_all_single(recv_feedback, feedback[order], recv_splits, send_splits, group=self.group)
        self.shard.record_feedback(recv_keys[:, 0], recv_feedback[:, 0], recv_feedback[:, 1], None if tags is None else recv_keys[:, 1])

    def warm_start(self, weight: Tensor, ids: Tensor, tag: int = 0) -> None:
        """Put dense rows into the table: row ``i`` of ``weight`` becomes ID ``ids[i]``, on its owner.

        Every rank passes the same (global) ``weight``/``ids``; each keeps the rows it owns. No communication.
        """
        from recforge.sparse.checkpoint import warm_start

        ids = check_ids(ids, "warm_start ids")
        mine = (self.owners(ids, torch.full_like(ids, tag)) == self.rank).nonzero().squeeze(1)
        warm_start(self.shard, weight[mine], ids[mine], tag)


@contextlib.contextmanager
def standin_lookups(module: nn.Module, here: bool, anywhere: bool) -> Iterator[None]:
    """Within: lookups of ``module``'s sharded tables are a stand-in on this rank (``here``: a rank without data
    repeating its last batch with weight 0, so the collectives still match) and/or on some rank (``anywhere``,
    the same on every rank). Stand-in IDs change no table state: no admission, counters or optimizer step.

    Example:
        >>> with standin_lookups(model, here=batch is None, anywhere=ranks_with_data < world_size):
        ...     (model(batch or last_batch) * weight).backward()
    """
    tables = [m for m in module.modules() if isinstance(m, ShardedDynamicEmbedding)]
    before = [(t.standin_here, t.standin_anywhere) for t in tables]
    for table in tables:
        table.standin_here, table.standin_anywhere = here, anywhere or here
    try:
        yield
    finally:
        for table, (was_here, was_anywhere) in zip(tables, before, strict=True):
            table.standin_here, table.standin_anywhere = was_here, was_anywhere


def sharded_tables(module: nn.Module) -> dict[str, ShardedDynamicEmbedding]:
    """Every ``ShardedDynamicEmbedding`` inside ``module``, by module path (what a sharded checkpoint saves)."""
    return {name or "table": m for name, m in module.named_modules() if isinstance(m, ShardedDynamicEmbedding)}
