"""``generative.dense_distill``: distil a trained retrieval run (e.g. SASRec) into a SID model's dense head.

With ``generative.dense_init: RUN_DIR`` the dense head scores in that run's item space; its user tower is still
trained only by the dense softmax loss on the next item. ``generative.dense_distill: w`` > 0 also makes the run a
frozen teacher: each training step adds ``w * KL(teacher || student)`` over the whole catalogue, where

- **teacher** logits = the run's user vector for the step's histories (its last-token output, the input built as the
  retrieval recipe builds it: up to the run's ``data.max_seq_len`` items before the target) dotted with its
  L2-normalised item table, / the run's own ``loss.temperature`` (the distribution it was trained to give);
- **student** logits = the dense head's ``cos(user, item) / loss.temperature`` over the same items.

Both sides' rows are this run's dense item indices 1..N: the teacher's rows are matched by raw item ID
(``dense_init.run_rows``, as ``dense_init`` maps its table). The teacher is loaded once per training process (a new
or resumed run), in eval mode, without gradients, on the training device; evaluation and serving never load it.

Example:
    >>> teacher = Teacher.load(cfg, seqs, device)              # cfg.generative.dense_init: the run
    >>> loss = loss + w * distill_kl(student_logits, teacher.logits(teacher.batch(seqs, samples).to(device)))
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.config import RunConfig
from recforge.data.sequences import UserSequences
from recforge.jagged.batch import JaggedBatch
from recforge.models.retrieval import RetrievalModel
from recforge.train.dense_init import checked_run, run_rows
from recforge.train.sid_fit import load_retrieval_run

log = logging.getLogger("recforge.train")


class Teacher:
    """A frozen retrieval model whose next-item distribution the dense head learns to match.

    Args:
        model: the run's model (put in eval mode, its parameters frozen).
        to_run: (N + 1,) int64 the run's item index of each of this run's dense item indices (0 -> 0).
        max_seq_len: the run's ``data.max_seq_len`` (inputs per history).
        temperature: the run's ``loss.temperature``.
    """

    def __init__(self, model: RetrievalModel, to_run: Tensor, max_seq_len: int, temperature: float) -> None:
        self.model = model.eval().requires_grad_(False)
        device = next(model.parameters()).device
        self.to_run = to_run.cpu()
        self.max_seq_len = max_seq_len
        self.temperature = temperature
        self.rows = torch.arange(1, len(self.to_run), device=device)  # this run's dense rows 1..N, the logits' order
        with torch.no_grad():  # frozen: the catalogue's vectors in this run's row order, computed once
            self.items = model.item_vectors()[self.to_run[1:].to(device)].float()  # (N, d)

    @staticmethod
    def load(cfg: RunConfig, seqs: UserSequences, device: torch.device) -> Teacher:
        """The teacher of ``cfg.generative.dense_init`` (best checkpoint on a clean run; leakage checked as for
        ``dense_init``) for a run whose dense item indices are ``seqs``'s."""
        run_dir = cfg.generative.dense_init
        what = f"generative.dense_distill: the teacher generative.dense_init={run_dir}"
        run, provenance = checked_run(lambda: load_retrieval_run(run_dir, cfg.data.path, what), cfg, what)
        source = run_rows(run.seqs.item_vocab[1:], seqs.item_vocab, what) + 1  # the run's item index of each item
        to_run = torch.from_numpy(np.r_[0, source].astype(np.int64))
        teacher = Teacher(run.model.to(device), to_run, run.cfg.data.max_seq_len, run.cfg.loss.temperature)
        log.info("generative.dense_distill=%s: teacher %s (%s, step %s, temperature %s, %d history items)",
                 cfg.generative.dense_distill, Path(run_dir), provenance["checkpoint"], provenance["step"],
                 teacher.temperature, teacher.max_seq_len)  # fmt: skip
        return teacher

    def batch(self, seqs: UserSequences, samples: Tensor) -> JaggedBatch:
        """The run's CPU input for (user, end) ``samples`` of ``seqs``: up to ``max_seq_len`` items before each target
        (as ``UserSequences.training_batch`` builds the retrieval recipe's), item IDs in the run's indices."""
        batch = seqs.training_batch(samples, self.max_seq_len)
        batch.features["item_ids"] = self.to_run[batch.features["item_ids"]]
        batch.labels.clear()  # the teacher predicts from the last token only
        return batch

    @torch.no_grad()
    def logits(self, batch: JaggedBatch) -> Tensor:
        """(B, N) float32 teacher logits over this run's items 1..N of a device ``batch`` (from ``batch()``)."""
        user = self.model.last_token_vectors(batch).float()  # (B, d), L2-normalised
        return user @ self.items.T / self.temperature


def distill_kl(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """Mean over the batch of ``KL(softmax(teacher) || softmax(student))`` over the last dimension (float32)."""
    return F.kl_div(student_logits.float().log_softmax(-1), teacher_logits.float().log_softmax(-1),
                    reduction="batchmean", log_target=True)  # fmt: skip
