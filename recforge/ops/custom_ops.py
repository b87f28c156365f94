"""The Triton HSTU attention as ``torch.library`` custom ops, for ``torch.compile``.

Eager calls take ``recforge.ops.triton.hstu.hstu_attention_triton`` directly (an
``autograd.Function``: less host time per call). Under ``torch.compile`` the dispatcher calls
``hstu_attention_op`` instead: Dynamo sees one opaque node per block (forward and backward ops
with fake implementations for shape propagation), so it neither traces into the Triton launch
code nor breaks the graph at every block. The mask travels as its tensors and scalars (custom
ops take no dataclasses); the kernels module is imported on the first real call. The block's SiLU
and attention as one op (``recforge.ops.triton.hstu_silu``, its backward writing the projection's
gradient) is ``hstu_silu_attention_op``. The HSTU block's
fused ``dropout(layer_norm(a) * u)`` (``recforge.ops.norm_gate``) and sampled softmax's gather-dot
(``recforge.ops.gather_dot``: forward and its two gradients) are custom ops here the same way.
"""

# no ``from __future__ import annotations``: torch.library reads the ops' schemas from real annotations
from typing import Optional, Tuple

import torch
from torch import Tensor

from recforge.jagged.mask import AttentionMask

_NO_WINDOW = -1  # max_attn_len None


def _mask(num_targets, num_contextual, segment_lengths, mask_timestamps, causal, max_attn_len, segment_full) -> AttentionMask:
    full = None
    if segment_lengths is not None:
        full = tuple(bool(segment_full >> s & 1) for s in range(segment_lengths.shape[1]))
    window = None if max_attn_len == _NO_WINDOW else max_attn_len
    return AttentionMask(causal, num_targets, num_contextual, window, segment_lengths, full, mask_timestamps)


def _prepare(q, k, v, offsets, mask: AttentionMask, timestamps, time_weights):
    from recforge.ops.triton._common import mask_args  # first real call: Triton is installed (dispatch checked)

    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    offsets = offsets.contiguous()
    ts_bias = timestamps.to(torch.int64).contiguous() if time_weights is not None else None
    num_buckets = time_weights.numel() - 1 if time_weights is not None else 0
    return q, k, v, offsets, mask_args(mask, offsets), ts_bias, num_buckets


@torch.library.custom_op("recforge::hstu_attention", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int, num_targets: Optional[Tensor],
                num_contextual: Optional[Tensor], segment_lengths: Optional[Tensor], mask_timestamps: Optional[Tensor],
                causal: bool, max_attn_len: int, segment_full: int, scale: float, pos_weights: Optional[Tensor],
                timestamps: Optional[Tensor], time_weights: Optional[Tensor]) -> Tensor:  # fmt: skip
    from recforge.ops.triton.hstu import hstu_forward

    mask = _mask(num_targets, num_contextual, segment_lengths, mask_timestamps, causal, max_attn_len, segment_full)
    q, k, v, offsets, ma, ts_bias, num_buckets = _prepare(q, k, v, offsets, mask, timestamps, time_weights)
    return hstu_forward(q, k, v, offsets, max_seq_len, ma, scale, pos_weights, ts_bias, time_weights, num_buckets)


@_forward_op.register_fake
def _(q, k, v, offsets, max_seq_len, num_targets, num_contextual, segment_lengths, mask_timestamps, causal,
      max_attn_len, segment_full, scale, pos_weights, timestamps, time_weights):  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("recforge::hstu_attention_backward", mutates_args=())
def _backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, max_seq_len: int,
                 num_targets: Optional[Tensor], num_contextual: Optional[Tensor], segment_lengths: Optional[Tensor],
                 mask_timestamps: Optional[Tensor], causal: bool, max_attn_len: int, segment_full: int, scale: float,
                 pos_weights: Optional[Tensor], timestamps: Optional[Tensor], time_weights: Optional[Tensor],
                 pos_grad: bool, time_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq * 2 / scale in float32, dk, dv, d pos_weights, d time_weights); a bias gradient not asked for is an empty
    tensor. dQ comes unscaled and in float32 as the fused dK/dV kernel sums it (``hstu_backward(unscaled_dq=True)``):
    the caller's ``(dq * (scale / 2)).to(q.dtype)`` then fuses into the compiled step's next kernel instead of a
    pass of its own."""
    from recforge.ops.triton.hstu import hstu_backward

    mask = _mask(num_targets, num_contextual, segment_lengths, mask_timestamps, causal, max_attn_len, segment_full)
    q, k, v, offsets, ma, ts_bias, num_buckets = _prepare(q, k, v, offsets, mask, timestamps, time_weights)
    dq, dk, dv, d_pos, d_time = hstu_backward(grad_out, q, k, v, offsets, max_seq_len, ma, scale, pos_weights, ts_bias,
                                              time_weights, num_buckets, pos_grad, time_grad, unscaled_dq=True)  # fmt: skip
    # a fresh empty tensor each: outputs of a custom op may not alias one another (both are empty without biases)
    return dq, dk, dv, d_pos if d_pos is not None else q.new_empty(0), d_time if d_time is not None else q.new_empty(0)


@_backward_op.register_fake
def _(grad_out, q, k, v, offsets, max_seq_len, num_targets, num_contextual, segment_lengths, mask_timestamps, causal,
      max_attn_len, segment_full, scale, pos_weights, timestamps, time_weights, pos_grad, time_grad):  # fmt: skip
    d_pos = pos_weights.new_empty(pos_weights.shape) if pos_grad and pos_weights is not None else q.new_empty(0)
    d_time = time_weights.new_empty(time_weights.shape) if time_grad and time_weights is not None else q.new_empty(0)
    return q.new_empty(q.shape, dtype=torch.float32), k.new_empty(k.shape), v.new_empty(v.shape), d_pos, d_time


_SCALE, _POS, _TIME = 12, 13, 15  # input positions of scale, pos_weights and time_weights


def _setup_context(ctx, inputs, output) -> None:
    tensors = [x for x in inputs if isinstance(x, Tensor) or x is None]
    ctx.save_for_backward(*tensors)
    ctx.scalars = {i: x for i, x in enumerate(inputs) if not (isinstance(x, Tensor) or x is None)}
    ctx.num_inputs = len(inputs)


def _backward(ctx, grad_out):
    saved = iter(ctx.saved_tensors)
    inputs = [ctx.scalars[i] if i in ctx.scalars else next(saved) for i in range(ctx.num_inputs)]
    pos_grad, time_grad = ctx.needs_input_grad[_POS], ctx.needs_input_grad[_TIME]
    dq, dk, dv, d_pos, d_time = _backward_op(grad_out, *inputs, pos_grad, time_grad)
    grads = [None] * ctx.num_inputs
    grads[0], grads[1], grads[2] = (dq * (0.5 * inputs[_SCALE])).to(inputs[0].dtype), dk, dv
    if pos_grad and inputs[_POS] is not None:
        grads[_POS] = d_pos
    if time_grad and inputs[_TIME] is not None:
        grads[_TIME] = d_time
    return tuple(grads)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def hstu_attention_op(q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask,
                      scale: float, pos_weights: Optional[Tensor] = None, timestamps: Optional[Tensor] = None,
                      time_weights: Optional[Tensor] = None) -> Tensor:  # fmt: skip
    """``hstu_attention_triton`` through the custom op (same contract): what a compiled model calls."""
    has_time = time_weights is not None and timestamps is not None
    full = 0
    if mask.segment_lengths is not None:
        full = sum(1 << s for s, f in enumerate(mask.segment_full or ()) if f)
    window = _NO_WINDOW if mask.max_attn_len is None else int(mask.max_attn_len)
    return _forward_op(q, k, v, seq_offsets, max_seq_len, mask.num_targets, mask.num_contextual, mask.segment_lengths,
                       mask.timestamps, mask.causal, window, full, float(scale), pos_weights,
                       timestamps if has_time else None, time_weights if has_time else None)  # fmt: skip


@torch.library.custom_op("recforge::hstu_silu_attention", mutates_args=())
def _silu_attention_op(pre: Tensor, offsets: Tensor, max_seq_len: int, scale: float, heads: int, dqk: int,
                       dv: int) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(u, a, y) of ``recforge.ops.triton.hstu_silu.silu_attention_forward`` (y: SiLU of the v | q | k columns, kept
    for the backward, not differentiable)."""
    from recforge.ops.triton.hstu_silu import silu_attention_forward

    u, y, a = silu_attention_forward(pre.contiguous(), offsets.contiguous(), max_seq_len, scale, heads, dqk, dv)
    return u, a, y


@_silu_attention_op.register_fake
def _(pre, offsets, max_seq_len, scale, heads, dqk, dv):
    tokens = pre.shape[0]
    return (pre.new_empty(tokens, heads * dv), pre.new_empty(tokens, heads, dv),
            pre.new_empty(tokens, heads * (dv + 2 * dqk)))  # fmt: skip


@torch.library.custom_op("recforge::hstu_silu_attention_backward", mutates_args=())
def _silu_attention_backward_op(du: Optional[Tensor], da: Optional[Tensor], pre: Tensor, y: Tensor, offsets: Tensor,
                                max_seq_len: int, scale: float, heads: int, dqk: int, dv: int) -> Tensor:  # fmt: skip
    """The gradient of the projection (``recforge.ops.triton.hstu_silu.silu_attention_backward``; None: a zero
    gradient of u or a)."""
    from recforge.ops.triton.hstu_silu import silu_attention_backward

    return silu_attention_backward(du, da, pre.contiguous(), y, offsets.contiguous(), max_seq_len, scale, heads, dqk, dv)


@_silu_attention_backward_op.register_fake
def _(du, da, pre, y, offsets, max_seq_len, scale, heads, dqk, dv):
    return pre.new_empty(pre.shape)


def _silu_attention_setup_context(ctx, inputs, output) -> None:
    pre, offsets, *scalars = inputs
    ctx.save_for_backward(pre, output[2], offsets)
    ctx.mark_non_differentiable(output[2])
    ctx.scalars = scalars


def _silu_attention_backward(ctx, du, da, _dy):
    pre, y, offsets = ctx.saved_tensors
    d_pre = _silu_attention_backward_op(du, da, pre, y, offsets, *ctx.scalars)
    return d_pre, None, None, None, None, None, None


_silu_attention_op.register_autograd(_silu_attention_backward, setup_context=_silu_attention_setup_context)


def hstu_silu_attention_op(pre: Tensor, offsets: Tensor, max_seq_len: int, scale: float, heads: int, dqk: int,
                           dv: int) -> Tuple[Tensor, Tensor]:  # fmt: skip
    """``recforge.ops.triton.hstu_silu.hstu_silu_attention_triton`` through the custom op (same contract): what a
    compiled model calls."""
    u, a, _ = _silu_attention_op(pre, offsets, int(max_seq_len), float(scale), int(heads), int(dqk), int(dv))
    return u, a


@torch.library.custom_op("recforge::hstu_silu_attention_gate", mutates_args=())
def _silu_attention_gate_op(pre: Tensor, offsets: Tensor, max_seq_len: int, scale: float, heads: int, dqk: int, dv: int,
                            weight: Tensor, bias: Tensor, seed: Optional[Tensor], eps: float,
                            p: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(g, y, a, mean, rstd) of ``recforge.ops.triton.hstu_silu.silu_attention_gate_forward`` (all but g kept for the
    backward, not differentiable)."""
    from recforge.ops.triton.hstu_silu import silu_attention_gate_forward

    return silu_attention_gate_forward(pre.contiguous(), offsets.contiguous(), max_seq_len, scale, heads, dqk, dv, weight,
                                       bias, seed, eps, p)  # fmt: skip


@_silu_attention_gate_op.register_fake
def _(pre, offsets, max_seq_len, scale, heads, dqk, dv, weight, bias, seed, eps, p):
    tokens = pre.shape[0]
    rows = pre.new_empty(tokens, dtype=torch.float32)
    return (pre.new_empty(tokens, heads * dv), pre.new_empty(tokens, heads * (dv + 2 * dqk)),
            pre.new_empty(tokens, heads, dv), rows, rows.new_empty(tokens))  # fmt: skip


@torch.library.custom_op("recforge::hstu_silu_attention_gate_backward", mutates_args=())
def _silu_attention_gate_backward_op(dg: Tensor, pre: Tensor, y: Tensor, a: Tensor, mean: Tensor, rstd: Tensor,
                                     weight: Tensor, bias: Tensor, seed: Optional[Tensor], p: float, offsets: Tensor,
                                     max_seq_len: int, scale: float, heads: int, dqk: int,
                                     dv: int) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(d pre, d weight, d bias): ``recforge.ops.triton.hstu_silu.silu_attention_gate_backward``."""
    from recforge.ops.triton.hstu_silu import silu_attention_gate_backward

    return silu_attention_gate_backward(dg.contiguous(), pre.contiguous(), y, a, mean, rstd, weight, bias, seed, p,
                                        offsets.contiguous(), max_seq_len, scale, heads, dqk, dv)  # fmt: skip


@_silu_attention_gate_backward_op.register_fake
def _(dg, pre, y, a, mean, rstd, weight, bias, seed, p, offsets, max_seq_len, scale, heads, dqk, dv):
    return pre.new_empty(pre.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _silu_attention_gate_setup_context(ctx, inputs, output) -> None:
    pre, offsets, max_seq_len, scale, heads, dqk, dv, weight, bias, seed, _, p = inputs
    _, y, a, mean, rstd = output
    ctx.save_for_backward(pre, y, a, mean, rstd, weight, bias, seed, offsets)
    ctx.mark_non_differentiable(y, a, mean, rstd)
    ctx.scalars = (max_seq_len, scale, heads, dqk, dv)
    ctx.p = p


def _silu_attention_gate_backward(ctx, dg, _dy, _da, _dmean, _drstd):
    pre, y, a, mean, rstd, weight, bias, seed, offsets = ctx.saved_tensors
    d_pre, d_weight, d_bias = _silu_attention_gate_backward_op(dg, pre, y, a, mean, rstd, weight, bias, seed, ctx.p,
                                                               offsets, *ctx.scalars)  # fmt: skip
    return d_pre, None, None, None, None, None, None, d_weight, d_bias, None, None, None


_silu_attention_gate_op.register_autograd(_silu_attention_gate_backward, setup_context=_silu_attention_gate_setup_context)


def hstu_silu_attention_gate_op(pre: Tensor, offsets: Tensor, max_seq_len: int, scale: float, heads: int, dqk: int,
                                dv: int, weight: Tensor, bias: Tensor, seed: Optional[Tensor], eps: float,
                                p: float) -> Tensor:  # fmt: skip
    """``recforge.ops.triton.hstu_silu.hstu_silu_attention_gate_triton`` through the custom op (same contract): what a
    compiled model calls."""
    return _silu_attention_gate_op(pre, offsets, int(max_seq_len), float(scale), int(heads), int(dqk), int(dv), weight,
                                   bias, seed, float(eps), float(p))[0]


@torch.library.custom_op("recforge::norm_gate", mutates_args=())
def _norm_gate_op(x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, seed: Optional[Tensor], eps: float,
                  p: float) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(y, row means, row 1/std) of ``recforge.ops.triton.norm_gate.norm_gate_forward``."""
    from recforge.ops.triton.norm_gate import norm_gate_forward

    return norm_gate_forward(x, u, weight, bias, seed, eps, p)


@_norm_gate_op.register_fake
def _(x, u, weight, bias, seed, eps, p):
    rows = x.new_empty(x.shape[0], dtype=torch.float32)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, u.dtype)), rows, rows.new_empty(rows.shape)


@torch.library.custom_op("recforge::norm_gate_backward", mutates_args=())
def _norm_gate_backward_op(dy: Tensor, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor,
                           seed: Optional[Tensor], p: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    from recforge.ops.triton.norm_gate import norm_gate_backward

    return norm_gate_backward(dy, x, u, weight, bias, mean, rstd, seed, p)


@_norm_gate_backward_op.register_fake
def _(dy, x, u, weight, bias, mean, rstd, seed, p):
    return x.new_empty(x.shape), u.new_empty(x.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _norm_gate_setup_context(ctx, inputs, output) -> None:
    x, u, weight, bias, seed, _, p = inputs
    ctx.save_for_backward(x, u, weight, bias, output[1], output[2], seed)
    ctx.p = p


def _norm_gate_backward(ctx, dy, _dmean, _drstd):
    x, u, weight, bias, mean, rstd, seed = ctx.saved_tensors
    dx, du, dw, db = _norm_gate_backward_op(dy, x, u, weight, bias, mean, rstd, seed, ctx.p)
    return dx, du, dw, db, None, None, None


_norm_gate_op.register_autograd(_norm_gate_backward, setup_context=_norm_gate_setup_context)


def norm_gate_op(x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, seed: Optional[Tensor], eps: float,
                 p: float) -> Tensor:  # fmt: skip
    """``recforge.ops.triton.norm_gate.NormGate`` through the custom op (same contract): what a compiled model calls."""
    return _norm_gate_op(x, u, weight, bias, seed, float(eps), float(p))[0]


@torch.library.custom_op("recforge::gather_dot", mutates_args=())
def _gather_dot_op(q: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """(N, R) float32 ``q[n] . table[idx[n, r]]`` of ``recforge.ops.triton.gather_dot.gather_dot_forward``."""
    from recforge.ops.triton.gather_dot import gather_dot_forward

    return gather_dot_forward(q, table, idx)


@_gather_dot_op.register_fake
def _(q, table, idx):
    return q.new_empty(idx.shape, dtype=torch.float32)


@torch.library.custom_op("recforge::gather_rows_sum", mutates_args=())
def _gather_rows_sum_op(g: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """(N, D) ``sum_r g[n, r] * table[idx[n, r]]``: the gather-dot's gradient of ``q``."""
    from recforge.ops.triton.gather_dot import gather_rows_sum

    return gather_rows_sum(g, table, idx)


@_gather_rows_sum_op.register_fake
def _(g, table, idx):
    return table.new_empty(idx.shape[0], table.shape[1])


@torch.library.custom_op("recforge::scatter_rows_sum", mutates_args=())
def _scatter_rows_sum_op(g: Tensor, q: Tensor, idx: Tensor, num_rows: int) -> Tensor:
    """(num_rows, D) ``sum_{idx[n, r] = e} g[n, r] * q[n]``: the gather-dot's gradient of the table."""
    from recforge.ops.triton.gather_dot import scatter_rows_sum

    return scatter_rows_sum(g, q, idx, num_rows)


@_scatter_rows_sum_op.register_fake
def _(g, q, idx, num_rows):
    return q.new_empty(num_rows, q.shape[1])


def _gather_dot_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _gather_dot_backward(ctx, g):
    q, table, idx = ctx.saved_tensors
    dq = _gather_rows_sum_op(g, table, idx) if ctx.needs_input_grad[0] else None
    dtable = _scatter_rows_sum_op(g, q, idx, table.shape[0]) if ctx.needs_input_grad[1] else None
    return dq, dtable, None


_gather_dot_op.register_autograd(_gather_dot_backward, setup_context=_gather_dot_setup_context)


@torch.library.custom_op("recforge::softmax_nll", mutates_args=())
def _softmax_nll_op(logits: Tensor, pos: Tensor, ids: Tensor, targets: Tensor, share: Optional[Tensor],
                    grad_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(nll, grad, grad_pos) of ``recforge.ops.triton.softmax_nll.softmax_nll``: no autograd (its outputs are the
    gradients)."""
    from recforge.ops.triton.softmax_nll import softmax_nll

    return softmax_nll(logits, pos, ids, targets, share, grad_dtype)


@_softmax_nll_op.register_fake
def _(logits, pos, ids, targets, share, grad_dtype):
    nll = pos.new_empty(logits.shape[0], dtype=torch.float32)
    return nll, logits.new_empty(logits.shape, dtype=grad_dtype), torch.empty_like(nll)


def softmax_nll_op(logits: Tensor, pos: Tensor, ids: Tensor, targets: Tensor, share: Optional[Tensor],
                   grad_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``recforge.ops.triton.softmax_nll.softmax_nll`` through the custom op: what compiled code calls."""
    return _softmax_nll_op(logits, pos, ids, targets, share, grad_dtype)


def gather_dot_op(q: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """``recforge.ops.triton.gather_dot.GatherDot`` through the custom op (same contract): what compiled code calls."""
    return _gather_dot_op(q, table, idx)


def gather_rows_sum_op(g: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """``recforge.ops.triton.gather_dot.gather_rows_sum`` through the custom op."""
    return _gather_rows_sum_op(g, table, idx)


def scatter_rows_sum_op(g: Tensor, q: Tensor, idx: Tensor, num_rows: int) -> Tensor:
    """``recforge.ops.triton.gather_dot.scatter_rows_sum`` through the custom op."""
    return _scatter_rows_sum_op(g, q, idx, int(num_rows))


__all__ = ["gather_dot_op", "gather_rows_sum_op", "hstu_attention_op", "hstu_silu_attention_gate_op",
           "hstu_silu_attention_op", "norm_gate_op", "scatter_rows_sum_op", "softmax_nll_op"]
