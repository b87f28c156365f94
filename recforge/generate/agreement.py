"""Do two runs' answers to the same retrieve requests agree, when their floats were summed in another order?

Two computations of one model's scores (a cached history encoding vs a full one, another batch
padding, another kernel) differ by float rounding, so beam search and the top-k cut can order
near-tied items differently: two items whose scores differ by 1e-6 swap ranks, or one of them falls
off the end of the list (observed: a swap at rank 32 of 50 between scores -12.0603733 and -12.0603743,
sid_hstu, float32, cached vs cold). What rounding cannot change is an item's score: it is the model's
log-probability of the item's SID, whatever path the search took. ``compare`` therefore checks

- ``max_score_diff``: the largest score difference of an item both lists hold (a wrong encoding, e.g.
  another user's cached history, moves these by far more than rounding);
- ``same_up_to_ties``: lists that are equal once items with scores within ``atol`` may swap, and an item
  only one list holds scores within ``atol`` of the other list's last score (a tie at the cut);
- ``overlap``: the mean fraction of shared items. A near-tie at an intermediate beam cut can replace a
  prefix's whole subtree, so this is close to, not exactly, 1.

Example:
    >>> report = compare(cached_results, cold_results, atol=1e-4)
    >>> assert report["max_score_diff"] <= 1e-4 and report["overlap"] >= 0.99
"""

from __future__ import annotations

from collections.abc import Sequence

from recforge.generate.requests import RetrieveResult


def same_up_to_ties(a: RetrieveResult, b: RetrieveResult, atol: float) -> bool:
    """True when ``a`` and ``b`` differ only by the order of items within ``atol`` of each other and by
    items tied within ``atol`` at the end of the lists."""
    if len(a.items) != len(b.items):
        return False
    if any(abs(x - y) > atol for x, y in zip(a.scores, b.scores, strict=True)):
        return False
    sa, sb = dict(zip(a.items, a.scores, strict=True)), dict(zip(b.items, b.scores, strict=True))
    if any(abs(sa[i] - sb[i]) > atol for i in sa.keys() & sb.keys()):
        return False
    last_a, last_b = (a.scores[-1], b.scores[-1]) if a.scores else (0.0, 0.0)
    return all(sa[i] <= last_b + atol for i in sa.keys() - sb.keys()) and all(
        sb[i] <= last_a + atol for i in sb.keys() - sa.keys()
    )


def compare(a: Sequence[RetrieveResult], b: Sequence[RetrieveResult], atol: float) -> dict[str, float]:
    """Agreement of two result lists for the same requests (see the module docstring)."""
    if len(a) != len(b):
        raise ValueError(f"compare: {len(a)} results vs {len(b)}; pass both runs' results of the same requests")
    max_diff, overlap, same, tied = 0.0, 0.0, 0, 0
    for x, y in zip(a, b, strict=True):
        sx, sy = dict(zip(x.items, x.scores, strict=True)), dict(zip(y.items, y.scores, strict=True))
        common = sx.keys() & sy.keys()
        max_diff = max([max_diff, *(abs(sx[i] - sy[i]) for i in common)])
        overlap += len(common) / max(1, len(sx), len(sy))
        same += x.items == y.items
        tied += same_up_to_ties(x, y, atol)
    n = max(1, len(a))
    return {"requests": len(a), "same_items": same / n, "same_up_to_ties": tied / n, "overlap": overlap / n,
            "max_score_diff": max_diff}  # fmt: skip


__all__ = ["compare", "same_up_to_ties"]
