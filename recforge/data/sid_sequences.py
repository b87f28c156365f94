"""Sliding-window examples for generative retrieval over ``UserSequences``.

Every training transition is one example (TIGER): for a user's items ``i_0 .. i_{n-1}`` in the
training part, example ``end`` (2 <= end <= n) has the history ``i_{max(0, end-1-H)} .. i_{end-2}``
(at most ``H`` items, right-aligned) and the target ``i_{end-1}``. Samples are (user, end) rows,
like the retrieval recipe's, so the same split protocols apply.

Example:
    >>> samples = transition_samples(seqs, holdout=2)                 # (S, 2)
    >>> items, mask, targets = history_windows(seqs, samples[:128], max_items=50)
"""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.data.sequences import UserSequences


def transition_samples(seqs: UserSequences, holdout: int) -> Tensor:
    """(S, 2) int64 rows (user, end): every transition of each user's training part."""
    return seqs.training_samples(holdout, max_seq_len=1, windows="all")  # windows of one input = every transition


def history_windows(seqs: UserSequences, samples: Tensor, max_items: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-aligned histories and targets of (user, end) ``samples``.

    Returns:
        items (B, H) int64 dense item indices (0 where padded, on the left), mask (B, H) bool
        (True for a real item), targets (B,) the item at position ``end - 1``. H is the longest
        history in the batch (at most ``max_items``).
    """
    users, ends = samples[:, 0], samples[:, 1]
    if bool((ends < 2).any()):
        raise ValueError("history_windows: every sample needs at least one history item (end >= 2)")
    lengths = torch.clamp(ends - 1, max=max_items)  # (B,)
    width = int(lengths.max())
    target_pos = seqs.offsets[users] + ends - 1  # global index of each target
    pos = torch.arange(width)
    pad = (width - lengths)[:, None]
    mask = pos[None] >= pad  # (B, H)
    source = (target_pos[:, None] - width + pos[None]).clamp_min(0)
    items = torch.where(mask, seqs.item_ids[source], 0)
    return items, mask, seqs.item_ids[target_pos]


def eval_samples(seqs: UserSequences, users: Tensor, target_from_end: int) -> Tensor:
    """(B, 2) (user, end) rows whose target is the item ``target_from_end`` from the end (1 = last)."""
    return torch.stack([users, seqs.lengths[users] - target_from_end + 1], dim=1)


def seen_mask(seqs: UserSequences, samples: Tensor) -> Tensor:
    """(B, num_items + 1) bool: the items each sample's user had before its target (padding 0 included)."""
    users, ends = samples[:, 0], samples[:, 1]
    lengths = ends - 1
    rows = torch.repeat_interleave(torch.arange(users.numel()), lengths)
    starts = torch.repeat_interleave(seqs.offsets[users] - torch.cumsum(lengths, 0) + lengths, lengths)
    index = starts + torch.arange(int(lengths.sum()))
    mask = torch.zeros(users.numel(), seqs.num_items + 1, dtype=torch.bool)
    mask[rows, seqs.item_ids[index]] = True
    mask[:, 0] = True
    return mask
