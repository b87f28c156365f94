"""A trained ID-retrieval run's next-item scores over a SID model's catalogue: the dense side of LIGER from a run.

For a history, the run's **dense logit** of item i is

    logit(i) = user . item_i / T

where ``user`` is the run's own user vector for the history (its L2-normalised last-token output, the input built as
the retrieval recipe builds it: up to the run's ``data.max_seq_len`` most recent items, in the run's item indices),
``item_i`` the run's L2-normalised item row of i (matched by raw item ID) and ``T`` the run's ``loss.temperature``:
the logits the run was trained to give. ``DenseScorer`` is the one home of that computation, for two uses:

- **teacher** (``generative.dense_distill``, training): KL(softmax(logits) || dense head) over the catalogue;
- **scorer** (``generative.dense_scorer``, evaluation and ``/v1/retrieve``): the logits in place of the SID model's
  dense head, for ``generative.rescore`` (``log p(SID) + rescore * logit``) and ``generative.dense_candidates`` (the
  run's top K items join the beam's).

The rows are the host catalogue's dense indices 1..N (a SID run's training catalogue, or the served ``RUN_DIR/sids``);
an item the run has no row for (coded after it was trained) gets logit 0 (it keeps its SID score) and is never a
candidate, as with the dense head. The run's model stays frozen in eval mode on the device it is loaded to; its item
rows are gathered once, so a batch costs one user-tower forward and one matmul (or a gather) on the device.

Example:
    >>> scorer = DenseScorer.load("runs/beauty-sasrec-collab", cfg, seqs.item_vocab, device, "generative.dense_scorer")
    >>> user = scorer.user_vectors(scorer.batch(seqs, samples).to(device))     # (B, d)
    >>> scorer.catalogue_logits(user)                                          # (B, N) over dense items 1..N
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from recforge.config import RunConfig
from recforge.data.sequences import UserSequences
from recforge.jagged.batch import JaggedBatch
from recforge.models.retrieval import RetrievalModel
from recforge.generate.retrieval_run import checked_run, load_retrieval_run, run_rows


class DenseScorer:
    """A frozen retrieval run scoring a host catalogue's items 1..N (see the module docstring).

    Args:
        model: the run's model (put in eval mode, its parameters frozen; scoring runs on its device).
        to_run: (N + 1,) int64 the run's item index of each host dense index; 0 for the padding index 0 and for items
            the run has no row for.
        max_seq_len: the run's ``data.max_seq_len`` (most recent history items it reads).
        temperature: the run's ``loss.temperature``.
        reads_timestamps: the run's model reads event timestamps (an HSTU time bias on timestamped data): histories
            given as item IDs alone (``history_user_vectors``) cannot be scored as the run scores them.
        provenance: where the scorer came from (run directory, checkpoint, step, digests), for ``eval.json``.
    """

    def __init__(
        self, model: RetrievalModel, to_run: Tensor, max_seq_len: int, temperature: float, *,
        reads_timestamps: bool = False, provenance: dict | None = None,
    ) -> None:  # fmt: skip
        self.model = model.eval().requires_grad_(False)
        self.device = next(model.parameters()).device
        self.to_run = to_run.cpu()
        self.max_seq_len, self.temperature = max_seq_len, temperature
        self.reads_timestamps = reads_timestamps
        self.provenance = provenance or {}
        self.rows = torch.arange(1, len(self.to_run), device=self.device)  # host dense items 1..N, the logits' order
        self.known = (self.to_run[1:] > 0).to(self.device)  # (N,) items the run has a row for
        with torch.no_grad():  # frozen: the catalogue's vectors in host order, computed once (zeros: no row)
            items = model.item_vectors()[self.to_run[1:].to(self.device)].float()  # (N, d)
            self.items = torch.where(self.known[:, None], items, 0.0)

    @staticmethod
    def load(
        run_dir: str | Path, cfg: RunConfig, item_vocab: np.ndarray, device: torch.device, what: str, *,
        exact: bool = True,
    ) -> DenseScorer:  # fmt: skip
        """The retrieval run ``run_dir`` (best checkpoint on a clean run) scoring the items ``item_vocab`` ((N + 1,)
        raw item IDs, ``[0]`` padding) of a SID run configured by ``cfg``, on ``device``.

        Refused (``ValueError`` naming ``what`` and the fix) unless it is a trained retrieval run on ``cfg.data.path``'s
        interactions with at least ``cfg.data.protocol``'s held-out items per user and the same catalogue by raw item
        ID (``exact``; not ``exact``: ``item_vocab`` may also hold items coded after training, which get no row)."""
        run, provenance = checked_run(lambda: load_retrieval_run(run_dir, cfg.data.path, what), cfg, what)
        source = run_rows(run.seqs.item_vocab[1:], item_vocab, what, exact=exact) + 1  # 0: no row
        weights = run.checkpoint / "model.safetensors"
        if weights.is_file():  # the exact weights scored with: eval.json's rows stay reproducible
            with weights.open("rb") as f:  # streamed, not read whole into memory
                provenance["weights_sha256"] = hashlib.file_digest(f, "sha256").hexdigest()
        reads_timestamps = run.seqs.timestamps is not None and any(
            getattr(m, "time_weights", None) is not None for m in run.model.modules())  # fmt: skip
        return DenseScorer(run.model.to(device), torch.from_numpy(np.r_[0, source].astype(np.int64)),
                           run.cfg.data.max_seq_len, run.cfg.loss.temperature, reads_timestamps=reads_timestamps,
                           provenance=provenance)  # fmt: skip

    def batch(self, seqs: UserSequences, samples: Tensor) -> JaggedBatch:
        """The run's CPU input for (user, end) ``samples`` of ``seqs`` (whose dense indices are this scorer's host
        catalogue): up to ``max_seq_len`` items before each target, as ``UserSequences.training_batch`` builds the
        retrieval recipe's (timestamps included), item IDs in the run's indices."""
        batch = seqs.training_batch(samples, self.max_seq_len)
        batch.features["item_ids"] = self.to_run[batch.features["item_ids"]]
        batch.labels.clear()  # scored from the last token only
        return batch

    @torch.no_grad()
    def user_vectors(self, batch: JaggedBatch) -> Tensor:
        """(B, d) float32 the run's L2-normalised user vector at each sequence's last token of a device ``batch``."""
        return self.model.last_token_vectors(batch).float()

    @torch.no_grad()
    def history_user_vectors(self, histories: Sequence[np.ndarray]) -> Tensor:
        """(B, d) float32 user vectors of histories given as host dense indices (oldest first, e.g. a retrieve
        request's): each one's ``max_seq_len`` most recent items the run has a row for, in one forward. A history with
        none gets a zero vector (dense logit 0: its SID scores stand; no candidates)."""
        if self.reads_timestamps:
            raise ValueError("this dense scorer's model reads timestamps (an HSTU time bias), which item-ID histories "
                             "do not carry; use a scorer trained with model.num_time_buckets=0 (or a SASRec run)")  # fmt: skip
        to_run = self.to_run.numpy()
        windows = []
        for history in histories:  # per request, never per item: one gather over its items
            ids = to_run[np.asarray(history, dtype=np.int64)]
            windows.append(ids[ids > 0][-self.max_seq_len :])
        present = np.flatnonzero([w.size > 0 for w in windows])
        user = torch.zeros(len(windows), self.items.shape[1], device=self.device)
        if present.size:
            lengths = np.array([windows[i].size for i in present], dtype=np.int64)
            offsets = torch.from_numpy(np.r_[0, np.cumsum(lengths)])
            ids = torch.from_numpy(np.concatenate([windows[i] for i in present]))
            batch = JaggedBatch(offsets, {"item_ids": ids}, self.max_seq_len).to(self.device)
            user[torch.from_numpy(present).to(self.device)] = self.user_vectors(batch)
        return user

    def catalogue_logits(self, user: Tensor) -> Tensor:
        """(B, N) float32 logits of the host items 1..N by one matmul; -inf for items without a row and for every item
        of a zero ``user`` (a history the run knows nothing of): never a candidate."""
        logits = user.float() @ self.items.T / self.temperature  # (B, N)
        scored = self.known[None] & (user != 0).any(1, keepdim=True)  # (B, N)
        return logits.masked_fill_(~scored, float("-inf"))

    def item_logits(self, user: Tensor, items: Tensor) -> Tensor:
        """(B, K) float32 logits of given host dense indices ``items`` (B, K) (0: an empty slot); 0 for index 0 and
        items without a row."""
        index = (items - 1).clamp_min(0)
        vectors = self.items[index]  # (B, K, d); rows without a run row are zeros
        logits = torch.bmm(vectors, user.float()[:, :, None]).squeeze(2) / self.temperature
        return torch.where(items > 0, logits, 0.0)

    def logits(self, batch: JaggedBatch) -> Tensor:
        """(B, N) float32 logits over the host items 1..N of a device ``batch`` (from ``batch()``): the teacher's."""
        return self.catalogue_logits(self.user_vectors(batch))
