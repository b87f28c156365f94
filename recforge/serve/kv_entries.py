"""The KV pool's per-user entry, its host-memory accounting, the pool's counters and its report (``kv_pool.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor

if TYPE_CHECKING:
    from recforge.serve.kv_pool import KVCachePool

ENTRY_OVERHEAD = 512  # bytes of Python objects per cached user (dict slot, dataclass, tensor headers), counted


@dataclass
class _Entry:
    blocks: list[int]  # device block ids, or host page ids while on the host tier
    length: int
    tokens: Tensor  # (n, 4) CPU token identities
    num_contextual: int
    version: str
    generation: int
    index: Tensor | None = None  # device tier: ``blocks`` as a device tensor, made when needed (KVCachePool._index)
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


def _metadata_bytes(user: str, entry: _Entry) -> int:
    """Host memory of an entry besides its pages: token identities, block ids, the user key."""
    return entry.tokens.numel() * 8 + len(entry.blocks) * 8 + len(user.encode()) + ENTRY_OVERHEAD


def _common_prefix(entry: _Entry, identity: Tensor, num_contextual: int) -> int:
    """How many first tokens of ``identity`` the entry holds with the same keys/values: the common prefix of
    their token identities, 0 when it ends inside the contextual tokens (or they differ in number)."""
    if entry.num_contextual != num_contextual:
        return 0
    k = min(entry.length, identity.shape[0])
    ours, theirs = entry.tokens.numpy()[:k], identity.numpy()[:k]  # NumPy: small host arrays, no torch dispatch
    if np.array_equal(ours, theirs):  # the usual case (a returning user's new request extends its entry): one pass
        n = k
    else:
        n = int(np.flatnonzero((ours != theirs).any(1))[0])
    return n if n >= num_contextual else 0


def pool_report(pool: KVCachePool) -> dict[str, float | str]:
    """``pool.report()``: both tiers' users and bytes, the eviction order's segments and every counter."""
    s = pool.stats
    hits = s.device_hits + s.host_hits - s.stale
    tokens = s.reused_tokens + s.computed_tokens
    hp = pool.host_pages
    return {
        "users_device": len(pool.entries),
        "users_host": len(pool.host),
        "device_bytes_capacity": pool.num_blocks * pool.block_bytes,
        "device_bytes_used": (pool.num_blocks - len(pool.free)) * pool.block_bytes,
        "host_bytes_capacity": pool.host_limit,
        "host_bytes_used": pool.host_bytes,
        "host_pages_bytes_used": (hp.num_pages - len(hp.free)) * hp.page_bytes,
        "metadata_bytes": pool.metadata_bytes,
        "policy": pool.config.policy,
        "users_protected": len(pool.order.protected),
        "users_host_protected": len(pool.host_order.protected),
        "ghost_users": len(pool.ghost),
        "ghost_bytes": pool.ghost.bytes,
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
