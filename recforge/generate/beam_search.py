"""Batched beam search over semantic IDs, constrained to valid prefixes, then resolved to items.

Every decode step is a fixed sequence of device ops (gather the beams' trie rows, mask, top-k,
gather the parents): no ``.item()``, ``.tolist()``, ``nonzero`` or boolean indexing, so the host
never waits for the device inside the loop and the step can be captured in a CUDA graph.
Shapes depend only on (batch, beam, vocab, level), never on data.

Beams that run out of valid continuations keep a score of -inf and resolve to no item. With
``constrained=False`` (free beam) any digit may follow any prefix; sequences that are not a
catalogue SID are dropped when resolving to items.

A model with a dense head (``generative.dense_head``, LIGER) re-scores the beam's items: ``search_items``
with ``dense`` and ``rescore > 0`` resolves every item of the beam's SIDs, scores each
``log p(SID) + rescore * dense_logit`` and re-sorts them (``rescore_items``), so the beam proposes the
candidates and the dense head orders them. The one path of evaluation and serving.

``DenseCandidates`` (``generative.dense_candidates`` = K > 0, LIGER's other half) also adds the dense head's own
top K items (over the request's allowed items that have a dense row) to the beam's items (union, no duplicates),
so items beyond the beam can be found. An added item's log p(SID) is its whole SID (collision digit included)
scored teacher-forced with the request's encoding (``ScoreFn``, one decoder pass for all added items); a beam
item keeps the beam's own score. Every candidate is then ranked by ``log p(SID) + rescore * dense_logit``: with
``rescore = 0`` the SID score alone ranks the union (the dense head only proposes candidates).

A trained ID-retrieval run can take the dense head's place (``generative.dense_scorer``, ``dense_scorer.DenseScorer``):
``dense`` then gives its logits and ``DenseCandidates.of_scorer`` its top items; the search itself is unchanged.

Example:
    >>> step = lambda codes: model.next_token_logprobs(memory, codes)   # (B, W, t) -> (B, W, V)
    >>> out = beam_search(step, trie, batch_size=8, beam=256)
    >>> items, scores = resolve_items(out, trie, k=100)                   # (8, 100) each
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from recforge.generate.trie import SidTrie

if TYPE_CHECKING:  # annotations only: the search itself needs no model
    from recforge.generate.dense_scorer import DenseScorer
    from recforge.models.sid_hstu import SIDHSTU, HSTUMemory
    from recforge.models.sid_seq2seq import Memory, SIDSeq2Seq

StepFn = Callable[[Tensor], Tensor]  # (B, W, t) int64 digits so far -> (B, W, V) next-digit log-probabilities
DenseFn = Callable[[Tensor], Tensor]  # (B, K) int64 trie items (-1: empty slot) -> (B, K) float32 dense logits
ScoreFn = Callable[[Tensor], Tensor]  # (B, K, L) int64 whole SIDs -> (B, K) float32 log p(SID), teacher forced


@dataclass
class BeamOutput:
    """Finished beams, best first per request.

    Attributes:
        codes: (B, W, L) int64 generated digits.
        scores: (B, W) float32 sum of log-probabilities (-inf: a dead beam).
        leaves: (B, W) int64 leaf node of each SID in the trie (-1: not a catalogue SID).
    """

    codes: Tensor
    scores: Tensor
    leaves: Tensor


@dataclass
class DenseCandidates:
    """The dense head's own top items, added to the beam's (``generative.dense_candidates``).

    Attributes:
        count: K, the dense head's top items per request (0: the beam's items only).
        logits: (B, N) float32 dense logits of every trie item; -inf for an item without a dense row (never added).
        item_codes: (N, L) int64 whole SID of each trie item (the collision digit included).
        score: log p(SID) of whole SIDs, teacher forced with each request's encoding (the one the beam reads).
    """

    count: int
    logits: Tensor
    item_codes: Tensor
    score: ScoreFn

    @staticmethod
    def of_model(model: SIDSeq2Seq, memory: Memory, rows: Tensor, item_codes: Tensor, count: int) -> DenseCandidates:
        """Bound to a dense-head model (``SIDSeq2Seq``) and a batch's encoding ``memory`` (``model.start``): ``rows``
        (N,) int64 the model's dense-table row of each trie item (0: none); one matmul scores the catalogue."""
        return DenseCandidates(count, model.catalogue_dense_logits(memory.user, rows), item_codes,
                               lambda codes: model.sid_log_probs(memory, codes))  # fmt: skip

    @staticmethod
    def of_scorer(
        scorer: DenseScorer, user: Tensor, model: SIDSeq2Seq | SIDHSTU, memory: Memory | HSTUMemory, item_codes: Tensor,
        count: int,
    ) -> DenseCandidates:  # fmt: skip
        """Bound to a retrieval run's ``scorer`` (its user vectors ``user`` (B, d) of the batch's histories; one matmul
        scores the catalogue, trie item i being the scorer's host item i + 1) and a SID model's encoding ``memory``,
        whose teacher-forced ``sid_log_probs`` score the added items."""
        return DenseCandidates(count, scorer.catalogue_logits(user), item_codes,
                               lambda codes: model.sid_log_probs(memory, codes))  # fmt: skip


def beam_search(
    step: StepFn,
    trie: SidTrie,
    *,
    batch_size: int,
    beam: int,
    allowed: list[Tensor] | None = None,
    constrained: bool = True,
) -> BeamOutput:
    """Keep the ``beam`` best prefixes per request through the trie's ``L`` levels.

    Args:
        step: next-digit log-probabilities of the beams' prefixes (the model, with each
            request's encoded history captured once and shared by all its beams).
        trie: the valid SIDs, on the device ``step`` runs on.
        batch_size: requests B.
        beam: beam width W (the most SIDs returned per request).
        allowed: ``trie.allowed_nodes(item_mask)``: restricts each request to prefixes leading to
            its allowed items (None: the whole catalogue).
        constrained: False for a free beam (any digit sequence; invalid ones resolve to no item).
    """
    if allowed is not None and not constrained:
        raise ValueError("allowed items need the constrained beam (constrained=True)")
    device = trie.leaf_offsets.device
    vocab = trie.vocab_size
    scores = torch.zeros(batch_size, 1, device=device)  # one live (empty) prefix per request
    nodes = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # -1: left the trie (free beam)
    codes = torch.zeros(batch_size, 1, 0, dtype=torch.long, device=device)
    rows = torch.arange(batch_size, device=device)[:, None, None]
    for level in range(trie.num_levels):
        logp = step(codes).float()  # (B, W, V)
        width = logp.shape[1]
        child = trie.child_rows(level, nodes)  # (B, W, V) next node per digit, -1 if invalid
        cand = scores[..., None] + logp
        if constrained:
            valid = child >= 0
            if allowed is not None:
                valid = valid & allowed[level][rows, child.clamp_min(0)]
            cand = cand.masked_fill(~valid, float("-inf"))
        new_width = min(beam, width * vocab)
        scores, flat = cand.view(batch_size, width * vocab).topk(new_width, dim=1)  # (B, W'), best first
        parent = torch.div(flat, vocab, rounding_mode="floor")
        token = flat - parent * vocab
        codes = torch.cat([codes.gather(1, parent[..., None].expand(-1, -1, level)), token[..., None]], dim=2)
        nodes = child.view(batch_size, width * vocab).gather(1, flat)
    nodes = torch.where(torch.isfinite(scores), nodes, -1)
    return BeamOutput(codes, scores, nodes)


def resolve_items(
    out: BeamOutput, trie: SidTrie, k: int, item_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The first ``k`` items of the beams in order, each SID expanded to all its items.

    A SID shared by several items (no collision level) yields them all, at the SID's score,
    in item order; items past ``k`` are cut, so a collision never returns more than ``k``.
    ``item_mask`` (B, N) bool drops items a request may not get (e.g. ones already seen).

    Returns:
        (items (B, k) int64 with -1 for empty slots, scores (B, k) float32 with -inf there).
    """
    batch, width = out.leaves.shape
    live = out.leaves >= 0
    leaf = out.leaves.clamp_min(0)
    count = torch.where(live, trie.leaf_offsets[leaf + 1] - trie.leaf_offsets[leaf], 0)  # (B, W)
    ends = torch.cumsum(count, 1)
    # enough slots for k survivors even if the mask drops items; the trie bounds items per SID
    most = width * trie.max_items_per_leaf
    slots = most if item_mask is not None else min(k, most)
    j = torch.arange(slots, device=leaf.device).expand(batch, -1).contiguous()  # (B, S)
    which = torch.searchsorted(ends, j, right=True).clamp_max(width - 1)  # beam holding slot j
    start = ends.gather(1, which) - count.gather(1, which)
    position = (trie.leaf_offsets[leaf.gather(1, which)] + (j - start)).clamp(0, trie.num_items - 1)  # empty slots: any item
    item = trie.leaf_items[position]
    score = out.scores.gather(1, which)
    ok = j < ends[:, -1:]
    if item_mask is not None:
        ok = ok & item_mask.gather(1, item)
    # stable compaction: kept slots first, in beam order
    order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices[:, :k]
    item, score, ok = item.gather(1, order), score.gather(1, order), ok.gather(1, order)
    item = torch.where(ok, item, -1)
    score = torch.where(ok, score, float("-inf"))
    if item.shape[1] < k:  # fewer slots than k: pad
        pad = k - item.shape[1]
        item = torch.cat([item, item.new_full((batch, pad), -1)], 1)
        score = torch.cat([score, score.new_full((batch, pad), float("-inf"))], 1)
    return item, score


def rescore_items(items: Tensor, scores: Tensor, dense_logits: Tensor, rescore: float, k: int) -> tuple[Tensor, Tensor]:
    """The first ``k`` of ``items`` re-sorted by ``scores + rescore * dense_logits`` (ties keep their order).

    Args:
        items: (B, K) int64 items, -1 for empty slots (``resolve_items``'s output, best SID first).
        scores: (B, K) float32 their SID log-probabilities (-inf at empty slots).
        dense_logits: (B, K) float32 their dense logits; 0 for an item the dense head has no row for, which so
            keeps its SID score (values at empty slots are ignored).
        rescore: weight of the dense term (0: the same list, cut at ``k``).
        k: items per request.

    Returns:
        (items (B, k) int64, -1 for empty slots; scores (B, k) float32, the combined score, -inf there).
    """
    present = items >= 0
    combined = scores + rescore * torch.where(present, dense_logits.float(), 0.0)
    combined = torch.where(present, combined, float("-inf"))  # (B, K)
    order = torch.sort(combined, dim=1, descending=True, stable=True).indices[:, :k]
    items, combined = items.gather(1, order), combined.gather(1, order)
    if items.shape[1] < k:  # fewer candidates than k: pad
        pad = k - items.shape[1]
        items = torch.cat([items, items.new_full((items.shape[0], pad), -1)], 1)
        combined = torch.cat([combined, combined.new_full((items.shape[0], pad), float("-inf"))], 1)
    return items, combined


def add_dense_candidates(
    items: Tensor, scores: Tensor, candidates: DenseCandidates, *, item_mask: Tensor | None, dense: DenseFn | None,
    rescore: float, k: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The first ``k`` of the beam's items and the dense head's top ``candidates.count``, ranked together.

    Args:
        items, scores: (B, M) the beam's items and their SID scores (``resolve_items``, every item of its SIDs).
        candidates: the dense head's logits of every trie item and the teacher-forced SID scorer.
        item_mask: (B, N) bool, the items each request may get (None: all); no added item is outside it.
        dense: the dense logits of given items (the beam's path), needed when ``rescore > 0``.
        rescore: weight of the dense term; 0: the SID score alone ranks the union.
        k: items per request.

    Returns:
        (items (B, k) int64, -1 for empty slots; scores (B, k) float32 ``log p(SID) + rescore * dense_logit``, -inf
        there). Ties keep the beam's items first, then the added ones in dense order.
    """
    logits = candidates.logits if item_mask is None else candidates.logits.masked_fill(~item_mask, float("-inf"))
    batch, n = logits.shape
    top_logits, top = logits.topk(min(candidates.count, n), dim=1)  # (B, K) the dense head's best, allowed items
    in_beam = torch.zeros(batch, n + 1, dtype=torch.bool, device=items.device)
    in_beam.scatter_(1, items + 1, True)  # column 0: the empty slots (-1)
    added = torch.isfinite(top_logits) & ~in_beam[:, 1:].gather(1, top)  # (B, K) not already a beam item
    sid_scores = candidates.score(candidates.item_codes[top]).float()  # (B, K), one batched decoder pass
    items = torch.cat([items, torch.where(added, top, -1)], 1)  # (B, M + K)
    scores = torch.cat([scores, torch.where(added, sid_scores, float("-inf"))], 1)
    if not rescore:
        return rescore_items(items, scores, torch.zeros_like(scores), 0.0, k)
    if dense is None:
        raise ValueError(f"rescore={rescore} needs the dense head's logits (dense)")
    return rescore_items(items, scores, dense(items), rescore, k)


def search_items(
    step: StepFn, trie: SidTrie, *, batch_size: int, beam: int, k: int, item_mask: Tensor | None = None,
    search_mask: Tensor | None = None, constrained: bool = True, dense: DenseFn | None = None, rescore: float = 0.0,
    candidates: DenseCandidates | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Beam search, then the top-``k`` items: the one generate-to-items path of evaluation and serving.

    Args:
        step, trie, batch_size, beam, constrained: as for ``beam_search``.
        k: items per request.
        item_mask: (B, N) bool over trie items: the items each request may get (e.g. not already in
            its history, only currently eligible ones); None: all.
        search_mask: (B, N) bool restricting the search itself to prefixes with such items, so no beam
            is spent on SIDs whose items are all excluded (usually ``item_mask``; None: unrestricted).
            Needs the constrained beam.
        dense: the dense head's logits of trie items (None: generation only).
        rescore: > 0 with ``dense``: every item of the beam's SIDs is scored ``log p(SID) + rescore *
            dense_logit`` and the top ``k`` by that score are returned (``rescore_items``); 0: generation only.
        candidates: with ``count > 0``, the dense head's top items join the beam's before ranking
            (``add_dense_candidates``); None or ``count = 0``: the beam's items only.

    Returns:
        (items (B, k) int64 trie items, -1 for empty slots; scores (B, k) float32, -inf there).
    """
    if not rescore >= 0:
        raise ValueError(f"search_items: rescore={rescore}; expected >= 0 (0: generation only)")
    if candidates is not None and candidates.count < 0:
        raise ValueError(f"search_items: dense candidates count={candidates.count}; expected >= 0 (0: the beam's only)")
    allowed = trie.allowed_nodes(search_mask) if search_mask is not None else None
    out = beam_search(step, trie, batch_size=batch_size, beam=beam, constrained=constrained, allowed=allowed)
    adding = candidates is not None and candidates.count > 0
    if not adding and (dense is None or not rescore):
        return resolve_items(out, trie, k, item_mask=item_mask)
    items, scores = resolve_items(out, trie, out.leaves.shape[1] * trie.max_items_per_leaf, item_mask=item_mask)
    if adding:
        return add_dense_candidates(items, scores, candidates, item_mask=item_mask, dense=dense, rescore=rescore, k=k)
    return rescore_items(items, scores, dense(items), rescore, k)
