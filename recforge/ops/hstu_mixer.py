"""The HSTU block's mixing step, from the uvqk projection's pre-activation to its gated, normalised attention output.

    u, v, q, k = split(SiLU(pre))                          pre: (T, H * (2 Dv + 2 Dqk))
    y          = dropout(LayerNorm(HSTUAttention(q, k, v)) * u)

On CUDA (Triton, float16/bfloat16/float32) one autograd node whose backward writes the gradient of ``pre`` directly
(``recforge.ops.triton.mixer``): SiLU' is applied where each of u, v, q, k's gradients is stored, instead of by one
more pass that concatenates them (H200, the 64K-token step: BENCHMARKS.md, 19th session). Elsewhere, or for inputs a
kernel does not take, the same functions the unfused block calls: ``F.silu``, ``hstu_attention``, ``norm_gate``.
``RECFORGE_HSTU_MIXER=0`` (read at import; or set ``fused = False``) always runs the unfused path, for A/B runs.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.env import hstu_mixer_fused
from recforge.jagged.mask import AttentionMask
from recforge.ops.custom_ops import hstu_mixer_op
from recforge.ops.dispatch import TRITON_DTYPES, resolve_kernel, unsupported_by_triton
from recforge.ops.hstu_attention import hstu_attention
from recforge.ops.norm_gate import MAX_TRITON_WIDTH, norm_gate

norm_gate_module = importlib.import_module("recforge.ops.norm_gate")  # the module (the package exports the function)
fused = hstu_mixer_fused()  # True: one node on CUDA where the kernels take the inputs; read at each call
_SEED_HIGH = 2**62


def _unsupported(pre: Tensor, heads: int, dqk: int, dv: int, weight: Tensor, bias: Tensor) -> str | None:
    """Why the fused path cannot take these inputs, or None when it can."""
    if heads * dv > MAX_TRITON_WIDTH:
        return f"H * Dv = {heads * dv} > {MAX_TRITON_WIDTH}"
    bad = [str(t.dtype) for t in (weight, bias) if t.dtype not in TRITON_DTYPES]
    if bad:
        return f"LayerNorm parameters of dtype {bad[0]}"
    return unsupported_by_triton(pre, head_dims=(dqk, dv))


def hstu_mixer(
    pre: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    mask: AttentionMask,
    *,
    num_heads: int,
    dqk: int,
    dv: int,
    norm_weight: Tensor,
    norm_bias: Tensor,
    eps: float = 1e-5,
    scale: float | None = None,
    pos_weights: Tensor | None = None,
    timestamps: Tensor | None = None,
    time_weights: Tensor | None = None,
    p: float = 0.0,
    training: bool = False,
    kernel: str = "auto",
) -> Tensor:
    """``dropout(layer_norm(hstu_attention(q, k, v)) * u)`` with ``u, v, q, k = split(SiLU(pre))``.

    Args:
        pre: (T, H * (2 Dv + 2 Dqk)) the uvqk projection's output before SiLU, columns u | v | q | k.
        seq_offsets, max_seq_len, mask, scale, pos_weights, timestamps, time_weights: as ``hstu_attention``.
        num_heads, dqk, dv: H and the per-head query/key and value widths.
        norm_weight, norm_bias, eps: the attention output's LayerNorm (over H * Dv).
        p, training: dropout probability, applied when ``training``.
        kernel: "auto" | "pytorch" | "triton", as ``hstu_attention``: "auto" fuses on CUDA inputs the kernels take
            and runs the unfused functions otherwise (logged once); "triton" raises for inputs they do not take.

    Returns:
        (T, H * Dv), the block's input to its output projection.

    Example:
        >>> y = hstu_mixer(block.uvqk(block.norm(x)), offsets, 200, AttentionMask(), num_heads=2, dqk=25, dv=25,
        ...                norm_weight=block.attn_norm.weight, norm_bias=block.attn_norm.bias)
    """
    if time_weights is not None and timestamps is None:
        raise ValueError("hstu_mixer: time_weights given without timestamps")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"hstu_mixer: dropout probability p={p} is not in [0, 1]")
    width = num_heads * (2 * dv + 2 * dqk)
    if pre.dim() != 2 or pre.shape[1] != width:
        raise ValueError(f"hstu_mixer: pre has shape {tuple(pre.shape)}; expected (T, {width}) for {num_heads} heads "
                         f"of Dqk {dqk} and Dv {dv} (columns u | v | q | k)")  # fmt: skip
    if scale is None:
        scale = 1.0 / max_seq_len
    # kernel="triton" on inputs only the fused path refuses: the unfused chain's Triton kernels (they raise or fall
    # back as they do in the unfused block)
    why = _unsupported(pre, num_heads, dqk, dv, norm_weight, norm_bias)
    if (not (fused and norm_gate_module.fused) or kernel == "pytorch"
            or resolve_kernel("hstu_mixer", kernel if why is None else "auto", pre.device, why) == "pytorch"):
        return _unfused(pre, seq_offsets, max_seq_len, mask, num_heads, dqk, dv, norm_weight, norm_bias, eps, scale,
                        pos_weights, timestamps, time_weights, p, training, kernel)  # fmt: skip
    p = p if training else 0.0
    # one int64 drawn on the device by torch's generator (graph-safe Philox offsets); none without dropout
    seed = torch.randint(0, _SEED_HIGH, (1,), device=pre.device) if p > 0.0 else None
    has_time = time_weights is not None and timestamps is not None
    if torch.compiler.is_compiling():  # one opaque custom op, not a trace of the launch code
        return hstu_mixer_op(pre, seq_offsets, max_seq_len, mask, scale, pos_weights, timestamps, time_weights,
                             norm_weight, norm_bias, seed, eps, p, num_heads, dqk, dv)  # fmt: skip
    from recforge.ops.triton._common import mask_args  # defined on first use: see recforge.ops.triton
    from recforge.ops.triton.mixer import HSTUMixer

    offsets = seq_offsets.contiguous()
    ts_bias = timestamps.to(torch.int64).contiguous() if has_time else None
    num_buckets = time_weights.numel() - 1 if has_time else 0
    return HSTUMixer.apply(pre.contiguous(), offsets, max_seq_len, mask_args(mask, offsets), float(scale), pos_weights,
                           ts_bias, time_weights if has_time else None, num_buckets, norm_weight, norm_bias, seed,
                           float(eps), float(p), num_heads, dqk, dv)  # fmt: skip


def _unfused(pre, seq_offsets, max_seq_len, mask, heads, dqk, dv, weight, bias, eps, scale, pos_weights, timestamps,
             time_weights, p, training, kernel) -> Tensor:  # fmt: skip
    """The block's chain call by call: each function picks its own backend from ``kernel``."""
    tokens = pre.shape[0]
    u, v, q, k = F.silu(pre).split([heads * dv, heads * dv, heads * dqk, heads * dqk], dim=-1)
    attn = hstu_attention(q.view(tokens, heads, dqk), k.view(tokens, heads, dqk), v.view(tokens, heads, dv),
                          seq_offsets, max_seq_len, mask, scale=scale, pos_weights=pos_weights, timestamps=timestamps,
                          time_weights=time_weights, kernel=kernel)  # fmt: skip
    attn = attn.reshape(tokens, heads * dv)
    if kernel == "triton" and norm_gate_module.unsupported(attn, u, weight, bias) is not None:
        kernel = "auto"
    return norm_gate(attn, u, weight, bias, eps=eps, p=p, training=training, kernel=kernel)


__all__ = ["hstu_mixer"]
