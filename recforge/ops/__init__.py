"""Attention kernels (and the HSTU block's fused LayerNorm * gate * dropout, ``norm_gate``, its projection's SiLU with
the attention (and the gate) as one op, ``hstu_silu_attention`` / ``hstu_silu_attention_gate``, and sampled softmax's
fused gather-dot, ``gather_dot``, and its per-row loss with logit gradients in one pass, ``softmax_nll``): a PyTorch
reference and a Triton kernel behind one dispatch function per op.

The vocabulary these ops speak (jagged offsets, ``AttentionMask``) lives in ``recforge.jagged``.
"""

from recforge.ops.cached_attention import cached_hstu_attention
from recforge.ops.gather_dot import gather_dot
from recforge.ops.hstu_attention import hstu_attention, hstu_silu_attention, hstu_silu_attention_gate
from recforge.ops.norm_gate import norm_gate
from recforge.ops.softmax_attention import softmax_attention
from recforge.ops.softmax_nll import softmax_nll

__all__ = ["cached_hstu_attention", "gather_dot", "hstu_attention", "hstu_silu_attention", "hstu_silu_attention_gate",
           "norm_gate", "softmax_attention", "softmax_nll"]
