"""Retrieval losses on L2-normalised user and item vectors."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.train.chunked_softmax import chunked_softmax_cross_entropy


def sampled_softmax_loss(
    user: Tensor,
    targets: Tensor,
    item_vectors: Callable[[Tensor | None], Tensor],
    num_items: int,
    *,
    negatives: str = "per_position",
    num_negatives: int = 128,
    in_batch_negatives: bool = False,
    temperature: float = 0.05,
    chunk_size: int = 0,
) -> Tensor:
    """Softmax cross-entropy of each position's next item against negatives.

    Args:
        user: (T, d) L2-normalised user vectors, one per position with a target.
        targets: (T,) target item indices in 1..num_items.
        item_vectors: ``f(ids) -> L2-normalised vectors``; ``f(None)`` returns the whole table.
        num_items: catalogue size; negatives are drawn uniformly from 1..num_items.
        negatives: ``per_position`` draws ``num_negatives`` per position (the HSTU paper),
            ``shared`` one set for the batch, ``full`` scores the whole catalogue.
        in_batch_negatives: add the batch's distinct target items as negatives.
        temperature: logits are cosine / temperature.
        chunk_size: > 0 and fewer than the batch's positions: compute the loss ``chunk_size``
            positions at a time (``recforge.train.chunked_softmax``), so no (positions x negatives)
            logits nor (positions x negatives x d) vectors are ever allocated; same value and
            gradients up to float rounding, the same negatives drawn. Per-position negatives are
            looked up once per distinct item (``item_vectors`` sees each sampled ID once, with
            fixed-size padding that repeats one of them); no host synchronisation.

    Sampled negatives equal to the target ("accidental hits") are masked out.

    Returns:
        Mean loss over positions (scalar), computed in float32 also under bfloat16 autocast: at
        temperature 0.05 bf16's ~3 significant digits would put ~0.1 of noise on each logit.
    """
    with torch.autocast(user.device.type, enabled=False):
        dtype = torch.promote_types(user.dtype, torch.float32)  # bf16/fp16 -> float32
        return _sampled_softmax_loss(user.to(dtype), targets, lambda ids: item_vectors(ids).to(dtype), num_items,
                                     negatives, num_negatives, in_batch_negatives, temperature, chunk_size)


def _sampled_softmax_loss(user: Tensor, targets: Tensor, item_vectors: Callable[[Tensor | None], Tensor], num_items: int,
                          negatives: str, num_negatives: int, in_batch_negatives: bool, temperature: float,
                          chunk_size: int = 0) -> Tensor:  # fmt: skip
    if 0 < chunk_size < user.shape[0]:
        return _chunked_loss(user, targets, item_vectors, num_items, negatives, num_negatives, in_batch_negatives,
                             temperature, chunk_size)  # fmt: skip
    if negatives == "full":
        logits = user @ item_vectors(None).T / temperature  # (T, N+1)
        logits[:, 0] = float("-inf")  # padding row is not an item
        return F.cross_entropy(logits, targets)
    pos = (user * item_vectors(targets)).sum(-1, keepdim=True) / temperature  # (T, 1)
    parts = [pos]
    if negatives == "per_position":
        neg_ids = torch.randint(1, num_items + 1, (user.shape[0], num_negatives), device=user.device)  # (T, K)
        neg_logits = torch.einsum("td,tkd->tk", user, item_vectors(neg_ids)) / temperature
        parts.append(neg_logits.masked_fill(neg_ids == targets[:, None], float("-inf")))
    elif negatives == "shared":
        neg_ids = torch.randint(1, num_items + 1, (num_negatives,), device=user.device)  # (K,)
        neg_logits = user @ item_vectors(neg_ids).T / temperature  # (T, K)
        parts.append(neg_logits.masked_fill(neg_ids[None, :] == targets[:, None], float("-inf")))
    else:
        raise ValueError(f"negatives={negatives!r}: expected per_position, shared or full")
    if in_batch_negatives:
        batch_ids = torch.unique(targets)  # (U,)
        batch_logits = user @ item_vectors(batch_ids).T / temperature  # (T, U)
        parts.append(batch_logits.masked_fill(batch_ids[None, :] == targets[:, None], float("-inf")))
    logits = torch.cat(parts, dim=1)
    return -F.log_softmax(logits, dim=1)[:, 0].mean()


def _chunked_loss(user: Tensor, targets: Tensor, item_vectors: Callable[[Tensor | None], Tensor], num_items: int,
                  negatives: str, num_negatives: int, in_batch_negatives: bool, temperature: float, chunk: int) -> Tensor:
    """``_sampled_softmax_loss`` in chunks of positions: the same negatives (drawn in the same order), the
    positive / shared / per-position columns handed to ``chunked_softmax_cross_entropy``."""
    device = user.device
    if negatives == "full":  # the catalogue is the shared columns; item 0 (padding) is masked there
        table = item_vectors(None)  # (N+1, d)
        return chunked_softmax_cross_entropy(user, table[targets], targets, shared=table,
                                             shared_ids=torch.arange(table.shape[0], device=device),
                                             temperature=temperature, chunk=chunk)  # fmt: skip
    shared_ids, own_ids = [], None
    if negatives == "per_position":
        own_ids = torch.randint(1, num_items + 1, (user.shape[0], num_negatives), device=device)  # (T, K)
    elif negatives == "shared":
        shared_ids.append(torch.randint(1, num_items + 1, (num_negatives,), device=device))  # (K,)
    else:
        raise ValueError(f"negatives={negatives!r}: expected per_position, shared or full")
    if in_batch_negatives:
        shared_ids.append(torch.unique(targets))  # (U,)
    shared = own = own_rows = None
    if shared_ids:
        shared_ids = torch.cat(shared_ids)
        shared = item_vectors(shared_ids)  # (S, d)
    if own_ids is not None:
        distinct, own_rows = _distinct_rows(own_ids, num_items + 1)  # (M,), (T, K)
        own = item_vectors(distinct)  # (M, d): one lookup per distinct sampled item, not T x K
    return chunked_softmax_cross_entropy(user, item_vectors(targets), targets, shared=shared,
                                         shared_ids=shared_ids if shared is not None else None, own=own,
                                         own_rows=own_rows, own_ids=own_ids, temperature=temperature, chunk=chunk)  # fmt: skip


def _distinct_rows(ids: Tensor, bound: int) -> tuple[Tensor, Tensor]:
    """(distinct, rows) with ``distinct[rows] == ids``: ``torch.unique(ids, return_inverse=True)`` without
    its host synchronisation (a CUDA-graph-safe, fixed size): ``distinct`` has min(ids.numel(), ``bound``)
    entries (``bound`` > max id), the distinct ids in order, then repeats of the smallest one."""
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return flat, ids
    sorted_ids, order = flat.sort()
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot = first.cumsum(0) - 1  # (T*K,) slot of each sorted id
    distinct = sorted_ids[:1].repeat(min(flat.numel(), bound))
    distinct[slot] = sorted_ids  # duplicates write the same value
    rows = torch.empty_like(slot)
    rows[order] = slot
    return distinct, rows.view(ids.shape)
