"""The attention mask description: per-sequence facts from which visibility is computed.

Kernels compute visibility on the fly from this description; only the reference
implementation materialises the (B, N, N) mask, and only for one batch at a time.

Token layout of one sequence of length n (c = num_contextual, t = num_targets)::

    | contextual c | history n - c - t                         | targets t |
      full attn      segments s_0 | s_1 | ... | rest             see contextual + history + self,
      among itself   each full or causal; later segments         never each other; with
                     see all earlier ones; "rest" follows        timestamps, only history
                     ``causal``                                  events strictly before them

Visibility of key j from query i (both real tokens; padding sees only itself):

- contextual query: every contextual key, nothing else.
- contextual key: visible to every query.
- target key: visible only to itself.
- history query i, history key j: ``seg(j) < seg(i)``, or the same segment and (the
  segment is full or ``j <= i``); with a window, additionally ``i - j < max_attn_len``
  when ``j < i``.
- target query: sees the history keys the last history token sees, itself, and, when
  ``timestamps`` is given, only history keys with ``timestamps[j] < timestamps[i]``
  (fixed-period aggregated samples: an impression sees only events before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from recforge.jagged.index import jagged_rows, lengths_from_offsets


@dataclass
class AttentionMask:
    """Who may attend to whom, described per sequence rather than as an L x L tensor.

    Attributes:
        causal: history tokens outside explicit segments see only earlier tokens and
            themselves (False: full attention among them).
        num_targets: (B,) int64 candidate tokens at the end of each sequence (ranking);
            None means no targets.
        num_contextual: (B,) int64 tokens at the start with full attention among
            themselves, visible to every later token; None means none.
        max_attn_len: local window: a history token sees at most this many earlier
            history tokens (itself included); None means unbounded.
        segment_lengths: (B, S) int64 lengths of S consecutive history segments starting
            right after the contextual prefix (zeros allowed); history tokens after them
            form a last segment that follows ``causal``. None means no segments.
        segment_full: S flags, True where a segment has full attention inside itself,
            False where it is causal. Required with ``segment_lengths``.
        timestamps: (T,) int64 per-token times (jagged like the batch): a target sees a
            history token only if it happened strictly earlier. None disables the rule.
    """

    causal: bool = True
    num_targets: Tensor | None = None
    num_contextual: Tensor | None = None
    max_attn_len: int | None = None
    segment_lengths: Tensor | None = None
    segment_full: tuple[bool, ...] | None = None
    timestamps: Tensor | None = None

    def to(self, device: torch.device | str) -> AttentionMask:
        move = lambda t: None if t is None else t.to(device)
        return AttentionMask(
            self.causal,
            move(self.num_targets),
            move(self.num_contextual),
            self.max_attn_len,
            move(self.segment_lengths),
            self.segment_full,
            move(self.timestamps),
        )

    def forget(self) -> None:
        """Drop what calls keep on this object between layers (the dense mask, the cached op's plan)."""
        self.__dict__.pop("_dense", None)
        self.__dict__.pop("_cached_plan", None)

    def validate(self, offsets: Tensor) -> None:
        """Raise ValueError naming the first inconsistency with the batch's ``offsets``."""
        lengths = lengths_from_offsets(offsets)
        batch = lengths.numel()
        zeros = torch.zeros_like(lengths)
        for name in ("num_targets", "num_contextual"):
            value = getattr(self, name)
            if value is None:
                continue
            if value.shape != (batch,):
                raise ValueError(f"AttentionMask.{name} has shape {tuple(value.shape)}, expected ({batch},)")
            if bool((value < 0).any()):
                raise ValueError(f"AttentionMask.{name} has negative entries")
        c = self.num_contextual if self.num_contextual is not None else zeros
        t = self.num_targets if self.num_targets is not None else zeros
        used = c + t
        if self.segment_lengths is not None:
            seg = self.segment_lengths
            if seg.dim() != 2 or seg.shape[0] != batch:
                raise ValueError(f"AttentionMask.segment_lengths has shape {tuple(seg.shape)}, expected ({batch}, S)")
            if self.segment_full is None or len(self.segment_full) != seg.shape[1]:
                raise ValueError(
                    f"AttentionMask.segment_full must give one flag per segment ({seg.shape[1]}), "
                    f"got {self.segment_full!r}"
                )
            if bool((seg < 0).any()):
                raise ValueError("AttentionMask.segment_lengths has negative entries")
            used = used + seg.sum(1)
        elif self.segment_full is not None:
            raise ValueError("AttentionMask.segment_full given without segment_lengths")
        bad = (used > lengths).nonzero().flatten()
        if bad.numel():
            b = int(bad[0])
            raise ValueError(
                f"AttentionMask: sequence {b} has {int(lengths[b])} tokens but its contextual, target "
                f"and segment counts add up to {int(used[b])}"
            )
        if self.timestamps is not None and self.timestamps.shape != (int(offsets[-1]),):
            raise ValueError(
                f"AttentionMask.timestamps has shape {tuple(self.timestamps.shape)}, expected ({int(offsets[-1])},) "
                "(one time per token of the batch)"
            )
        if self.max_attn_len is not None and self.max_attn_len < 1:
            raise ValueError(f"AttentionMask.max_attn_len must be >= 1, got {self.max_attn_len}")

    def dense(self, offsets: Tensor, max_len: int) -> Tensor:
        """Materialise the (B, max_len, max_len) boolean mask, True where query i sees key j.

        Padding rows see only themselves, so a softmax over them stays finite. The result
        is kept on this (per-batch) object, since every layer asks for the same mask.
        """
        tensors = (offsets, self.num_targets, self.num_contextual, self.segment_lengths, self.timestamps)
        # no version counters (inference tensors), or traced by torch.compile (no is_inference there): don't cache
        if torch.compiler.is_compiling() or any(t is not None and t.is_inference() for t in tensors):
            return self._build_dense(offsets, max_len)
        # identity + version of every tensor the mask depends on, and the plain fields
        key = (
            max_len,
            self.causal,
            self.max_attn_len,
            self.segment_full,
            *((None, None) if t is None else (id(t), t._version) for t in tensors),
        )
        cached = self.__dict__.get("_dense")
        if cached is not None and cached[0] == key and cached[1] is offsets:
            return cached[2]
        result = self._build_dense(offsets, max_len)
        self.__dict__["_dense"] = (key, offsets, result)  # holding offsets keeps its id unique
        return result

    def _build_dense(self, offsets: Tensor, max_len: int) -> Tensor:
        rows = torch.arange(max_len, device=offsets.device).expand(offsets.numel() - 1, -1)
        return self.rows(offsets, max_len, rows)

    def rows(self, offsets: Tensor, max_len: int, q_pos: Tensor) -> Tensor:
        """(B, M, max_len) boolean visibility of the query positions ``q_pos`` (B, M) over keys 0..max_len-1.

        The rows of ``dense`` at ``q_pos``, without building the other rows: the cached attention op
        (``recforge.ops.cached_hstu_attention``) asks for the rows of its new tokens only. Positions
        at or past a sequence's length are padding and see only themselves. No host synchronisation.
        """
        lengths = lengths_from_offsets(offsets)
        i = q_pos.unsqueeze(2)  # (B, M, 1) query
        j = torch.arange(max_len, device=offsets.device).view(1, 1, -1)  # key
        n = lengths.view(-1, 1, 1)
        targets = self.num_targets is not None
        history_end = n - self.num_targets.view(-1, 1, 1) if targets else n  # first target position
        # a target's effective position is the end of history: it sees what the last history token sees
        # (without targets every real row is history; padding rows are masked at the end)
        i_eff = torch.minimum(i, history_end - 1) if targets else i
        if self.segment_lengths is None:  # one segment: the history follows ``causal``
            visible = (j <= i_eff) if self.causal else (j == j)
        else:
            seg, full = self._segments(lengths, max_len)  # (B, N) segment id per position, (B, S + 1) flags
            seg_i = torch.gather(seg, 1, i_eff.clamp(0, max_len - 1).squeeze(2)).unsqueeze(2)  # (B, M, 1)
            seg_j = seg.unsqueeze(1)  # (B, 1, N)
            full_i = torch.gather(full, 1, seg_i.squeeze(2)).unsqueeze(2)  # (B, M, 1)
            visible = (seg_j < seg_i) | ((seg_j == seg_i) & (full_i | (j <= i_eff)))
        if self.max_attn_len is not None:
            visible = visible & ((i_eff - j < self.max_attn_len) | (j >= i_eff))
        if self.timestamps is not None and targets:  # the rule is for targets only
            ts = jagged_rows(self.timestamps, offsets, max_len)  # (B, N)
            ts_i = torch.gather(ts, 1, q_pos.clamp(0, max_len - 1)).unsqueeze(2)  # (B, M, 1)
            earlier = ts.unsqueeze(1) < ts_i  # key strictly before query
            visible = visible & (earlier | (i < history_end))
        eye = j == i
        visible = visible | eye  # every token sees itself (targets included)
        if targets:
            visible = visible & ((j < history_end) | eye)  # nobody sees another target
        if self.num_contextual is not None:
            c = self.num_contextual.view(-1, 1, 1)
            in_context_q, key_context = i < c, j < c
            # contextual prefix (logical ops, not a boolean where: exported ONNX programs have no boolean Where)
            visible = (in_context_q & key_context) | (~in_context_q & (visible | key_context))
        real_q = i < n
        return (visible & real_q & (j < n)) | (eye & ~real_q)  # padding rows see only themselves

    def _segments(self, lengths: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
        """Segment id of every position (history positions; others get any id) and per-segment full flags."""
        batch = lengths.numel()
        device = lengths.device
        rest_full = torch.full((batch, 1), not self.causal, dtype=torch.bool, device=device)
        if self.segment_lengths is None:
            return torch.zeros(batch, max_len, dtype=torch.int64, device=device), rest_full
        c = self.num_contextual if self.num_contextual is not None else torch.zeros_like(lengths)
        ends = c.view(-1, 1) + torch.cumsum(self.segment_lengths, 1)  # (B, S) exclusive segment ends
        pos = torch.arange(max_len, device=device).expand(batch, -1).contiguous()
        seg = torch.searchsorted(ends.contiguous(), pos, right=True)  # (B, N) in [0, S]
        flags = torch.tensor(self.segment_full, dtype=torch.bool, device=device).expand(batch, -1)
        return seg, torch.cat([flags, rest_full], 1)
