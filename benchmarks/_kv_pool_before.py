# The KV-cache pool as it was before the kvburst change (commit 05e4106), frozen for the before/after
# comparison of serve_kv_churn.py. Not used by recforge.
"""Per-user KV-cache pool: paged blocks on the device, LRU eviction to a bounded host-memory tier.

Each cached user holds the per-block keys/values of its prefix (contextual + history tokens) in
fixed-size pages of ``block_size`` tokens::

    device tier   keys   (num_blocks, layers, block_size, H, Dqk)   one preallocated buffer:
                  values (num_blocks, layers, block_size, H, Dv)    the memory bound
                  user -> [block ids], length, token identities      LRU order
    host tier     user -> contiguous CPU copy (pinned on CUDA)       bounded by host_bytes, LRU

A device entry evicted for room goes to the host tier (copied on a side CUDA stream; the copy
is waited for only when the entry is read back), or is dropped when there is no host tier. A
request looks its user up (``get``), the scheduler's ``CacheManager`` checks that the cached
tokens are a prefix of the request's and were computed under the same context
(``PrefixState.is_prefix_of``), only the new tokens are computed, and ``put`` writes back just those. ``invalidate`` drops everything when
the model version changes; entries also carry their version.

Writers never mix: every entry has a *generation*, new on each write. A state read from the
pool remembers the generation it saw (``generation_of`` at lookup, 0 for none) and the model
version it was computed with; ``put`` writes only when both still hold, so a slower request for
the same user, or one computed under a model since replaced, never overwrites a newer entry
(and never appends its tokens to keys another request wrote).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from recforge.serve.state import PrefixState


@dataclass
class PoolConfig:
    """KV-cache pool bounds."""

    device_mb: float = 256.0  # device tier size (keys + values pages); fixes the number of blocks
    host_mb: float = 1024.0  # host tier bound; 0 disables the tier (evicted users are dropped)
    block_size: int = 64  # tokens per page

    def problems(self) -> list[str]:
        """Every invalid field, each message starting with the field's name."""
        checks = (("device_mb", self.device_mb > 0, "> 0"), ("host_mb", self.host_mb >= 0, ">= 0"),
                  ("block_size", self.block_size >= 1, ">= 1"))  # fmt: skip
        return [f"{name}: must be {bound}, got {getattr(self, name)}" for name, ok, bound in checks if not ok]

    def validate(self) -> None:
        if problems := self.problems():
            raise ValueError("PoolConfig: " + "; ".join(problems))


@dataclass
class _DeviceEntry:
    blocks: list[int]
    length: int
    tokens: Tensor  # (n, 4) CPU token identities
    timestamps: Tensor  # (n,) device
    num_contextual: int
    version: str
    generation: int


@dataclass
class _HostEntry:
    keys: Tensor  # (layers, n, H, Dqk) CPU
    values: Tensor
    timestamps: Tensor
    tokens: Tensor
    num_contextual: int
    version: str
    generation: int
    ready: object = None  # torch.cuda.Event of the copy, None when complete
    key_bytes: int = 0  # the user key, counted in the host bound too

    @property
    def nbytes(self) -> int:
        tensors = sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.timestamps, self.tokens))
        return tensors + self.key_bytes + ENTRY_OVERHEAD


@dataclass
class PoolStats:
    lookups: int = 0
    device_hits: int = 0
    host_hits: int = 0
    misses: int = 0
    stale: int = 0  # found but not reusable (other model version, history changed)
    evicted_to_host: int = 0
    dropped: int = 0
    too_large: int = 0
    stale_writes: int = 0  # write-backs refused: the entry changed, or the model did, since the lookup
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
        self.block_bytes = num_layers * bs * heads * (dqk + dv) * elem
        self.num_blocks = max(1, int(self.config.device_mb * 2**20 // self.block_bytes))
        self.keys = torch.zeros(self.num_blocks, num_layers, bs, heads, dqk, dtype=dtype, device=device)
        self.values = torch.zeros(self.num_blocks, num_layers, bs, heads, dv, dtype=dtype, device=device)
        self.device = torch.device(device)
        self.free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self.entries: OrderedDict[str, _DeviceEntry] = OrderedDict()
        self.host: OrderedDict[str, _HostEntry] = OrderedDict()
        self.host_bytes = 0
        self.version = version
        self.stats = PoolStats()
        self.metadata_bytes = 0  # device entries' token identities, timestamps and user keys (host memory)
        self._generations = itertools.count(1)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def for_engine(cls, engine, config: PoolConfig | None = None) -> KVCachePool:
        cfg = engine.model.encoder.cfg
        return cls(cfg.num_blocks, cfg.num_heads, cfg.dqk, cfg.dv, engine.dtype, engine.device, config, engine.version)

    # ------------------------------------------------------------------------------- reads

    def get(self, user: str, capacity: int = 0) -> PrefixState | None:
        """A working copy of ``user``'s cached prefix with room for ``capacity`` tokens, or None."""
        self.stats.lookups += 1
        entry = self.entries.get(user)
        if entry is not None and entry.version == self.version:
            self.entries.move_to_end(user)
            self.stats.device_hits += 1
            return self._materialize(entry, capacity)
        host = self.host.get(user)
        if host is not None and host.version == self.version:
            self.stats.host_hits += 1
            if host.ready is not None:
                host.ready.synchronize()
            state = self._state_from_host(host, capacity)
            self._drop_host(user)
            self._write(user, state, 0, host.generation)  # promote: back into device pages, same content
            return state
        self.stats.misses += 1
        return None

    def _materialize(self, entry: _DeviceEntry, capacity: int) -> PrefixState:
        n, idx = entry.length, torch.tensor(entry.blocks, device=self.device)
        layers, heads, dqk, dv = self.keys.shape[1], self.keys.shape[3], self.keys.shape[4], self.values.shape[4]
        state = PrefixState(layers, max(capacity, n), heads, dqk, dv, entry.num_contextual, self.keys.dtype,
                            self.device)  # fmt: skip
        state.keys[:, :n] = self.keys[idx].transpose(0, 1).reshape(layers, -1, heads, dqk)[:, :n]
        state.values[:, :n] = self.values[idx].transpose(0, 1).reshape(layers, -1, heads, dv)[:, :n]
        state.timestamps[:n] = entry.timestamps
        state.tokens[:n] = entry.tokens
        state.length = n
        state.version, state.generation = entry.version, entry.generation
        return state

    def _state_from_host(self, host: _HostEntry, capacity: int) -> PrefixState:
        layers, n, heads, dqk = host.keys.shape
        state = PrefixState(layers, max(capacity, n), heads, dqk, host.values.shape[3], host.num_contextual,
                            self.keys.dtype, self.device)  # fmt: skip
        state.keys[:, :n] = host.keys.to(self.device, non_blocking=True)
        state.values[:, :n] = host.values.to(self.device, non_blocking=True)
        state.timestamps[:n] = host.timestamps.to(self.device)
        state.tokens[:n] = host.tokens
        state.length = n
        state.version, state.generation = host.version, host.generation
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
        was read (a newer request wrote it), or the prefix does not fit at all."""
        if state.version != self.version or self.generation_of(user) != state.generation:
            self.stats.stale_writes += 1
            return False
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
        if entry is None or entry.version != self.version or entry.length != start or start == 0:
            self.discard(user)
            entry = _DeviceEntry([], 0, state.tokens[:0], state.timestamps[:0], state.num_contextual,
                                 self.version, generation)  # fmt: skip
            start = 0
        else:
            self._pop_entry(user)
        grow = needed - len(entry.blocks)
        if not self._reserve(grow):
            self._release(entry.blocks)
            self.stats.too_large += 1
            return False
        entry.blocks += [self.free.pop() for _ in range(grow)]
        pos = torch.arange(start, n, device=self.device)
        blocks = torch.tensor(entry.blocks, device=self.device)[pos // bs]
        slots = pos % bs
        # (layers, m, H, D) -> pages[block, layer, slot]
        self.keys[blocks, :, slots] = state.keys[:, start:n].transpose(0, 1)
        self.values[blocks, :, slots] = state.values[:, start:n].transpose(0, 1)
        entry.length = n
        entry.tokens = state.tokens[:n].clone()
        entry.timestamps = state.timestamps[:n].clone()
        entry.generation = generation
        self.entries[user] = entry
        self.metadata_bytes += _metadata_bytes(user, entry)
        return True

    def _pop_entry(self, user: str) -> _DeviceEntry | None:
        entry = self.entries.pop(user, None)
        if entry is not None:
            self.metadata_bytes -= _metadata_bytes(user, entry)
        return entry

    def _reserve(self, blocks: int) -> bool:
        while len(self.free) < blocks and self.entries:
            victim = next(iter(self.entries))
            self._evict(victim, self._pop_entry(victim))
        return len(self.free) >= blocks

    def _evict(self, user: str, entry: _DeviceEntry) -> None:
        if self.config.host_mb > 0:
            state = self._materialize(entry, 0)
            host = self._to_host(state, entry)
            host.key_bytes = len(user.encode())
            if host.nbytes <= self.config.host_mb * 2**20:
                while self.host and self.host_bytes + host.nbytes > self.config.host_mb * 2**20:
                    self._drop_host(next(iter(self.host)))
                    self.stats.dropped += 1
                self.host[user] = host
                self.host_bytes += host.nbytes
                self.stats.evicted_to_host += 1
            else:
                self.stats.dropped += 1
        else:
            self.stats.dropped += 1
        self._release(entry.blocks)

    def _to_host(self, state: PrefixState, entry: _DeviceEntry) -> _HostEntry:
        n = state.length
        keys, values = state.keys[:, :n], state.values[:, :n]
        ready = None
        if self._stream is not None:  # copy back asynchronously; readers wait on the event
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host_k = torch.empty(keys.shape, dtype=keys.dtype, pin_memory=True).copy_(keys, non_blocking=True)
                host_v = torch.empty(values.shape, dtype=values.dtype, pin_memory=True).copy_(values, non_blocking=True)
                keys.record_stream(self._stream)
                values.record_stream(self._stream)
                ready = torch.cuda.Event()
                ready.record(self._stream)
        else:
            host_k, host_v = keys.clone(), values.clone()
        return _HostEntry(host_k, host_v, state.timestamps[:n].cpu(), state.tokens[:n].clone(), entry.num_contextual,
                          entry.version, entry.generation, ready)  # fmt: skip

    def _release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def _drop_host(self, user: str) -> None:
        host = self.host.pop(user)
        self.host_bytes -= host.nbytes

    def discard(self, user: str) -> None:
        """Forget ``user`` in both tiers."""
        entry = self._pop_entry(user)
        if entry is not None:
            self._release(entry.blocks)
        if user in self.host:
            self._drop_host(user)

    def invalidate(self, version: str) -> None:
        """A new model version: every cached prefix is stale."""
        self.version = version
        for user in list(self.entries):
            self.discard(user)
        for user in list(self.host):
            self._drop_host(user)

    # ------------------------------------------------------------------------------- reporting

    def record(self, reused: int, computed: int) -> None:
        """Prefix tokens a request reused from the cache and computed itself."""
        self.stats.reused_tokens += reused
        self.stats.computed_tokens += computed

    def mark_stale(self, user: str) -> None:
        """The entry found for ``user`` was not a prefix of its request (history rewritten, other
        request time or features): drop it; the request computes from scratch."""
        self.stats.stale += 1
        self.discard(user)

    def report(self) -> dict[str, float]:
        s = self.stats
        hits = s.device_hits + s.host_hits - s.stale
        tokens = s.reused_tokens + s.computed_tokens
        return {
            "users_device": len(self.entries),
            "users_host": len(self.host),
            "device_bytes_capacity": self.num_blocks * self.block_bytes,
            "device_bytes_used": (self.num_blocks - len(self.free)) * self.block_bytes,
            "host_bytes_capacity": int(self.config.host_mb * 2**20),
            "host_bytes_used": self.host_bytes,
            "metadata_bytes": self.metadata_bytes,
            "lookups": s.lookups,
            "device_hits": s.device_hits,
            "host_hits": s.host_hits,
            "misses": s.misses,
            "stale": s.stale,
            "hit_rate": hits / s.lookups if s.lookups else 0.0,
            "token_hit_rate": s.reused_tokens / tokens if tokens else 0.0,
            "evicted_to_host": s.evicted_to_host,
            "dropped": s.dropped,
            "too_large": s.too_large,
            "stale_writes": s.stale_writes,
        }


ENTRY_OVERHEAD = 512  # bytes of Python objects per cached user (dict slot, dataclass, tensor headers), counted


def _metadata_bytes(user: str, entry: _DeviceEntry) -> int:
    """Host memory of a device entry besides its pages: token identities, timestamps, the user key."""
    return entry.tokens.numel() * 8 + entry.timestamps.numel() * 8 + len(user.encode()) + ENTRY_OVERHEAD


__all__ = ["KVCachePool", "PoolConfig", "PoolStats"]
