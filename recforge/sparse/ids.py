"""Input checks and deduplication of raw IDs (shared by tables and collections)."""

from __future__ import annotations

import torch
from torch import Tensor


def check_ids(ids: Tensor, what: str = "ids", negatives: bool = True) -> Tensor:
    """Return ``ids`` as int64; raise ``ValueError`` for a non-integer dtype or a negative ID.

    IDs are raw, any value in [0, 2**63 - 1]; there is no vocabulary size to exceed.
    Negative values are reserved (the hash table's empty/tombstone markers) and are a
    data error: map them to non-negative IDs (e.g. ``ids & (2**63 - 1)``) upstream.
    ``negatives=False`` skips that check (a host synchronisation on a GPU): the caller checks
    later, at a synchronisation it makes anyway (``DynamicEmbedding.forward``), with ``raise_negative``.
    """
    if not isinstance(ids, Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor of int64 IDs, got {type(ids).__name__}")
    if ids.dtype in (torch.int32, torch.int16, torch.uint8, torch.int8):
        ids = ids.long()
    elif ids.dtype != torch.int64:
        raise ValueError(f"{what}: dtype {ids.dtype} is not an integer type; pass int64 IDs (e.g. ids.long() for exact integers)")
    if negatives and ids.numel() and bool((ids < 0).any()):
        raise_negative(ids, what)
    return ids


def raise_negative(ids: Tensor, what: str = "ids") -> None:
    """Raise the ``ValueError`` for negative values in ``ids``."""
    bad = ids[ids < 0][:3].tolist()
    raise ValueError(f"{what}: negative IDs {bad} are not allowed; IDs must be >= 0 (remap them upstream, e.g. ids & (2**63 - 1))")


def unique_keys(ids: Tensor, tags: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Distinct (id, tag) pairs of flat ``ids``: (keys, tags, inverse, occurrences).

    ``keys[inverse] == ids``; ``occurrences[i]`` counts ``keys[i]`` in ``ids``.
    """
    if tags is None:
        keys, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        return keys, torch.zeros_like(keys), inverse, counts
    # two stable sorts order by (tag, id); run starts mark the distinct pairs
    order = torch.sort(ids, stable=True).indices
    order = order[torch.sort(tags[order], stable=True).indices]
    sk, st = ids[order], tags[order]
    start = torch.ones_like(sk, dtype=torch.bool)
    start[1:] = (sk[1:] != sk[:-1]) | (st[1:] != st[:-1])
    group = torch.cumsum(start, 0) - 1  # (N,) pair index of each sorted element
    inverse = torch.empty_like(group)
    inverse[order] = group
    counts = torch.bincount(group, minlength=int(start.sum()))
    return sk[start], st[start], inverse, counts
