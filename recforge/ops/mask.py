"""The attention mask description: per-sequence facts from which visibility is computed.

Kernels compute visibility on the fly from this description; only the reference
implementation materialises the (B, N, N) mask, and only for one batch at a time.

Token layout of one sequence of length n (c = num_contextual, t = num_targets)::

    | contextual c | history n - c - t                 | targets t |
      full attn      causal; sees contextual              see contextual + history + self,
      among itself                                         never each other
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recforge.ops.jagged import lengths_from_offsets


@dataclass
class AttentionMask:
    """Who may attend to whom, described per sequence rather than as an L x L tensor.

    Attributes:
        causal: history tokens see only earlier tokens and themselves.
        num_targets: (B,) int64 candidate tokens at the end of each sequence (ranking);
            None means no targets.
        num_contextual: (B,) int64 tokens at the start with full attention among
            themselves, visible to every later token; None means none.
        max_attn_len: local window: a history token sees at most this many earlier
            history tokens (itself included); None means unbounded.
    """

    causal: bool = True
    num_targets: Tensor | None = None
    num_contextual: Tensor | None = None
    max_attn_len: int | None = None

    def to(self, device: torch.device | str) -> AttentionMask:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return AttentionMask(self.causal, move(self.num_targets), move(self.num_contextual), self.max_attn_len)

    def dense(self, offsets: Tensor, max_len: int) -> Tensor:
        """Materialise the (B, max_len, max_len) boolean mask, True where query i sees key j.

        Padding rows see only themselves, so a softmax over them stays finite. The result
        is kept on this (per-batch) object, since every layer asks for the same mask.
        """
        tensors = (offsets, self.num_targets, self.num_contextual)
        if any(t is not None and t.is_inference() for t in tensors):  # no version counters: don't cache
            return self._build_dense(offsets, max_len)
        # identity + version of every tensor the mask depends on, and the plain fields
        key = (max_len, self.causal, self.max_attn_len, *((None, None) if t is None else (id(t), t._version) for t in tensors))
        cached = self.__dict__.get("_dense")
        if cached is not None and cached[0] == key and cached[1] is offsets:
            return cached[2]
        result = self._build_dense(offsets, max_len)
        self.__dict__["_dense"] = (key, offsets, result)  # holding offsets keeps its id unique
        return result

    def _build_dense(self, offsets: Tensor, max_len: int) -> Tensor:
        lengths = lengths_from_offsets(offsets)
        device = offsets.device
        pos = torch.arange(max_len, device=device)
        i = pos.view(1, -1, 1)  # query
        j = pos.view(1, 1, -1)  # key
        n = lengths.view(-1, 1, 1)
        zeros = torch.zeros_like(lengths)
        t = (self.num_targets if self.num_targets is not None else zeros).view(-1, 1, 1)
        c = (self.num_contextual if self.num_contextual is not None else zeros).view(-1, 1, 1)
        valid = (i < n) & (j < n)
        history_end = n - t  # first target position
        # a target's effective position is the end of history: it sees what the last history token sees
        i_eff = torch.minimum(i, history_end - 1)
        visible = (j <= i_eff) if self.causal else torch.ones_like(valid)
        if self.max_attn_len is not None:
            visible = visible & ((i_eff - j < self.max_attn_len) | (j < c))
        visible = visible | (j == i)  # every token sees itself (targets included)
        visible = visible & ~((j >= history_end) & (j != i))  # nobody sees another target
        in_context_q = i < c
        visible = torch.where(in_context_q, j < c, visible | (j < c))  # contextual prefix
        eye = (i == j).expand_as(valid)
        return (visible & valid) | (eye & ~valid)
