"""Per-request KV-cache bookkeeping: the scheduler's one interface to the pool (vLLM's KV cache manager).

``KVCachePool`` (``kv_pool.py``) stores prefixes; this module decides what a request may reuse
and what it may write back:

- ``acquire``: a working ``PrefixState`` for a request, starting from the longest prefix of the
  request's tokens that the user's entry holds (prefix match: the whole entry when the request
  extends it; the request's own prefix when it is an older request, arriving after a newer one was
  cached; the common part when the histories diverge), else empty. The entry itself is left as it
  is. The state is tagged with the model version computing it and the pool entry's generation it
  was read from.
- ``release``: write the request's new tokens back. The pool refuses it when the entry changed
  since the lookup (a newer request wrote it) or the pool now serves another model version, and
  writes nothing when the request computed nothing the entry lacks (an older request).

A manager serves one engine (one model version). A pool whose version is not the engine's (the
engine was retired by a reload) is never read or written by it, so entries of two models never
mix. ``successor_pool`` decides which pool an engine built by a reload gets.

Example:
    >>> cache = CacheManager.for_engine(engine)          # engine.pool: a KVCachePool or None
    >>> state = cache.acquire("u1", tokens, num_contextual=2)
    >>> ...                                               # the scheduler fills state in chunks
    >>> cache.release("u1", state, reused)
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from recforge.serve.kv_pool import KVCachePool
from recforge.serve.state import PrefixState, copy_state, token_identity

if TYPE_CHECKING:
    from recforge.serve.engine import RankEngine


class CacheManager:
    """Prefix match, acquire/release and version/generation tagging over an optional ``KVCachePool``.

    Args:
        num_layers, heads, dqk, dv: the encoder's key/value shapes (a state holds every block's).
        dtype, device: of the keys and values.
        version: the model version whose keys this manager's states hold.
        pool: the pool to reuse and fill; None computes every prefix from scratch.
    """

    def __init__(self, num_layers: int, heads: int, dqk: int, dv: int, dtype: torch.dtype, device: torch.device,
                 version: str, pool: KVCachePool | None = None) -> None:  # fmt: skip
        self.shape = (num_layers, heads, dqk, dv)
        self.dtype, self.device, self.version = dtype, device, version
        self._pool = pool

    @classmethod
    def for_engine(cls, engine: RankEngine) -> CacheManager:
        cfg = engine.model.encoder.cfg
        return cls(cfg.num_blocks, cfg.num_heads, cfg.dqk, cfg.dv, engine.dtype, engine.device, engine.version, engine.pool)

    @property
    def pool(self) -> KVCachePool | None:
        """The pool, while it holds this manager's model version (after a reload it serves the new one)."""
        pool = self._pool
        return pool if pool is not None and pool.version == self.version else None

    def new_state(self, num_contextual: int, capacity: int) -> PrefixState:
        layers, heads, dqk, dv = self.shape
        state = PrefixState(layers, capacity, heads, dqk, dv, num_contextual, self.dtype, self.device)
        state.version = self.version
        return state

    def acquire(self, user: str, tokens: dict[str, Tensor], num_contextual: int,
                identity: Tensor | None = None) -> PrefixState:  # fmt: skip
        """A working state for a prefix of ``tokens`` (room for all of them): the longest prefix of ``tokens``
        that ``user``'s entry holds (``length`` tokens already computed; ``KVCachePool.lookup``), else an
        empty one. ``identity``: ``token_identity(tokens)`` when the caller has it."""
        pool, total = self.pool, tokens["item_ids"].numel()
        if pool is not None and identity is None:
            identity = token_identity(tokens)
        state = pool.lookup(user, identity, num_contextual, total) if pool is not None else None
        state = self._with_room(state, num_contextual, total)
        state.version = self.version
        state.generation = pool.generation_of(user) if pool is not None else 0
        return state

    def adopt(self, state: PrefixState, tokens: dict[str, Tensor], num_contextual: int) -> PrefixState:
        """A caller's own ``state`` to extend to ``tokens`` (grown when it lacks room); ``ValueError`` when it
        is not a prefix of them."""
        if not state.is_prefix_of(tokens, num_contextual):
            raise ValueError("the given state is not a prefix of this request (other features or events); "
                             "pass no state, or check PrefixState.is_prefix_of first")  # fmt: skip
        return self._with_room(state, num_contextual, tokens["item_ids"].numel())

    def release(self, user: str, state: PrefixState, reused: int) -> bool:
        """Write ``state`` back for ``user`` (only the tokens computed after ``reused``); False when there is
        no pool or the pool refused it (a newer entry for the user, or another model version)."""
        pool = self.pool
        if pool is None:
            return False
        pool.record(reused, state.length - reused)
        return pool.put(user, state, reused)

    def _with_room(self, state: PrefixState | None, num_contextual: int, total: int) -> PrefixState:
        if state is not None and state.capacity >= total:
            return state
        fresh = self.new_state(num_contextual, total)
        if state is not None:
            copy_state(state, fresh)
        return fresh


def successor_pool(pool: KVCachePool | None, engine: RankEngine) -> KVCachePool | None:
    """The pool for ``engine``, built by a reload to replace the engine that uses ``pool``.

    None when there is no pool or ``engine`` serves without a prefix cache; ``pool`` itself when its
    pages fit ``engine``'s keys and values (the caller invalidates it at the swap); else a new pool
    of the same size, its device pages allocated now, before anything live changes (so an allocation
    failure fails the reload, not the server). Its host tier grows as it fills instead of being
    preallocated: the old pool's pinned slab is held until the swap, and PyTorch's pinned-memory cache
    hands its chunks to the new tier once it is freed (never two slabs pinned at once)."""
    if pool is None or not engine.cached:
        return None
    cfg = engine.model.encoder.cfg
    fits = (tuple(pool.keys.shape[1:]) == (cfg.num_blocks, pool.config.block_size, cfg.num_heads, cfg.dqk)
            and pool.values.shape[-1] == cfg.dv and pool.keys.dtype == engine.dtype)  # fmt: skip
    return pool if fits else KVCachePool.for_engine(engine, replace(pool.config, host_prealloc=False))


__all__ = ["CacheManager", "successor_pool"]
