"""Retrieval losses on L2-normalised user and item vectors."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


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

    Sampled negatives equal to the target ("accidental hits") are masked out.

    Returns:
        Mean loss over positions (scalar), computed in float32 also under bfloat16 autocast: at
        temperature 0.05 bf16's ~3 significant digits would put ~0.1 of noise on each logit.
    """
    with torch.autocast(user.device.type, enabled=False):
        dtype = torch.promote_types(user.dtype, torch.float32)  # bf16/fp16 -> float32
        return _sampled_softmax_loss(user.to(dtype), targets, lambda ids: item_vectors(ids).to(dtype), num_items,
                                     negatives, num_negatives, in_batch_negatives, temperature)


def _sampled_softmax_loss(user: Tensor, targets: Tensor, item_vectors: Callable[[Tensor | None], Tensor], num_items: int,
                          negatives: str, num_negatives: int, in_batch_negatives: bool, temperature: float) -> Tensor:
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
