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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.jagged.index import jagged_rows, lengths_from_offsets
from recforge.jagged.mask import AttentionMask
from recforge.ops.dispatch import resolve_kernel, unsupported_by_triton
from recforge.ops.hstu_attention import apply_bias_index, relative_bias_index_rows


@dataclass
class _Plan:
    """What the reference computes once per batch and reuses in every block (all layer-independent)."""

    visible: Tensor  # (B, 1, M, N)
    bias_index: tuple[Tensor | None, Tensor | None, Tensor | None]
    # the padding layout; None for a single request whose buffers are exactly the bounds (no padding)
    key_rows: Tensor | None = None  # (B, N) row of cat([cache, new]) at each key position
    key_real: Tensor | None = None  # (B, N, 1, 1) the position holds a token
    seq: Tensor | None = None  # (Tq,) request of each new token
    pos: Tensor | None = None  # (Tq,) its row among the request's new tokens


def _plan(q_offsets: Tensor, cache_offsets: Tensor, max_q_len: int, max_cache_len: int, mask: AttentionMask,
          tokens: int, cache_rows: int, num_pos: int | None, timestamps: Tensor | None,
          num_buckets: int | None, single: bool) -> _Plan:  # fmt: skip
    full = max_cache_len + max_q_len
    full_offsets = cache_offsets + q_offsets
    device = q_offsets.device
    n = lengths_from_offsets(cache_offsets).view(-1, 1)
    m = lengths_from_offsets(q_offsets).view(-1, 1)
    r = torch.arange(max_q_len, device=device).view(1, -1)
    q_pos = n + r  # (B, M) positions of the queries in their whole sequences
    visible = mask.rows(full_offsets, full, q_pos)  # (B, M, N)
    bias_index = relative_bias_index_rows(full_offsets, full, q_pos, num_pos, timestamps, num_buckets,
                                          mask.num_targets, mask.num_contextual)  # fmt: skip
    if single:
        return _Plan(visible.unsqueeze(1), bias_index)
    # each new token's (request, row): comparisons and gathers only, so this traces into exported programs too
    token = torch.arange(tokens, device=device).view(-1, 1)
    seq = (token >= q_offsets[1:].view(1, -1)).sum(1)  # (Tq,)
    pos = token.view(-1) - q_offsets[seq]
    key = torch.arange(full, device=device).view(1, -1)
    key_rows = torch.where(key < n, cache_offsets[:-1].view(-1, 1) + key, cache_rows + q_offsets[:-1].view(-1, 1) + key - n)
    key_real = (key < n + m).unsqueeze(-1).unsqueeze(-1)  # (B, N, 1, 1)
    visible = visible & (r < m).unsqueeze(2)
    return _Plan(visible.unsqueeze(1), bias_index, key_rows, key_real, seq, pos)


def _cached_plan(mask: AttentionMask, args: tuple, tensors: tuple) -> _Plan:
    """``_plan(*args)``, kept on the mask object (as ``AttentionMask.dense`` keeps its mask): every block
    of a pass asks for the same one. Keyed by identity and version of every tensor it depends on."""
    tensors = tuple(t for t in tensors if t is not None)
    if any(t.is_inference() for t in tensors):  # no version counters: don't cache
        return _plan(*args)
    key = (tuple(a for a in args if not isinstance(a, Tensor | AttentionMask)),
           tuple((id(t), t._version) for t in tensors), mask.causal, mask.max_attn_len, mask.segment_full)  # fmt: skip
    cached = mask.__dict__.get("_cached_plan")
    if cached is not None and cached[0] == key:
        return cached[2]
    plan = _plan(*args)
    mask.__dict__["_cached_plan"] = (key, tensors, plan)  # holding the tensors keeps their ids unique
    return plan


def _padded(cache: Tensor, new: Tensor, plan: _Plan) -> Tensor:
    """(B, N, H, D): per request its cached rows then its new rows, zeros after (no host sync)."""
    both = torch.cat([cache, new])
    rows = both[plan.key_rows.clamp(0, max(both.shape[0] - 1, 0))] if both.shape[0] else both.new_zeros(
        *plan.key_rows.shape, *both.shape[1:])
    return torch.where(plan.key_real, rows, 0)  # where: a row past the end may hold inf


def _exactly_one(q: Tensor, k_cache: Tensor, q_offsets: Tensor, cache_offsets: Tensor, max_q_len: int,
                 max_cache_len: int) -> bool:  # fmt: skip
    """One request whose buffers hold exactly its tokens (the CPU engine's usual pass): no padding needed.
    Checked only where reading the offsets costs nothing: plain CPU tensors, outside tracing."""
    if q_offsets.numel() != 2 or q.shape[0] != max_q_len or k_cache.shape[0] != max_cache_len:
        return False
    if type(cache_offsets) is not Tensor or type(q_offsets) is not Tensor or cache_offsets.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():
        return False
    bounds = torch.stack([q_offsets, cache_offsets]).tolist()
    return bounds[0][1] - bounds[0][0] == max_q_len and bounds[1][1] - bounds[1][0] == max_cache_len


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
    num_pos = None if pos_weights is None else pos_weights.numel()
    num_buckets = None if time_weights is None or timestamps is None else time_weights.numel() - 1
    # one request whose buffers are exactly as long as the bounds (the engine's usual pass): no padding
    single = _exactly_one(q, k_cache, q_offsets, cache_offsets, max_q_len, max_cache_len)
    args = (q_offsets, cache_offsets, max_q_len, max_cache_len, mask, q.shape[0], k_cache.shape[0], num_pos,
            timestamps, num_buckets, single)  # fmt: skip
    plan = _cached_plan(mask, args, (q_offsets, cache_offsets, mask.num_targets, mask.num_contextual,
                                     mask.segment_lengths, mask.timestamps, timestamps))  # fmt: skip
    if single:
        qp, kp, vp = q.unsqueeze(0), torch.cat([k_cache, k]).unsqueeze(0), torch.cat([v_cache, v]).unsqueeze(0)
    else:
        qp = jagged_rows(q, q_offsets, max_q_len)  # (B, M, H, Dqk)
        kp = _padded(k_cache, k, plan)  # (B, N, H, Dqk)
        vp = _padded(v_cache, v, plan)  # (B, N, H, Dv)
    scores = torch.einsum("bmhd,bnhd->bhmn", qp, kp)  # (B, H, M, N)
    bias = apply_bias_index(plan.bias_index, pos_weights, time_weights if num_buckets is not None else None)
    if bias is not None:
        scores = scores + bias.unsqueeze(1).to(scores.dtype)
    # where, not a product: a key the query cannot see may hold anything (inf included)
    weights = torch.where(plan.visible, F.silu(scores), 0) * scale
    out = torch.einsum("bhmn,bnhd->bmhd", weights, vp)  # (B, M, H, Dv)
    return out[0] if single else out[plan.seq, plan.pos]


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
