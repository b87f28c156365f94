"""Attention kernels: a PyTorch reference and a Triton kernel behind one dispatch function per op.

The vocabulary these ops speak (jagged offsets, ``AttentionMask``) lives in ``recforge.jagged``.
"""

from recforge.ops.cached_attention import cached_hstu_attention
from recforge.ops.hstu_attention import hstu_attention
from recforge.ops.softmax_attention import softmax_attention

__all__ = ["cached_hstu_attention", "hstu_attention", "softmax_attention"]
