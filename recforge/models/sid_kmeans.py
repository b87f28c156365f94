"""K-means for semantic-ID codebooks: k-means++ init, Lloyd steps, an optional balanced assignment.

All randomness comes from one ``torch.Generator``, so a fit is a pure function of (data, seed).

Example:
    >>> g = torch.Generator().manual_seed(0)
    >>> centroids = kmeans(x, 256, iters=20, generator=g)        # (256, d)
    >>> codes = assign(x, centroids)                             # (N,) nearest centroid
    >>> codes = balanced_assign(x, centroids, capacity=ceil(N / 256))
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sq_distances(x: Tensor, centroids: Tensor) -> Tensor:
    """(N, K) squared Euclidean distances (clamped at 0 against rounding)."""
    d = x.pow(2).sum(1, keepdim=True) - 2 * x @ centroids.T + centroids.pow(2).sum(1)[None]
    return d.clamp_min_(0)


def assign(x: Tensor, centroids: Tensor) -> Tensor:
    """(N,) index of each row's nearest centroid."""
    return sq_distances(x, centroids).argmin(1)


def balanced_assign(x: Tensor, centroids: Tensor, capacity: int) -> Tensor:
    """Nearest-centroid assignment where no centroid takes more than ``capacity`` rows.

    Rounds of proposals: every unassigned row proposes to its nearest centroid that still has
    room; each centroid accepts its closest proposers up to its remaining room. A row is
    rejected only by a full centroid, so each round fills at least one centroid or assigns
    every proposer, and at most K rounds run.
    """
    n, k = x.shape[0], centroids.shape[0]
    if capacity * k < n:
        raise ValueError(f"balanced assignment: capacity {capacity} x {k} centroids < {n} rows")
    dist = sq_distances(x, centroids)  # (N, K)
    codes = torch.full((n,), -1, dtype=torch.long)
    room = torch.full((k,), capacity, dtype=torch.long)
    for _ in range(k + 1):
        open_rows = torch.nonzero(codes < 0).flatten()
        if open_rows.numel() == 0:
            break
        d = dist[open_rows].masked_fill(room[None] <= 0, float("inf"))
        choice = d.argmin(1)  # (R,)
        best = d.gather(1, choice[:, None]).squeeze(1)
        order = torch.argsort(best, stable=True)
        order = order[torch.argsort(choice[order], stable=True)]  # grouped by centroid, closest first
        chosen = choice[order]
        first = torch.searchsorted(chosen, chosen, right=False)
        rank_in_group = torch.arange(chosen.numel()) - first
        accept = rank_in_group < room[chosen]
        codes[open_rows[order[accept]]] = chosen[accept]
        room -= torch.bincount(chosen[accept], minlength=k)
    assert (codes >= 0).all(), "balanced assignment left rows unassigned"
    return codes


def kmeans_plus_plus(x: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """k-means++ seeding: (k, d) centroids drawn from the rows of ``x``."""
    n = x.shape[0]
    first = torch.randint(n, (1,), generator=generator)
    centroids = [x[first]]
    closest = sq_distances(x, centroids[0]).squeeze(1)
    for _ in range(1, k):
        total = closest.sum()
        if total <= 0:  # fewer distinct rows than k: repeat random rows
            pick = torch.randint(n, (1,), generator=generator)
        else:
            pick = torch.multinomial(closest / total, 1, generator=generator)
        centroids.append(x[pick])
        closest = torch.minimum(closest, sq_distances(x, x[pick]).squeeze(1))
    return torch.cat(centroids)


def kmeans(
    x: Tensor, k: int, *, iters: int = 20, generator: torch.Generator, balanced: bool = False
) -> tuple[Tensor, Tensor]:
    """Fit ``k`` centroids to the rows of ``x`` (float64 inside for determinism across threads).

    Args:
        x: (N, d) points.
        k: number of centroids; when N < k the surplus centroids are copies of points.
        iters: Lloyd iterations.
        generator: source of all randomness (seeding, empty-cluster refills).
        balanced: cap each cluster at ceil(N / k) points (better codebook usage, fewer collisions).

    Returns:
        (centroids (k, d), codes (N,)). Unbalanced: codes are the nearest centroids. Balanced: codes
        respect the cap and each used centroid is the mean of its codes' points.
    """
    x64 = x.double()
    centroids = kmeans_plus_plus(x64, k, generator)
    capacity = math.ceil(x.shape[0] / k)
    step = (lambda c: balanced_assign(x64, c, capacity)) if balanced else (lambda c: assign(x64, c))
    for _ in range(iters):
        centroids = _means(x64, step(centroids), centroids, generator)
    codes = step(centroids)
    if balanced:
        # capped assignments need not settle (the greedy proposals can cycle), and the codes returned
        # are the items' SIDs: end on the means of exactly these codes (empty codes are left as they are)
        centroids = _means(x64, codes, centroids, None)
    return centroids.to(x.dtype), codes


def _means(x: Tensor, codes: Tensor, centroids: Tensor, generator: torch.Generator | None) -> Tensor:
    """Lloyd update: each centroid moves to its points' mean; an empty one restarts on a random point
    (stays where it is when ``generator`` is None)."""
    k = centroids.shape[0]
    counts = torch.bincount(codes, minlength=k)
    sums = torch.zeros_like(centroids).index_add_(0, codes, x)
    empty = counts == 0
    centroids = torch.where(empty[:, None], centroids, sums / counts.clamp_min(1)[:, None])
    if generator is not None and empty.any():  # re-seed empty clusters on random points so every code stays usable
        picks = torch.randint(x.shape[0], (int(empty.sum()),), generator=generator)
        centroids[empty] = x[picks]
    return centroids
