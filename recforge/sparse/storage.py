"""Row storage of a dynamic table: one tier, or a host table with a device cache of hot rows.

Both stores expose the same small interface to the table and its optimizer:

    slots = store.ensure(rows, pin=True)   # rows -> indices into store.weight / store.state
    store.weight[slots], store.state[name][slots]   # where lookups read and updates write
    store.unpin_all(); store.flush(); store.host_rows(rows); store.grow(n)

``RowStore`` keeps everything in one tensor per field: slots are rows. ``TieredStore``
keeps the full table (weights and optimizer state) in host memory (pinned when the
compute device is CUDA) and a ``cache_rows``-slot copy on the compute device::

    host (R rows, pinned)              device cache (C slots)             mappings (device)
    weight[R, d], state[R, ...]  <-->  weight[C, d], state[C, ...]        row_to_slot[R]: slot or -1
              H2D on a miss/prefetch;  dirty[C], stamp[C], pinned[C]      slot_to_row[C]: row or -1
              D2H write-back of dirty victims (least recently stamped, unpinned)

The optimizer updates cache slots exactly as ``RowStore`` updates rows (the same ops on
the same values), so a tiered table trains bit-identically to a one-tier one.

On CUDA with Triton the cache traffic is one kernel per field (``kernels.swap_rows``) that
reads the missed rows straight from the pinned host table and writes the dirty victims
straight back (unified virtual addressing): only those rows cross PCIe, in both directions at
once, with no CPU gather, no staging copy and no synchronisation but the miss count. Host
reads of the table (``host_rows``, ``read``, checkpoints) first wait for those kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.sparse import kernels

StateSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


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
        cpu = torch.device("cpu")
        self.host_weight = _empty(rows, (dim,), dtype, cpu, self.pin)
        self.host_state = {name: _empty(rows, shape, dt, cpu, self.pin) for name, (shape, dt) in spec.items()}
        self.weight = _empty(cache_rows, (dim,), dtype, device)
        self.state = {name: _empty(cache_rows, shape, dt, device) for name, (shape, dt) in spec.items()}
        self.row_to_slot = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)  # [rows]: scratch for "no row"
        self.slot_to_row = torch.full((cache_rows,), -1, dtype=torch.int64, device=device)
        self.stamp = torch.full((cache_rows,), -1, dtype=torch.int64, device=device)  # LRU clock per slot
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool, device=device)
        self.pinned = torch.zeros(cache_rows, dtype=torch.bool, device=device)
        self.clock = 0
        self.counts = {"cache_hits": 0, "cache_misses": 0, "rows_loaded": 0, "rows_written_back": 0}
        self.uva = self.pin and kernels.available(device)  # GPU reads/writes the pinned host table itself
        self._written_back = torch.zeros((), dtype=torch.int64, device=device)  # device-side count (uva)
        self._host_busy: torch.cuda.Event | None = None  # the last kernel touching host memory

    @property
    def num_rows(self) -> int:
        return self.host_weight.shape[0]

    def _fields(self) -> list[tuple[Tensor, Tensor]]:
        """(cache, host) pairs of every field, rows flattened: weight, then each optimizer state."""
        pairs = [(self.weight, self.host_weight)] + [(self.state[k], self.host_state[k]) for k in self.state]
        return [(c.view(c.shape[0], -1), h.view(h.shape[0], -1)) for c, h in pairs]

    def _swap(self, slots: Tensor, write_back: Tensor | None, load: Tensor | None) -> None:
        for cache, host in self._fields():
            kernels.swap_rows(cache, host, slots, write_back, load)
        if self.device.type == "cuda":
            self._host_busy = torch.cuda.Event()
            self._host_busy.record()

    def _host_sync(self) -> None:
        """Wait for the kernels that read or write host memory (before the CPU touches the host table)."""
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
        self.clock += 1
        slots = self.row_to_slot[rows]
        miss = (slots < 0).nonzero().squeeze(1)  # synchronises: how many rows to load
        n_miss = miss.numel()
        self.counts["cache_hits"] += rows.numel() - n_miss
        self.counts["cache_misses"] += n_miss
        if n_miss:
            victims = self._victims(n_miss, protect=slots, partial=future > 0)
            if victims.numel() < n_miss:  # a prefetch that does not fit beside the pinned rows: load what fits
                miss = miss[: victims.numel()]
                n_miss = miss.numel()
                keep = slots >= 0
                keep[miss] = True
                rows, slots, miss = rows[keep], slots[keep], torch.cumsum(keep, 0)[miss] - 1
            missing = rows[miss]
            old = self.slot_to_row[victims]
            if self.uva:
                write_back = torch.where(self.dirty[victims] & (old >= 0), old, -1)
                self._written_back += (write_back >= 0).sum()
                self._swap(victims, write_back, missing)
                self.dirty[victims] = False
                self.counts["rows_loaded"] += n_miss
            else:
                self._write_back(victims)
                self._load(missing, victims)
            self.row_to_slot[torch.where(old >= 0, old, self.num_rows)] = -1
            self.slot_to_row[victims] = missing
            self.row_to_slot[missing] = victims
            slots = slots.clone()
            slots[miss] = victims
        self.stamp[slots] = self.clock + future
        if pin:
            self.pinned[slots] = True
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

    def _victims(self, n: int, protect: Tensor, partial: bool = False) -> Tensor:
        """``n`` slots to reuse: empty ones first, then least recently stamped; never pinned or ``protect`` (-1: none)."""
        top = torch.iinfo(torch.int64).max
        key = torch.empty(self.cache_rows + 1, dtype=torch.int64, device=self.device)  # [C]: scratch for -1
        key[: self.cache_rows] = self.stamp.masked_fill(self.pinned, top)
        key[torch.where(protect >= 0, protect, self.cache_rows)] = top
        key = key[: self.cache_rows]
        available = int((key < top).sum())
        if available < n and partial:
            n = available
        if available < n:
            raise ValueError(
                f"device cache too small: a step needs {n} more rows but only {available} of {self.cache_rows} cache "
                "slots are free of the current step's rows; raise cache_rows (it must hold one step's unique rows)"
            )
        return torch.topk(key, n, largest=False, sorted=False).indices

    def _write_back(self, slots: Tensor) -> None:
        slots = slots[self.dirty[slots] & (self.slot_to_row[slots] >= 0)]
        if slots.numel() == 0:
            return
        rows = self.slot_to_row[slots].cpu()
        self.host_weight.index_copy_(0, rows, self.weight[slots].cpu())
        for k, v in self.state.items():
            self.host_state[k].index_copy_(0, rows, v[slots].cpu())
        self.dirty[slots] = False
        self.counts["rows_written_back"] += rows.numel()

    def _load(self, rows: Tensor, slots: Tensor) -> None:
        rows_cpu = rows.cpu()
        self.weight[slots] = self._h2d(self.host_weight, rows_cpu)
        for k, v in self.state.items():
            v[slots] = self._h2d(self.host_state[k], rows_cpu)
        self.dirty[slots] = False
        self.counts["rows_loaded"] += rows.numel()

    def _h2d(self, host: Tensor, rows_cpu: Tensor) -> Tensor:
        picked = host.index_select(0, rows_cpu)
        if self.pin:  # gathered into pinned memory so the copy can be asynchronous
            picked = picked.pin_memory()
        return picked.to(self.device, non_blocking=True)

    def mark_dirty(self, slots: Tensor) -> None:
        self.dirty[slots] = True

    def unpin_all(self) -> None:
        self.pinned.zero_()

    def flush(self) -> None:
        """Write every dirty cached row back to the host table."""
        slots = self.dirty.nonzero().squeeze(1)
        if self.uva:
            rows = self.slot_to_row[slots]
            write_back = torch.where(rows >= 0, rows, -1)
            self._written_back += (write_back >= 0).sum()
            self._swap(slots, write_back, None)
            self.dirty[slots] = False
            self._host_sync()
        else:
            self._write_back(slots)

    def host_rows(self, rows: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        self.flush()
        rows_cpu = rows.cpu()
        return self.host_weight[rows_cpu].to(self.device), {k: v[rows_cpu].to(self.device) for k, v in self.host_state.items()}

    def write_rows(self, rows: Tensor, weight: Tensor, state: dict[str, Tensor]) -> None:
        self.flush()
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
        self.host_weight = _grow(self.host_weight, rows, self.pin)
        self.host_state = {k: _grow(v, rows, self.pin) for k, v in self.host_state.items()}
        old = self.row_to_slot[:-1]
        self.row_to_slot = torch.cat([old, old.new_full((rows + 1 - old.numel(),), -1)])

    def stats(self) -> dict[str, int]:
        if self.uva:
            self.counts["rows_written_back"] += int(self._written_back)
            self._written_back.zero_()
        return dict(self.counts)


def _grow(t: Tensor, rows: int, pin: bool = False) -> Tensor:
    out = _empty(rows, tuple(t.shape[1:]), t.dtype, t.device, pin)
    out[: t.shape[0]] = t
    return out
