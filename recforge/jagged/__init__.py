"""The bottom layer every package shares: the jagged batch, the attention-mask description and
the jagged index helpers. It imports nothing of recforge (checked by tests/test_architecture.py).

Example:
    >>> from recforge.jagged import AttentionMask, JaggedBatch, offsets_from_lengths
    >>> offsets = offsets_from_lengths(torch.tensor([3, 1]))   # tensor([0, 3, 4])
"""

from recforge.jagged.batch import JaggedBatch, readonly_tensor
from recforge.jagged.index import (
    gather_sequences,
    jagged_rows,
    jagged_to_padded,
    lengths_from_offsets,
    offsets_from_lengths,
    padded_to_jagged,
    padding_index,
    positions_in_sequence,
    range_index,
    sequence_ids,
    trim_sequences,
)
from recforge.jagged.mask import AttentionMask

__all__ = [
    "AttentionMask",
    "JaggedBatch",
    "gather_sequences",
    "jagged_rows",
    "jagged_to_padded",
    "lengths_from_offsets",
    "offsets_from_lengths",
    "padded_to_jagged",
    "padding_index",
    "positions_in_sequence",
    "range_index",
    "readonly_tensor",
    "sequence_ids",
    "trim_sequences",
]
