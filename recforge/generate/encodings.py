"""Per-request history encodings of the SID models: what the history cache stores and how batches reuse it.

A batch's memory (what ``model.start`` returns and every beam reads) is cut into one piece per request
(``split``), pieces of any origin (cached, computed now, extended) are put back together as one batch
memory (``assemble``), and a decoder-only model's piece is extended with new history items
(``extend_hstu``). A piece is a tuple of tensors holding only the request's real tokens:

    SIDSeq2Seq  (k_0, v_0, ..., k_{D-1}, v_{D-1}[, user])  each (H, S_b, dh): every decoder layer's cross-attention
                                                       keys/values of the encoder output (S_b = items * L);
                                                       user (d,): the dense head's user vector, if it has one
    SIDHSTU     (last, k_0, v_0, ..., k_{N-1}, v_{N-1}) last (d,): the output at the history's last token;
                                                       k_i/v_i (S_b, H, D): block i's keys/values

The encoder-decoder's encoder is bidirectional: every history token's output depends on every other
token, so a changed history (even one appended event) changes all of it and only an identical history
can reuse a piece. The decoder-only HSTU is causal with relative positions and a constant attention
scale: a history token's keys/values depend only on the tokens before it, so a piece of the first ``n``
items stays exact when events are appended, and ``extend_hstu`` computes only the new tokens against it
(``ops.cached_hstu_attention``: equal to the full pass's rows for the same mask and biases; tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from recforge.jagged.index import offsets_from_lengths
from recforge.jagged.mask import AttentionMask
from recforge.models.sid_hstu import SIDHSTU, HSTUMemory
from recforge.models import sid_seq2seq
from recforge.models.sid_seq2seq import Memory, SIDSeq2Seq
from recforge.ops.cached_attention import cached_hstu_attention

Piece = tuple[Tensor, ...]


def extendable(model: SIDSeq2Seq | SIDHSTU) -> bool:
    """True when a cached piece may be extended with appended events (causal models only)."""
    return isinstance(model, SIDHSTU)


def split(model: SIDSeq2Seq | SIDHSTU, memory: Memory | HSTUMemory, tokens: Sequence[int]) -> list[Piece]:
    """One piece per request of a batch ``memory`` whose requests have ``tokens[b]`` real history tokens
    (copies: a piece never keeps the batch's buffers alive)."""
    if isinstance(model, SIDHSTU):
        return [(memory.last[b].clone(), *(t[b, :n].clone() for kv in zip(memory.keys, memory.values, strict=True)
                                            for t in kv)) for b, n in enumerate(tokens)]  # fmt: skip
    width = memory.kv[0][0].shape[2]  # right-aligned: request b's tokens are the last n of the row
    user = [] if memory.user is None else [memory.user]
    return [(*(t[b, :, width - n :].clone() for kv in memory.kv for t in kv), *(u[b].clone() for u in user))
            for b, n in enumerate(tokens)]  # fmt: skip


def assemble(model: SIDSeq2Seq | SIDHSTU, pieces: Sequence[Piece]) -> Memory | HSTUMemory:
    """The batch memory of ``pieces`` (one per request, in order), laid out as ``model.start`` lays it out."""
    if isinstance(model, SIDHSTU):
        lengths = [p[1].shape[0] for p in pieces]
        width = max(lengths)
        tensors = []
        for i in range(1, len(pieces[0])):  # k_0, v_0, k_1, ...: (B, S, H, D) left-aligned, zeros after
            out = pieces[0][i].new_zeros(len(pieces), width, *pieces[0][i].shape[1:])
            for b, p in enumerate(pieces):
                out[b, : lengths[b]] = p[i]
            tensors.append(out)
        device = pieces[0][0].device
        return HSTUMemory(tensors[0::2], tensors[1::2], torch.tensor(lengths, device=device),
                          torch.stack([p[0] for p in pieces]))  # fmt: skip
    lengths = [p[0].shape[1] for p in pieces]
    width = max(lengths) + -max(lengths) % sid_seq2seq.KEY_ALIGN  # as SIDSeq2Seq.encode pads a masked batch
    num_kv = 2 * len(model.decoder)  # then the dense user vector, for a model with a dense head
    user = torch.stack([p[num_kv] for p in pieces]) if len(pieces[0]) > num_kv else None  # (B, d)
    tensors = []
    for i in range(num_kv):  # (B, H, S, dh) right-aligned, zeros before
        out = pieces[0][i].new_zeros(len(pieces), pieces[0][i].shape[0], width, pieces[0][i].shape[2])
        for b, p in enumerate(pieces):
            out[b, :, width - lengths[b] :] = p[i]
        tensors.append(out)
    start = torch.tensor([width - n for n in lengths], device=tensors[0].device)
    key_mask = (torch.arange(width, device=start.device) >= start[:, None]).view(len(pieces), 1, 1, width)
    return Memory(list(zip(tensors[0::2], tensors[1::2], strict=True)), key_mask, user)


@torch.no_grad()
def extend_hstu(model: SIDHSTU, pieces: Sequence[Piece], new_codes: Sequence[Tensor]) -> list[Piece]:
    """Each piece extended by its request's new items' SIDs ``new_codes[b]`` (m_b, L): only their tokens run
    through the blocks, attending to the piece's cached keys/values (as ``SIDHSTU.start`` would)."""
    L, V = model.cfg.num_levels, model.cfg.vocab_size
    device = pieces[0][0].device
    codes = torch.cat(list(new_codes))  # (M, L)
    tokens = (1 + torch.arange(L, device=device) * V + codes).flatten()  # (M * L,)
    new_lengths = [c.shape[0] * L for c in new_codes]
    cached_lengths = [p[1].shape[0] for p in pieces]
    q_offsets = offsets_from_lengths(torch.tensor(new_lengths, device=device))
    cache_offsets = offsets_from_lengths(torch.tensor(cached_lengths, device=device))
    bounds = [0, *torch.tensor(new_lengths).cumsum(0).tolist()]  # host copy of q_offsets (no device sync)
    x = model.drop(model.token_embedding(tokens))  # (Tq, d)
    grown: list[list[Tensor]] = [[] for _ in pieces]
    for i, block in enumerate(model.encoder.blocks):
        u, q, k, v = block.project(x)
        k_cache = torch.cat([p[1 + 2 * i] for p in pieces])  # (Tc, H, D)
        v_cache = torch.cat([p[2 + 2 * i] for p in pieces])
        attn = cached_hstu_attention(q, k, v, k_cache, v_cache, q_offsets, cache_offsets, max(new_lengths),
                                     max(cached_lengths), AttentionMask(), scale=1.0 / model.max_len,
                                     pos_weights=block.pos_weights, kernel=model.cfg.kernel)  # fmt: skip
        for b, p in enumerate(pieces):
            grown[b] += [torch.cat([p[1 + 2 * i], k[bounds[b] : bounds[b + 1]]]),
                         torch.cat([p[2 + 2 * i], v[bounds[b] : bounds[b + 1]]])]  # fmt: skip
        x = block.combine(x, attn, u)
    last = model.norm(x)[torch.tensor(bounds[1:], device=device) - 1]  # (B, d)
    return [(last[b].clone(), *grown[b]) for b in range(len(pieces))]


__all__ = ["Piece", "assemble", "extend_hstu", "extendable", "split"]
