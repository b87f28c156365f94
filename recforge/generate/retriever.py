"""The retrieve engine behind `/v1/retrieve`: raw item histories -> top-k items by constrained beam search.

Serving splits the work like the ranking engine: ``encode`` checks one request and maps its raw IDs
once (a bad request raises ``ValueError``, the HTTP layer's 4xx, and never enters a batch); ``run``
serves a batch of encoded requests with one encoder pass (each history encoded once, its beams share
the encoding; see ``recforge.models.sid_seq2seq``), one beam search restricted per request (its
allowed items, minus its history items) and one copy of the result to the host.

Requests that name a user reuse that user's cached history encoding when ``cache`` is set (a
``HistoryCache``): an identical history skips the encoder, and for the decoder-only ``SIDHSTU`` a history
that extends the cached one by appended events runs only the new events' tokens (``encodings.py``).
The answer is the cold one's up to float rounding (tested: the same items, scores within 1e-4).

A model with an item-ID embedding (``generative.item_id_embedding``) also reads each history item's
table row: the catalogue's dense indices map to the model's rows once, at construction (an item coded
after training, e.g. by `recforge sid add`, maps to the zero row 0).

A run with a dense head and ``generative.rescore`` > 0 re-sorts each request's beam items by
``log p(SID) + rescore * cos(user, item) / temperature`` (``beam_search.rescore_items``, the evaluation's
path); the returned scores are those combined scores. An item without a dense row (coded after training)
keeps its SID score. With ``generative.dense_candidates`` = K > 0 the dense head's top K allowed items (one matmul
over the catalogue, items without a dense row left out) join the beam's before that ranking, their log p(SID)
scored teacher-forced on the request's encoding (``beam_search.add_dense_candidates``, evaluation's path too).

A run with ``generative.dense_scorer`` (a trained ID-retrieval run, ``dense_scorer.DenseScorer``, loaded once with the
run, on the engine's device) scores both in the dense head's place, with or without one: one forward of the run's user
tower over the batch's histories (each its ``data.max_seq_len`` most recent items), then the same ``rescore`` /
``dense_candidates`` path, the same allowed items and history exclusion. Items coded after the scorer was trained
keep their SID score and are never its candidates.

Like evaluation (``recforge eval``), the items of a request's history are never returned
(``exclude_history=False`` keeps them, e.g. for re-purchases): for a history without its target,
``retrieve`` returns exactly the list the evaluation scores (tested).

Example:
    >>> retriever = Retriever.from_run("runs/beauty-sid-tiger", RetrieveConfig(beam=64), device="cuda")
    >>> batch = [retriever.encode(RetrieveRequest(history=[12, 7, 99], k=10)),
    ...          retriever.encode(RetrieveRequest(history=[5], k=20, allowed_items=[3, 8, 13]))]
    >>> results = retriever.run(batch)      # RetrieveResult(items, scores) per request, best first
    >>> retriever.retrieve([[12, 7, 99], [5]], k=10, beam=64)   # the same as plain lists
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from recforge.generate import encodings
from recforge.generate.beam_search import DenseCandidates, search_items
from recforge.generate.dense_scorer import DenseScorer
from recforge.generate.history_cache import HistoryCache
from recforge.generate.requests import Catalogue, EncodedRetrieve, RetrieveConfig, RetrieveRequest, RetrieveResult
from recforge.generate.sid_run import load_sid_run
from recforge.generate.trie import SidTrie
from recforge.models.sid_hstu import SIDHSTU, HSTUMemory
from recforge.models.sid_seq2seq import Memory, SIDSeq2Seq
from recforge.ops.dispatch import resolve_device


def mark_items(mask: Tensor, rows_items: list[tuple[int, np.ndarray]], value: bool) -> None:
    """``mask[row, items] = value`` for each (row, items), with one host-to-device copy: flat int64
    positions (8 bytes per item), or the rows' dense (rows, N) bool slab when that is smaller (large
    allowed sets: 64 requests x 1M allowed items cost 64 MB, not 512 MB of positions)."""
    n = mask.shape[1]
    count = sum(items.size for _, items in rows_items)
    if count * 8 <= len(rows_items) * n:
        flat = np.concatenate([items + row * n for row, items in rows_items]).astype(np.int64, copy=False)
        mask.view(-1)[torch.from_numpy(flat).to(mask.device)] = value
        return
    slab = np.zeros((len(rows_items), n), dtype=bool)
    for i, (_, items) in enumerate(rows_items):
        slab[i, items] = True
    rows = torch.tensor([row for row, _ in rows_items], device=mask.device)
    mask[rows] = torch.where(torch.from_numpy(slab).to(mask.device), value, mask[rows])


class Retriever:
    """A generative model, its items' SIDs and their trie, ready to retrieve.

    Args:
        model: the trained SID model (tiger or sid_hstu; on ``device``).
        item_vocab: (N + 1,) raw item ID of each dense index (index 0 is padding).
        item_codes: (N + 1, L) SID of each dense index.
        trie: the valid SIDs over items 1..N (trie item i = dense index i + 1), on ``device``.
        max_items: most recent history items the model reads.
        config: limits and settings (beam, exclusion inside the search, ...).
        rescore: weight of the dense logits in the items' scores (a run's ``generative.rescore``; 0: generation
            only; > 0 needs a model with a dense head, or ``dense_scorer``).
        dense_candidates: the dense side's top items per request added to the beam's (a run's
            ``generative.dense_candidates``; 0: the beam's items only; > 0 needs a dense head or ``dense_scorer``).
        dense_scorer: a retrieval run scoring the catalogue (host dense indices = ``item_vocab``'s) in place of the
            model's dense head (a run's ``generative.dense_scorer``); None: the dense head, if any.

    Attributes:
        cache: per-user history encodings reused across requests (None: every history is encoded).
        version: the model version tagging the cache's entries (``load_retriever`` sets the served one).
    """

    def __init__(
        self, model: SIDSeq2Seq | SIDHSTU, item_vocab: np.ndarray, item_codes: Tensor, trie: SidTrie, max_items: int,
        config: RetrieveConfig | None = None, *, rescore: float = 0.0, dense_candidates: int = 0,
        dense_scorer: DenseScorer | None = None,
    ) -> None:  # fmt: skip
        self.config = config or RetrieveConfig()
        self.config.validate()
        dense_side = dense_scorer is not None or getattr(model, "has_dense_head", False)
        if not rescore >= 0:
            raise ValueError(f"rescore={rescore}: the dense term's weight must be >= 0 (0: generation only)")
        if rescore and not dense_side:
            raise ValueError(f"rescore={rescore} needs a model with a dense head (generative.dense_head) or a dense "
                             "scorer (generative.dense_scorer); use rescore=0 for this model")  # fmt: skip
        if dense_candidates < 0:
            raise ValueError(f"dense_candidates={dense_candidates}: must be >= 0 (0: the beam's items only)")
        if dense_candidates and not dense_side:
            raise ValueError(f"dense_candidates={dense_candidates} needs a model with a dense head (generative.dense_head) "
                             "or a dense scorer (generative.dense_scorer); use dense_candidates=0 for this model")  # fmt: skip
        if dense_scorer is not None and len(dense_scorer.to_run) != len(item_vocab):
            raise ValueError(f"the dense scorer scores {len(dense_scorer.to_run) - 1} items, the catalogue has "
                             f"{len(item_vocab) - 1}; load it for this catalogue (DenseScorer.load with item_vocab)")  # fmt: skip
        self.rescore, self.dense_candidates, self.dense_scorer = rescore, dense_candidates, dense_scorer
        self.model, self.item_vocab, self.trie, self.max_items = model.eval(), item_vocab, trie, max_items
        self.catalogue = Catalogue(item_vocab)
        self.device = trie.leaf_offsets.device
        self.item_codes = item_codes.to(self.device)
        # (N + 1,) the model's item-table row of each dense index (0: padding, or no row); None: SIDs only
        self.item_rows: Tensor | None = None
        if model.reads_item_ids or (dense_scorer is None and (self.rescore or self.dense_candidates)):
            self.item_rows = model.item_rows(torch.from_numpy(np.asarray(item_vocab, dtype=np.int64))).to(self.device)
            self.item_rows[0] = 0
        self.cache: HistoryCache | None = None
        self.version = "0"

    @staticmethod
    def from_run(
        run_dir: str | Path, config: RetrieveConfig | None = None, *, checkpoint: str = "auto", device: str = "auto",
        dtype: str = "float32", dense_candidates: int | None = None, rescore: float | None = None,
        dense_scorer: str | None = None,
    ) -> Retriever:  # fmt: skip
        """Load a generative run's checkpoint (``auto``: best for clean runs, else latest); its catalogue is
        every item in ``RUN_DIR/sids``. ``config`` (default: the run's ``generative.beam`` and
        ``generative.exclude_seen_in_search``) sets the engine's limits; ``dense_candidates`` (None: the run's
        ``generative.dense_candidates``) the dense side's items added to the beam's; ``rescore`` / ``dense_scorer``
        (None: the run's ``generative.rescore`` / ``generative.dense_scorer``; "" for no scorer) as a `recforge eval`
        override would set them (checked as the run's config is).

        A dense scorer (a retrieval run, on the same dataset as the run's ``data.path``, which must be readable here:
        its item vocabulary and the leakage check come from it) runs in float32 on ``device`` whatever ``dtype``."""
        target = resolve_device(device)
        settings = (("rescore", rescore), ("dense_scorer", dense_scorer), ("dense_candidates", dense_candidates))
        overrides = [f"generative.{key}={value}" for key, value in settings if value is not None]  # checked together
        run = load_sid_run(run_dir, checkpoint, overrides, device=target)
        if dtype != "float32":
            run.model.to(getattr(torch, dtype))
        # the catalogue is every item of RUN_DIR/sids, so items coded after training (`recforge sid add
        # RUN_DIR/sids DATA_DIR`) can be retrieved and read in histories without retraining
        sids = run.sids
        vocab = np.r_[-1, sids.item_ids].astype(np.int64)
        codes = torch.cat([torch.zeros(1, sids.num_levels, dtype=torch.long), sids.codes])
        trie = SidTrie.build(sids.codes, sids.vocab_size, run.cfg.generative.trie).to(target)
        g = run.cfg.generative
        config = config or RetrieveConfig(beam=g.beam, exclude_in_search=g.exclude_seen_in_search)
        scorer = None
        if g.dense_scorer:  # the catalogue may hold items coded after training: they get no scorer row
            what = f"generative.dense_scorer={g.dense_scorer}"
            scorer = DenseScorer.load(g.dense_scorer, run.cfg, vocab, target, what, exact=False)
            if scorer.reads_timestamps:
                raise ValueError(f"{what}: its model reads event timestamps (an HSTU time bias on timestamped data), "
                                 "which retrieve requests do not carry, so it cannot score them as evaluation does; "
                                 "serve with a scorer trained with model.num_time_buckets=0 (or a SASRec run)")  # fmt: skip
        return Retriever(run.model, vocab, codes, trie, run.cfg.data.max_seq_len, config, rescore=g.rescore,
                         dense_candidates=g.dense_candidates, dense_scorer=scorer)  # fmt: skip

    def encode(self, request: RetrieveRequest) -> EncodedRetrieve:
        """Check one request against the engine's limits and map its IDs (``ValueError`` says what is wrong)."""
        return self.catalogue.encode_request(request, self.config)

    def history_batch(self, batch: Sequence[EncodedRetrieve]) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The model's ``start`` inputs: ((B, T, L) SID digits of each request's last ``max_items`` history items,
        right-aligned; (B, T) mask, None when every request fills the T items: no padding, so attention runs
        without a mask; (B, T) the items' item-ID table rows, None for a model without one)."""
        width = min(self.max_items, max(r.history.size for r in batch))
        if all(r.history.size >= width for r in batch):
            items_t = torch.from_numpy(np.stack([r.history[-width:] for r in batch])).to(self.device)
            return self.item_codes[items_t], None, self._rows(items_t)
        items = np.zeros((len(batch), width), dtype=np.int64)
        for row, req in enumerate(batch):
            recent = req.history[-width:]
            items[row, width - recent.size :] = recent
        items_t = torch.from_numpy(items).to(self.device)
        return self.item_codes[items_t], items_t > 0, self._rows(items_t)

    def _rows(self, items: Tensor) -> Tensor | None:
        """The item-ID input's table rows of dense indices ``items`` (None for a model without that input)."""
        return self.item_rows[items] if self.item_rows is not None and self.model.reads_item_ids else None

    def _masks(self, batch: Sequence[EncodedRetrieve]) -> tuple[Tensor | None, Tensor | None]:
        """((B, N) items each request may get, (B, N) its allowed items) on the device; None where unrestricted."""
        n = self.trie.num_items
        allowed = None
        restricted = [row for row, r in enumerate(batch) if r.allowed is not None]
        if restricted:
            allowed = torch.ones(len(batch), n, dtype=torch.bool, device=self.device)
            allowed[torch.tensor(restricted, device=self.device)] = False
            mark_items(allowed, [(row, batch[row].allowed) for row in restricted], True)
        excluding = [(row, r.history - 1) for row, r in enumerate(batch) if r.exclude_history]
        if not excluding:
            return allowed, allowed
        keep = allowed.clone() if allowed is not None else torch.ones(len(batch), n, dtype=torch.bool, device=self.device)
        mark_items(keep, excluding, False)
        return keep, allowed

    @torch.no_grad()
    def run(self, batch: Sequence[EncodedRetrieve], *, beam: int | None = None, constrained: bool | None = None) -> list[RetrieveResult]:
        """Serve a batch of encoded requests: one encoder pass, one beam search, one host copy.

        ``beam`` / ``constrained`` override the engine's config for this batch. Each request gets at
        most its own ``k`` items.
        """
        if not batch:
            return []
        beam = beam or self.config.beam
        constrained = self.config.constrained if constrained is None else constrained
        if not constrained and any(r.allowed is not None for r in batch):
            raise ValueError("allowed_items need the constrained beam (constrained=True)")
        keep, allowed = self._masks(batch)
        search_mask = (keep if self.config.exclude_in_search else allowed) if constrained else None
        memory = self._memory(batch)
        # trie item i is dense index i + 1 (-1, an empty slot: index 0, row 0, no dense term)
        dense, candidates, scorer = None, None, self.dense_scorer
        if scorer is not None and (self.rescore or self.dense_candidates):  # the retrieval run, one forward
            user = scorer.history_user_vectors([r.history for r in batch])  # (B, d) on the device
            dense = lambda trie_items: scorer.item_logits(user, trie_items + 1)  # noqa: E731
            if self.dense_candidates:
                candidates = DenseCandidates.of_scorer(scorer, user, self.model, memory, self.item_codes[1:],
                                                       self.dense_candidates)  # fmt: skip
        elif scorer is None:
            if self.rescore:
                dense = lambda trie_items: self.model.dense_logits(memory.user, self.item_rows[trie_items + 1])  # noqa: E731
            if self.dense_candidates:
                candidates = DenseCandidates.of_model(self.model, memory, self.item_rows[1:], self.item_codes[1:],
                                                      self.dense_candidates)  # fmt: skip
        items, scores = search_items(
            lambda codes: self.model.next_token_logprobs(memory, codes), self.trie, batch_size=len(batch), beam=beam,
            k=max(r.k for r in batch), item_mask=keep, search_mask=search_mask, constrained=constrained, dense=dense,
            rescore=self.rescore, candidates=candidates,
        )  # fmt: skip
        items, scores = items.cpu().numpy(), scores.float().cpu().numpy()  # the one host sync of the batch
        results = []
        for req, row_items, row_scores in zip(batch, items, scores, strict=True):
            present = row_items[: req.k] >= 0
            results.append(RetrieveResult(self.item_vocab[row_items[: req.k][present] + 1].tolist(),
                                          row_scores[: req.k][present].tolist()))  # fmt: skip
        return results

    def _memory(self, batch: Sequence[EncodedRetrieve]) -> Memory | HSTUMemory:
        """The batch's encoded histories: from the cache where a request's user has them, else computed
        (and written back, once per user: the batch's last request of each user)."""
        cache = self.cache
        if cache is None or all(r.user is None for r in batch):
            return self.model.start(*self.history_batch(batch))
        L, extend = self.item_codes.shape[1], encodings.extendable(self.model)
        windows = [r.history[-self.max_items :] for r in batch]
        found = [cache.lookup(r.user, w, self.version, extend) if r.user is not None else None
                 for r, w in zip(batch, windows, strict=True)]  # fmt: skip
        cold = [b for b, f in enumerate(found) if f is None or f.entry is None]
        grow = [b for b, f in enumerate(found) if f is not None and f.entry is not None and f.reused < windows[b].size]
        pieces: list = [f.entry.tensors if f is not None and f.entry is not None else None for f in found]
        memory = None
        if cold:
            memory = self.model.start(*self.history_batch([batch[b] for b in cold]))
            writers = [b for b in cold if found[b] is not None]
            if len(cold) < len(batch) or writers:
                for b, piece in zip(cold, encodings.split(self.model, memory, [windows[b].size * L for b in cold]),
                                    strict=True):  # fmt: skip
                    pieces[b] = piece
        if grow:
            new = [self.item_codes[torch.from_numpy(windows[b][found[b].reused :]).to(self.device)] for b in grow]
            for b, piece in zip(grow, encodings.extend_hstu(self.model, [pieces[b] for b in grow], new), strict=True):
                pieces[b] = piece
        computed = {*cold, *grow}
        last_of_user = {r.user: b for b, r in enumerate(batch) if r.user is not None}
        for b in last_of_user.values():  # same-user requests of one batch: the latest one's history is kept
            if b in computed and not found[b].superseded:
                cache.put(batch[b].user, windows[b], pieces[b], self.version, found[b].generation)
        if len(cold) == len(batch):
            return memory  # all computed in one pass: the cold layout itself
        return encodings.assemble(self.model, pieces)

    def retrieve_requests(self, requests: Sequence[RetrieveRequest]) -> list[RetrieveResult]:
        """Encode every request (all are checked before any runs), then run them ``max_batch`` at a time."""
        encoded = [self.encode(r) for r in requests]
        size = self.config.max_batch
        return [result for i in range(0, len(encoded), size) for result in self.run(encoded[i : i + size])]

    def retrieve(
        self, histories: Sequence[Sequence[int]], k: int, beam: int, allowed_items: Sequence[Sequence[int] | None] | None = None,
        constrained: bool = True, exclude_history: bool = True,
    ) -> list[tuple[list[int], list[float]]]:  # fmt: skip
        """Top-``k`` items for each history (raw item IDs, oldest first), as plain lists.

        Args:
            histories: one list of raw item IDs per request.
            k: items per request (at most ``beam`` SIDs, each resolving to its items).
            beam: beam width.
            allowed_items: per request, the raw item IDs it may get (None: any item); restricts the search.
            constrained: False for a free beam (digit sequences that are no SID yield no item; needs
                ``allowed_items=None``, and history items are then dropped only from the result).
            exclude_history: never return an item of the request's history, as the evaluation protocol
                does (``recforge eval``); inside the search when the config's ``exclude_in_search`` is on
                (a run's ``generative.exclude_seen_in_search``, the default), like evaluation.

        Returns:
            Per request: (item IDs, scores), best first; shorter than ``k`` when fewer valid items exist.
        """
        if k <= 0 or beam <= 0:
            raise ValueError(f"k ({k}) and beam ({beam}) must be > 0")
        if not histories:
            raise ValueError("retrieve needs at least one request")
        if allowed_items is not None and len(allowed_items) != len(histories):
            raise ValueError(f"allowed_items has {len(allowed_items)} entries for {len(histories)} histories")
        if not constrained and allowed_items is not None and any(a is not None for a in allowed_items):
            raise ValueError("allowed_items need the constrained beam (constrained=True)")
        config = replace(self.config, max_k=max(k, self.config.max_k), constrained=constrained)
        allowed = allowed_items if allowed_items is not None else [None] * len(histories)
        batch = []
        for row, (history, items) in enumerate(zip(histories, allowed, strict=True)):
            try:
                batch.append(self.catalogue.encode_request(RetrieveRequest(history, k, items, exclude_history), config))
            except ValueError as err:
                raise ValueError(f"request {row}: {err}") from err
        return [(r.items, r.scores) for r in self.run(batch, beam=beam, constrained=constrained)]
