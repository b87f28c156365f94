"""Decoder-only HSTU over semantic-ID tokens (``model.kind: sid_hstu``).

The history's items become ``L`` tokens each (token id ``1 + level * V + digit``) in one causal
sequence through the recforge HSTU blocks (relative position bias unless ``relative_bias=False``, pointwise
SiLU attention).
Each token's output predicts the next token with the head of that token's level, so a window
of ``n`` items trains on every item after the first (all positions are targets, as in HSTU).

Beam search: ``start`` runs the history once and keeps every block's keys/values; a beam's
digits then attend to those (shared by all beams of the request) and to the beam's own earlier
digits, with the same relative position bias as in training (tested: the decode path's
log-probabilities equal the full forward's).

Example:
    >>> model = SIDHSTU(SIDHSTUConfig(num_levels=4, vocab_size=256))
    >>> loss = model.loss(history_codes, history_mask, target_codes)
    >>> memory = model.start(history_codes, history_mask)
    >>> logp = model.next_token_logprobs(memory, codes)                  # (B, W, t) -> (B, W, V)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recforge.jagged.index import jagged_to_padded, offsets_from_lengths
from recforge.jagged.mask import AttentionMask
from recforge.models.hstu import HSTUConfig, HSTUEncoder
from recforge.ops.hstu_attention import hstu_attention


@dataclass
class SIDHSTUConfig:
    num_levels: int
    vocab_size: int
    dim: int = 128
    num_blocks: int = 4
    num_heads: int = 4
    dropout: float = 0.1
    max_items: int = 50  # history items; sequences hold up to (max_items + 1) * num_levels tokens
    kernel: str = "auto"
    relative_bias: bool = True  # the blocks' learned bias per causal distance (HSTUConfig.relative_bias)


@dataclass
class HSTUMemory:
    keys: list[Tensor]  # per block (B, S, H, Dqk), each request's history left-aligned
    values: list[Tensor]  # per block (B, S, H, Dv)
    lengths: Tensor  # (B,) history tokens per request
    last: Tensor  # (B, d) output at each history's last token (predicts digit 0)


def _no_item_ids(history_items: Tensor | None) -> None:
    if history_items is not None:
        raise ValueError("sid_hstu reads no item IDs (generative.item_id_embedding is for model.kind=tiger)")


class SIDHSTU(nn.Module):
    """Decoder-only HSTU over SID tokens (see the module docstring)."""

    # no item-ID input: every SID token is also a target here, so an item's ID would give away its own digits
    reads_item_ids = False

    def __init__(self, cfg: SIDHSTUConfig) -> None:
        super().__init__()
        self.cfg = cfg
        L, V, d = cfg.num_levels, cfg.vocab_size, cfg.dim
        head_dim = d // cfg.num_heads
        self.max_len = (cfg.max_items + 1) * L
        self.encoder = HSTUEncoder(HSTUConfig(dim=d, num_blocks=cfg.num_blocks, num_heads=cfg.num_heads, dqk=head_dim,
                                              dv=head_dim, dropout=cfg.dropout, max_seq_len=self.max_len,
                                              num_time_buckets=0, relative_bias=cfg.relative_bias,
                                              kernel=cfg.kernel))  # fmt: skip
        self.token_embedding = nn.Embedding(1 + L * V, d, padding_idx=0)
        self.norm = nn.LayerNorm(d)
        self.heads = nn.Parameter(torch.randn(L, V, d) * d**-0.5)
        self.drop = nn.Dropout(cfg.dropout)

    def _jagged(self, codes: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(token ids (T,), offsets (B+1,), lengths (B,)) of the masked items' digits, in order."""
        b, n, L = codes.shape
        tokens = 1 + torch.arange(L, device=codes.device) * self.cfg.vocab_size + codes  # (B, N, L)
        lengths = mask.sum(1) * L
        return tokens[mask].flatten(), offsets_from_lengths(lengths), lengths

    def _hidden(self, tokens: Tensor, offsets: Tensor) -> Tensor:
        return self.norm(self.encoder(self.drop(self.token_embedding(tokens)), offsets, self.max_len, AttentionMask()))

    def loss(
        self, history_codes: Tensor, history_mask: Tensor | None, target_codes: Tensor, history_items: Tensor | None = None
    ) -> Tensor:  # fmt: skip
        """Mean next-token cross-entropy over every item after the first of [history, target] (``history_items``:
        must be None, the interface of ``SIDSeq2Seq.loss``)."""
        _no_item_ids(history_items)
        b, h, L = history_codes.shape
        mask = torch.ones(b, h, dtype=torch.bool, device=history_codes.device) if history_mask is None else history_mask
        codes = torch.cat([history_codes, target_codes[:, None]], 1)  # (B, H+1, L)
        mask = torch.cat([mask, mask.new_ones(b, 1)], 1)
        tokens, offsets, lengths = self._jagged(codes, mask)
        hidden = self._hidden(tokens, offsets)  # (T, d)
        pos = torch.arange(tokens.numel(), device=tokens.device) - torch.repeat_interleave(offsets[:-1], lengths)
        last = torch.repeat_interleave(lengths, lengths) - 1
        use = (pos >= L - 1) & (pos < last)  # predict tokens of the 2nd item onwards
        level = (pos + 1) % L  # level of the predicted (next) token
        logits = torch.einsum("td,tvd->tv", hidden[use], self.heads[level[use]])
        nxt = tokens.roll(-1)[use]
        digit = nxt - 1 - level[use] * self.cfg.vocab_size
        return F.cross_entropy(logits.float(), digit)

    def start(self, history_codes: Tensor, history_mask: Tensor | None, history_items: Tensor | None = None) -> HSTUMemory:
        """Run the histories once; keep every block's keys/values for the beams (``history_items``: must be None,
        the interface of ``SIDSeq2Seq.start``)."""
        _no_item_ids(history_items)
        b, h, L = history_codes.shape
        mask = torch.ones(b, h, dtype=torch.bool, device=history_codes.device) if history_mask is None else history_mask
        tokens, offsets, lengths = self._jagged(history_codes, mask)
        width = h * L
        x = self.drop(self.token_embedding(tokens))
        keys, values = [], []
        for block in self.encoder.blocks:
            u, q, k, v = block.project(x)
            attn = hstu_attention(q, k, v, offsets, self.max_len, AttentionMask(), scale=1.0 / self.max_len,
                                  pos_weights=block.pos_weights, kernel=self.cfg.kernel)  # fmt: skip
            keys.append(jagged_to_padded(k, offsets, width))  # (B, S, H, D)
            values.append(jagged_to_padded(v, offsets, width))
            x = block.combine(x, attn, u)
        last = self.norm(x)[offsets[1:] - 1]  # (B, d)
        return HSTUMemory(keys, values, lengths, last)

    def sid_log_probs(self, memory: HSTUMemory, codes: Tensor) -> Tensor:
        """(B, K) float32 log p(SID) of whole SIDs ``codes`` (B, K, L), teacher forced: each level's log-probability of
        the SID's own digit by the beam's own step (``next_token_logprobs`` on its first t digits), so a beam's SID gets
        the beam's score up to float rounding (the interface of ``SIDSeq2Seq.sid_log_probs``)."""
        total = torch.zeros(codes.shape[:2], device=codes.device)
        for level in range(codes.shape[2]):
            logprobs = self.next_token_logprobs(memory, codes[:, :, :level])  # (B, K, V)
            total = total + logprobs.gather(2, codes[:, :, level, None]).squeeze(2)
        return total

    def next_token_logprobs(self, memory: HSTUMemory, codes: Tensor) -> Tensor:
        """(B, W, V) log-probabilities of digit ``t`` after each beam's prefix ``codes`` (B, W, t)."""
        b, w, t = codes.shape
        if t == 0:
            return (memory.last @ self.heads[0].T).float().log_softmax(-1)[:, None].expand(b, w, -1)
        tokens = 1 + torch.arange(t, device=codes.device) * self.cfg.vocab_size + codes  # (B, W, t)
        x = self.token_embedding(tokens).reshape(b * w * t, -1)  # (BWt, d)
        s = memory.keys[0].shape[1]
        i = torch.arange(t, device=codes.device)
        dist_hist = memory.lengths[:, None, None] + i[None, :, None] - torch.arange(s, device=codes.device)  # (B, t, S)
        seen_hist = torch.arange(s, device=codes.device)[None, None] < memory.lengths[:, None, None]  # (B, 1, S)
        dist_own = i[:, None] - i[None]  # (t, t)
        for block, k_hist, v_hist in zip(self.encoder.blocks, memory.keys, memory.values, strict=True):
            u, q, k, v = block.project(x)
            heads, dqk = q.shape[1], q.shape[2]
            q = q.view(b, w, t, heads, dqk)
            k, v = k.view(b, w, t, heads, -1), v.view(b, w, t, heads, -1)
            scores = torch.einsum("bwihd,bshd->bwhis", q, k_hist)  # (B, W, H, t, S)
            own = torch.einsum("bwihd,bwjhd->bwhij", q, k)  # (B, W, H, t, t)
            if block.pos_weights is not None:  # relative_bias: the learned weight of each causal distance
                top = block.pos_weights.numel() - 1
                scores = scores + block.pos_weights[dist_hist.clamp(0, top)][:, None, None]  # (B, t, S) bias
                own = own + block.pos_weights[dist_own.clamp(0, top)]
            weights = F.silu(scores) * seen_hist[:, None, None] / self.max_len
            out = torch.einsum("bwhis,bshd->bwihd", weights, v_hist)
            own = F.silu(own) * (dist_own >= 0) / self.max_len
            out = out + torch.einsum("bwhij,bwjhd->bwihd", own, v)  # (B, W, t, H, Dv)
            x = block.combine(x, out.reshape(b * w * t, heads, -1), u)
        last = self.norm(x).view(b, w, t, -1)[:, :, -1]  # (B, W, d)
        return (last @ self.heads[t].T).float().log_softmax(-1)
