"""What a retrieve request is, how it is checked, and what comes back (the `/v1/retrieve` contract).

A request names raw item IDs; ``Catalogue.encode_request`` checks it against the engine's limits and
maps its IDs to dense item indices once, so a bad request fails here (``ValueError``: the HTTP
layer's 4xx) and never enters a batch.

Example:
    >>> catalogue = Catalogue(item_vocab)
    >>> req = catalogue.encode_request(RetrieveRequest(history=[12, 7, 99], k=10), RetrieveConfig())
    >>> req.history, req.allowed       # dense indices; trie items of the allowed set (or None)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class RetrieveConfig:
    """Limits and settings of a retrieve engine (the server's, not the caller's, choices)."""

    beam: int = 64  # SIDs generated per request
    max_k: int = 200  # most items one request may ask for
    max_batch: int = 64  # requests per search; a longer list runs in chunks
    max_history: int = 10_000  # most history items per request (the model reads the most recent max_items)
    max_allowed: int = 1_000_000  # most allowed_items per request
    exclude_in_search: bool = True  # excluded history items never take a beam (else only dropped from the result)
    constrained: bool = True  # False: free beam (no trie constraint; requests may not restrict allowed items)
    skip_unknown: bool = False  # history/allowed items without a SID are dropped instead of refused

    def validate(self) -> None:
        problems = [f"{name}={getattr(self, name)} must be >= 1" for name in ("beam", "max_k", "max_batch", "max_history",
                    "max_allowed") if getattr(self, name) < 1]  # fmt: skip
        if problems:
            raise ValueError("RetrieveConfig: " + "; ".join(problems))


@dataclass
class RetrieveRequest:
    """One caller's request: raw item IDs, oldest first."""

    history: Sequence[int]
    k: int = 10
    allowed_items: Sequence[int] | None = None  # only these items may be returned (e.g. currently eligible ones)
    exclude_history: bool = True  # never return a history item (as evaluation does); False allows repeats
    user_id: int | str | None = None  # whose history: a returning user's cached encoding is reused (None: never)


@dataclass
class EncodedRetrieve:
    """A checked request in dense item indices (1..N), ready to batch."""

    history: np.ndarray  # (H,) int64 every history item (exclusion uses all; the model reads the last max_items)
    k: int
    allowed: np.ndarray | None  # (A,) int64 trie items (dense index - 1) the request may get; None: all
    exclude_history: bool
    unknown: int = 0  # items dropped for having no SID (skip_unknown)
    user: str | None = None  # history cache key (``str(user_id)``, as the ranking server keys users); None: uncached


@dataclass
class RetrieveResult:
    """Top items of one request, best first (fewer than k when fewer valid items exist)."""

    items: list[int]  # raw item IDs
    scores: list[float]  # SID log-probabilities (+ rescore x dense logits for a run with generative.rescore)


class Catalogue:
    """Raw item ID <-> dense index (1..N) of the items that have a SID."""

    def __init__(self, item_vocab: np.ndarray) -> None:
        self.item_vocab = item_vocab  # (N + 1,) raw ID of each dense index; index 0 is padding
        order = np.argsort(item_vocab[1:], kind="stable")
        self._sorted_raw, self._sorted_index = item_vocab[1:][order], order + 1

    def dense_ids(self, raw: Sequence[int], what: str, skip_unknown: bool = False) -> tuple[np.ndarray, int]:
        """(dense indices of the known ``raw`` IDs, how many were unknown); unknown ones raise unless skipped."""
        try:
            values = np.asarray(raw)
            if values.size and values.dtype.kind not in "iu":  # no floats (1.5 -> 1), bools or strings
                raise TypeError(f"got {values.dtype} values")
            raw = values.astype(np.int64).reshape(-1)
        except (TypeError, ValueError, OverflowError) as err:
            raise ValueError(f"{what}: item IDs must be integers ({err})") from err
        if not len(self._sorted_raw):
            raise ValueError("the catalogue is empty")
        pos = np.searchsorted(self._sorted_raw, raw).clip(0, len(self._sorted_raw) - 1)
        unknown = self._sorted_raw[pos] != raw
        if unknown.any() and not skip_unknown:
            raise ValueError(f"{what}: unknown item IDs {raw[unknown][:5].tolist()} (not in the model's catalogue; code "
                             "new items with `recforge sid add RUN_DIR/sids DATA_DIR`)")  # fmt: skip
        return self._sorted_index[pos[~unknown]], int(unknown.sum())

    def encode_request(self, request: RetrieveRequest, config: RetrieveConfig) -> EncodedRetrieve:
        """Check ``request`` against ``config`` and map its IDs; ``ValueError`` says what is wrong."""
        if isinstance(request.k, bool) or not isinstance(request.k, (int, np.integer)) or not 1 <= request.k <= config.max_k:
            raise ValueError(f"k={request.k!r}: must be an integer in 1..{config.max_k}")
        if len(request.history) == 0:
            raise ValueError("history is empty: give at least one item ID (oldest first)")
        if len(request.history) > config.max_history:
            raise ValueError(f"history has {len(request.history)} items; at most {config.max_history} (send the most recent)")
        history, unknown = self.dense_ids(request.history, "history", config.skip_unknown)
        if history.size == 0:
            raise ValueError(f"history: none of its {len(request.history)} items is in the model's catalogue")
        allowed = None
        if request.allowed_items is not None:
            if not config.constrained:
                raise ValueError("allowed_items needs the constrained beam (this engine runs a free beam)")
            if len(request.allowed_items) > config.max_allowed:
                raise ValueError(f"allowed_items has {len(request.allowed_items)} items; at most {config.max_allowed}")
            dense, dropped = self.dense_ids(request.allowed_items, "allowed_items", config.skip_unknown)
            if dense.size == 0:
                raise ValueError("allowed_items holds no item of the catalogue, so nothing could be returned; "
                                 "omit it to allow every item")  # fmt: skip
            allowed, unknown = dense - 1, unknown + dropped
        user = None if request.user_id is None else str(request.user_id)
        return EncodedRetrieve(history, int(request.k), allowed, bool(request.exclude_history), unknown, user)
