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
"""

from __future__ import annotations

import torch
from torch import Tensor

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
        self.row_to_slot = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.slot_to_row = torch.full((cache_rows,), -1, dtype=torch.int64, device=device)
        self.stamp = torch.full((cache_rows,), -1, dtype=torch.int64, device=device)  # LRU clock per slot
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool, device=device)
        self.pinned = torch.zeros(cache_rows, dtype=torch.bool, device=device)
        self.clock = 0
        self.counts = {"cache_hits": 0, "cache_misses": 0, "rows_loaded": 0, "rows_written_back": 0}

    @property
    def num_rows(self) -> int:
        return self.host_weight.shape[0]

    @property
    def cache_rows(self) -> int:
        return self.weight.shape[0]

    def ensure(self, rows: Tensor, pin: bool = True, future: int = 0) -> Tensor:
        """Cache slots of distinct ``rows``, loading misses; ``pin`` keeps them until ``unpin_all``.

        ``future`` > 0 (prefetch) stamps the rows as if used that many steps ahead, so the
        LRU choice of victims keeps them until then.
        """
        self.clock += 1
        slots = self.row_to_slot[rows]
        miss = (slots < 0).nonzero().squeeze(1)
        n_miss = miss.numel()
        self.counts["cache_hits"] += rows.numel() - n_miss
        self.counts["cache_misses"] += n_miss
        if n_miss:
            missing = rows[miss]
            victims = self._victims(n_miss, protect=slots[slots >= 0])
            self._write_back(victims)
            old = self.slot_to_row[victims]
            self.row_to_slot[old[old >= 0]] = -1
            self._load(missing, victims)
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
        slots = self.row_to_slot[rows]
        out = torch.empty(rows.numel(), self.dim, dtype=self.dtype, device=self.device)
        hit = slots >= 0
        out[hit] = self.weight[slots[hit]]
        out[~hit] = self._h2d(self.host_weight, rows[~hit].cpu())
        return out

    def _victims(self, n: int, protect: Tensor) -> Tensor:
        """``n`` slots to reuse: empty ones first, then least recently stamped; never pinned or ``protect``."""
        key = self.stamp.clone()
        key[self.pinned] = torch.iinfo(torch.int64).max
        key[protect] = torch.iinfo(torch.int64).max
        available = int((key < torch.iinfo(torch.int64).max).sum())
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
        self._write_back(self.dirty.nonzero().squeeze(1))

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
        self.host_weight = _grow(self.host_weight, rows, self.pin)
        self.host_state = {k: _grow(v, rows, self.pin) for k, v in self.host_state.items()}
        self.row_to_slot = torch.cat([self.row_to_slot, self.row_to_slot.new_full((rows - self.row_to_slot.numel(),), -1)])

    def stats(self) -> dict[str, int]:
        return dict(self.counts)


def _grow(t: Tensor, rows: int, pin: bool = False) -> Tensor:
    out = _empty(rows, tuple(t.shape[1:]), t.dtype, t.device, pin)
    out[: t.shape[0]] = t
    return out
