"""The retrieve path a server calls: raw item histories -> top-k items by constrained beam search.

Each request's history is encoded once; its beams share the encoding (see
``recforge.models.sid_seq2seq``). A batch of requests is one encoder pass and one beam search.

Example:
    >>> retriever = Retriever.from_run("runs/beauty-sid-tiger", device="cuda")
    >>> results = retriever.retrieve([[12, 7, 99], [5]], k=10, beam=64)
    >>> items, scores = results[0]        # raw item IDs, best first; scores are SID log-probabilities
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from recforge.generate.beam_search import beam_search, resolve_items
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
    """

    def __init__(self, model: SIDSeq2Seq | SIDHSTU, item_vocab: np.ndarray, item_codes: Tensor, trie: SidTrie, max_items: int) -> None:
        self.model, self.item_vocab, self.trie, self.max_items = model.eval(), item_vocab, trie, max_items
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
        return Retriever(run.model, vocab, codes, trie, run.cfg.data.max_seq_len)

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

    @torch.no_grad()
    def retrieve(
        self, histories: Sequence[Sequence[int]], k: int, beam: int, allowed_items: Sequence[Sequence[int] | None] | None = None,
        constrained: bool = True,
    ) -> list[tuple[list[int], list[float]]]:  # fmt: skip
        """Top-``k`` items for each history (raw item IDs, oldest first).

        Args:
            histories: one list of raw item IDs per request.
            k: items per request (at most ``beam`` SIDs, each resolving to its items).
            beam: beam width.
            allowed_items: per request, the raw item IDs it may get (None: any item).
            constrained: False for a free beam (digit sequences that are no SID yield no item).

        Returns:
            Per request: (item IDs, scores), best first; shorter than ``k`` when fewer valid items exist.
        """
        if k <= 0 or beam <= 0:
            raise ValueError(f"k ({k}) and beam ({beam}) must be > 0")
        history_codes, mask = self._histories(histories)
        item_mask = None
        if allowed_items is not None and any(a is not None for a in allowed_items):
            if len(allowed_items) != len(histories):
                raise ValueError(f"allowed_items has {len(allowed_items)} entries for {len(histories)} histories")
            item_mask = torch.ones(len(histories), self.trie.num_items, dtype=torch.bool)
            for row, allowed in enumerate(allowed_items):
                if allowed is not None:
                    item_mask[row] = False
                    item_mask[row, torch.from_numpy(self.dense_ids(allowed, f"allowed_items {row}") - 1)] = True
            item_mask = item_mask.to(self.device)
        memory = self.model.start(history_codes, mask)
        out = beam_search(
            lambda codes: self.model.next_token_logprobs(memory, codes), self.trie, batch_size=len(histories), beam=beam,
            allowed=self.trie.allowed_nodes(item_mask) if item_mask is not None else None, constrained=constrained,
        )  # fmt: skip
        items, scores = resolve_items(out, self.trie, k, item_mask=item_mask)
        items, scores = items.cpu().numpy(), scores.float().cpu().numpy()  # the one host sync of the request
        results = []
        for row_items, row_scores in zip(items, scores, strict=True):
            keep = row_items >= 0
            results.append((self.item_vocab[row_items[keep] + 1].tolist(), row_scores[keep].tolist()))
        return results

