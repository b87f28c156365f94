"""The retrieve path a server calls: raw item histories -> top-k items by constrained beam search.

Each request's history is encoded once; its beams share the encoding (see
``recforge.models.sid_seq2seq``). A batch of requests is one encoder pass and one beam search.

Example:
    >>> retriever = Retriever.from_run("runs/beauty-sid-tiger", device="cuda")
    >>> results = retriever.retrieve([[12, 7, 99], [5]], k=10, beam=64)
    >>> items, scores = results[0]        # raw item IDs, best first; scores are SID log-probabilities

Like evaluation (``recforge eval``), the items of a request's history are never returned
(``exclude_history=False`` keeps them, e.g. for re-purchases).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from recforge.generate.beam_search import search_items
from recforge.generate.sid_run import load_sid_run
from recforge.generate.trie import SidTrie
from recforge.models.sid_hstu import SIDHSTU
from recforge.models.sid_seq2seq import SIDSeq2Seq
from recforge.ops.dispatch import resolve_device


class Retriever:
    """A generative model, its items' SIDs and their trie, ready to retrieve.

    Args:
        model: the trained SID model (tiger or sid_hstu; on ``device``).
        item_vocab: (N + 1,) raw item ID of each dense index (index 0 is padding).
        item_codes: (N + 1, L) SID of each dense index.
        trie: the valid SIDs over items 1..N (trie item i = dense index i + 1), on ``device``.
        max_items: most recent history items the model reads.
        exclude_in_search: exclude history items inside the search, not only from the result (a run's
            ``generative.exclude_seen_in_search``).
    """

    def __init__(
        self, model: SIDSeq2Seq | SIDHSTU, item_vocab: np.ndarray, item_codes: Tensor, trie: SidTrie, max_items: int,
        exclude_in_search: bool = True,
    ) -> None:  # fmt: skip
        self.model, self.item_vocab, self.trie, self.max_items = model.eval(), item_vocab, trie, max_items
        self.exclude_in_search = exclude_in_search
        self.device = trie.leaf_offsets.device
        self.item_codes = item_codes.to(self.device)
        order = np.argsort(item_vocab[1:], kind="stable")
        self._sorted_raw, self._sorted_index = item_vocab[1:][order], order + 1

    @staticmethod
    def from_run(run_dir: str | Path, *, checkpoint: str = "auto", device: str = "auto", dtype: str = "float32") -> Retriever:
        """Load a generative run's checkpoint (``auto``: best for clean runs, else latest); its catalogue is
        every item in ``RUN_DIR/sids``."""
        target = resolve_device(device)
        run = load_sid_run(run_dir, checkpoint, device=target)
        if dtype != "float32":
            run.model.to(getattr(torch, dtype))
        # the catalogue is every item of RUN_DIR/sids, so items coded after training (`recforge sid add
        # RUN_DIR/sids DATA_DIR`) can be retrieved and read in histories without retraining
        sids = run.sids
        vocab = np.r_[-1, sids.item_ids].astype(np.int64)
        codes = torch.cat([torch.zeros(1, sids.num_levels, dtype=torch.long), sids.codes])
        trie = SidTrie.build(sids.codes, sids.vocab_size, run.cfg.generative.trie).to(target)
        return Retriever(run.model, vocab, codes, trie, run.cfg.data.max_seq_len, run.cfg.generative.exclude_seen_in_search)

    def dense_ids(self, raw: Sequence[int], what: str = "history") -> np.ndarray:
        raw = np.asarray(raw, dtype=np.int64)
        pos = np.searchsorted(self._sorted_raw, raw).clip(0, len(self._sorted_raw) - 1)
        unknown = self._sorted_raw[pos] != raw
        if unknown.any():
            raise ValueError(f"{what}: unknown item IDs {raw[unknown][:5].tolist()} (not in the model's catalogue)")
        return self._sorted_index[pos]

    def _histories(self, histories: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        if not histories or any(len(h) == 0 for h in histories):
            raise ValueError("retrieve needs at least one request and at least one history item per request")
        width = min(self.max_items, max(len(h) for h in histories))
        items = np.zeros((len(histories), width), dtype=np.int64)
        for row, history in enumerate(histories):
            recent = self.dense_ids(history[-width:], f"history {row}")
            items[row, width - len(recent) :] = recent
        items_t = torch.from_numpy(items).to(self.device)
        return self.item_codes[items_t], items_t > 0

    def item_mask(
        self, histories: Sequence[Sequence[int]], allowed_items: Sequence[Sequence[int] | None] | None, exclude_history: bool
    ) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
        """((B, N) bool items each request may get or None, (B, N) allowed-items mask or None), on the device.

        Built from index lists with one host-to-device copy each; excluded are every item of the
        request's history (all of it, not only the ``max_items`` the model reads), as evaluation does.
        """
        batch, n = len(histories), self.trie.num_items
        allowed = None
        if allowed_items is not None and any(a is not None for a in allowed_items):
            if len(allowed_items) != batch:
                raise ValueError(f"allowed_items has {len(allowed_items)} entries for {batch} histories")
            restricted = torch.tensor([a is not None for a in allowed_items], device=self.device)
            rows, cols = self._index_lists([a for a in allowed_items if a is not None], "allowed_items",
                                           np.flatnonzero([a is not None for a in allowed_items]))  # fmt: skip
            allowed = (~restricted)[:, None].expand(batch, n).clone()
            allowed[rows, cols] = True
        if not exclude_history:
            return allowed, allowed
        keep = allowed.clone() if allowed is not None else torch.ones(batch, n, dtype=torch.bool, device=self.device)
        rows, cols = self._index_lists(histories, "history", np.arange(batch))
        keep[rows, cols] = False
        return keep, allowed

    def _index_lists(self, lists: Sequence[Sequence[int]], what: str, row_ids: np.ndarray) -> tuple[Tensor, Tensor]:
        lengths = np.array([len(x) for x in lists], dtype=np.int64)
        raw = np.concatenate([np.asarray(x, dtype=np.int64) for x in lists]) if lists else np.zeros(0, np.int64)
        cols = self.dense_ids(raw, what) - 1  # trie items
        rows = np.repeat(row_ids, lengths)
        return torch.from_numpy(rows).to(self.device), torch.from_numpy(cols).to(self.device)

    @torch.no_grad()
    def retrieve(
        self, histories: Sequence[Sequence[int]], k: int, beam: int, allowed_items: Sequence[Sequence[int] | None] | None = None,
        constrained: bool = True, exclude_history: bool = True,
    ) -> list[tuple[list[int], list[float]]]:  # fmt: skip
        """Top-``k`` items for each history (raw item IDs, oldest first).

        Args:
            histories: one list of raw item IDs per request.
            k: items per request (at most ``beam`` SIDs, each resolving to its items).
            beam: beam width.
            allowed_items: per request, the raw item IDs it may get (None: any item); restricts the search.
            constrained: False for a free beam (digit sequences that are no SID yield no item; needs
                ``allowed_items=None``, and history items are then dropped only from the result).
            exclude_history: never return an item of the request's history, as the evaluation protocol
                does (``recforge eval``); inside the search when the run's ``generative.exclude_seen_in_search``
                is on (the default), like evaluation. False where repeats are wanted (e.g. re-purchases).

        Returns:
            Per request: (item IDs, scores), best first; shorter than ``k`` when fewer valid items exist.
        """
        if k <= 0 or beam <= 0:
            raise ValueError(f"k ({k}) and beam ({beam}) must be > 0")
        history_codes, mask = self._histories(histories)
        keep, allowed = self.item_mask(histories, allowed_items, exclude_history)
        if not constrained and allowed is not None:
            raise ValueError("allowed_items need the constrained beam (constrained=True)")
        search_mask = (keep if self.exclude_in_search else allowed) if constrained else None
        memory = self.model.start(history_codes, mask)
        items, scores = search_items(
            lambda codes: self.model.next_token_logprobs(memory, codes), self.trie, batch_size=len(histories), beam=beam,
            k=k, item_mask=keep, search_mask=search_mask, constrained=constrained,
        )  # fmt: skip
        items, scores = items.cpu().numpy(), scores.float().cpu().numpy()  # the one host sync of the request
        results = []
        for row_items, row_scores in zip(items, scores, strict=True):
            present = row_items >= 0
            results.append((self.item_vocab[row_items[present] + 1].tolist(), row_scores[present].tolist()))
        return results
