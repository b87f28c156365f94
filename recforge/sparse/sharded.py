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
    backward    (N, d) -> summed per local key (U, d) -all_to_all-> (R, d) -summed per row-> (G, d)
                -> the owner shard's pending row gradients; ``apply_gradients`` updates only there.

``distribute`` is ``distribution.py``; ``stage``, and the staged rows' read in ``lookup``, are ``staging.py``
(``stage`` only reads the table, so it may run a step early: what ``lookup`` then checks is told there).

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
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from recforge.sparse import distribution, staging
from recforge.sparse.distribution import exchange_splits
from recforge.sparse.ids import check_ids, unique_keys
from recforge.sparse.routing import _RANK_SEED, DistributedIds, _AllToAll, owner_of, shard_config
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
        return distribution.distribute(self, ids, tags, group=group, standin=standin)

    def stage(self, handle: DistributedIds) -> None:
        """Phase 2a, read-only: dedup the received keys, find their rows, bring missing rows of the host tier
        into the device cache and hold their slots until ``lookup`` (one host sync; changes no table state).

        May run a step ahead, before the previous step's optimizer update: ``lookup`` reads the values.
        """
        staging.stage(self, handle)

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
        else:  # training: staged now if it was not (staging.py)
            unique_emb, inverse = staging.staged_rows(self, handle, admit), handle.staged.inverse
        # (R, d): each sender's keys, in the order it sent them (one sender: the staged order itself)
        sent_back = unique_emb if inverse is None else F.embedding(inverse, unique_emb)
        return _AllToAll.apply(sent_back, handle.send_splits, handle.recv_splits, self.group)  # (U, d); backward: to the owners

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
        ``looked_up``: (rows, how many are -1) of ``keys`` from the index (``staging.rows_now``; no stand-in anywhere)."""
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
            send_splits, recv_splits, _ = exchange_splits(torch.bincount(owner, minlength=self.world_size), flat.new_zeros(1),
                                                        self.world_size, self.group)
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
        send_splits, recv_splits, _ = exchange_splits(torch.bincount(owner, minlength=self.world_size), keys.new_zeros(1),
                                                    self.world_size, self.group)
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
