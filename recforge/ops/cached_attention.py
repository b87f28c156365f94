"""HSTU attention of new query tokens over cached keys/values (serving: prefill chunks, candidates).

Request b of a batch is one sequence of ``n_b + m_b`` tokens: its ``n_b`` cached tokens
(positions 0 .. n_b - 1, keys/values in ``k_cache``/``v_cache``), then its ``m_b`` new tokens
(positions n_b .. n_b + m_b - 1, queries ``q``, keys ``k``, values ``v``). Only the new tokens
are queries; they see cached keys and each other exactly as ``hstu_attention`` lets the same
positions of the whole sequence see them, under the same ``AttentionMask`` (contextual prefix,
causal history, segments, window, targets, timestamps) and the same position/time biases. So

    cached_hstu_attention(q, k, v, k_cache, v_cache, ...) == hstu_attention(whole sequence)[new tokens]

Serving uses two layouts: a prefill chunk (new tokens = the next history tokens, causal among
themselves) and candidates (new tokens = targets: ``num_targets = m_b``, each sees the visible
cached keys and itself only).

The mask describes the *whole* sequences: its counts are per whole sequence, and its
``timestamps`` (like ``timestamps`` for the time bias) are laid out per request as the cached
tokens' times then the new tokens' times (jagged by ``cache_offsets + q_offsets``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.ops.dispatch import resolve_kernel, unsupported_by_triton
from recforge.ops.hstu_attention import relative_bias_rows
from recforge.ops.jagged import jagged_rows, lengths_from_offsets
from recforge.ops.mask import AttentionMask


def _padded_keys(cache: Tensor, new: Tensor, cache_offsets: Tensor, q_offsets: Tensor, max_len: int) -> Tensor:
    """(B, max_len, H, D): per request its cached rows then its new rows, zeros after (no host sync)."""
    n = lengths_from_offsets(cache_offsets).view(-1, 1)
    m = lengths_from_offsets(q_offsets).view(-1, 1)
    pos = torch.arange(max_len, device=cache_offsets.device).view(1, -1)
    from_cache = pos < n
    row = torch.where(from_cache, cache_offsets[:-1].view(-1, 1) + pos, cache.shape[0] + q_offsets[:-1].view(-1, 1) + pos - n)
    real = pos < n + m
    both = torch.cat([cache, new])
    rows = both[row.clamp(0, max(both.shape[0] - 1, 0))] if both.shape[0] else both.new_zeros(*row.shape, *both.shape[1:])
    return torch.where(real.view(*real.shape, 1, 1), rows, 0)  # where: a row past the end may hold inf


def cached_hstu_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    q_offsets: Tensor,
    cache_offsets: Tensor,
    max_q_len: int,
    max_cache_len: int,
    mask: AttentionMask,
    scale: float,
    pos_weights: Tensor | None = None,
    timestamps: Tensor | None = None,
    time_weights: Tensor | None = None,
) -> Tensor:
    """PyTorch reference: the new tokens' rows of the whole sequences' mask and bias, padded."""
    full = max_cache_len + max_q_len
    full_offsets = cache_offsets + q_offsets
    r = torch.arange(max_q_len, device=q.device).view(1, -1)
    q_pos = lengths_from_offsets(cache_offsets).view(-1, 1) + r  # (B, M) positions of the queries
    q_real = r < lengths_from_offsets(q_offsets).view(-1, 1)
    qp = jagged_rows(q, q_offsets, max_q_len)  # (B, M, H, Dqk)
    # each new token's (request, row): gathers only, so this traces into exported programs too
    tokens = torch.arange(q.shape[0], device=q.device).view(-1, 1)
    seq = (tokens >= q_offsets[1:].view(1, -1)).sum(1)  # (Tq,)
    pos = tokens.view(-1) - q_offsets[seq]
    kp = _padded_keys(k_cache, k, cache_offsets, q_offsets, full)  # (B, N, H, Dqk)
    vp = _padded_keys(v_cache, v, cache_offsets, q_offsets, full)  # (B, N, H, Dv)
    scores = torch.einsum("bmhd,bnhd->bhmn", qp, kp)  # (B, H, M, N)
    bias = relative_bias_rows(full_offsets, full, q_pos, pos_weights, timestamps, time_weights,
                              mask.num_targets, mask.num_contextual)  # fmt: skip
    if bias is not None:
        scores = scores + bias.unsqueeze(1).to(scores.dtype)
    visible = mask.rows(full_offsets, full, q_pos) & q_real.unsqueeze(2)  # (B, M, N)
    # where, not a product: a key the query cannot see may hold anything (inf included)
    weights = torch.where(visible.unsqueeze(1), F.silu(scores), 0) * scale
    out = torch.einsum("bhmn,bnhd->bmhd", weights, vp)  # (B, M, H, Dv)
    return out[seq, pos]


def cached_hstu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    q_offsets: Tensor,
    cache_offsets: Tensor,
    max_q_len: int,
    max_cache_len: int,
    mask: AttentionMask,
    *,
    scale: float,
    pos_weights: Tensor | None = None,
    timestamps: Tensor | None = None,
    time_weights: Tensor | None = None,
    kernel: str = "auto",
) -> Tensor:
    """HSTU attention of new tokens over cached keys/values and themselves (see the module docstring).

    Args:
        q, k: (Tq, H, Dqk) queries and keys of the new tokens, jagged by ``q_offsets``.
        v: (Tq, H, Dv) values of the new tokens.
        k_cache: (Tc, H, Dqk) cached keys, jagged by ``cache_offsets`` (rows past ``cache_offsets[-1]``
            are ignored, so a preallocated buffer can be passed as it is).
        v_cache: (Tc, H, Dv) cached values.
        q_offsets, cache_offsets: (B+1,) int64 boundaries of each request's new and cached tokens.
        max_q_len, max_cache_len: upper bounds on m_b and n_b (Python ints: no host synchronisation).
        mask: the ``AttentionMask`` of the whole sequences (cached + new tokens of each request).
        scale: multiplies the SiLU scores (1 / max_seq_len in HSTU, as in training).
        pos_weights, time_weights: the block's relative bias weights, as for ``hstu_attention``.
        timestamps: (Tc + Tq,) int64 times of the whole sequences (jagged by ``cache_offsets + q_offsets``),
            required with ``time_weights``.
        kernel: "auto" | "pytorch" | "triton", dispatched and logged like ``hstu_attention``.

    Returns:
        (Tq, H, Dv) attention output of the new tokens.

    Example:
        >>> # 3 candidates of one request after a 5-token cached history: each sees the history and itself
        >>> out = cached_hstu_attention(q, k, v, k_cache, v_cache, torch.tensor([0, 3]), torch.tensor([0, 5]),
        ...                             3, 5, AttentionMask(num_targets=torch.tensor([3])), scale=1 / 200)
    """
    if time_weights is not None and timestamps is None:
        raise ValueError("cached_hstu_attention: time_weights given without timestamps (pass the whole sequences' times)")
    if q_offsets.shape != cache_offsets.shape:
        raise ValueError(f"cached_hstu_attention: q_offsets {tuple(q_offsets.shape)} and cache_offsets "
                         f"{tuple(cache_offsets.shape)} must both be (B+1,), one entry per request")  # fmt: skip
    if k_cache.shape[1:] != k.shape[1:] or v_cache.shape[1:] != v.shape[1:]:
        raise ValueError(f"cached_hstu_attention: cache rows {tuple(k_cache.shape[1:])}/{tuple(v_cache.shape[1:])} "
                         f"differ from the new keys/values' {tuple(k.shape[1:])}/{tuple(v.shape[1:])}")  # fmt: skip
    unsupported = unsupported_by_triton(q, k, v, k_cache, v_cache, head_dims=(q.shape[-1], v.shape[-1]))
    if resolve_kernel("cached_hstu_attention", kernel, q.device, unsupported) == "triton":
        from recforge.ops.triton.cached import cached_hstu_attention_triton  # defined on first use

        return cached_hstu_attention_triton(q, k, v, k_cache, v_cache, q_offsets, cache_offsets, max_q_len,
                                            max_cache_len, mask, scale, pos_weights, timestamps, time_weights)  # fmt: skip
    return cached_hstu_attention_reference(q, k, v, k_cache, v_cache, q_offsets, cache_offsets, max_q_len,
                                           max_cache_len, mask, scale, pos_weights, timestamps, time_weights)  # fmt: skip


__all__ = ["cached_hstu_attention", "cached_hstu_attention_reference"]
