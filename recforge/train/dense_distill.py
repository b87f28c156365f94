"""``generative.dense_distill``: distil a trained retrieval run (e.g. SASRec) into a SID model's dense head.

With ``generative.dense_init: RUN_DIR`` the dense head scores in that run's item space; its user tower is still
trained only by the dense softmax loss on the next item. ``generative.dense_distill: w`` > 0 also makes the run a
frozen teacher: each training step adds ``w * KL(teacher || student)`` over the whole catalogue, where

- **teacher** logits = the run's user vector for the step's histories (its last-token output, the input built as the
  retrieval recipe builds it: up to the run's ``data.max_seq_len`` items before the target) dotted with its
  L2-normalised item table, / the run's own ``loss.temperature`` (the distribution it was trained to give): the
  ``recforge.generate.dense_scorer.DenseScorer`` of the run, the one home of those logits (``generative.dense_scorer``
  scores evaluation and serving with the same class);
- **student** logits = the dense head's ``cos(user, item) / loss.temperature`` over the same items.

Both sides' rows are this run's dense item indices 1..N: the teacher's rows are matched by raw item ID
(``generate.retrieval_run.run_rows``, as ``dense_init`` maps its table). The teacher is loaded once per training
process (a new or resumed run), in eval mode, without gradients, on the training device; evaluation and serving never
load it.

Example:
    >>> teacher = load_teacher(cfg, seqs, device)              # cfg.generative.dense_init: the run
    >>> loss = loss + w * distill_kl(student_logits, teacher.logits(teacher.batch(seqs, samples).to(device)))
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.config import RunConfig
from recforge.data.sequences import UserSequences
from recforge.generate.dense_scorer import DenseScorer

log = logging.getLogger("recforge.train")


def load_teacher(cfg: RunConfig, seqs: UserSequences, device: torch.device) -> DenseScorer:
    """The teacher of ``cfg.generative.dense_init`` (best checkpoint on a clean run; leakage and catalogue checked as
    for ``dense_init``) for a run whose dense item indices are ``seqs``'s."""
    run_dir = cfg.generative.dense_init
    what = f"generative.dense_distill: the teacher generative.dense_init={run_dir}"
    teacher = DenseScorer.load(run_dir, cfg, seqs.item_vocab, device, what)
    provenance = teacher.provenance
    log.info("generative.dense_distill=%s: teacher %s (%s, step %s, temperature %s, %d history items)",
             cfg.generative.dense_distill, Path(run_dir), provenance["checkpoint"], provenance["step"],
             teacher.temperature, teacher.max_seq_len)  # fmt: skip
    return teacher


def distill_kl(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """Mean over the batch of ``KL(softmax(teacher) || softmax(student))`` over the last dimension (float32)."""
    return F.kl_div(student_logits.float().log_softmax(-1), teacher_logits.float().log_softmax(-1),
                    reduction="batchmean", log_target=True)  # fmt: skip
