"""Per-user cache of history encodings for retrieval: what a returning user's request reuses.

Each entry holds one user's encoded history (the model's per-request memory: a decoder-only model's
keys/values of every history token, an encoder-decoder's cross-attention keys/values; see
``encodings.py``) under the items it encodes::

    user -> CacheEntry(items (n,) dense item indices, tensors (on the device), version, generation, nbytes)
            LRU order, the sum of nbytes <= max_bytes

``lookup`` says how much of a request's history an entry covers: all of it (a hit: nothing to compute),
a prefix (``extendable`` models only: the causal decoder computes just the new items' tokens), or
nothing usable (a miss; ``stale`` when the user has an entry that is not a prefix: history rewritten,
or the model's window slid past its oldest items). An entry that extends the request's history (a late
request of an earlier history) is ``superseded``: the request does not replace it.

The rules of the ranking server's KV pool (``recforge.serve.kv_pool``) hold here too:

- entries carry the model version that computed them; a lookup under another version misses and
  ``invalidate(version)`` (a reload) empties the cache, so two models' encodings never mix;
- writers never mix: every write gets a new *generation*; ``put`` writes only when the user's entry
  still has the generation its lookup saw and the version still is the cache's, so a slower request
  (or one computed by a model since replaced) never overwrites a newer entry.

A lock guards every method: the worker thread writes while the HTTP thread reads ``report``.

Example:
    >>> cache = HistoryCache(max_bytes=512 << 20, version="ckpt-7")
    >>> found = cache.lookup("u42", window, "ckpt-7", extendable=True)   # found.reused items are cached
    >>> cache.put("u42", window, tensors, "ckpt-7", found.generation)
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

ENTRY_OVERHEAD = 512  # bytes of Python objects per cached user (dict slot, dataclass, tensor headers), counted


@dataclass
class CacheEntry:
    items: np.ndarray  # (n,) int64 dense item indices the tensors encode, oldest first
    tensors: tuple[Tensor, ...]  # the model's per-request encoding (encodings.py)
    version: str
    generation: int
    nbytes: int


@dataclass
class Lookup:
    """What a request may reuse: ``entry`` (None: nothing) covering its first ``reused`` window items."""

    entry: CacheEntry | None
    reused: int
    generation: int  # of the user's entry at lookup (0: none); ``put`` needs it unchanged
    superseded: bool = False  # the entry extends this request's history (a later request's): keep it, write nothing


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0  # the whole history was cached
    extends: int = 0  # a prefix was cached; only the new items were encoded
    misses: int = 0
    stale: int = 0  # an entry was found but is not reusable for the request (counted in misses too)
    evicted: int = 0
    too_large: int = 0
    stale_writes: int = 0  # write-backs refused: the entry or the model changed since the lookup
    reused_items: int = 0
    computed_items: int = 0
    extra: dict = field(default_factory=dict)


def entry_bytes(user: str, items: np.ndarray, tensors: tuple[Tensor, ...]) -> int:
    """Memory one entry holds: its tensors, its item identities, the user key and the Python objects."""
    return sum(t.numel() * t.element_size() for t in tensors) + items.nbytes + len(user.encode()) + ENTRY_OVERHEAD


class HistoryCache:
    """Bounded LRU of per-user history encodings (see the module docstring).

    Args:
        max_bytes: bound on the entries' bytes (tensors + metadata); an entry larger than it is not cached.
        version: the model version whose encodings the cache holds.
    """

    def __init__(self, max_bytes: int, version: str = "0") -> None:
        if max_bytes <= 0:
            raise ValueError(f"HistoryCache: max_bytes must be > 0, got {max_bytes} (no cache: pass none)")
        self.max_bytes, self.version = int(max_bytes), version
        self.entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self.bytes = 0
        self.stats = CacheStats()
        self._generations = itertools.count(1)
        self._lock = threading.Lock()

    def lookup(self, user: str, items: np.ndarray, version: str, extendable: bool) -> Lookup:
        """The reusable part of ``user``'s entry for a request whose model window is ``items``.

        A hit when the entry holds exactly ``items``; with ``extendable`` (a causal model) also when it
        holds a prefix of them. Counts the outcome."""
        with self._lock:
            self.stats.lookups += 1
            entry = self.entries.get(user)
            generation = entry.generation if entry is not None else 0
            n = 0 if entry is None else entry.items.size
            usable = (entry is not None and entry.version == version == self.version and 0 < n <= items.size
                      and (n == items.size or extendable) and np.array_equal(entry.items, items[:n]))  # fmt: skip
            if not usable:
                self.stats.misses += 1
                self.stats.stale += entry is not None and entry.version == self.version
                self.stats.computed_items += items.size
                superseded = (entry is not None and entry.version == self.version and n > items.size
                              and np.array_equal(entry.items[: items.size], items))  # fmt: skip
                return Lookup(None, 0, generation, superseded)
            self.entries.move_to_end(user)
            if n == items.size:
                self.stats.hits += 1
            else:
                self.stats.extends += 1
            self.stats.reused_items += n
            self.stats.computed_items += items.size - n
            return Lookup(entry, n, generation)

    def put(self, user: str, items: np.ndarray, tensors: tuple[Tensor, ...], version: str, generation: int) -> bool:
        """Cache ``tensors`` (encoding ``items``) for ``user``, evicting least recently used users for room.

        False when refused: computed under another model version, the user's entry changed since the
        lookup that returned ``generation`` (a newer request wrote it), or larger than the whole bound."""
        nbytes = entry_bytes(user, items, tensors)
        with self._lock:
            current = self.entries.get(user)
            if version != self.version or (current.generation if current is not None else 0) != generation:
                self.stats.stale_writes += 1
                return False
            self._discard(user)
            if nbytes > self.max_bytes:
                self.stats.too_large += 1
                return False
            while self.bytes + nbytes > self.max_bytes:
                self._discard(next(iter(self.entries)))
                self.stats.evicted += 1
            self.entries[user] = CacheEntry(items.copy(), tensors, version, next(self._generations), nbytes)
            self.bytes += nbytes
            return True

    def invalidate(self, version: str) -> None:
        """A new model version: every entry is stale; later writes of the old version are refused."""
        with self._lock:
            self.version = version
            self.entries.clear()
            self.bytes = 0

    def _discard(self, user: str) -> None:
        entry = self.entries.pop(user, None)
        if entry is not None:
            self.bytes -= entry.nbytes

    def report(self) -> dict[str, float]:
        """Counters for /health: lookups by outcome, bytes used of the bound, users cached."""
        with self._lock:
            s = self.stats
            return {
                "users": len(self.entries), "bytes_used": self.bytes, "bytes_capacity": self.max_bytes,
                "lookups": s.lookups, "hits": s.hits, "extends": s.extends, "misses": s.misses, "stale": s.stale,
                "hit_rate": (s.hits + s.extends) / s.lookups if s.lookups else 0.0,
                "item_hit_rate": s.reused_items / (s.reused_items + s.computed_items) if s.lookups else 0.0,
                "evicted": s.evicted, "too_large": s.too_large, "stale_writes": s.stale_writes,
            }  # fmt: skip


__all__ = ["CacheEntry", "CacheStats", "HistoryCache", "Lookup", "entry_bytes"]
