"""A vectorised open-addressing hash table in torch tensors: (tag, int64 key) -> int64 value.

Layout (``S`` slots, a power of two, at most ``max_load`` full)::

    slot:    0      1      2      3      4      5      6      7
    keys:   [-1   , 901  , -2   , 7    , -1   , 2**62, -1   , 12  ]   -1 empty, -2 tombstone
    tags:   [ .   , 0    , .    , 1    , .    , 0    , .    , 0   ]   which logical table a key is of
    values: [ .   , 4    , .    , 0    , .    , 2    , .    , 1   ]   the row of (tag, key)

A key's home slot is ``mix(key, tag) & (S - 1)``; collisions probe linearly. Every
operation works on a whole batch of keys at once in *rounds*: each round reads one slot
per still-active key and drops the keys that are resolved, so the Python loop runs
over probe distance (a handful of rounds at load <= 0.5), never over keys.

Insert claims an empty (or tombstone) slot by writing each claimant's batch position
into ``values`` and reading it back: exactly one claimant of a slot sees its own
position (the last write on CPU, an arbitrary one on CUDA) and the others probe on.
Rows are assigned by the caller, not by the race, so row numbers are deterministic.

Hashing or a sorted key array (``SortedIdIndex``, sorted_index.py): a sorted array looks a
key up in ``log2(N)`` dependent reads and merges (O(N)) on every insert; a probe here is 1-2
reads and insert touches only the new keys, but every probing round ends in a host
synchronisation. On a CPU that costs nothing and this table is the index; on a GPU the
round trips dominate and tables use the sorted array (``make_index``).
``benchmarks/sparse_embedding.py`` measures both (the "hash" rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

EMPTY = -1
TOMBSTONE = -2
_WINDOW = 8  # slots a lookup reads per key and round (linear probing: most keys sit within a few of their home slot)
_M1 = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64 constants as signed int64
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)


def mix(keys: Tensor, tags: Tensor | None) -> Tensor:
    """A 64-bit mix of (key, tag) (splitmix64 finaliser; int64 products wrap); ``tags=None``: all 0."""
    h = keys if tags is None else keys + tags * _M1
    h = (h ^ (h >> 30)) * _M2
    h = (h ^ (h >> 27)) * _M3
    return h ^ (h >> 31)


class IdHashTable:
    """Batched (tag, key) -> value map with linear probing; grows (and drops tombstones) by rehashing.

    Keys must be >= 0 (the callers validate raw IDs); tags are small non-negative ints.

    Example:
        >>> table = IdHashTable(1024, device="cpu")
        >>> keys = torch.tensor([5, 2**62, 7])
        >>> table.insert(keys, torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 2]))
        >>> table.lookup(torch.tensor([7, 9]), torch.zeros(2, dtype=torch.int64))
        tensor([ 2, -1])
    """

    def __init__(self, expected: int, device: torch.device | str = "cpu", max_load: float = 0.5) -> None:
        self.device = torch.device(device)
        self.max_load = max_load
        self.size = 0  # live keys
        self.used = 0  # live keys + tombstones
        self.tagged = False  # some key was inserted with a non-zero tag (else lookups without tags skip the tag check)
        self._allocate(_slots_for(expected, max_load))

    def _allocate(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.keys = torch.full((num_slots,), EMPTY, dtype=torch.int64, device=self.device)
        self.tags = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self.values = torch.zeros(num_slots, dtype=torch.int64, device=self.device)

    def find_slots(self, keys: Tensor, tags: Tensor | None) -> Tensor:
        """Slot of each (key, tag), -1 where absent (``tags=None``: all zero).

        Each round reads a window of ``_WINDOW`` consecutive slots per still-active key: a key is where it
        matches (it has one slot at most, and no EMPTY slot precedes it on its probe sequence: slots only
        become tombstones), absent if its window has an EMPTY slot and no match, else it reads the next window.
        """
        untagged = tags is None and not self.tagged  # every stored tag is 0: the keys alone decide
        mask = self.num_slots - 1
        slot = mix(keys, tags) & mask
        tags = torch.zeros_like(keys) if tags is None else tags
        out = torch.full_like(keys, -1)
        active = torch.arange(keys.numel(), device=keys.device)
        k, t = keys, tags
        window = torch.arange(_WINDOW, device=keys.device)
        for _ in range(-(-self.num_slots // _WINDOW)):
            if active.numel() == 0:
                break
            span = (slot[:, None] + window) & mask  # (A, W) the slots this round reads
            flat_span = span.view(-1)
            seen = self.keys.index_select(0, flat_span).view(span.shape)  # index_select: no advanced-indexing overhead
            match = seen == k[:, None]
            if not untagged:
                match &= self.tags.index_select(0, flat_span).view(span.shape) == t[:, None]
            hit = match.any(1)
            where = (slot + match.byte().argmax(1)) & mask  # (A,) the matching slot where ``hit``
            out.index_copy_(0, active, torch.where(hit, where, -1))  # the others are still -1
            go_on = (~hit & (seen != EMPTY).all(1)).nonzero().squeeze(1)
            active, k, t, slot = active[go_on], k[go_on], t[go_on], (slot[go_on] + _WINDOW) & mask
        return out

    def lookup(self, keys: Tensor, tags: Tensor | None) -> Tensor:
        """Value of each (key, tag), -1 where absent."""
        slots = self.find_slots(keys, tags)
        return torch.where(slots >= 0, self.values[slots.clamp(min=0)], -1)

    def insert(self, keys: Tensor, tags: Tensor | None, values: Tensor) -> None:
        """Insert (key, tag) -> value for keys that are distinct and NOT in the table (the caller looked them up)."""
        n = keys.numel()
        if n == 0:
            return
        if tags is not None and not self.tagged:
            self.tagged = bool((tags != 0).any())
        tags = torch.zeros_like(keys) if tags is None else tags
        if self.used + n > self.max_load * self.num_slots:
            self._rehash(self.size + n)
        mask = self.num_slots - 1
        position = torch.arange(n, device=keys.device)
        active, slot = position, mix(keys, tags) & mask
        claimed_empty = 0
        for _ in range(self.num_slots):
            if active.numel() == 0:
                break
            seen = self.keys[slot]
            free = (seen == EMPTY) | (seen == TOMBSTONE)
            self.values[slot[free]] = active[free]  # claim: one write per slot survives
            won = free & (self.values[slot] == active)
            won_slots, won_pos = slot[won], active[won]
            claimed_empty += int((seen[won] == EMPTY).sum())
            self.keys[won_slots] = keys[won_pos]
            self.tags[won_slots] = tags[won_pos]
            self.values[won_slots] = values[won_pos]
            lost = (~won).nonzero().squeeze(1)
            # a loser of a claim re-reads the same (now taken) slot next round and moves on then
            active, slot = active[lost], torch.where(free[lost], slot[lost], (slot[lost] + 1) & mask)
        self.size += n
        self.used += claimed_empty

    def delete(self, keys: Tensor, tags: Tensor | None) -> int:
        """Remove the (key, tag) pairs that are present; return how many were."""
        slots = self.find_slots(keys, tags)
        slots = slots[slots >= 0]
        self.keys[slots] = TOMBSTONE
        self.size -= slots.numel()
        return slots.numel()

    def items(self) -> tuple[Tensor, Tensor, Tensor]:
        """(keys, tags, values) of every live entry, in slot order."""
        live = self.keys >= 0
        return self.keys[live], self.tags[live], self.values[live]

    def _rehash(self, need: int) -> None:
        keys, tags, values = self.items()
        self._allocate(max(self.num_slots, _slots_for(need, self.max_load)))
        self.size = self.used = 0
        self.insert(keys, tags, values)

    def state_tensors(self) -> dict[str, Tensor]:
        """Live entries as tensors (what a checkpoint stores; slots are rebuilt on load)."""
        keys, tags, values = self.items()
        return {"keys": keys, "tags": tags, "values": values}


def _slots_for(entries: int, max_load: float) -> int:
    need = max(16, int(entries / max_load) + 1)
    return 1 << (need - 1).bit_length()
