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
pages are reserved (evicting others), its pages copied back, its host pages freed. The host tier's
state and these moves are ``kv_tiering.py``; the entry record, its metadata bytes, the counters and
the report are ``kv_entries.py``; this module is the device tier and the lookup/put API.

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
from dataclasses import dataclass

import torch
from torch import Tensor

from recforge.serve.kv_entries import ENTRY_OVERHEAD, PoolStats, _common_prefix, _Entry, _metadata_bytes, pool_report
from recforge.serve.kv_policy import POLICIES, Segments
from recforge.serve.kv_tiering import HostTier
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


class KVCachePool(HostTier):
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
        share = self.config.protected_share if self.config.policy == "slru" else 0.0
        self.order = Segments(share, self.num_blocks)  # the device tier's eviction order
        self._init_host_tier(((num_layers, bs, heads, dqk), (num_layers, bs, heads, dv)), dtype, self.device.type == "cuda",
                             share)  # fmt: skip
        self.metadata_bytes = 0  # device entries' token identities and user keys (host memory)
        self.version = version
        self.stats = PoolStats()
        self._generations = itertools.count(1)

    @classmethod
    def for_engine(cls, engine, config: PoolConfig | None = None) -> KVCachePool:
        cfg = engine.model.encoder.cfg
        return cls(cfg.num_blocks, cfg.num_heads, cfg.dqk, cfg.dv, engine.dtype, engine.device, config, engine.version)

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
        b = math.ceil(n / bs)
        # room for whole pages, so they are copied straight into the state (no reshaped copy in between)
        # (the rows past ``n`` hold the last page's other tokens; rows past ``length`` are never read)
        state = PrefixState(layers, max(capacity, b * bs), heads, dqk, dv, entry.num_contextual, self.keys.dtype,
                            self.device)  # fmt: skip
        keys = state.keys[:, : b * bs].view(layers, b, bs, heads, dqk)  # the state's rows as pages
        values = state.values[:, : b * bs].view(layers, b, bs, heads, dv)
        times = state.timestamps[: b * bs].view(b, bs)
        first, blocks = entry.blocks[0], entry.blocks[:b]
        if blocks == list(range(first, first + b)):  # one run of pages (usual: free pages are taken lowest first)
            keys.copy_(self.keys[first : first + b].transpose(0, 1))  # read as a slice: one copy each, no gather
            values.copy_(self.values[first : first + b].transpose(0, 1))
            times.copy_(self.times[first : first + b])
        else:  # pages (b, layers, bs, H, D) gathered, then copied into the state's (layers, b * bs, H, D)
            idx = self._index(entry)[:b]
            keys.copy_(self.keys[idx].transpose(0, 1))
            values.copy_(self.values[idx].transpose(0, 1))
            torch.index_select(self.times, 0, idx, out=times)
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
        if len(entry.blocks) != blocks:
            entry.index = None  # made again when a gather or scatter needs it (_index)
        first, last = start // bs, (n - 1) // bs
        if last - first < 2:  # an extension (a few new events): slices of its one or two pages, no index tensors
            for b in range(first, last + 1):
                lo, hi, page = max(start, b * bs), min(n, (b + 1) * bs), entry.blocks[b]
                self.keys[page, :, lo - b * bs : hi - b * bs] = state.keys[:, lo:hi]
                self.values[page, :, lo - b * bs : hi - b * bs] = state.values[:, lo:hi]
                self.times[page, lo - b * bs : hi - b * bs] = state.timestamps[lo:hi]
        else:
            pos = torch.arange(start, n, device=self.device)
            pages, slots = self._index(entry)[pos // bs], pos % bs
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

    def _index(self, entry: _Entry) -> Tensor:
        """``entry.blocks`` as a device tensor (the pages' gather/scatter index), made when first needed: most
        reads and writes find their pages in one run or one or two pages and need none."""
        if entry.index is None:
            entry.index = self._device_index(entry.blocks)
        return entry.index

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

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            heapq.heappush(self.free, block)

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
        """Both tiers' users and bytes, the eviction order's segments and every counter (``kv_entries.pool_report``)."""
        return pool_report(self)


__all__ = ["ENTRY_OVERHEAD", "KVCachePool", "PoolConfig", "PoolStats"]
