"""Row storage of a dynamic table: one tier, or a host table with a device cache of hot rows.

Both stores expose the same small interface to the table and its optimizer:

    slots = store.ensure(rows, pin=True)   # rows -> indices into store.weight / store.state
    store.weight[slots], store.state[name][slots]   # where lookups read and updates write
    store.unpin_all(); store.flush(); store.host_rows(rows); store.grow(n)
    store.stage(slots); store.claim_staged(slots); store.unstage(slots); store.release_staged()   # lookups staged a step ahead

``RowStore`` keeps everything in one tensor per field: slots are rows. ``TieredStore``
keeps the full table (weights and optimizer state) in host memory (pinned when the
compute device is CUDA) and a ``cache_rows``-slot copy on the compute device::

    host (R rows, pinned)              device cache (C slots)             mappings (device)
    host_all[R, record]          <-->  cache_all[C, record]               row_to_slot[R]: slot or -1
              H2D on a miss/prefetch;  dirty[C], stamp[C], pinned[C]      slot_to_row[C]: row or -1
              D2H write-back of dirty victims (least recently stamped, unpinned)

    one float32 record per row:  | weight (d) | exp_avg (d) | exp_avg_sq (d) | step (int64) | pad |
    (Adam; the fields follow the optimizer's state spec). ``weight``/``state[name]`` (and the
    ``host_`` ones) are strided views of the records.

The optimizer updates cache slots exactly as ``RowStore`` updates rows (the same ops on
the same values), so a tiered table trains bit-identically to a one-tier one.

On CUDA with Triton the cache traffic is one kernel over whole records (``kernels.swap_rows``) that
reads the missed rows straight from the pinned host table and writes the dirty victims
straight back (unified virtual addressing): only those rows cross PCIe, in both directions at
once, with no CPU gather, no staging copy and no synchronisation but the miss count. Host
reads of the table (``host_rows``, ``read``, checkpoints) first wait for those kernels.
A prefetch runs on a side stream (``side_stream``): its copies overlap the backward and update
queued after it, and the compute stream waits for it at the store's next call. On the CUDA path it
hands over a bitmap of the rows it wants (``ensure_marked``): the miss count, the free slots and the
caller's checks are read in one synchronisation, with no sort or list of the rows first.

A lookup staged a step ahead (``ShardedDynamicEmbedding.stage``) keeps its rows' slots in ``staged``:
like ``pinned`` they are never victims, but ``unpin_all`` (the end of the current step) leaves them,
so they stay cached until the next step's lookup claims them (``claim_staged``: staged -> pinned).
``generation`` counts ``write_rows`` calls, which move rows out of the cache under a staged lookup.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from recforge.sparse import kernels

StateSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]
_TOP = torch.iinfo(torch.int64).max


def _empty(n: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool = False) -> Tensor:
    t = torch.zeros((n, *shape), dtype=dtype, device=device)
    return t.pin_memory() if pin else t


class RowStore:
    """Every row on the compute device (slots are rows)."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, spec: StateSpec, device: torch.device) -> None:
        self.device, self.dim, self.dtype, self.spec = device, dim, dtype, spec
        self.weight = _empty(rows, (dim,), dtype, device)
        self.state = {name: _empty(rows, shape, dt, device) for name, (shape, dt) in spec.items()}

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    def ensure(self, rows: Tensor, pin: bool = True, future: int = 0) -> Tensor:
        return rows

    generation = 0  # slots are rows: nothing moves them

    def stage(self, slots: Tensor) -> None:
        pass

    def claim_staged(self, slots: Tensor) -> None:
        pass

    def unstage(self, slots: Tensor) -> None:
        pass

    def release_staged(self) -> None:
        pass

    def read(self, rows: Tensor) -> Tensor:
        """Weights of ``rows`` without caching them (lookups outside training)."""
        return self.weight.index_select(0, rows)

    def mark_dirty(self, slots: Tensor) -> None:
        pass

    def unpin_all(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def host_rows(self, rows: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(weights, states) of ``rows``, read from the full table."""
        return self.weight[rows], {k: v[rows] for k, v in self.state.items()}

    def write_rows(self, rows: Tensor, weight: Tensor, state: dict[str, Tensor]) -> None:
        """Overwrite ``rows`` of the full table (checkpoint load, warm start)."""
        self.weight[rows] = weight.to(self.weight)
        for k, v in state.items():
            self.state[k][rows] = v.to(self.state[k])

    def grow(self, rows: int) -> None:
        self.weight = _grow(self.weight, rows)
        self.state = {k: _grow(v, rows) for k, v in self.state.items()}

    def stats(self) -> dict[str, int]:
        return {}


class TieredStore:
    """Full table in host memory, ``cache_rows`` hot rows on the compute device (see module docstring)."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, spec: StateSpec, device: torch.device, cache_rows: int) -> None:
        self.device, self.dim, self.dtype, self.spec = device, dim, dtype, spec
        self.pin = device.type == "cuda"
        self.layout, self.record = _record_layout(dim, dtype, spec)
        # one record per row holds the weight and all its optimizer state, so a miss moves one
        # contiguous block (~3 KB for d=256 Adam) over PCIe: measured on an H100, random 1 KB rows
        # (a field apiece) moved at about half the rate of 3 KB records
        self.host_all = _empty(rows, (self.record,), torch.float32, torch.device("cpu"), self.pin)
        self.cache_all = _empty(cache_rows, (self.record,), torch.float32, device)
        self.host_weight, self.host_state = self._views(self.host_all)
        self.weight, self.state = self._views(self.cache_all)
        self.row_to_slot = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)  # [rows]: scratch for "no row"
        self.slot_to_row = torch.full((cache_rows,), -1, dtype=torch.int64, device=device)
        self._stamp = torch.full((cache_rows + 1,), -1, dtype=torch.int64, device=device)  # [C]: scratch for slot -1
        self.stamp = self._stamp[:cache_rows]  # LRU clock per slot
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool, device=device)
        self.pinned = torch.zeros(cache_rows, dtype=torch.bool, device=device)
        self._staged = torch.zeros(cache_rows + 1, dtype=torch.bool, device=device)  # [C]: scratch for slot -1
        self.staged = self._staged[:cache_rows]  # slots held for a lookup staged a step ahead (never victims)
        self.generation = 0  # write_rows calls: a staged lookup's slots are stale after one
        self.clock = 0
        self.counts = {"cache_hits": 0, "cache_misses": 0, "rows_loaded": 0, "rows_written_back": 0}
        self.uva = self.pin and kernels.available(device)  # GPU reads/writes the pinned host table itself
        self._written_back = torch.zeros((), dtype=torch.int64, device=device)  # device-side count (uva)
        self._host_busy: torch.cuda.Event | None = None  # the last kernel touching host memory
        self._side: torch.cuda.Stream | None = None  # prefetch stream (CUDA)
        self._side_busy = False  # work queued on it that the compute stream has not waited for

    def _views(self, records: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(weight, state) as strided views into (R, record) float32 ``records``."""
        out = []
        for offset, words, shape, dtype in self.layout:
            field = records[:, offset : offset + words].view(dtype)  # (R, numel)
            out.append(field.view(records.shape[0], *shape) if shape else field.squeeze(1))
        return out[0], dict(zip(self.spec, out[1:], strict=True))

    @property
    def num_rows(self) -> int:
        return self.host_all.shape[0]

    def _swap(self, slots: Tensor, write_back: Tensor | None, load: Tensor | None) -> None:
        kernels.swap_rows(self.cache_all, self.host_all, slots, write_back, load)
        if self.device.type == "cuda":
            self._host_busy = torch.cuda.Event()
            self._host_busy.record()

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[torch.cuda.Stream | None]:
        """Queue the enclosed store calls (a prefetch) on a side CUDA stream; yields it (None off CUDA).

        The side stream starts after the work queued so far; the compute stream waits for it at its
        next store call (``_join``). In between, the compute stream may only touch rows pinned by the
        current step, which a prefetch never evicts: the backward and the optimizer update.
        """
        if self.device.type != "cuda":
            yield None
            return
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._join()
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            yield self._side
        self._side_busy = True

    def _join(self) -> None:
        """Make the current (compute) stream wait for queued prefetch work."""
        if self._side_busy and torch.cuda.current_stream(self.device) != self._side:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._side_busy = False

    def _host_sync(self) -> None:
        """Wait for the kernels that read or write host memory (before the CPU touches the host table)."""
        self._join()
        if self._host_busy is not None:
            self._host_busy.synchronize()
            self._host_busy = None

    @property
    def cache_rows(self) -> int:
        return self.weight.shape[0]

    def ensure(self, rows: Tensor, pin: bool = True, future: int = 0) -> Tensor:
        """Cache slots of distinct ``rows``, loading misses; ``pin`` keeps them until ``unpin_all``.

        ``future`` > 0 (prefetch) stamps the rows as if used that many steps ahead, so the
        LRU choice of victims keeps them until then; a prefetch loads only what fits beside the
        pinned rows (the lookup loads the rest).
        """
        self._join()
        self.clock += 1
        slots = self.row_to_slot[rows]
        missing = slots < 0
        n_miss = int(missing.sum())  # the one synchronisation when every row is cached
        self.counts["cache_hits"] += rows.numel() - n_miss
        self.counts["cache_misses"] += n_miss
        if n_miss:
            key = self._victim_keys(slots)  # (C,) LRU stamps (-1: empty); _TOP: not a candidate
            available, empty = torch.stack([(key < _TOP).sum(), (key < 0).sum()]).tolist()
            miss = _positions(missing, n_miss)
            if available < n_miss and not future:
                raise ValueError(
                    f"device cache too small: a step needs {n_miss} more rows but only {available} of {self.cache_rows} cache "
                    "slots are free of the current step's rows; raise cache_rows (it must hold one step's unique rows)"
                )
            n = min(n_miss, available)
            if empty >= n:  # the n smallest stamps are all -1 (a filling cache): any n empty slots, no top-k
                victims = _positions(key < 0, n)
            else:  # empty slots first (stamp -1), then least recently stamped
                victims = torch.topk(key, n, largest=False, sorted=False).indices
            if n < n_miss:  # a prefetch that does not fit beside the pinned rows: load what fits
                miss = miss[:n]
                keep = _positions((~missing).index_fill_(0, miss, True), rows.numel() - n_miss + n)  # no sync: count known
                rows, slots, miss = rows[keep], slots[keep], torch.searchsorted(keep, miss)
            if n:
                slots = self._fill(rows, slots, miss, victims)
        self.stamp.index_fill_(0, slots, self.clock + future)  # index_fill_: no host copy of the scalar (t[i] = x syncs)
        if pin:
            self.pinned.index_fill_(0, slots, True)
        return slots

    def ensure_marked(self, marked: Tensor, future: int, extra: Tensor, stage: bool = False) -> tuple[int, list[int], bool]:
        """``ensure(rows, pin=False, future)`` (a prefetch) for the rows where ``marked`` (R,) is True, in one sync.

        Works on the bitmap, without listing the rows first: the miss count and the cache's free
        slots are read in one synchronisation, together with the caller's ``extra`` (k,) int64 device
        values. Loads the same rows as ``ensure`` given the marked rows ascending. ``stage``: the marked
        rows' slots are held for a staged lookup (``stage``). Returns (rows marked, ``extra`` read back,
        whether every marked row is now cached).
        """
        self._join()
        self.clock += 1
        slot_of = self.row_to_slot[:-1]  # (R,)
        cached = marked & (slot_of >= 0)
        missing = marked & (slot_of < 0)
        key = self._victim_keys(torch.where(cached, slot_of, -1))  # (C,) the marked cached rows are no victims
        facts = torch.cat([torch.stack([marked.sum(), missing.sum(), (key < _TOP).sum(), (key < 0).sum()]), extra])
        total, n_miss, available, empty, *extra_values = facts.tolist()  # the one synchronisation
        self.counts["cache_hits"] += total - n_miss
        self.counts["cache_misses"] += n_miss
        slots = slot_of[_positions(cached, total - n_miss)]
        n = min(n_miss, available)
        if n:  # the n lowest missing rows (ensure's order), into empty slots first, then least recently stamped
            victims = _positions(key < 0, n) if empty >= n else torch.topk(key, n, largest=False, sorted=False).indices
            missing_rows = _positions(missing, n_miss)[:n]
            loaded = self._fill(missing_rows, torch.full_like(missing_rows, -1), torch.arange(n, device=self.device), victims)
            slots = torch.cat([slots, loaded])
        self.stamp.index_fill_(0, slots, self.clock + future)
        if stage:
            self.stage(slots)
        return total, extra_values, n_miss <= available

    def stage_rows(self, rows: Tensor, extra: Tensor, future: int = 1) -> tuple[list[int], bool, Tensor]:
        """``ensure_marked(mark, future, extra, stage=True)`` for distinct ``rows`` (-1 entries: none) instead of a bitmap.

        The work is O(rows + cache slots), not O(table rows): the same rows are loaded into the same slots
        (the missing ones ascending, as the bitmap lists them) in one synchronisation, which also reads the
        caller's ``extra`` (k,) int64 device values. Returns (``extra`` read back, whether every row is now cached,
        each row's slot (-1: none)).
        """
        self._join()
        self.clock += 1
        valid = rows >= 0
        slot_of = self.row_to_slot[torch.where(valid, rows, self.num_rows)]  # (G,) -1: not cached (row_to_slot[R] = -1)
        missing = valid & (slot_of < 0)
        key = self._victim_keys(slot_of)  # (C,) the cached rows are no victims
        facts = torch.cat([torch.stack([valid.sum(), missing.sum(), (key < _TOP).sum(), (key < 0).sum()]), extra])
        total, n_miss, available, empty, *extra_values = facts.tolist()  # the one synchronisation
        self.counts["cache_hits"] += total - n_miss
        self.counts["cache_misses"] += n_miss
        n = min(n_miss, available)
        if n:  # the n lowest missing rows (ensure's order), into empty slots first, then least recently stamped
            victims = _positions(key < 0, n) if empty >= n else torch.topk(key, n, largest=False, sorted=False).indices
            missing_rows = torch.sort(rows[_positions(missing, n_miss)]).values[:n]
            self._fill(missing_rows, torch.full_like(missing_rows, -1), torch.arange(n, device=self.device), victims)
            slot_of = self.row_to_slot[torch.where(valid, rows, self.num_rows)]
        # rows without a row or a slot (-1) stamp and hold the scratch entry: no boolean mask (a host sync)
        self._stamp.index_fill_(0, torch.where(slot_of >= 0, slot_of, self.cache_rows), self.clock + future)
        self.stage(slot_of)
        return extra_values, n_miss <= available, slot_of

    def _fill(self, rows: Tensor, slots: Tensor, miss: Tensor, victims: Tensor) -> Tensor:
        """Load ``rows[miss]`` into the ``victims`` slots (writing dirty victims back); ``slots`` with them filled in."""
        missing = rows[miss]
        old = self.slot_to_row[victims]
        if self.uva:
            write_back = torch.where(self.dirty[victims] & (old >= 0), old, -1)
            self._written_back += (write_back >= 0).sum()
            self._swap(victims, write_back, missing)
            self.dirty.index_fill_(0, victims, False)
            self.counts["rows_loaded"] += miss.numel()
        else:
            self._write_back(victims)
            self._load(missing, victims)
        self.row_to_slot.index_fill_(0, torch.where(old >= 0, old, self.num_rows), -1)
        self.slot_to_row[victims] = missing
        self.row_to_slot[missing] = victims
        slots = slots.clone()
        slots[miss] = victims
        return slots

    def read(self, rows: Tensor) -> Tensor:
        """Weights of ``rows``: cached ones from the cache, the rest straight from host (nothing is cached)."""
        self._host_sync()
        slots = self.row_to_slot[rows]
        out = torch.empty(rows.numel(), self.dim, dtype=self.dtype, device=self.device)
        hit = slots >= 0
        out[hit] = self.weight[slots[hit]]
        out[~hit] = self._h2d(self.host_weight, rows[~hit].cpu())
        return out

    def _victim_keys(self, protect: Tensor) -> Tensor:
        """(C,) each slot's LRU stamp (-1: empty), ``_TOP`` where pinned, staged or in ``protect`` (-1 entries: none)."""
        key = torch.empty(self.cache_rows + 1, dtype=torch.int64, device=self.device)  # [C]: scratch for -1
        key[: self.cache_rows] = self.stamp.masked_fill(self.pinned | self.staged, _TOP)
        key.index_fill_(0, torch.where(protect >= 0, protect, self.cache_rows), _TOP)
        return key[: self.cache_rows]

    def _write_back(self, slots: Tensor) -> None:
        slots = slots[self.dirty[slots] & (self.slot_to_row[slots] >= 0)]
        if slots.numel() == 0:
            return
        rows = self.slot_to_row.index_select(0, slots).cpu()
        self.host_all.index_copy_(0, rows, self.cache_all.index_select(0, slots).cpu())  # index_select: no advanced indexing
        self.dirty.index_fill_(0, slots, False)
        self.counts["rows_written_back"] += rows.numel()

    def _load(self, rows: Tensor, slots: Tensor) -> None:
        self.cache_all.index_copy_(0, slots, self._h2d(self.host_all, rows.cpu()))
        self.dirty.index_fill_(0, slots, False)
        self.counts["rows_loaded"] += rows.numel()

    def _h2d(self, host: Tensor, rows_cpu: Tensor) -> Tensor:
        if not self.pin:
            return host.index_select(0, rows_cpu).to(self.device)
        # gathered straight into pinned memory (no pageable copy first), so the copy is asynchronous
        picked = torch.empty((rows_cpu.numel(), *host.shape[1:]), dtype=host.dtype, pin_memory=True)
        torch.index_select(host, 0, rows_cpu, out=picked)
        return picked.to(self.device, non_blocking=True)

    def mark_dirty(self, slots: Tensor) -> None:
        self._join()
        self.dirty.index_fill_(0, slots, True)  # dirty[slots] = True would synchronise (host copy of True)

    def unpin_all(self) -> None:
        """Release the current step's rows (staged ones stay held for the next step)."""
        self._join()
        self.pinned.zero_()

    def stage(self, slots: Tensor) -> None:
        """Hold ``slots`` (-1 entries: none) for a lookup staged ahead, past this step's ``unpin_all``."""
        self._staged.index_fill_(0, torch.where(slots >= 0, slots, self.cache_rows), True)

    def claim_staged(self, slots: Tensor) -> None:
        """The staged lookup runs: its ``slots`` (all cached) become the current step's pinned slots."""
        self._join()
        self.staged.index_fill_(0, slots, False)
        self.pinned.index_fill_(0, slots, True)

    def unstage(self, slots: Tensor) -> None:
        """Drop the staged hold of ``slots`` (-1 entries: none), e.g. a staged lookup that is redone."""
        self._join()
        self._staged.index_fill_(0, torch.where(slots >= 0, slots, self.cache_rows), False)

    def release_staged(self) -> None:
        """Forget every staged hold (staged lookups that will not run)."""
        self._join()
        self._staged.zero_()

    def flush(self) -> None:
        """Write every dirty cached row back to the host table."""
        self._join()
        slots = self.dirty.nonzero().squeeze(1)
        if self.uva:
            rows = self.slot_to_row[slots]
            write_back = torch.where(rows >= 0, rows, -1)
            self._written_back += (write_back >= 0).sum()
            self._swap(slots, write_back, None)
            self.dirty.index_fill_(0, slots, False)
            self._host_sync()
        else:
            self._write_back(slots)

    def host_rows(self, rows: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        self.flush()
        rows_cpu = rows.cpu()
        return self.host_weight[rows_cpu].to(self.device), {k: v[rows_cpu].to(self.device) for k, v in self.host_state.items()}

    def write_rows(self, rows: Tensor, weight: Tensor, state: dict[str, Tensor]) -> None:
        self.flush()
        self._host_sync()
        self.generation += 1
        slots = self.row_to_slot[rows]
        cached = slots >= 0  # drop stale cached copies: the next use reloads from host
        self.row_to_slot[rows[cached]] = -1
        self.slot_to_row[slots[cached]] = -1
        self.stamp[slots[cached]] = -1
        rows_cpu = rows.cpu()
        self.host_weight[rows_cpu] = weight.to("cpu", self.dtype)
        for k, v in state.items():
            self.host_state[k][rows_cpu] = v.to("cpu", self.host_state[k].dtype)

    def grow(self, rows: int) -> None:
        self._host_sync()
        self.host_all = _grow(self.host_all, rows, self.pin)
        self.host_weight, self.host_state = self._views(self.host_all)
        old = self.row_to_slot[:-1]
        self.row_to_slot = torch.cat([old, old.new_full((rows + 1 - old.numel(),), -1)])

    def stats(self) -> dict[str, int]:
        self._join()
        if self.uva:
            self.counts["rows_written_back"] += int(self._written_back)
            self._written_back.zero_()
        return dict(self.counts)


def _record_layout(dim: int, dtype: torch.dtype, spec: StateSpec) -> tuple[list[tuple[int, int, tuple, torch.dtype]], int]:
    """Where each field sits in a row's float32 record: [(offset, words, shape, dtype)] (weight first), record words.

    Each field starts at a multiple of its own size (an int64 step count at an even word) and the
    record is a multiple of 4 words (16-byte rows for vector loads).
    """
    layout, offset = [], 0
    for shape, dt in [((dim,), dtype)] + list(spec.values()):
        size = torch.empty((), dtype=dt).element_size()
        assert size % 4 == 0, f"tiered rows hold 4-byte multiples, got {dt}"
        numel = 1
        for n in shape:
            numel *= n
        words = numel * size // 4
        offset = -(-offset // (size // 4)) * (size // 4)
        layout.append((offset, words, shape, dt))
        offset += words
    return layout, -(-offset // 4) * 4


def _positions(mask: Tensor, count: int) -> Tensor:
    """The first ``count`` indices where ``mask`` is True (it has that many): ``nonzero`` without its host sync."""
    dest = torch.where(mask, torch.cumsum(mask, 0) - 1, count).clamp_(max=count)
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    return out.scatter_(0, dest, torch.arange(mask.numel(), device=mask.device))[:count]


def _grow(t: Tensor, rows: int, pin: bool = False) -> Tensor:
    out = _empty(rows, tuple(t.shape[1:]), t.dtype, t.device, pin)
    out[: t.shape[0]] = t
    return out
