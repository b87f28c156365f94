"""Jagged utilities and attention ops: a PyTorch reference behind one dispatch function per op."""

from recforge.ops.cached_attention import cached_hstu_attention
from recforge.ops.hstu_attention import hstu_attention
from recforge.ops.jagged import (
    gather_sequences,
    jagged_to_padded,
    padded_to_jagged,
    positions_in_sequence,
    trim_sequences,
)
from recforge.ops.mask import AttentionMask
from recforge.ops.softmax_attention import softmax_attention

__all__ = [
    "AttentionMask",
    "cached_hstu_attention",
    "gather_sequences",
    "hstu_attention",
    "jagged_to_padded",
    "padded_to_jagged",
    "positions_in_sequence",
    "softmax_attention",
    "trim_sequences",
]
