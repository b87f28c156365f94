"""HSTU: Hierarchical Sequential Transduction Units (Zhai et al., arXiv 2402.17152).

One block, on jagged tokens x of shape (T, d)::

    u, v, q, k = split(SiLU(W_uvqk · LayerNorm(x)))
    a          = HSTUAttention(q, k, v)          # SiLU(qk^T + rab) / max_seq_len, masked
    x          = x + W_o · Dropout(LayerNorm(a) ⊙ u)

The relative attention bias (rab) is a learned weight per causal distance (``relative_bias``) plus,
when timestamps exist, a learned weight per log-spaced time-difference bucket (``num_time_buckets``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from recforge.jagged.index import lengths_from_offsets, padding_index
from recforge.jagged.mask import AttentionMask
from recforge.ops.hstu_attention import hstu_silu_attention, hstu_silu_attention_gate
from recforge.ops.norm_gate import norm_gate, unsupported


@dataclass
class HSTUConfig:
    """HSTU encoder hyper-parameters."""

    dim: int = 50  # model (embedding) width d
    num_blocks: int = 2
    num_heads: int = 1
    dqk: int = 50  # per-head query/key width
    dv: int = 50  # per-head value/gate width
    dropout: float = 0.2  # on the block output projection input
    max_seq_len: int = 200  # attention normaliser and position-bias range
    num_time_buckets: int = 128  # 0 disables the time bias; unused when data has no timestamps
    # the learned bias per causal distance (pos_weights); False: none (e.g. with absolute position
    # embeddings, as NVIDIA's recsys-examples trains): the attention's bias-gradient work disappears
    relative_bias: bool = True
    kernel: str = "auto"  # attention backend: auto | pytorch | triton
    # attention output normalisation: "layernorm" (the paper: LayerNorm(A V) ⊙ U, which keeps only the
    # direction of A V, so *how many* history items match a query is lost) | "visible_mean" (no
    # LayerNorm; A V divided by the number of keys the query sees: a match count becomes a share)
    attn_norm: str = "layernorm"
    # activation checkpointing: the first N blocks keep only their input for backward and recompute
    # the rest there (one block's activations live at a time); 0 none, >= num_blocks all
    checkpoint_blocks: int = 0
    # the residual stream x under autocast: "float32" (autocast's own: float32 x plus each block's output), "compute"
    # (x cast to the autocast dtype before the first block: bfloat16 LayerNorm inputs, residual adds and gradients) or
    # "auto" (compute under bfloat16 autocast, float32 under float16: float16's range is not float32's). bfloat16 measured
    # no quality change on ML-1M and Amazon Beauty (RESULTS.md) and a 1.04x faster 64K-token step (BENCHMARKS.md)
    residual_dtype: str = "auto"


class HSTUBlock(nn.Module):
    """One HSTU layer on jagged (T, d) tokens."""

    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.num_heads
        self.split_sizes = [h * cfg.dv, h * cfg.dv, h * cfg.dqk, h * cfg.dqk]
        self.norm = nn.LayerNorm(cfg.dim)
        self.uvqk = nn.Linear(cfg.dim, sum(self.split_sizes))
        if cfg.attn_norm not in ("layernorm", "visible_mean"):
            raise ValueError(f"HSTUConfig.attn_norm={cfg.attn_norm!r}: expected layernorm or visible_mean")
        self.attn_norm = nn.LayerNorm(h * cfg.dv) if cfg.attn_norm == "layernorm" else None
        self.out = nn.Linear(h * cfg.dv, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)
        if cfg.relative_bias:
            self.pos_weights = nn.Parameter(torch.zeros(cfg.max_seq_len))
        else:  # None, and no state_dict entry: every reader passes pos_weights=None (no position bias)
            self.register_parameter("pos_weights", None)
        self.time_weights = nn.Parameter(torch.zeros(cfg.num_time_buckets + 1)) if cfg.num_time_buckets else None

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(u, q, k, v) of tokens ``x`` (T, d): u (T, H*Dv) gates the attention output, q/k (T, H, Dqk), v (T, H, Dv)."""
        cfg, tokens = self.cfg, x.shape[0]
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).split(self.split_sizes, dim=-1)  # each (T, H*D)
        return (u, q.view(tokens, cfg.num_heads, cfg.dqk), k.view(tokens, cfg.num_heads, cfg.dqk),
                v.view(tokens, cfg.num_heads, cfg.dv))  # fmt: skip

    def combine(self, x: Tensor, attn: Tensor, u: Tensor, visible_keys: Tensor | None = None,
                kernel: str | None = None) -> Tensor:  # fmt: skip
        """The block's output from its attention ``attn`` (T, H, Dv): x + out(dropout(norm(attn) * u)).

        ``visible_keys`` (T,): how many keys each token attended to, needed by ``attn_norm=visible_mean``
        (which undoes the attention's 1/max_seq_len and divides by it instead). ``kernel``: the backend of
        LayerNorm * u * dropout (``ops.norm_gate``: one Triton kernel each way on CUDA; "triton" falls back to
        PyTorch for inputs the fused kernel does not take, e.g. rows wider than 8192); None (callers with their own
        attention, e.g. serving or export on CPU): "auto", or "pytorch" when ``cfg.kernel`` is. ``forward`` calls
        it for ``attn_norm=visible_mean`` only: with the LayerNorm, ``ops.hstu_silu_attention_gate`` computes the
        same gate (one op with the attention where the Gluon kernels take the call)."""
        cfg = self.cfg
        attn = attn.reshape(x.shape[0], cfg.num_heads * cfg.dv)  # (T, H*Dv)
        if self.attn_norm is not None:
            norm = self.attn_norm
            if kernel is None:
                kernel = "pytorch" if cfg.kernel == "pytorch" else "auto"
            elif kernel == "triton" and unsupported(attn, u, norm.weight, norm.bias) is not None:
                kernel = "auto"  # the attention's setting: this op runs PyTorch where its kernel cannot (logged once)
            gated = norm_gate(attn, u, norm.weight, norm.bias, eps=norm.eps, p=self.dropout.p, training=self.training,
                              kernel=kernel)  # (T, H*Dv); on CPU: F.dropout(F.layer_norm(attn) * u) as nn.Modules do
            return x + self.out(gated)  # (T, d)
        if visible_keys is None:
            raise ValueError("HSTUConfig.attn_norm=visible_mean: combine() needs each token's visible-key count")
        attn = attn * (cfg.max_seq_len / visible_keys.to(attn.dtype)).unsqueeze(1)
        return x + self.out(self.dropout(attn * u))  # (T, d)

    def forward(self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None,
                visible_keys: Tensor | None = None) -> Tensor:  # fmt: skip
        """``visible_keys`` (T,): for attn_norm=visible_mean, each token's visible-key count (the same in
        every block: ``HSTUEncoder`` counts once per batch); counted here when not given."""
        cfg = self.cfg
        pre = self.uvqk(self.norm(x))  # (T, H (2 Dv + 2 Dqk)): project() before its SiLU
        args = (pre, cfg.num_heads, cfg.dqk, cfg.dv, seq_offsets, max_seq_len, mask)
        kw = dict(scale=1.0 / cfg.max_seq_len, pos_weights=self.pos_weights,
                  timestamps=timestamps if self.time_weights is not None else None,
                  time_weights=self.time_weights if timestamps is not None else None, kernel=cfg.kernel)  # fmt: skip
        if self.attn_norm is not None:  # SiLU, the attention and combine()'s gate as one op where the Gluon kernels
            norm = self.attn_norm  # take the call (ops.hstu_silu_attention_gate); the same values either way
            gated = hstu_silu_attention_gate(*args, norm.weight, norm.bias, eps=norm.eps, p=self.dropout.p,
                                             training=self.training, **kw)  # fmt: skip
            return x + self.out(gated)  # (T, d)
        u, attn = hstu_silu_attention(*args, **kw)  # (T, H Dv), (T, H, Dv)
        if visible_keys is None:
            visible_keys = visible_key_counts(seq_offsets, max_seq_len, mask, x.shape[0])
        return self.combine(x, attn, u, visible_keys, kernel=cfg.kernel)


def visible_key_counts(seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, tokens: int,
                       block: int = 256) -> Tensor:  # fmt: skip
    """(T,) how many keys each token sees under ``mask``.

    Masks of history tokens only (no targets, contextual tokens or segments): a closed form, O(T).
    Otherwise from the mask's rows, ``block`` query positions at a time: O(B x block x N) memory,
    never the (B, N, N) mask, which at 100K tokens per user would not fit."""
    seq, pos = padding_index(seq_offsets, tokens)
    if mask.num_targets is None and mask.num_contextual is None and mask.segment_lengths is None:
        earlier = pos + 1 if mask.max_attn_len is None else torch.clamp(pos + 1, max=mask.max_attn_len)  # j <= i
        if mask.causal:
            return earlier
        return earlier + lengths_from_offsets(seq_offsets)[seq] - pos - 1  # and every later key
    batch = seq_offsets.numel() - 1
    rows = [mask.rows(seq_offsets, max_seq_len, torch.arange(lo, min(lo + block, max_seq_len), device=seq_offsets.device)
                      .expand(batch, -1)).sum(-1) for lo in range(0, max_seq_len, block)]  # each (B, block)
    return torch.cat(rows, 1)[seq, pos] if rows else pos


RESIDUAL_DTYPES = ("auto", "float32", "compute")  # HSTUConfig.residual_dtype


def residual_stream_dtype(setting: str, device_type: str) -> torch.dtype | None:
    """The dtype the encoder casts its residual stream to before the first block under ``setting``
    (``HSTUConfig.residual_dtype``), or None (leave it): the autocast dtype for "compute", and for "auto" when it is
    bfloat16; None without autocast on ``device_type``."""
    if setting == "float32" or not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if setting == "compute" or dtype == torch.bfloat16 else None


AttentionHook = Callable[[int, HSTUBlock, Tensor, Tensor, Tensor], Tensor]
"""``attention(layer, block, q, k, v) -> (T, H, Dv)``: a block's attention, given its projections.

Serving passes one (``recforge.serve.engine``: ``ops.cached_hstu_attention`` over the KV cache)
to ``HSTUEncoder.encode`` so that it runs the training blocks' own projection and output code."""


class HSTUEncoder(nn.Module):
    """A stack of HSTU blocks over jagged token embeddings.

    Example:
        >>> enc = HSTUEncoder(HSTUConfig(dim=64, num_blocks=2, num_heads=2, dqk=32, dv=32))
        >>> y = enc(x, seq_offsets, max_seq_len=200, mask=AttentionMask())  # (T, 64)
        >>> y = enc.encode(x, lambda layer, block, q, k, v: my_attention(q, k, v))  # serving: own attention
    """

    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        if cfg.residual_dtype not in RESIDUAL_DTYPES:  # the encoder's setting (forward casts the stream)
            raise ValueError(f"HSTUConfig.residual_dtype={cfg.residual_dtype!r}: expected one of "
                             f"{', '.join(RESIDUAL_DTYPES)}")  # fmt: skip
        self.cfg = cfg
        self.blocks = nn.ModuleList(HSTUBlock(cfg) for _ in range(cfg.num_blocks))

    def forward(
        self,
        x: Tensor,
        seq_offsets: Tensor,
        max_seq_len: int,
        mask: AttentionMask,
        timestamps: Tensor | None = None,
    ) -> Tensor:
        if max_seq_len > self.cfg.max_seq_len:
            raise ValueError(f"batch max_seq_len {max_seq_len} exceeds the encoder's max_seq_len {self.cfg.max_seq_len}")
        visible_keys = None
        if self.cfg.attn_norm == "visible_mean":  # once per batch, not per block
            visible_keys = visible_key_counts(seq_offsets, max_seq_len, mask, x.shape[0])
        x = self._residual_stream(x)
        recompute = torch.is_grad_enabled() and self.training  # no backward, nothing to save memory on
        for layer, block in enumerate(self.blocks):
            if recompute and layer < self.cfg.checkpoint_blocks:
                # non-reentrant: takes the non-tensor mask argument, works with the Triton attention's
                # autograd.Function and with DDP/FSDP; the recomputation replays dropout's RNG state
                x = checkpoint(block, x, seq_offsets, max_seq_len, mask, timestamps, visible_keys, use_reentrant=False)
            else:
                x = block(x, seq_offsets, max_seq_len, mask, timestamps, visible_keys)
        return x

    def _residual_stream(self, x: Tensor) -> Tensor:
        """``x`` in the dtype ``cfg.residual_dtype`` gives the stream (``residual_stream_dtype``): forward and encode."""
        stream = residual_stream_dtype(self.cfg.residual_dtype, x.device.type)
        return x if stream is None else x.to(stream)

    def encode(self, x: Tensor, attention: AttentionHook) -> Tensor:
        """``x`` (T, d) through every block with ``attention(layer, block, q, k, v)`` as the blocks' attention
        (``attn_norm=layernorm``: ``visible_mean`` needs per-token visible-key counts that a hook does not give)."""
        if self.cfg.attn_norm != "layernorm":
            raise ValueError(f"HSTUEncoder.encode: attn_norm={self.cfg.attn_norm!r} needs visible-key counts; "
                             "run forward() with a mask instead")  # fmt: skip
        x = self._residual_stream(x)
        for layer, block in enumerate(self.blocks):
            u, q, k, v = block.project(x)
            x = block.combine(x, attention(layer, block, q, k, v), u)
        return x
