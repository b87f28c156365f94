"""Per-user KV-cache pool: paged blocks on the device, evicted to a bounded host-memory tier, then dropped.

Each cached user holds the per-block keys/values (and times) of its prefix (contextual + history
tokens) in fixed-size pages of ``block_size`` tokens::

    device tier   times  (num_blocks, block_size)            one preallocated buffer each:
                  keys   (num_blocks, layers, block_size, H, Dqk)   the memory bound
                  values (num_blocks, layers, block_size, H, Dv)
                  user -> [block ids], length, token identities      eviction order (policy)
    host tier     pages of the same shape in a reused slab (kv_host.py; pinned on CUDA), its own
                  eviction order, bounded by host_mb (the slab's bytes + the host entries' token
                  identities + the ghost list); the slab is allocated when the pool is made
                  (host_prealloc), never while serving

Eviction order (``PoolConfig.policy``, ``kv_policy.py``): ``lru``, or ``slru``: users seen once are
evicted before users seen again (a probationary and a protected segment per tier), and a user
dropped from both tiers is remembered on a small ghost list (1/128 of host_mb), so that when it
returns its entry starts protected.

A device entry evicted for room has its pages copied into free host pages, or is dropped when the
host tier cannot hold it. Every copy is asynchronous and issued on the current stream, so
nothing on the serving thread waits for one (``kv_host.py``). A host hit is promoted: device
pages are reserved (evicting others), its pages copied back, its host pages freed.

A request looks its user up with its own tokens (``lookup``): the pool compares them with the
entry's token identities on the CPU and returns a working copy of the longest reusable prefix
(the whole entry when it is a prefix of the request; the request's own tokens when the request
is an older one, a prefix of the entry; a common prefix when the histories diverge). Only the
rest is computed, and ``put`` writes back just that. ``invalidate`` drops everything when the
model version changes; entries also carry their version.

Writers never mix: every entry has a *generation*, new on each write. A state read from the
pool remembers the generation it saw (``generation_of`` at lookup, 0 for none) and the model
version it was computed with; ``put`` writes only when both still hold, so a slower request for
the same user, or one computed under a model since replaced, never overwrites a newer entry
(and never appends its tokens to keys another request wrote). A state that computed nothing the
entry lacks (an older request, served from a prefix of a newer entry) writes nothing.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from recforge.serve.kv_host import HostPages
from recforge.serve.kv_policy import POLICIES, GhostList, Segments
from recforge.serve.state import PrefixState


@dataclass
class PoolConfig:
    """KV-cache pool bounds."""

    device_mb: float = 256.0  # device tier size (keys + values + times pages); fixes the number of blocks
    host_mb: float = 1024.0  # host tier bound (pages + token identities); 0 disables the tier (evicted users are dropped)
    block_size: int = 64  # tokens per page
    # allocate the host tier's page slab (pinned on CUDA) when the pool is made, so serving never allocates it;
    # False: as the tier first fills (an idle server pins nothing, the first evictions pay the allocations)
    host_prealloc: bool = True
    # eviction order of both tiers: slru (users seen once go before users seen again; kv_policy.py) | lru;
    # slru recomputes fewer prefix tokens on every trace with one-time users (benchmarks/serve_kv_policy.py)
    policy: str = "slru"
    protected_share: float = 0.8  # slru: most of each tier's pages held by users seen again

    def problems(self) -> list[str]:
        """Every invalid field, each message starting with the field's name."""
        checks = (("device_mb", self.device_mb > 0, "> 0"), ("host_mb", self.host_mb >= 0, ">= 0"),
                  ("block_size", self.block_size >= 1, ">= 1"),
                  ("protected_share", 0 < self.protected_share <= 1, "in (0, 1]"))  # fmt: skip
        problems = [f"{name}: must be {bound}, got {getattr(self, name)}" for name, ok, bound in checks if not ok]
        if self.policy not in POLICIES:
            problems.append(f"policy: {self.policy!r} is not one of {POLICIES}")
        return problems

    def validate(self) -> None:
        if problems := self.problems():
            raise ValueError("PoolConfig: " + "; ".join(problems))


@dataclass
class _Entry:
    blocks: list[int]  # device block ids, or host page ids while on the host tier
    length: int
    tokens: Tensor  # (n, 4) CPU token identities
    num_contextual: int
    version: str
    generation: int
    index: Tensor | None = None  # device tier: ``blocks`` as a device tensor (the pages' gather/scatter index)
    protected: bool = False  # in its tier's protected segment when it left it (kv_policy.py)


@dataclass
class PoolStats:
    lookups: int = 0
    device_hits: int = 0
    host_hits: int = 0
    misses: int = 0
    stale: int = 0  # found but nothing reusable (other model version or features, history changed from the start)
    older: int = 0  # the request was a prefix of its entry (an older request arriving late): served read-only
    diverged: int = 0  # the request shared only a common prefix with its entry: that prefix reused
    evicted_to_host: int = 0
    dropped: int = 0
    too_large: int = 0
    stale_writes: int = 0  # write-backs refused: the entry changed, or the model did, since the lookup
    ghost_admissions: int = 0  # users dropped earlier, cached again as protected (slru)
    reused_tokens: int = 0
    computed_tokens: int = 0
    extra: dict = field(default_factory=dict)


class KVCachePool:
    """Bounded per-user prefix caches; see the module docstring.

    Example:
        >>> pool = KVCachePool.for_engine(engine, PoolConfig(device_mb=512, host_mb=4096))
        >>> engine.pool = pool                    # its schedulers (and rank_encoded) now reuse and extend caches
    """

    def __init__(self, num_layers: int, heads: int, dqk: int, dv: int, dtype: torch.dtype, device: torch.device,
                 config: PoolConfig | None = None, version: str = "0") -> None:  # fmt: skip
        self.config = config or PoolConfig()
        self.config.validate()
        bs = self.config.block_size
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = num_layers * bs * heads * (dqk + dv) * elem + bs * 8  # keys, values, times
        self.num_blocks = max(1, int(self.config.device_mb * 2**20 // self.block_bytes))
        self.device = torch.device(device)
        self.times = torch.zeros(self.num_blocks, bs, dtype=torch.int64, device=device)
        self.keys = torch.zeros(self.num_blocks, num_layers, bs, heads, dqk, dtype=dtype, device=device)
        self.values = torch.zeros(self.num_blocks, num_layers, bs, heads, dv, dtype=dtype, device=device)
        self.free: list[int] = list(range(self.num_blocks))  # a heap: the lowest ids first, so an entry's pages
        # tend to be consecutive, and its copies to and from the host tier few
        self.entries: OrderedDict[str, _Entry] = OrderedDict()
        self.host: OrderedDict[str, _Entry] = OrderedDict()
        self.host_limit = int(self.config.host_mb * 2**20)
        share = self.config.protected_share if self.config.policy == "slru" else 0.0
        self.order = Segments(share, self.num_blocks)  # the device tier's eviction order
        self.host_order = Segments(share, 0)  # the host tier's; its capacity follows the slab's pages
        # users dropped from both tiers (slru), in the host bound; the slab leaves room for the list
        self.ghost = GhostList(self.host_limit // 128 if share else 0)
        self._slab_limit = self.host_limit - self.ghost.limit
        self.host_pages = HostPages(((num_layers, bs, heads, dqk), (num_layers, bs, heads, dv)), dtype,
                                    pin=self.device.type == "cuda")  # fmt: skip
        self.host_metadata_bytes = 0  # host entries' token identities and user keys (counted in host_mb)
        self.host_fixed = False  # the slab is whole (preallocated): it never grows while serving
        if self.config.host_prealloc and self.host_limit > 0:
            self.host_fixed = self._preallocate_host()
        self.host_order.capacity = self.host_pages.num_pages
        self.metadata_bytes = 0  # device entries' token identities and user keys (host memory)
        self.version = version
        self.stats = PoolStats()
        self._generations = itertools.count(1)

    @classmethod
    def for_engine(cls, engine, config: PoolConfig | None = None) -> KVCachePool:
        cfg = engine.model.encoder.cfg
        return cls(cfg.num_blocks, cfg.num_heads, cfg.dqk, cfg.dv, engine.dtype, engine.device, config, engine.version)

    @property
    def host_bytes(self) -> int:
        """Host memory the host tier holds: its slab (allocated pages, used or free), its entries' metadata and the
        ghost list."""
        return self.host_pages.allocated_bytes + self.host_metadata_bytes + self.ghost.bytes

    # ------------------------------------------------------------------------------- reads

    def lookup(self, user: str, identity: Tensor | None = None, num_contextual: int = 0,
               capacity: int = 0) -> PrefixState | None:  # fmt: skip
        """A working copy of the longest prefix of a request's tokens that ``user``'s entry holds, with room
        for ``capacity`` tokens; None when nothing is reusable.

        Args:
            identity: (n, 4) the request's prefix token identities (``state.token_identity``); None: the whole entry.
            num_contextual: the request's contextual tokens (an entry computed with other ones is not reusable,
                nor a common prefix that ends inside them: they attend to each other both ways).
        """
        self.stats.lookups += 1
        entry, on_device = self.entries.get(user), True
        if entry is None or entry.version != self.version:
            entry, on_device = self.host.get(user), False
            if entry is None or entry.version != self.version:
                self.stats.misses += 1
                return None
        if on_device:
            self.stats.device_hits += 1
        else:
            self.stats.host_hits += 1
        n = entry.length if identity is None else _common_prefix(entry, identity, num_contextual)
        if n == 0:
            self.stats.stale += 1
            return None
        if n < entry.length:
            if n == identity.shape[0]:
                self.stats.older += 1
            else:
                self.stats.diverged += 1
        if on_device:
            self.order.hit(user)
        else:
            self._promote(user, entry)
        return self._materialize(entry, n, capacity)

    def _materialize(self, entry: _Entry, n: int, capacity: int) -> PrefixState:
        """A new state holding the first ``n`` tokens of device ``entry``."""
        layers, bs, heads, dqk = self.keys.shape[1:]
        dv = self.values.shape[4]
        state = PrefixState(layers, max(capacity, n), heads, dqk, dv, entry.num_contextual, self.keys.dtype,
                            self.device)  # fmt: skip
        idx = entry.index[: math.ceil(n / bs)]
        # pages (b, layers, bs, H, D) -> (layers, b * bs, H, D)
        state.keys[:, :n] = self.keys[idx].transpose(0, 1).reshape(layers, -1, heads, dqk)[:, :n]
        state.values[:, :n] = self.values[idx].transpose(0, 1).reshape(layers, -1, heads, dv)[:, :n]
        state.timestamps[:n] = self.times[idx].reshape(-1)[:n]
        state.tokens[:n] = entry.tokens[:n]
        state.length = n
        state.version, state.generation = entry.version, entry.generation
        return state

    def generation_of(self, user: str) -> int:
        """The generation of ``user``'s current entry in either tier (0: none); see the module docstring."""
        entry = self.entries.get(user) or self.host.get(user)
        return entry.generation if entry is not None else 0

    # ------------------------------------------------------------------------------- writes

    def put(self, user: str, state: PrefixState, start: int) -> bool:
        """Cache ``state`` for ``user``; when the cached entry already holds its first ``start`` tokens,
        only tokens ``[start, length)`` are written. Returns False when the write is refused: ``state``
        was computed with another model version, ``user``'s entry changed since ``state.generation``
        was read (a newer request wrote it), or the prefix does not fit at all. A state that computed
        nothing the entry lacks (``start == length <=`` the entry's length) keeps the entry as it is."""
        if state.version != self.version or self.generation_of(user) != state.generation:
            self.stats.stale_writes += 1
            return False
        entry = self.entries.get(user) or self.host.get(user)
        if entry is not None and state.length <= start and state.length <= entry.length:
            if user in self.entries:
                self.order.touch(user)
            return True
        state.generation = next(self._generations)
        return self._write(user, state, start, state.generation)

    def _write(self, user: str, state: PrefixState, start: int, generation: int) -> bool:
        n, bs = state.length, self.config.block_size
        needed = math.ceil(n / bs)
        if needed > self.num_blocks:
            self.stats.too_large += 1
            self.discard(user)
            return False
        entry = self.entries.get(user)
        if entry is None or entry.version != self.version or start == 0 or entry.length < start:
            # a user seen before (cached in a tier, or dropped and remembered) starts protected
            ghost = self.ghost.take(user)
            self.stats.ghost_admissions += ghost
            returning = ghost or user in self.entries or user in self.host
            self.discard(user)
            entry = _Entry([], 0, state.tokens[:0], state.num_contextual, self.version, generation, protected=returning)
            start = 0
        else:  # out of the eviction order while reserving, so never its own victim
            self._pop_entry(user)
        blocks = len(entry.blocks)
        if blocks > needed:  # a diverged request's shorter history: the pages past it are free again
            self._release(entry.blocks[needed:])
            entry.blocks = entry.blocks[:needed]
        if not self._reserve(needed - len(entry.blocks)):
            self._release(entry.blocks)
            self.stats.too_large += 1
            return False
        entry.blocks += [heapq.heappop(self.free) for _ in range(needed - len(entry.blocks))]
        if entry.index is None or len(entry.blocks) != blocks:
            entry.index = self._device_index(entry.blocks)
        pos = torch.arange(start, n, device=self.device)
        pages, slots = entry.index[pos // bs], pos % bs
        # (layers, m, H, D) -> pages[block, layer, slot]
        self.keys[pages, :, slots] = state.keys[:, start:n].transpose(0, 1)
        self.values[pages, :, slots] = state.values[:, start:n].transpose(0, 1)
        self.times[pages, slots] = state.timestamps[start:n]
        entry.length = n
        entry.tokens = state.tokens[:n].clone()
        entry.generation = generation
        self.entries[user] = entry
        self.order.add(user, len(entry.blocks), entry.protected)
        self.metadata_bytes += _metadata_bytes(user, entry)
        return True

    def _device_index(self, blocks: list[int]) -> Tensor:
        index = torch.tensor(blocks, dtype=torch.int64)
        if self.device.type == "cuda":  # from pinned memory: an asynchronous copy, no wait for the stream
            return index.pin_memory().to(self.device, non_blocking=True)
        return index.to(self.device)

    def _pop_entry(self, user: str) -> _Entry | None:
        entry = self.entries.pop(user, None)
        if entry is not None:
            entry.protected = self.order.is_protected(user)
            self.order.remove(user)
            self.metadata_bytes -= _metadata_bytes(user, entry)
        return entry

    def _reserve(self, blocks: int) -> bool:
        while len(self.free) < blocks and self.entries:
            victim = self.order.victim()
            self._evict(victim, self._pop_entry(victim))
        return len(self.free) >= blocks

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
        entry.blocks, entry.index = blocks, self._device_index(blocks)
        self.entries[user] = entry
        self.order.add(user, len(blocks), protected=True)  # it came back: a user seen again
        self.metadata_bytes += meta

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            heapq.heappush(self.free, block)

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

    def discard(self, user: str) -> None:
        """Forget ``user`` in both tiers."""
        entry = self._pop_entry(user)
        if entry is not None:
            self._release(entry.blocks)
        if user in self.host:
            self._drop_host(user)

    def invalidate(self, version: str) -> None:
        """A new model version: every cached prefix is stale. Its users stay known (slru's ghost list, the least
        recently used first), so those who return start protected."""
        self.version = version
        users = [*self.host_order.probation, *self.host_order.protected, *self.order.probation, *self.order.protected]
        for user in list(self.entries):
            self.discard(user)
        for user in list(self.host):
            self._drop_host(user)
        for user in users:
            self._remember(user)

    # ------------------------------------------------------------------------------- reporting

    def record(self, reused: int, computed: int) -> None:
        """Prefix tokens a request reused from the cache and computed itself."""
        self.stats.reused_tokens += reused
        self.stats.computed_tokens += computed

    def report(self) -> dict[str, float | str]:
        s = self.stats
        hits = s.device_hits + s.host_hits - s.stale
        tokens = s.reused_tokens + s.computed_tokens
        hp = self.host_pages
        return {
            "users_device": len(self.entries),
            "users_host": len(self.host),
            "device_bytes_capacity": self.num_blocks * self.block_bytes,
            "device_bytes_used": (self.num_blocks - len(self.free)) * self.block_bytes,
            "host_bytes_capacity": self.host_limit,
            "host_bytes_used": self.host_bytes,
            "host_pages_bytes_used": (hp.num_pages - len(hp.free)) * hp.page_bytes,
            "metadata_bytes": self.metadata_bytes,
            "policy": self.config.policy,
            "users_protected": len(self.order.protected),
            "users_host_protected": len(self.host_order.protected),
            "ghost_users": len(self.ghost),
            "ghost_bytes": self.ghost.bytes,
            "ghost_admissions": s.ghost_admissions,
            "lookups": s.lookups,
            "device_hits": s.device_hits,
            "host_hits": s.host_hits,
            "misses": s.misses,
            "stale": s.stale,
            "older": s.older,
            "diverged": s.diverged,
            "hit_rate": hits / s.lookups if s.lookups else 0.0,
            "token_hit_rate": s.reused_tokens / tokens if tokens else 0.0,
            "evicted_to_host": s.evicted_to_host,
            "dropped": s.dropped,
            "too_large": s.too_large,
            "stale_writes": s.stale_writes,
        }


ENTRY_OVERHEAD = 512  # bytes of Python objects per cached user (dict slot, dataclass, tensor headers), counted


def _metadata_bytes(user: str, entry: _Entry) -> int:
    """Host memory of an entry besides its pages: token identities, block ids, the user key."""
    return entry.tokens.numel() * 8 + len(entry.blocks) * 8 + len(user.encode()) + ENTRY_OVERHEAD


def _common_prefix(entry: _Entry, identity: Tensor, num_contextual: int) -> int:
    """How many first tokens of ``identity`` the entry holds with the same keys/values: the common prefix of
    their token identities, 0 when it ends inside the contextual tokens (or they differ in number)."""
    if entry.num_contextual != num_contextual:
        return 0
    k = min(entry.length, identity.shape[0])
    differ = (entry.tokens[:k] != identity[:k]).any(1).nonzero()
    n = int(differ[0]) if differ.numel() else k
    return n if n >= num_contextual else 0


__all__ = ["KVCachePool", "PoolConfig", "PoolStats"]
