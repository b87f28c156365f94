"""A retrieval step's batch and sampled negatives padded to a shape bucket, with the padding adding nothing to the
gradients and the loss corrected back to the real batch's (for steps replayed as CUDA graphs: ``train.graphed``).

The batch is padded by ``recforge.jagged.padding`` (padding tokens in sequences of their own); then:

- ``labels["next_item"]`` of a padding position is item 1 (any real item: its vector is looked up, never
  scored), and ``labels[LOSS_MASK]`` (T',) marks the real positions: the recipe's loss zeroes the user
  vectors of the others (``retrieval._loss``), so no gradient reaches the encoder through them and
  every item vector they score gets a zero gradient (its logit's derivative is the zero user vector);
- per-position negatives of a padding position are all item 1, its target: every negative is an
  accidental hit (masked out), so its loss is exactly 0; full softmax: its logits are all 0, so its
  loss is exactly log(num_items), subtracted back (``loss_offset``);
- the loss is a mean over T' positions, so the real batch's is ``loss * T'/T + offset``; the objective
  (what is differentiated) ``* T'/T``, or unchanged for token-budget batches (already a sum).

Shared and in-batch negatives are not padded (a padding position's logits would depend on the draws):
``unsupported`` says why, and such runs keep the eager step. The proper home of this rule is a
per-position weight in ``losses.sampled_softmax_loss``; until it has one, this module relies on its
documented accidental-hit masking and on the zero user vectors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from recforge.config import LossConfig
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.padding import bucket, pad_batch, pad_rows, padding_sequences
from recforge.train.losses import SampledNegatives

LOSS_MASK = "loss_mask"  # label of a padded batch: (T',) bool, True at the real positions
PAD_ITEM = 1  # a padding position's target (and its negatives)
TOKEN_MULTIPLE, SEQUENCE_MULTIPLE = 64, 8  # bucket sizes are multiples of these


@dataclass
class PaddedStep:
    """One step's inputs at a bucket's shape, and how its loss maps back to the real batch's."""

    batch: JaggedBatch
    draws: SampledNegatives | None
    loss_scale: float  # the real batch's loss = loss * loss_scale + loss_offset
    loss_offset: float
    objective_scale: float  # the real batch's objective (its gradients) = objective * objective_scale


def unsupported(loss: LossConfig) -> str | None:
    """Why a retrieval step with this loss cannot be padded (None: it can)."""
    if loss.negatives == "shared":
        return "loss.negatives=shared: a padding position would score the shared negatives"
    if loss.in_batch_negatives:
        return "loss.in_batch_negatives: the batch's distinct targets have a data-dependent count"
    return None


class RetrievalPadding:
    """``(batch, draws) -> PaddedStep`` for the retrieval recipe's loss.

    Args:
        loss: the run's loss settings (``unsupported(loss)`` must be None).
        num_items: catalogue size (items 1..num_items).
        ratio: bucket ladder ratio (``train.graph_bucket_ratio``): token and sequence counts are padded up
            to at most about ``ratio`` times themselves.
        summed: the objective is already a sum (token-budget batches).

    Example:
        >>> pad = RetrievalPadding(cfg.loss, num_items, 1.125, summed=False)
        >>> step = pad(batch, draws)   # step.batch: T' tokens in B' sequences
    """

    def __init__(self, loss: LossConfig, num_items: int, ratio: float, *, summed: bool) -> None:
        why = unsupported(loss)
        if why is not None:
            raise ValueError(f"RetrievalPadding: {why}")
        self.loss, self.num_items, self.ratio, self.summed = loss, num_items, ratio, summed

    def shape(self, tokens: int, sequences: int, max_seq_len: int) -> tuple[int, int]:
        """(T', B'): the bucket of a batch of ``tokens`` tokens in ``sequences`` sequences."""
        padded = bucket(tokens, self.ratio, TOKEN_MULTIPLE)
        chunk = self.loss.chunk_size
        if self.loss.negatives == "per_position" and 0 < tokens <= chunk < padded:
            padded = chunk  # drawn unchunked (no distinct ids): the padded loss must not chunk either
        return padded, bucket(sequences + padding_sequences(tokens, padded, max_seq_len), self.ratio, SEQUENCE_MULTIPLE)

    def __call__(self, batch: JaggedBatch, draws: SampledNegatives | None) -> PaddedStep:
        tokens = batch.num_tokens
        if tokens == 0:
            raise ValueError("RetrievalPadding: the batch has no tokens")
        padded_tokens, sequences = self.shape(tokens, batch.batch_size, batch.max_seq_len)
        out = pad_batch(batch, padded_tokens, sequences, {name: PAD_ITEM for name in batch.labels})
        real = batch.item_ids.new_ones(tokens, dtype=bool)
        out.labels[LOSS_MASK] = pad_rows(real, padded_tokens, False)  # (T',)
        pad_loss = 0.0
        if self.loss.negatives == "full":
            pad_loss = math.log(self.num_items)  # logits 0 for items 1..num_items (item 0 is masked)
        elif draws is not None:
            draws = self._pad_draws(draws, padded_tokens)
        scale = padded_tokens / tokens
        return PaddedStep(out, draws, loss_scale=scale, loss_offset=-pad_loss * (padded_tokens - tokens) / tokens,
                          objective_scale=1.0 if self.summed else scale)  # fmt: skip

    def _pad_draws(self, draws: SampledNegatives, tokens: int) -> SampledNegatives:
        """Per-position negatives at ``tokens`` rows: the padding rows draw their target (all masked)."""
        ids = pad_rows(draws.ids, tokens, PAD_ITEM)  # (T', K)
        if draws.distinct is None:
            return dataclasses.replace(draws, ids=ids)
        # chunked: the distinct ids at the size draw_negatives gives T' positions, padded by repeating the first
        # (as it does); the padding rows' rows point anywhere (row 0): their logits are masked by ``ids``
        size = min(ids.numel(), self.num_items + 1)
        return dataclasses.replace(draws, ids=ids, distinct=pad_rows(draws.distinct, size, draws.distinct[:1]),
                                   rows=pad_rows(draws.rows, tokens, 0))  # fmt: skip
