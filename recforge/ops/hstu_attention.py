"""HSTU pointwise attention on jagged sequences.

    out_i = sum_j  mask_ij * SiLU(q_i . k_j + rab_ij) * scale * v_j

with ``rab_ij = pos_weights[clamp(i - j)] + time_weights[bucket(ts_i - ts_j)]``.
Targets take the history end's position in ``pos_weights`` and contextual tokens get no time
bias (see ``relative_bias``). ``scale`` is a constant (1 / max_seq_len in HSTU): dividing by
each sequence's own length would leak how many future tokens exist into earlier positions.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.jagged.index import jagged_rows, jagged_to_padded, lengths_from_offsets, padded_to_jagged
from recforge.jagged.mask import AttentionMask
from recforge.ops.custom_ops import hstu_attention_op, hstu_silu_attention_gate_op, hstu_silu_attention_op
from recforge.ops.dispatch import resolve_kernel, triton_available, unsupported_by_triton
from recforge.ops.norm_gate import dropout_seed, fused_kernels, norm_gate
from recforge.ops.norm_gate import unsupported as norm_gate_unsupported
from recforge.ops.time_bias import time_buckets

@functools.lru_cache(maxsize=16)
def _distance_index(max_len: int, num_weights: int, device: torch.device) -> Tensor:
    pos = torch.arange(max_len, device=device)
    return (pos.view(-1, 1) - pos.view(1, -1)).clamp(0, num_weights - 1)  # (N, N) causal distance i - j


def relative_bias(
    offsets: Tensor,
    max_len: int,
    pos_weights: Tensor | None,
    timestamps: Tensor | None,
    time_weights: Tensor | None,
    num_targets: Tensor | None = None,
    num_contextual: Tensor | None = None,
) -> Tensor | None:
    """Dense (B, N, N) relative position + time bias for the reference implementations.

    Target tokens all take the position of the first target (the history end h = n - t) for
    the position bias: the distance is ``min(i, h) - min(j, h)``, so a candidate's score does
    not depend on its index among the candidates (and serving can score any number of them).
    Contextual tokens (the first ``num_contextual``) are features, not events: no time bias
    involves them, so cached history keys/values do not depend on the request time.
    """
    bias = None
    if pos_weights is not None:
        num = pos_weights.numel()
        if num_targets is None:
            bias = pos_weights[_distance_index(max_len, num, offsets.device)].unsqueeze(0)  # (1, N, N)
        else:
            history_end = (lengths_from_offsets(offsets) - num_targets).view(-1, 1)  # (B, 1)
            pos = torch.minimum(torch.arange(max_len, device=offsets.device).view(1, -1), history_end)  # (B, N)
            bias = pos_weights[(pos.unsqueeze(2) - pos.unsqueeze(1)).clamp(0, num - 1)]  # (B, N, N)
    if time_weights is not None and timestamps is not None:
        ts = jagged_to_padded(timestamps, offsets, max_len)  # (B, N)
        buckets = time_buckets(ts.unsqueeze(2) - ts.unsqueeze(1), time_weights.numel() - 1)
        time_bias = time_weights[buckets]  # (B, N, N)
        if num_contextual is not None:
            event = torch.arange(max_len, device=offsets.device).view(1, -1) >= num_contextual.view(-1, 1)  # (B, N)
            time_bias = time_bias * (event.unsqueeze(2) & event.unsqueeze(1))
        bias = time_bias if bias is None else bias + time_bias
    return bias


def relative_bias_index_rows(
    offsets: Tensor,
    max_len: int,
    q_pos: Tensor,
    num_pos: int | None,
    timestamps: Tensor | None,
    num_buckets: int | None,
    num_targets: Tensor | None = None,
    num_contextual: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The layer-independent part of ``relative_bias`` for rows ``q_pos`` (B, M): (B, M, N) indices into
    ``pos_weights`` (``num_pos`` of them; None: no position bias) and ``time_weights`` (``num_buckets``
    + 1; None: no time bias), and the (B, M, N) pairs that get a time bias (None: all)."""
    device = offsets.device
    keys = torch.arange(max_len, device=device).view(1, -1)  # (1, N)
    pos_index = time_index = events = None
    if num_pos is not None:
        q, k = q_pos, keys
        if num_targets is not None:
            history_end = (lengths_from_offsets(offsets) - num_targets).view(-1, 1)  # (B, 1)
            q, k = torch.minimum(q_pos, history_end), torch.minimum(keys, history_end)
        pos_index = (q.unsqueeze(2) - k.unsqueeze(1)).clamp(0, num_pos - 1)  # (B, M, N)
    if num_buckets is not None and timestamps is not None:
        ts = jagged_rows(timestamps, offsets, max_len)  # (B, N)
        ts_q = torch.gather(ts, 1, q_pos.clamp(0, max_len - 1))  # (B, M)
        time_index = time_buckets(ts_q.unsqueeze(2) - ts.unsqueeze(1), num_buckets)
        if num_contextual is not None:
            c = num_contextual.view(-1, 1)
            events = (q_pos >= c).unsqueeze(2) & (keys >= c).unsqueeze(1)
    return pos_index, time_index, events


def apply_bias_index(index: tuple[Tensor | None, Tensor | None, Tensor | None], pos_weights: Tensor | None,
                     time_weights: Tensor | None) -> Tensor | None:  # fmt: skip
    """The bias of ``relative_bias_index_rows``'s indices with one block's weights."""
    pos_index, time_index, events = index
    bias = pos_weights[pos_index] if pos_weights is not None and pos_index is not None else None
    if time_weights is not None and time_index is not None:
        time_bias = time_weights[time_index]
        if events is not None:
            time_bias = time_bias * events
        bias = time_bias if bias is None else bias + time_bias
    return bias


def relative_bias_rows(
    offsets: Tensor,
    max_len: int,
    q_pos: Tensor,
    pos_weights: Tensor | None,
    timestamps: Tensor | None,
    time_weights: Tensor | None,
    num_targets: Tensor | None = None,
    num_contextual: Tensor | None = None,
) -> Tensor | None:
    """(B, M, N) rows ``q_pos`` (B, M) of ``relative_bias`` (same rules), without the other rows."""
    index = relative_bias_index_rows(
        offsets, max_len, q_pos, None if pos_weights is None else pos_weights.numel(), timestamps,
        None if time_weights is None else time_weights.numel() - 1, num_targets, num_contextual)  # fmt: skip
    return apply_bias_index(index, pos_weights, time_weights)


def hstu_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    mask: AttentionMask,
    scale: float,
    pos_weights: Tensor | None = None,
    timestamps: Tensor | None = None,
    time_weights: Tensor | None = None,
) -> Tensor:
    """PyTorch reference: pads the batch, materialises mask and bias, unpads."""
    qp = jagged_to_padded(q, seq_offsets, max_seq_len)  # (B, N, H, Dqk)
    kp = jagged_to_padded(k, seq_offsets, max_seq_len)  # (B, N, H, Dqk)
    vp = jagged_to_padded(v, seq_offsets, max_seq_len)  # (B, N, H, Dv)
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp)  # (B, H, N, N)
    bias = relative_bias(
        seq_offsets, max_seq_len, pos_weights, timestamps, time_weights, mask.num_targets, mask.num_contextual
    )
    if bias is not None:
        scores = scores + bias.unsqueeze(1).to(scores.dtype)
    visible = mask.dense(seq_offsets, max_seq_len)  # (B, N, N)
    lengths = lengths_from_offsets(seq_offsets).view(-1, 1, 1)
    pos = torch.arange(max_seq_len, device=q.device)
    visible = visible & (pos.view(1, -1, 1) < lengths)  # padding rows contribute nothing
    weights = F.silu(scores) * scale * visible.unsqueeze(1)
    out = torch.einsum("bhij,bjhd->bihd", weights, vp)  # (B, N, H, Dv)
    return padded_to_jagged(out, seq_offsets, q.shape[0])


def hstu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    mask: AttentionMask,
    *,
    scale: float | None = None,
    pos_weights: Tensor | None = None,
    timestamps: Tensor | None = None,
    time_weights: Tensor | None = None,
    kernel: str = "auto",
) -> Tensor:
    """HSTU attention over jagged sequences.

    Args:
        q: (T, H, Dqk) queries, T = total tokens of the batch.
        k: (T, H, Dqk) keys.
        v: (T, H, Dv) values.
        seq_offsets: (B+1,) int64 sequence boundaries.
        max_seq_len: upper bound on sequence lengths in this batch.
        mask: the mask description.
        scale: multiplies SiLU scores; default 1 / max_seq_len.
        pos_weights: (P,) learned bias per causal distance i - j (clamped to P - 1).
        timestamps: (T,) int64 seconds, required with ``time_weights``.
        time_weights: (num_buckets + 1,) learned bias per log time-difference bucket.
        kernel: "auto" | "pytorch" | "triton"; "auto" runs the Triton kernel on CUDA
            inputs it supports (float16/bfloat16/float32, head dims <= 256), else the
            reference, and logs which once (``recforge.ops.dispatch``).

    Returns:
        (T, H, Dv) attention output.

    Example:
        >>> out = hstu_attention(q, k, v, offsets, 200, AttentionMask(), pos_weights=w)
    """
    if time_weights is not None and timestamps is None:
        raise ValueError("hstu_attention: time_weights given without timestamps")
    if scale is None:
        scale = 1.0 / max_seq_len
    unsupported = unsupported_by_triton(q, k, v, head_dims=(q.shape[-1], v.shape[-1]))
    if resolve_kernel("hstu_attention", kernel, q.device, unsupported) == "triton":
        if torch.compiler.is_compiling():  # one opaque custom op per call, not a trace of the launch code
            return hstu_attention_op(q, k, v, seq_offsets, max_seq_len, mask, scale, pos_weights, timestamps, time_weights)
        from recforge.ops.triton.hstu import (
            hstu_attention_triton,  # defined on first use: see recforge.ops.triton
        )

        return hstu_attention_triton(
            q, k, v, seq_offsets, max_seq_len, mask, scale, pos_weights, timestamps, time_weights
        )
    return hstu_attention_reference(
        q, k, v, seq_offsets, max_seq_len, mask, scale, pos_weights, timestamps, time_weights
    )


def _fused_silu_min_len(device: torch.device, dtype: torch.dtype, dqk: int, dv: int) -> int:
    """``hstu_gluon.min_len``, -1 for None (Triton's modules imported only here: a CUDA call)."""
    from recforge.ops.triton.hstu_gluon import min_len

    shortest = min_len(device, dtype, dqk, dv)
    return -1 if shortest is None else shortest


# one answer per (device, dtype, head dims): a constant to torch.compile, as torch.compiler.assume_constant_result
# marks it (the attribute it sets), without importing torch._dynamo here: a plain eager run must not (seconds of
# start-up; tests/train/test_startup_imports.py), and tests/ops/test_hstu_silu.py checks the attribute is still it
_fused_silu_min_len._dynamo_marked_constant = True  # type: ignore[attr-defined]


def silu_attention_fusable(pre: Tensor, num_heads: int, dqk: int, dv: int, max_seq_len: int, mask: AttentionMask,
                           pos_weights: Tensor | None, timestamps: Tensor | None, time_weights: Tensor | None,
                           kernel: str) -> bool:  # fmt: skip
    """Whether ``hstu_silu_attention`` (and ``hstu_silu_attention_gate``) run as one op for these arguments: the
    calls the Gluon kernels take (a plain causal mask, no relative bias, head dims 64 or 128, bf16/fp16 on Hopper,
    ``max_seq_len`` >= ``hstu_gluon.MIN_LEN`` of the head dim)."""
    plain = mask.causal and mask.num_targets is None and mask.num_contextual is None and mask.max_attn_len is None \
        and mask.segment_lengths is None and mask.timestamps is None
    if not plain or pos_weights is not None or (time_weights is not None and timestamps is not None):
        return False
    if pre.dim() != 2 or pre.shape[1] != num_heads * (2 * dv + 2 * dqk) or kernel == "pytorch" or not pre.is_cuda:
        return False
    if not triton_available():
        return False
    min_len = _fused_silu_min_len(pre.device, pre.dtype, dqk, dv)
    return 0 <= min_len <= max_seq_len


def hstu_silu_attention(
    pre: Tensor,
    num_heads: int,
    dqk: int,
    dv: int,
    seq_offsets: Tensor,
    max_seq_len: int,
    mask: AttentionMask,
    *,
    scale: float | None = None,
    pos_weights: Tensor | None = None,
    timestamps: Tensor | None = None,
    time_weights: Tensor | None = None,
    kernel: str = "auto",
) -> tuple[Tensor, Tensor]:
    """The HSTU block's gate and attention from its projection: ``u, v, q, k = split(SiLU(pre))``, then
    ``(u, hstu_attention(q, k, v, ...))``.

    Args:
        pre: (T, H (2 Dv + 2 Dqk)) the block's projection W_uvqk · LayerNorm(x) before its SiLU, columns u | v | q | k.
        num_heads, dqk, dv: H, the query/key and the value/gate widths per head.
        The rest: as ``hstu_attention``.

    Returns:
        (u (T, H Dv), attention (T, H, Dv)).

    The same values either way. On Hopper, for the calls its Gluon kernels take (a plain causal mask, no relative
    bias, head dims 64 or 128, bf16/fp16, ``max_seq_len`` >= ``hstu_gluon.MIN_LEN`` of the head dim), one op computes
    both (``recforge.ops.triton.hstu_silu``) and its backward writes ``pre``'s gradient from the attention kernels'
    stores, without the separate SiLU-backward and concatenation pass over the projection.
    """
    tokens, h = pre.shape[0], num_heads
    if scale is None:
        scale = 1.0 / max_seq_len
    if silu_attention_fusable(pre, h, dqk, dv, max_seq_len, mask, pos_weights, timestamps, time_weights, kernel):
        if torch.compiler.is_compiling():
            return hstu_silu_attention_op(pre, seq_offsets, max_seq_len, scale, h, dqk, dv)
        from recforge.ops.triton.hstu_silu import hstu_silu_attention_triton

        return hstu_silu_attention_triton(pre, seq_offsets, max_seq_len, scale, h, dqk, dv)
    u, v, q, k = F.silu(pre).split([h * dv, h * dv, h * dqk, h * dqk], dim=-1)
    attn = hstu_attention(q.view(tokens, h, dqk), k.view(tokens, h, dqk), v.view(tokens, h, dv), seq_offsets,
                          max_seq_len, mask, scale=scale, pos_weights=pos_weights, timestamps=timestamps,
                          time_weights=time_weights, kernel=kernel)  # fmt: skip
    return u, attn


def hstu_silu_attention_gate(
    pre: Tensor,
    num_heads: int,
    dqk: int,
    dv: int,
    seq_offsets: Tensor,
    max_seq_len: int,
    mask: AttentionMask,
    norm_weight: Tensor,
    norm_bias: Tensor,
    *,
    eps: float = 1e-5,
    p: float = 0.0,
    training: bool = False,
    scale: float | None = None,
    pos_weights: Tensor | None = None,
    timestamps: Tensor | None = None,
    time_weights: Tensor | None = None,
    kernel: str = "auto",
) -> Tensor:
    """The HSTU block's gated attention from its projection: ``dropout(LayerNorm(a) * u)`` (T, H Dv) with
    ``u, a = hstu_silu_attention(pre, ...)`` and ``norm_gate``'s LayerNorm ``norm_weight``, ``norm_bias``, ``eps``
    and dropout ``p`` (applied when ``training``).

    The same values either way. Where ``silu_attention_fusable``, one op computes it all
    (``recforge.ops.triton.hstu_silu``): the norm-gate kernel reads the gate's pre-activation columns of ``pre`` (u is
    never written) and its backward writes their gradient into ``pre``'s, next to the attention backward's stores.
    """
    if scale is None:
        scale = 1.0 / max_seq_len
    if fused_kernels() and silu_attention_fusable(pre, num_heads, dqk, dv, max_seq_len, mask, pos_weights, timestamps,
                                                    time_weights, kernel):  # fmt: skip
        p = p if training else 0.0
        seed = dropout_seed(p, pre.device)
        if torch.compiler.is_compiling():
            return hstu_silu_attention_gate_op(pre, seq_offsets, max_seq_len, scale, num_heads, dqk, dv, norm_weight,
                                               norm_bias, seed, eps, p)  # fmt: skip
        from recforge.ops.triton.hstu_silu import hstu_silu_attention_gate_triton

        return hstu_silu_attention_gate_triton(pre, seq_offsets, max_seq_len, scale, num_heads, dqk, dv, norm_weight,
                                               norm_bias, seed, eps, p)  # fmt: skip
    u, attn = hstu_silu_attention(pre, num_heads, dqk, dv, seq_offsets, max_seq_len, mask, scale=scale,
                                  pos_weights=pos_weights, timestamps=timestamps, time_weights=time_weights,
                                  kernel=kernel)  # fmt: skip
    attn = attn.reshape(pre.shape[0], num_heads * dv)
    if kernel == "triton" and norm_gate_unsupported(attn, u, norm_weight, norm_bias) is not None:
        kernel = "auto"  # the attention's setting: the gate runs PyTorch where its kernel cannot (logged once)
    return norm_gate(attn, u, norm_weight, norm_bias, eps=eps, p=p, training=training, kernel=kernel)


__all__ = ["hstu_attention", "hstu_attention_reference", "hstu_silu_attention", "hstu_silu_attention_gate",
           "silu_attention_fusable", "apply_bias_index", "relative_bias", "relative_bias_index_rows",
           "relative_bias_rows"]
