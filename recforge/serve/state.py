"""Working state of the engine: one user's cached prefix, and the unit of work of an engine pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class PrefixState:
    """Per-block keys/values of one user's prefix (contextual + history tokens), with room to grow.

    ``tokens`` (n, 4) holds each token's (item, action, context id, time): the identity a later
    request's prefix is compared with before this state is reused. ``version`` is the model version
    its keys/values were computed with, ``generation`` the KV-cache pool entry it was read from
    (``KVCachePool.generation_of`` at lookup): a write-back is refused when either has changed.
    """

    def __init__(self, num_layers: int, capacity: int, heads: int, dqk: int, dv: int, num_contextual: int,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        # rows past ``length`` are never read (every reader takes [:length], a pass writes a chunk's rows before it
        # reads them): no zero fill, one kernel less each
        self.keys = torch.empty(num_layers, capacity, heads, dqk, dtype=dtype, device=device)
        self.values = torch.empty(num_layers, capacity, heads, dv, dtype=dtype, device=device)
        self.timestamps = torch.empty(capacity, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(capacity, 4, dtype=torch.int64)
        self.length = 0
        self.num_contextual = num_contextual
        self.version = ""
        self.generation = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def is_prefix_of(self, tokens: dict[str, Tensor], num_contextual: int) -> bool:
        """True when this state's tokens are the first tokens of ``tokens`` (same contextual features and
        events), so its keys/values can be reused. The request time does not matter: contextual tokens
        carry no time bias, so the history's keys and values are the same whenever the user returns."""
        n = self.length
        if n > tokens["item_ids"].numel() or self.num_contextual != num_contextual:
            return False
        return bool((self.tokens[:n] == token_identity({k: v[:n] for k, v in tokens.items()})).all())

    def nbytes(self) -> int:
        n = self.length
        return (self.keys[:, :n].numel() * self.keys.element_size() + self.values[:, :n].numel() * self.values.element_size()
                + n * 8 * 5)  # fmt: skip


@dataclass
class WorkItem:
    """Query tokens of one request for one pass through the blocks.

    kind "prefix": prefix tokens ``[start, start + m)`` of ``state``, causal among themselves,
    appended to the state. kind "targets": candidates, attending to the whole state and themselves.
    """

    state: PrefixState
    features: dict[str, Tensor]
    kind: str
    start: int = 0
    identity: Tensor | None = None  # a prefix chunk's (size, 4) token identities, when the caller has them (else derived)

    def token_identities(self) -> Tensor:
        """(size, 4) the item's token identities (``token_identity`` of its features unless given)."""
        return self.identity if self.identity is not None else token_identity(self.features)

    @property
    def size(self) -> int:
        return self.features["item_ids"].numel()


def token_identity(features: dict[str, Tensor]) -> Tensor:
    """(n, 4) int64 (item, action, context id, time) per token, on the CPU."""
    return torch.stack([features[k].cpu() for k in ("item_ids", "actions", "context_ids", "timestamps")], 1)


def copy_state(src: PrefixState, dst: PrefixState) -> None:
    n = src.length
    dst.keys[:, :n] = src.keys[:, :n]
    dst.values[:, :n] = src.values[:, :n]
    dst.timestamps[:n] = src.timestamps[:n]
    dst.tokens[:n] = src.tokens[:n]
    dst.length = n
    dst.version, dst.generation = src.version, src.generation


__all__ = ["PrefixState", "WorkItem", "copy_state", "token_identity"]
