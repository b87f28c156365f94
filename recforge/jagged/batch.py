"""The one jagged batch type that flows from data to models.

A batch of B variable-length sequences is stored padding-free. Every token feature
shares ``seq_offsets``::

    sequences     u0: [a b c]   u1: []   u2: [d e f g]
    seq_offsets   [0, 3, 3, 7]                      (B + 1,) int64
    item_ids      [a b c d e f g]                   (T,)  T = seq_offsets[-1]
    timestamps    [. . . . . . .]                   (T,)  optional
    labels        {"next_item": (T,), ...}          token-aligned, (B, ...) per sequence, or
                                                      (sum(num_targets), ...) per ranking target

Arrow list columns have exactly this layout, so ``from_arrow`` is zero-copy for the
values and offsets of a contiguous ListArray.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from recforge.jagged.index import lengths_from_offsets
from recforge.jagged.mask import AttentionMask


_silenced = False


def readonly_tensor(values: np.ndarray) -> Tensor:
    """``torch.from_numpy`` of a read-only array (an Arrow buffer), zero-copy.

    PyTorch warns once per process that such tensors must not be written; that warning is
    silenced on the first call (``warnings.catch_warnings`` on every call cost a quarter of
    a batch's collation, and is not thread-safe).
    """
    global _silenced
    if _silenced or values.flags.writeable:
        return torch.from_numpy(values)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        out = torch.from_numpy(values)
    _silenced = True
    return out


@dataclass
class JaggedBatch:
    """Named jagged token features + dense features + labels + the mask description.

    The constructor only assigns; call ``validate()`` at data boundaries.

    Attributes:
        seq_offsets: (B+1,) int64 sequence boundaries shared by every token feature.
        features: token-aligned features, each (T, ...); ``item_ids`` is required.
        max_seq_len: an upper bound on the batch's sequence lengths (for padding/kernels).
        dense: per-sequence features, each (B, ...).
        labels: token-aligned (T, ...) or per-sequence (B, ...) labels.
        mask: the attention mask description.
    """

    seq_offsets: Tensor
    features: dict[str, Tensor]
    max_seq_len: int
    dense: dict[str, Tensor] = field(default_factory=dict)
    labels: dict[str, Tensor] = field(default_factory=dict)
    mask: AttentionMask = field(default_factory=AttentionMask)

    @property
    def item_ids(self) -> Tensor:
        return self.features["item_ids"]

    @property
    def timestamps(self) -> Tensor | None:
        return self.features.get("timestamps")

    @property
    def batch_size(self) -> int:
        return self.seq_offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        """T, from the token features' rows (every feature has T of them): no read of device offsets."""
        values = self.features.get("item_ids")
        return values.shape[0] if values is not None else int(self.seq_offsets[-1])

    @property
    def lengths(self) -> Tensor:
        return lengths_from_offsets(self.seq_offsets)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedBatch:
        move = lambda d: {k: v.to(device, non_blocking=non_blocking) for k, v in d.items()}  # noqa: E731
        return JaggedBatch(
            self.seq_offsets.to(device, non_blocking=non_blocking),
            move(self.features),
            self.max_seq_len,
            move(self.dense),
            move(self.labels),
            self.mask.to(device),
        )

    def validate(self) -> None:
        """Raise ``ValueError`` describing every inconsistency found."""
        problems = []
        off = self.seq_offsets
        if off.dtype != torch.int64 or off.dim() != 1 or off.numel() < 1:
            problems.append(f"seq_offsets must be a 1-D int64 tensor of B+1 entries, got {off.dtype} {tuple(off.shape)}")
        else:
            if int(off[0]) != 0:
                problems.append(f"seq_offsets must start at 0, got {int(off[0])}")
            lengths = off[1:] - off[:-1]
            if (lengths < 0).any():
                problems.append(f"seq_offsets must be non-decreasing (sequence {int(torch.nonzero(lengths < 0)[0])})")
            elif lengths.numel() and int(lengths.max()) > self.max_seq_len:
                problems.append(f"a sequence has {int(lengths.max())} tokens > max_seq_len={self.max_seq_len}")
            total, batch = int(off[-1]), off.numel() - 1
            if "item_ids" not in self.features:
                problems.append("features must include 'item_ids'")
            for name, t in self.features.items():
                if t.shape[0] != total:
                    problems.append(f"feature {name!r} has {t.shape[0]} rows, seq_offsets say {total} tokens")
            for name, t in self.dense.items():
                if t.shape[0] != batch:
                    problems.append(f"dense feature {name!r} has {t.shape[0]} rows, batch has {batch} sequences")
            targets = int(self.mask.num_targets.sum()) if self.mask.num_targets is not None else None
            for name, t in self.labels.items():
                if t.shape[0] not in (total, batch, targets):
                    problems.append(
                        f"label {name!r} has {t.shape[0]} rows: neither {total} tokens, {batch} sequences "
                        f"nor {targets} targets"
                    )
            for name, t in (("num_targets", self.mask.num_targets), ("num_contextual", self.mask.num_contextual)):
                if t is not None and (t.shape != (batch,) or (t < 0).any() or (t > lengths).any()):
                    problems.append(f"mask.{name} must be (B,) with 0 <= value <= sequence length")
        if not problems:
            try:
                self.mask.validate(off)
            except ValueError as err:
                problems.append(str(err))
        if problems:
            raise ValueError("invalid JaggedBatch: " + "; ".join(problems))

    @staticmethod
    def from_arrow(
        columns: dict[str, pa.ListArray | pa.LargeListArray | pa.ChunkedArray], max_seq_len: int | None = None
    ) -> JaggedBatch:
        """Build a batch from Arrow list columns that share one offsets layout.

        Args:
            columns: feature name -> list array; all must have identical offsets. Must
                contain ``item_ids``.
            max_seq_len: upper bound on lengths; computed when None.
        """
        off_np = None
        features = {}
        for name, col in columns.items():
            if isinstance(col, pa.ChunkedArray):
                col = col.combine_chunks()
            col_off = col.offsets.to_numpy()
            if off_np is None:
                off_np = col_off
            elif not np.array_equal(off_np - off_np[0], col_off - col_off[0]):
                raise ValueError(f"list column {name!r} has different lengths from the others")
            # Arrow buffers are immutable; the tensor shares them (zero-copy), so batch
            # features are read-only: clone before modifying one in place.
            features[name] = readonly_tensor(col.values.slice(col_off[0], col_off[-1] - col_off[0]).to_numpy(zero_copy_only=False))
        if off_np is None:
            raise ValueError("from_arrow needs at least one column")
        offsets = torch.from_numpy(off_np.astype(np.int64) - off_np[0])  # a copy: (B+1,) rebased to 0
        if max_seq_len is None:
            max_seq_len = int(np.diff(off_np).max()) if len(off_np) > 1 else 0
        return JaggedBatch(offsets, features, max_seq_len)
