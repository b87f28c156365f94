"""The KV pool's host tier: its state and bound, and the moves between the tiers (``kv_pool.py``'s ``KVCachePool``).

A device entry evicted for room has its pages copied into free host pages (``_evict``), or is dropped when
the host tier cannot hold it (``_host_room``: grow the slab while ``host_mb`` allows, else drop the host
tier's own victims). A host hit is promoted (``_promote``): device pages are reserved (evicting others), its
pages copied back, its host pages freed. A user dropped from both tiers is remembered on the ghost list
(``_remember``, slru). Every copy is asynchronous on the current stream (``kv_host.py``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from recforge.serve.kv_entries import ENTRY_OVERHEAD, PoolStats, _Entry, _metadata_bytes
from recforge.serve.kv_host import HostPages
from recforge.serve.kv_policy import GhostList, Segments

if TYPE_CHECKING:
    from recforge.serve.kv_pool import PoolConfig


class HostTier:
    """``KVCachePool``'s host-tier half (a mixin): it reads the device tier through the attributes below."""

    # the device tier's, set and defined by KVCachePool
    config: PoolConfig
    times: Tensor
    keys: Tensor
    values: Tensor
    free: list[int]
    entries: OrderedDict[str, _Entry]
    order: Segments
    metadata_bytes: int
    stats: PoolStats
    _reserve: Callable[[int], bool]  # free device blocks, evicting for room
    _release: Callable[[list[int]], None]  # device blocks back on the free list

    def _init_host_tier(self, page_shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, pin: bool, share: float) -> None:
        """The host tier's state; its slab allocated now when ``host_prealloc`` (never while serving)."""
        self.host: OrderedDict[str, _Entry] = OrderedDict()
        self.host_limit = int(self.config.host_mb * 2**20)
        self.host_order = Segments(share, 0)  # the host tier's eviction order; its capacity follows the slab's pages
        # users dropped from both tiers (slru), in the host bound; the slab leaves room for the list
        self.ghost = GhostList(self.host_limit // 128 if share else 0)
        self._slab_limit = self.host_limit - self.ghost.limit
        self.host_pages = HostPages(page_shapes, dtype, pin=pin)
        self.host_metadata_bytes = 0  # host entries' token identities and user keys (counted in host_mb)
        self.host_fixed = False  # the slab is whole (preallocated): it never grows while serving
        if self.config.host_prealloc and self.host_limit > 0:
            self.host_fixed = self._preallocate_host()
        self.host_order.capacity = self.host_pages.num_pages

    @property
    def host_bytes(self) -> int:
        """Host memory the host tier holds: its slab (allocated pages, used or free), its entries' metadata and the
        ghost list."""
        return self.host_pages.allocated_bytes + self.host_metadata_bytes + self.ghost.bytes

    def _evict(self, user: str, entry: _Entry) -> None:
        """Move device ``entry`` to the host tier (its pages copied asynchronously), or drop it."""
        blocks, meta = entry.blocks, _metadata_bytes(user, entry)
        try:
            if self._host_room(len(blocks), meta):
                pages = self.host_pages.take(len(blocks))
                self.host_pages.store(pages, self.times, self.keys, self.values, blocks)
                entry.blocks, entry.index = pages, None
                self.host[user] = entry
                self.host_order.add(user, len(pages), entry.protected)
                self.host_metadata_bytes += meta
                self.stats.evicted_to_host += 1
            else:
                self.stats.dropped += 1
                self._remember(user)
        finally:  # the device pages are free again whatever happened to the copy
            self._release(blocks)

    def _host_room(self, pages: int, meta: int) -> bool:
        """Make ``pages`` free host pages and ``meta`` bytes of metadata fit the host bound: grow the slab while
        the bound allows, else drop least recently used host entries. False when it cannot."""
        hp, limit = self.host_pages, self.host_limit
        if pages * hp.page_bytes + meta > limit or (self.host_fixed and pages > hp.num_pages):
            return False  # never empties the tier for an entry that cannot fit anyway
        while True:
            spare = limit - hp.allocated_bytes - self.host_metadata_bytes - self.ghost.bytes - meta
            if len(hp.free) >= pages and spare >= 0:
                return True
            if len(hp.free) >= pages and self.ghost:  # short of metadata room only: forget a ghost, not an entry
                self.ghost.forget_oldest()
                continue
            # a new chunk leaves room for the metadata of the entries its pages will hold (judged by this one's)
            per_page = meta / max(pages, 1)  # an empty prefix (no pages) still has metadata
            rows = (self._slab_limit - hp.allocated_bytes - hp.num_pages * per_page) // (hp.page_bytes + per_page)
            if not self.host_fixed and len(hp.free) < pages and hp.grow(min(spare, int(rows) * hp.page_bytes)):
                self.host_order.capacity = hp.num_pages
                continue
            if not self.host:
                return False
            victim = self.host_order.victim()
            self._drop_host(victim)
            self.stats.dropped += 1
            self._remember(victim)

    def _preallocate_host(self) -> bool:
        """The whole host slab now: as many pages as the bound holds beside the metadata of the entries they can
        hold, judged for one-page entries (the most metadata per page) with a 64-byte user id. True when it is
        whole; False when an allocation was refused part way (the tier then grows as it fills, like
        ``host_prealloc: false``, once memory is free again)."""
        hp = self.host_pages
        per_page = self.config.block_size * 4 * 8 + 8 + ENTRY_OVERHEAD + 64
        slab = self._slab_limit * hp.page_bytes // (hp.page_bytes + per_page)
        while hp.grow(slab - hp.allocated_bytes):
            pass
        return slab - hp.allocated_bytes < hp.page_bytes  # else grow stopped on a refusal, not for lack of room

    def _promote(self, user: str, entry: _Entry) -> None:
        """Host ``entry`` back into device pages (evicting others for room), its host pages freed."""
        meta = _metadata_bytes(user, entry)
        del self.host[user]  # out of the host order: its pages are never dropped while they are read
        self.host_order.remove(user)
        self.host_metadata_bytes -= meta
        pages = entry.blocks
        try:
            self._reserve(len(pages))  # always succeeds: the entry came from the device tier
            blocks = [heapq.heappop(self.free) for _ in pages]
            self.host_pages.load(pages, self.times, self.keys, self.values, blocks)
        finally:  # reused only by copies issued after this one on the same stream; never lost on an error
            self.host_pages.release(pages)
        entry.blocks, entry.index = blocks, None  # the device index is made when needed (KVCachePool._index)
        self.entries[user] = entry
        self.order.add(user, len(blocks), protected=True)  # it came back: a user seen again
        self.metadata_bytes += meta

    def _drop_host(self, user: str) -> None:
        entry = self.host.pop(user)
        self.host_order.remove(user)
        self.host_pages.release(entry.blocks)
        self.host_metadata_bytes -= _metadata_bytes(user, entry)

    def _remember(self, user: str) -> None:
        """``user`` left both tiers: its key on the ghost list (slru), within the host bound."""
        self.ghost.remember(user)
        while self.ghost and self.host_bytes > self.host_limit:
            self.ghost.forget_oldest()
