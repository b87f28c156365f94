"""``DynamicEmbedding``: an embedding table keyed by raw int64 IDs, rows created on admission.

One lookup, for flat ids (N,) with U distinct::

    ids (N,) --dedup--> keys (U,), inverse (N,)
    keys --index (hash / sorted)--> rows (U,), -1 where absent --admission--> new rows (evicting on pressure)
    rows --store.ensure--> cache slots --gather--> (N, d)

On CUDA the dedup, index lookup and counters are one Triton pass queued before the lookup's one
host sync (``lookup.py``, ``_forward_planned`` + ``lookup.LookupIds``); elsewhere torch ops do the same
(``_unique_lookup`` + ``lookup.GatherRows`` + ``F.embedding(inverse, ...)``). Backward hands the (U, d)
row gradient, duplicates summed, to the table's pending list; ``apply_gradients()`` (or
``SparseOptimizer.step()``) merges the pending lists of all lookups of the step, skips rows whose
gradient is not finite (counted in ``stats``) and updates only those rows and their optimizer
state. The table holds no ``nn.Parameter`` (except a learned default row), so a dense optimizer
over ``model.parameters()`` leaves it alone.

Reading order of ``DynamicEmbedding``: lookup (``forward``, ``_forward_planned``, ``_rows``),
admission (``_admit``, ``_candidate_slots``, ``_init_rows``), capacity and eviction
(``_allocate``, ``_grow``, ``_evict_lowest``, ``run_eviction``, ``evict_rows``), update
(``apply_gradients``), the host tier (``prefetch``), feedback (``record_feedback``). Storage tiers
are in ``storage.py``, policies in ``policies.py``, optimizers in ``optim.py``, files in ``checkpoint.py``, the config in
``table_config.py``.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recforge.sparse import kernels
from recforge.sparse.ids import check_ids, raise_negative, unique_keys
from recforge.sparse.lookup import GatherRows, LookupIds, mark_rows, plan_lookup
from recforge.sparse.optim import SparseOptimConfig, apply_update, initial_state, lr_at, state_spec
from recforge.sparse.policies import RowCounters, admit, eviction_scores, scheduled_threshold
from recforge.sparse.sorted_index import make_index
from recforge.sparse.storage import RowStore, TieredStore
from recforge.sparse.table_config import TableConfig

log = logging.getLogger(__name__)
class DynamicEmbedding(nn.Module):
    """Embedding table over raw int64 IDs with admission, eviction, a sparse optimizer and optional host tier.

    Args:
        cfg: the table's configuration.
        device: compute device (hash index, counters, device cache / whole table).

    Example:
        >>> table = DynamicEmbedding(TableConfig(dim=16, optimizer=SparseOptimConfig(kind="adam", lr=0.01)))
        >>> emb = table(torch.tensor([[10**12, 7, 7]]))        # (1, 3, 16); rows created on sight
        >>> emb.sum().backward()
        >>> table.apply_gradients()                             # lazy Adam on the 2 touched rows
        >>> table.num_live, table.stats["admitted"]
        (2, 2)
    """

    def __init__(self, cfg: TableConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        cfg.validate()
        self.cfg, self.device = cfg, torch.device(device)
        self.dim = cfg.dim
        self.clock = time.time  # seconds for TTL; replaceable (tests)
        self.stage_epoch = 0  # bumped when IDs lose their rows (eviction, rebuild): lookups staged before are stale
        self.builds = 0  # _build calls (the index, rows and store made anew)
        self._build(cfg.capacity)

    def _build(self, rows: int) -> None:
        cfg, dev = self.cfg, self.device
        self.stage_epoch += 1
        self.builds += 1
        self.step = 0
        self.index = make_index(rows, dev, cfg.index)
        spec = state_spec(cfg.optimizer.kind, cfg.dim)
        self.store = TieredStore(rows, cfg.dim, torch.float32, spec, dev, cfg.cache_rows) if cfg.cache_rows else RowStore(
            rows, cfg.dim, torch.float32, spec, dev
        )
        self.counters = RowCounters.zeros(rows, dev)
        self.row_key = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.row_tag = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.changed = torch.zeros(rows, dtype=torch.bool, device=dev)  # since the last delta export
        self.free = torch.arange(rows - 1, -1, -1, device=dev)  # stack: rows 0, 1, 2... are taken first
        self.num_free = rows
        # (keys, tags) evicted since the last export_rows; None until the first export: before it no
        # consumer holds any key, so evictions need no record (and the list cannot grow unbounded)
        self.deleted: list[tuple[Tensor, Tensor]] | None = None
        self.generator = torch.Generator(dev).manual_seed(cfg.seed)
        if cfg.admission.needs_candidates:
            self.cand_index = make_index(min(cfg.admission.max_candidates, 1 << 16), dev, cfg.index)
            self.cand = RowCounters.zeros(cfg.admission.max_candidates, dev)
            self.cand_used = 0
        default = torch.zeros(cfg.dim, device=dev)
        if cfg.default == "fixed":
            default.normal_(0.0, cfg.init_std, generator=self.generator)
        self.default_row = nn.Parameter(default) if cfg.default == "learned" else default
        self._anchor = torch.empty(0, requires_grad=True)  # makes lookups part of the autograd graph
        self._pending: list[tuple[Tensor, Tensor, Tensor]] = []
        # counts the CUDA path keeps on the device (no host synchronisation): non-finite gradient rows
        self._device_counts = torch.zeros(1, dtype=torch.int64, device=dev)
        self._stats = dict.fromkeys(
            ("lookups", "ids", "admitted", "not_admitted", "rejected_full", "evicted", "evicted_pressure",
             "evicted_scheduled", "nonfinite_grad_rows", "updated_rows", "candidates_reset", "grown"), 0
        )  # fmt: skip

    @property
    def stats(self) -> dict[str, int]:
        """Event counts (admitted, evicted, updated_rows, ...); reading them synchronises device-side counts."""
        bad = int(self._device_counts[0])
        if bad:
            self._device_counts.zero_()
            self._stats["nonfinite_grad_rows"] += bad
            self._stats["updated_rows"] -= bad
            log.warning("table %r: %d rows had NaN/inf gradients and were not updated (by step %d)", self.cfg.name, bad, self.step)
        return self._stats

    @property
    def num_rows(self) -> int:
        """Rows allocated (live + free)."""
        return self.row_key.numel()

    @property
    def num_live(self) -> int:
        """Rows that hold an ID."""
        return self.num_rows - self.num_free

    # ---------------------------------------------------------------------------------- lookup

    def forward(self, ids: Tensor, tags: Tensor | None = None, admit: bool = True) -> Tensor:
        """Embeddings of ``ids`` (any shape) -> ``ids.shape + (dim,)``.

        In training mode unseen IDs go through admission (``admit=False`` skips it: they
        read the default) and the lookup counts for the eviction policy; in eval mode
        nothing changes in the table. ``tags`` (same shape) name the logical table of each
        ID when several share this physical table.
        """
        ids = check_ids(ids, negatives=False)  # negative IDs are caught at _rows's synchronisation
        flat = ids.reshape(-1)
        flat_tags = None if tags is None else tags.reshape(-1).to(torch.int64)
        if flat_tags is None and flat.numel() and kernels.available(flat.device):
            return self._forward_planned(flat, admit).view(*ids.shape, self.dim)
        if flat_tags is None and flat.is_cuda and flat.numel():
            keys, inverse, occurrences, looked_up = self._unique_lookup(flat)
            rows, absent = self._rows(keys, None, occurrences, self.training, admit, looked_up=looked_up, n_ids=flat.numel())
        else:
            keys, key_tags, inverse, occurrences = unique_keys(flat, flat_tags)
            rows, absent = self._rows(keys, None if tags is None else key_tags, occurrences, self.training, admit, check=True,
                                      n_ids=flat.numel())  # fmt: skip
        unique_emb = self._gather(rows, absent)  # (U, d)
        # F.embedding's backward sums duplicates with the tuned embedding kernel (index_add semantics)
        return F.embedding(inverse, unique_emb).view(*ids.shape, self.dim)

    def _forward_planned(self, flat: Tensor, admit: bool) -> Tensor:
        """``forward`` on the kernel path (lookup.py): dedup, index lookup and counters queued before the one sync."""
        train = self.training
        plan = plan_lookup(flat, self.index, self.counters if train else None, self.step, self.clock() if train else 0.0)
        u, n_absent, smallest, longest = plan.facts.tolist()  # the one synchronisation of a lookup without new IDs
        if smallest < 0:
            raise_negative(flat)
        looked_up = (plan.rows[:u], n_absent)
        rows, absent = self._rows(plan.keys[:u], None, plan.occurrences[:u], train, admit, looked_up=looked_up,
                                  n_ids=flat.numel(), touched=True)  # fmt: skip
        if absent == 0 and train and torch.is_grad_enabled():
            slots = self.store.ensure(rows, pin=True)
            # each id's slot: one tier, every row found by the lookup (none admitted since): the lookup wrote it
            id_slots = plan.row_of if slots is rows and n_absent == 0 else slots.index_select(0, plan.inverse)  # (N,)
            return LookupIds.apply(self._anchor, self, slots, rows, plan, longest, id_slots)
        return F.embedding(plan.inverse, self._gather(rows, absent))

    def rows_for(self, keys: Tensor, tags: Tensor | None, occurrences: Tensor, *, train: bool, admit: bool = True) -> Tensor:
        """Row of each distinct (key, tag), -1 where it has none; in training, admit and count."""
        return self._rows(keys, tags, occurrences, train, admit)[0]

    def _unique_lookup(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, int]]:
        """``unique_keys`` and the index lookup in one host synchronisation (CUDA; ``torch.unique`` makes its own).

        Sorts the N ids, looks all of them up (a sorted-index lookup costs little per key) and reads
        back (distinct ids, distinct ids without a row, smallest id) at once.
        """
        sorted_ids, order = torch.sort(flat)
        start = torch.ones_like(sorted_ids, dtype=torch.bool)
        start[1:] = sorted_ids[1:] != sorted_ids[:-1]
        group = torch.cumsum(start, 0) - 1  # (N,) distinct-id index of each sorted id
        found = self.index.lookup(sorted_ids, None)
        facts = torch.stack([group[-1] + 1, ((found < 0) & start).sum(), sorted_ids[0]]).tolist()  # the one synchronisation
        if facts[2] < 0:
            raise_negative(flat)
        u = facts[0]
        keys = sorted_ids.new_empty(u).scatter_(0, group, sorted_ids)  # a group's writes are all equal
        rows = found.new_empty(u).scatter_(0, group, found)
        occurrences = torch.zeros(u, dtype=torch.int64, device=flat.device).index_add_(0, group, torch.ones_like(group))
        inverse = torch.empty_like(group).index_copy_(0, order, group)
        return keys, inverse, occurrences, (rows, facts[1])

    def _rows(self, keys: Tensor, tags: Tensor | None, occurrences: Tensor, train: bool, admit: bool, check: bool = False,
              looked_up: tuple[Tensor, int] | None = None, n_ids: int | None = None, touched: bool = False,
              first: Tensor | None = None):  # fmt: skip
        """(rows, how many are -1). One host synchronisation when every key has a row (the usual step).

        ``touched``: the lookup already counted the rows it found (``plan_lookup``). ``first``: each key's first
        part in a combined lookup (``_admit_in_order``).
        """
        if looked_up is not None:
            rows, n_absent = looked_up
            if keys.numel() == 0:
                return rows, 0
        else:
            rows = self.index.lookup(keys, tags)
            if keys.numel() == 0:
                return rows, 0
            facts = [(rows < 0).sum()] + ([(keys.min() < 0).long()] if check else [])
            facts = torch.stack(facts).tolist()  # the one synchronisation of a lookup without new IDs
            if check and facts[1]:
                raise_negative(keys)
            n_absent = facts[0]
        if not train:
            return rows, n_absent
        self._stats["lookups"] += 1
        self._stats["ids"] += int(occurrences.sum()) if n_ids is None else n_ids
        if n_absent == 0:
            if not touched:
                self._touch(rows, occurrences)
            return rows, 0
        absent = rows < 0
        if not touched:
            hit = (~absent).nonzero().squeeze(1)
            self._touch(rows[hit], occurrences[hit])
        missing = absent.nonzero().squeeze(1)
        if admit:
            rows[missing] = self._admit_in_order(keys[missing], None if tags is None else tags[missing], occurrences[missing],
                                                 None if first is None else first[missing])  # fmt: skip
        absent = rows < 0
        self._stats["not_admitted"] += int(occurrences[absent].sum())
        return rows, int(absent.sum())

    def _touch(self, rows: Tensor, occurrences: Tensor) -> None:
        self.counters.count.index_add_(0, rows, occurrences)
        self.counters.last_step.index_fill_(0, rows, self.step)
        self.counters.last_time.index_fill_(0, rows, self.clock())

    # ------------------------------------------------------------------------------- admission

    def _admit_in_order(self, keys: Tensor, tags: Tensor | None, occurrences: Tensor, first: Tensor | None) -> Tensor:
        """Admit new ``keys`` and count their rows' use: at once, or (``first``: each key's first part in a combined
        lookup) part by part in ascending order, as separate lookups of the parts would.

        Rows, initial values and admission draws are then those of separate lookups whenever no key is in two
        parts. A key in several parts is admitted (or not) once, at its first part, on its occurrences summed
        over all parts (separately: each lookup on its own count, so a later part could admit a key an earlier
        one refused). Pressure eviction never takes a row this step uses (the combined lookup touched every
        part's rows before admitting; separately, an earlier part could evict a later part's row).
        """
        parts = [] if first is None or keys.numel() == 0 else torch.unique(first).tolist()
        if len(parts) <= 1:
            return self._admit_touched(keys, tags, occurrences)
        out = torch.full_like(keys, -1)
        for part in parts:
            idx = (first == part).nonzero().squeeze(1)
            out[idx] = self._admit_touched(keys[idx], None if tags is None else tags[idx], occurrences[idx])
        return out

    def _admit_touched(self, keys: Tensor, tags: Tensor | None, occurrences: Tensor) -> Tensor:
        """``_admit``, then count the new rows' use (before a later part's admission may evict)."""
        new_rows = self._admit(keys, tags, occurrences)
        taken = new_rows >= 0
        self._touch(new_rows[taken], occurrences[taken])
        return new_rows

    def _admit(self, keys: Tensor, tags: Tensor | None, occurrences: Tensor) -> Tensor:
        cfg = self.cfg.admission
        slots = None
        if cfg.needs_candidates:
            slots = self._candidate_slots(keys, tags)
            self.cand.count[slots] += occurrences
        if cfg.kind == "always":
            chosen = torch.arange(keys.numel(), device=keys.device)
        else:
            chosen = admit(cfg, occurrences, getattr(self, "cand", None), slots, self.generator).nonzero().squeeze(1)
        new_rows = self._allocate(chosen.numel())
        taken = chosen[: new_rows.numel()]
        if taken.numel() < chosen.numel():
            refused = chosen.numel() - taken.numel()
            self._stats["rejected_full"] += refused
            log.warning("table %r is full (%d rows, eviction %r): %d new IDs read the default this step; "
                        "raise max_rows or enable eviction", self.cfg.name, self.num_rows, self.cfg.eviction.kind, refused)  # fmt: skip
        out = torch.full_like(keys, -1)
        out[taken] = new_rows
        if taken.numel():
            taken_tags = None if tags is None else tags[taken]
            self.index.insert(keys[taken], taken_tags, new_rows)
            self.row_key[new_rows] = keys[taken]
            self.row_tag[new_rows] = 0 if taken_tags is None else taken_tags
            self.counters.reset(new_rows)
            self._init_rows(new_rows)
            self._stats["admitted"] += taken.numel()
            if cfg.needs_candidates:
                self.cand_index.delete(keys[taken], taken_tags)
        return out

    def _candidate_slots(self, keys: Tensor, tags: Tensor | None) -> Tensor:
        slots = self.cand_index.lookup(keys, tags)
        new = (slots < 0).nonzero().squeeze(1)
        if keys.numel() > self.cand.count.numel():
            raise ValueError(
                f"table {self.cfg.name!r}: {keys.numel()} unseen IDs in one batch exceed admission.max_candidates "
                f"({self.cand.count.numel()}); raise max_candidates"
            )
        if self.cand_used + new.numel() > self.cand.count.numel():  # tracker full: start over
            self.cand_index = make_index(min(self.cfg.admission.max_candidates, 1 << 16), self.device, self.cfg.index)
            self.cand = RowCounters.zeros(self.cand.count.numel(), self.device)
            self.cand_used = 0
            self._stats["candidates_reset"] += 1
            slots, new = torch.full_like(keys, -1), torch.arange(keys.numel(), device=keys.device)
        fresh = torch.arange(self.cand_used, self.cand_used + new.numel(), device=keys.device)
        self.cand_index.insert(keys[new], None if tags is None else tags[new], fresh)
        self.cand_used += new.numel()
        slots[new] = fresh
        return slots

    def _init_rows(self, rows: Tensor) -> None:
        values = torch.empty(rows.numel(), self.dim, device=self.device)
        values.normal_(0.0, self.cfg.init_std, generator=self.generator)
        slots = self.store.ensure(rows, pin=False)
        self.store.weight[slots] = values
        for name, tensor in self.store.state.items():
            tensor.index_fill_(0, slots, initial_state(self.cfg.optimizer, name))  # t[i] = x would sync (host copy of x)
        self.store.mark_dirty(slots)
        self.changed.index_fill_(0, rows, True)

    # ------------------------------------------------------------------- capacity and eviction

    def _allocate(self, n: int) -> Tensor:
        """Up to ``n`` free rows: grow, else evict on pressure; fewer when neither frees enough."""
        if self.num_free < n:
            limit = self.cfg.max_rows or 1 << 62
            target = min(max(2 * self.num_rows, self.num_rows + n - self.num_free), limit)
            if target > self.num_rows:
                self._grow(target)
        ev = self.cfg.eviction
        if self.num_free < n and ev.kind != "none" and ev.on_pressure:
            self._evict_lowest(n - self.num_free)
        m = min(n, self.num_free)
        rows = self.free[self.num_free - m : self.num_free].flip(0)
        self.num_free -= m
        return rows.clone()

    def _grow(self, rows: int) -> None:
        old = self.num_rows
        self.store.grow(rows)
        self.counters = self.counters.grown(rows)
        self.row_key = torch.cat([self.row_key, self.row_key.new_full((rows - old,), -1)])
        self.row_tag = torch.cat([self.row_tag, self.row_tag.new_zeros(rows - old)])
        self.changed = torch.cat([self.changed, self.changed.new_zeros(rows - old)])
        free = torch.empty(rows, dtype=torch.int64, device=self.device)  # the stack can hold every row
        free[: rows - old] = torch.arange(rows - 1, old - 1, -1, device=self.device)  # new rows under the old free ones
        free[rows - old : rows - old + self.num_free] = self.free[: self.num_free]
        self.free = free
        self.num_free += rows - old
        self._stats["grown"] += 1

    def live_rows(self) -> Tensor:
        """Rows that hold an ID, ascending."""
        return (self.row_key >= 0).nonzero().squeeze(1)

    def _norms(self, rows: Tensor) -> Tensor:
        return self.store.host_rows(rows)[0].norm(dim=1)

    def _evict_lowest(self, n: int) -> None:
        rows = self.live_rows()
        rows = rows[self.counters.last_step[rows] != self.step]  # never a row this step already uses
        if rows.numel() == 0:
            return
        norms = self._norms(rows) if self.cfg.eviction.kind == "l2" else None
        scores = eviction_scores(self.cfg.eviction, self.counters, rows, self.step, self.clock(), norms)
        victims = rows[torch.topk(scores, min(n, rows.numel()), largest=False).indices]
        self.evict_rows(victims)
        self._stats["evicted_pressure"] += victims.numel()

    def run_eviction(self) -> int:
        """Scheduled pass: evict the rows whose policy score is below its threshold; return how many."""
        cfg = self.cfg.eviction
        threshold = scheduled_threshold(cfg, self.step, self.clock())
        if cfg.kind == "none" or threshold is None:
            return 0
        rows = self.live_rows()
        norms = self._norms(rows) if cfg.kind == "l2" else None
        scores = eviction_scores(cfg, self.counters, rows, self.step, self.clock(), norms)
        victims = rows[scores < threshold]
        self.evict_rows(victims)
        self._stats["evicted_scheduled"] += victims.numel()
        return victims.numel()

    def evict_rows(self, rows: Tensor) -> None:
        """Drop ``rows``' IDs from the table; the rows go back on the free stack (counted in ``stats``)."""
        if rows.numel() == 0:
            return
        self.stage_epoch += 1
        keys, tags = self.row_key[rows], self.row_tag[rows]
        self.index.delete(keys, tags)
        if self.deleted is not None:
            self.deleted.append((keys.clone(), tags.clone()))
        self.row_key[rows] = -1
        self.counters.reset(rows)
        self.changed[rows] = False
        self.free[self.num_free : self.num_free + rows.numel()] = rows
        self.num_free += rows.numel()
        self._stats["evicted"] += rows.numel()

    # ------------------------------------------------------------------ rows out, gradients in

    def _gather(self, rows: Tensor, absent: int) -> Tensor:
        found = rows >= 0
        all_found = absent == 0
        idx = None if all_found else found.nonzero().squeeze(1)
        present = rows if all_found else rows[idx]
        if self.training and torch.is_grad_enabled():
            slots = self.store.ensure(present, pin=True)
            emb = GatherRows.apply(self._anchor, self, slots, present)
        else:
            emb = self.store.read(present)
        if all_found:
            return emb
        out = torch.zeros(rows.numel(), self.dim, device=self.device, dtype=emb.dtype).index_copy(0, idx, emb)
        if self.cfg.default != "zeros":
            out = torch.where(found[:, None], out, self.default_row[None, :])
        return out

    def apply_gradients(self, lr_scale: float = 1.0) -> None:
        """The fused sparse step: merge this step's row gradients, update those rows (learning rate
        ``lr_at(step) * lr_scale``), advance the step."""
        if self._pending:
            if len(self._pending) == 1:
                rows, slots, grads = self._pending[0]
            else:  # several lookups this step: sum per row
                rows = torch.cat([r for r, _, _ in self._pending])
                grads = torch.cat([g for _, _, g in self._pending])
                rows, inverse = torch.unique(rows, return_inverse=True)
                grads = torch.zeros(rows.numel(), self.dim, device=grads.device, dtype=grads.dtype).index_add_(0, inverse, grads)
                slots = self.store.ensure(rows, pin=True)
            opt, lr = self.cfg.optimizer, lr_at(self.cfg.optimizer, self.step) * lr_scale
            if self._fused_update(opt, grads):  # one kernel; non-finite rows skipped and counted on the device
                kernels.lazy_adam_rows(self.store.weight, self.store.state["exp_avg"], self.store.state["exp_avg_sq"],
                                       self.store.state["step"], slots, grads, lr=lr, betas=tuple(opt.betas), eps=opt.eps,
                                       weight_decay=opt.weight_decay, decoupled=opt.kind == "adamw", bad=self._device_counts)  # fmt: skip
            else:
                finite = torch.isfinite(grads).all(1)
                if not bool(finite.all()):
                    bad = int((~finite).sum())
                    self._stats["nonfinite_grad_rows"] += bad
                    log.warning("table %r step %d: %d rows had NaN/inf gradients and were not updated", self.cfg.name, self.step, bad)
                    rows, slots, grads = rows[finite], slots[finite], grads[finite]
                apply_update(opt, lr, self.store.weight, self.store.state, slots, grads)
            self.store.mark_dirty(slots)
            self.changed.index_fill_(0, rows, True)
            self._stats["updated_rows"] += rows.numel()
        self.zero_grad_rows()
        self.step += 1
        every = self.cfg.eviction.every_steps
        if every and self.step % every == 0:
            self.run_eviction()

    def _fused_update(self, opt: SparseOptimConfig, grads: Tensor) -> bool:
        w, st = self.store.weight, self.store.state
        return (kernels.available(w.device) and opt.kind in ("adam", "adamw") and w.dtype == torch.float32
                and w.stride(1) == st["exp_avg"].stride(1) == st["exp_avg_sq"].stride(1) == 1
                and grads.dtype == torch.float32)  # fmt: skip

    def zero_grad_rows(self) -> None:
        """Drop pending row gradients and release the cache rows this step pinned."""
        self._pending.clear()
        self.store.unpin_all()

    # ------------------------------------------------------- host tier, feedback, device moves

    def prefetch(self, upcoming: list[Tensor]) -> int:
        """Load the admitted rows of upcoming ID batches into the device cache ahead of use; return how many.

        Batch ``i`` of ``upcoming`` is stamped as used ``i + 1`` lookups ahead, so the cache's
        LRU keeps it until then. A no-op for a one-tier table.
        """
        if not isinstance(self.store, TieredStore):
            return 0
        total = 0
        with self.store.side_stream() as stream:  # CUDA: the row copies overlap the step's backward and update
            for ahead, ids in enumerate(upcoming, start=1):
                flat = check_ids(ids, "prefetch ids", negatives=False).reshape(-1).to(self.device)
                if stream is not None:
                    flat.record_stream(stream)  # may come from the compute stream, which could free it before the copies ran
                if flat.numel() and kernels.available(flat.device):
                    # a bitmap of the rows, no sort (lookup.py); the store's one sync also reads the negative-id flag
                    # and finishes this stream's reads of the index before a later insert could replace it
                    mark = mark_rows(flat, self.index, self.num_rows)  # (R + 2,)
                    count, (negative,), _ = self.store.ensure_marked(mark[2:], ahead, mark[:1].long())
                    if negative:
                        raise_negative(flat, "prefetch ids")
                else:
                    check_ids(flat, "prefetch ids")
                    rows = self.index.lookup(torch.unique(flat), None)
                    rows = rows[rows >= 0]
                    self.store.ensure(rows, pin=False, future=ahead)
                    count = rows.numel()
                total += count
        return total

    def record_feedback(self, ids: Tensor, shows: Tensor, clicks: Tensor, tags: Tensor | None = None) -> None:
        """Add shows/clicks per ID occurrence to the rows (and admission candidates) of ``ids``."""
        flat = check_ids(ids, "feedback ids").reshape(-1)
        keys, key_tags, inverse, _ = unique_keys(flat, None if tags is None else tags.reshape(-1).long())
        show = torch.zeros(keys.numel(), device=flat.device).index_add_(0, inverse, shows.reshape(-1).float())
        click = torch.zeros(keys.numel(), device=flat.device).index_add_(0, inverse, clicks.reshape(-1).float())
        rows = self.index.lookup(keys, key_tags)
        hit = rows >= 0
        self.counters.show[rows[hit]] += show[hit]
        self.counters.click[rows[hit]] += click[hit]
        if self.cfg.admission.needs_candidates and bool((~hit).any()):
            slots = self._candidate_slots(keys[~hit], key_tags[~hit])
            self.cand.show[slots] += show[~hit]
            self.cand.click[slots] += click[~hit]

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        target = fn(torch.zeros(1, device=self.device)).device
        if target != self.device:
            from recforge.sparse.checkpoint import table_state, load_table_state

            tensors, meta = table_state(self)
            self.device = target
            load_table_state(self, tensors, meta)
        return self
