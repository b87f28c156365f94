"""The HSTU block's mixing step on CUDA, from the uvqk projection's pre-activation to the gated attention output.

    u, v, q, k = split(SiLU(pre))                 pre: (T, H * (2 Dv + 2 Dqk)), the uvqk Linear's output
    y          = dropout(LayerNorm(HSTUAttention(q, k, v)) * u)

Forward: SiLU (one pass over ``pre``), the attention kernel, the norm-gate kernel, as the unfused block runs them.
Backward writes the gradient of ``pre`` in place, slice by slice, with SiLU' applied where each slice's gradient is
stored: the norm-gate backward for u, the dK/dV kernel's epilogue for k and v, the dQ kernel's epilogue (or, when the
dK/dV kernel sums dQ, one pass over its float32 sums) for q. Unfused, the four gradients are written, read back,
multiplied by SiLU' and concatenated by one more pass over (T, H * (2 Dv + 2 Dqk)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.ops.triton._common import MaskArgs
from recforge.ops.triton.hstu import hstu_backward, hstu_forward
from recforge.ops.triton.norm_gate import norm_gate_backward, norm_gate_forward


def split_uvqk(t: Tensor, heads: int, dqk: int, dv: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Views (u (T, H*Dv), v (T, H, Dv), q (T, H, Dqk), k (T, H, Dqk)) of a (T, H * (2 Dv + 2 Dqk)) tensor."""
    tokens = t.shape[0]
    u, v, q, k = t.split([heads * dv, heads * dv, heads * dqk, heads * dqk], dim=-1)
    return u, v.view(tokens, heads, dv), q.view(tokens, heads, dqk), k.view(tokens, heads, dqk)


def mixer_forward(pre: Tensor, heads: int, dqk: int, dv: int, offsets: Tensor, max_seq_len: int, ma: MaskArgs,
                  scale: float, pos_w: Tensor | None, ts_bias: Tensor | None, time_w: Tensor | None, num_buckets: int,
                  weight: Tensor, bias: Tensor, seed: Tensor | None, eps: float,
                  p: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(y (T, H*Dv), SiLU(pre), attention output (T, H, Dv), LayerNorm row means, row 1/std): the last four are what
    ``mixer_backward`` reads. ``pre`` must be contiguous (its SiLU then has its strides)."""
    act = F.silu(pre)
    u, v, q, k = split_uvqk(act, heads, dqk, dv)
    attn = hstu_forward(q, k, v, offsets, max_seq_len, ma, scale, pos_w, ts_bias, time_w, num_buckets)
    y, mean, rstd = norm_gate_forward(attn.view(pre.shape[0], heads * dv), u, weight, bias, seed, eps, p)
    return y, act, attn, mean, rstd


def mixer_backward(dy: Tensor, pre: Tensor, act: Tensor, attn: Tensor, mean: Tensor, rstd: Tensor, heads: int,
                   dqk: int, dv: int, offsets: Tensor, max_seq_len: int, ma: MaskArgs, scale: float,
                   pos_w: Tensor | None, ts_bias: Tensor | None, time_w: Tensor | None, num_buckets: int,
                   weight: Tensor, bias: Tensor, seed: Tensor | None, p: float, pos_grad: bool,
                   time_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """(d pre, d weight, d bias, d pos_w, d time_w) given ``dy``, the gradient of ``mixer_forward``'s ``y``."""
    tokens = pre.shape[0]
    d_pre = torch.empty_like(pre)
    u, v, q, k = split_uvqk(act, heads, dqk, dv)
    pre_u, pre_v, pre_q, pre_k = split_uvqk(pre, heads, dqk, dv)
    d_u, d_v, d_q, d_k = split_uvqk(d_pre, heads, dqk, dv)
    d_attn, _, d_weight, d_bias = norm_gate_backward(dy, attn.view(tokens, heads * dv), u, weight, bias, mean, rstd,
                                                     seed, p, u_pre=pre_u, du_out=d_u)  # fmt: skip
    _, _, _, d_pos, d_time = hstu_backward(d_attn.view(tokens, heads, dv), q, k, v, offsets, max_seq_len, ma, scale,
                                           pos_w, ts_bias, time_w, num_buckets, pos_grad, time_grad,
                                           silu_pre=(pre_q, pre_k, pre_v), grads_out=(d_q, d_k, d_v))  # fmt: skip
    return d_pre, d_weight, d_bias, d_pos, d_time


class HSTUMixer(torch.autograd.Function):
    """``mixer_forward`` with ``mixer_backward`` (eager calls; compiled ones go through ``recforge::hstu_mixer``)."""

    @staticmethod
    def forward(ctx, pre, offsets, max_seq_len, ma, scale, pos_w, ts_bias, time_w, num_buckets, weight, bias, seed,
                eps, p, heads, dqk, dv):  # fmt: skip
        y, act, attn, mean, rstd = mixer_forward(pre, heads, dqk, dv, offsets, max_seq_len, ma, scale, pos_w, ts_bias,
                                                 time_w, num_buckets, weight, bias, seed, eps, p)  # fmt: skip
        ctx.save_for_backward(pre, act, attn, mean, rstd, offsets, pos_w, ts_bias, time_w, weight, bias, seed)
        ctx.stuff = (max_seq_len, ma, scale, num_buckets, p, heads, dqk, dv)
        return y

    @staticmethod
    def backward(ctx, dy):
        pre, act, attn, mean, rstd, offsets, pos_w, ts_bias, time_w, weight, bias, seed = ctx.saved_tensors
        max_seq_len, ma, scale, num_buckets, p, heads, dqk, dv = ctx.stuff
        d_pre, d_weight, d_bias, d_pos, d_time = mixer_backward(
            dy, pre, act, attn, mean, rstd, heads, dqk, dv, offsets, max_seq_len, ma, scale, pos_w, ts_bias, time_w,
            num_buckets, weight, bias, seed, p, ctx.needs_input_grad[5], ctx.needs_input_grad[7])  # fmt: skip
        return (d_pre, None, None, None, None, d_pos, None, d_time, None, d_weight, d_bias, None, None, None, None,
                None, None)  # fmt: skip


__all__ = ["HSTUMixer", "mixer_backward", "mixer_forward", "split_uvqk"]
