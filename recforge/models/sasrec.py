"""SASRec (Kang & McAuley, 2018): pre-LayerNorm softmax self-attention blocks, as a baseline."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from recforge.jagged.mask import AttentionMask
from recforge.ops.softmax_attention import softmax_attention


@dataclass
class SASRecConfig:
    """SASRec encoder hyper-parameters."""

    dim: int = 50
    num_blocks: int = 2
    num_heads: int = 1
    ffn_dim: int = 50  # hidden width of the point-wise feed-forward layer
    dropout: float = 0.2
    max_seq_len: int = 200
    kernel: str = "auto"


class SASRecBlock(nn.Module):
    def __init__(self, cfg: SASRecConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.num_heads:
            raise ValueError(f"SASRec dim {cfg.dim} is not divisible by num_heads {cfg.num_heads}")
        self.cfg = cfg
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.attn_out = nn.Linear(cfg.dim, cfg.dim)
        self.ffn_norm = nn.LayerNorm(cfg.dim)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim), nn.ReLU(), nn.Dropout(cfg.dropout), nn.Linear(cfg.ffn_dim, cfg.dim)
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask) -> Tensor:
        cfg = self.cfg
        tokens, heads = x.shape[0], cfg.num_heads
        q, k, v = self.qkv(self.attn_norm(x)).view(tokens, 3, heads, cfg.dim // heads).unbind(1)  # (T, H, D) each
        attn = softmax_attention(
            q, k, v, seq_offsets, max_seq_len, mask, dropout=cfg.dropout if self.training else 0.0, kernel=cfg.kernel
        )
        x = x + self.dropout(self.attn_out(attn.reshape(tokens, cfg.dim)))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class SASRecEncoder(nn.Module):
    """A stack of SASRec blocks with a final LayerNorm; same call signature as ``HSTUEncoder``."""

    def __init__(self, cfg: SASRecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(SASRecBlock(cfg) for _ in range(cfg.num_blocks))
        self.final_norm = nn.LayerNorm(cfg.dim)

    def forward(
        self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None = None
    ) -> Tensor:
        if max_seq_len > self.cfg.max_seq_len:
            raise ValueError(f"batch max_seq_len {max_seq_len} exceeds the encoder's max_seq_len {self.cfg.max_seq_len}")
        for block in self.blocks:
            x = block(x, seq_offsets, max_seq_len, mask)
        return self.final_norm(x)
