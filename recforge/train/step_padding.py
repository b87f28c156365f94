"""A retrieval step's batch and sampled negatives padded to a shape bucket, with the padding adding nothing to the
loss or the gradients (for steps replayed as CUDA graphs: ``train.graphed``).

The batch is padded by ``recforge.jagged.padding`` (padding tokens in sequences of their own); then:

- ``labels[LOSS_MASK]`` (T',) marks the real positions; the recipe's loss passes it as the per-position
  ``weights`` of ``losses.sampled_softmax_loss`` (``loss_weights``): the loss is the mean over the real
  positions, and a padding position's loss and gradients are scaled by 0, so nothing reaches the encoder or
  an item vector through it. Its loss only has to be finite: ``labels["next_item"]`` of a padding position
  is item 1 (any real item); its per-position negatives are spread over the catalogue (unchunked: one row
  repeated T' - T times K would make one serial segment of the gather-dot's table gradient) or item 1 (chunked:
  all accidental hits, its loss is 0);
- the negatives the real positions score are the real batch's: a shared sample is unchanged, the in-batch
  negatives (the real targets, ``losses.batch_distinct``) are padded with the padding id 0, which the loss
  masks, so the padding targets never become negatives;
- so the padded step's loss and objective are the real batch's (``loss_scale`` 1, ``loss_offset`` 0,
  ``objective_scale`` 1); a token-budget objective counts the real positions (``loss_weights(batch).sum()``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

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


def loss_weights(batch: JaggedBatch) -> Tensor | None:
    """(T',) float weights of a padded batch's positions (1 real, 0 padding) for ``sampled_softmax_loss``;
    None for a batch that was not padded."""
    mask = batch.labels.get(LOSS_MASK)
    return None if mask is None else mask.to(torch.float32)


class RetrievalPadding:
    """``(batch, draws) -> PaddedStep`` for the retrieval recipe's loss (every negatives mode).

    Args:
        loss: the run's loss settings.
        num_items: catalogue size (items 1..num_items).
        ratio: bucket ladder ratio (``train.graph_bucket_ratio``): token and sequence counts are padded up
            to at most about ``ratio`` times themselves.
        summed: the objective is already a sum (token-budget batches; it counts ``loss_weights``).

    Example:
        >>> pad = RetrievalPadding(cfg.loss, num_items, 1.125, summed=False)
        >>> step = pad(batch, draws)   # step.batch: T' tokens in B' sequences
    """

    def __init__(self, loss: LossConfig, num_items: int, ratio: float, *, summed: bool) -> None:
        self.loss, self.num_items, self.ratio, self.summed = loss, num_items, ratio, summed

    def shape(self, tokens: int, sequences: int, max_seq_len: int) -> tuple[int, int]:
        """(T', B'): the bucket of a batch of ``tokens`` tokens in ``sequences`` sequences."""
        padded = bucket(tokens, self.ratio, TOKEN_MULTIPLE)
        chunk = self.loss.chunk_size
        if self.loss.negatives != "full" and 0 < tokens <= chunk < padded:
            padded = chunk  # drawn unchunked (no distinct ids, no shared set): the padded loss must not chunk either
        return padded, bucket(sequences + padding_sequences(tokens, padded, max_seq_len), self.ratio, SEQUENCE_MULTIPLE)

    def __call__(self, batch: JaggedBatch, draws: SampledNegatives | None) -> PaddedStep:
        tokens = batch.num_tokens
        if tokens == 0:
            raise ValueError("RetrievalPadding: the batch has no tokens")
        padded_tokens, sequences = self.shape(tokens, batch.batch_size, batch.max_seq_len)
        out = pad_batch(batch, padded_tokens, sequences, {name: PAD_ITEM for name in batch.labels})
        real = batch.item_ids.new_ones(tokens, dtype=bool)
        out.labels[LOSS_MASK] = pad_rows(real, padded_tokens, False)  # (T',)
        if draws is not None:
            draws = self._pad_draws(draws, padded_tokens)
        return PaddedStep(out, draws, loss_scale=1.0, loss_offset=0.0, objective_scale=1.0)

    def _pad_draws(self, draws: SampledNegatives, tokens: int) -> SampledNegatives:
        """The negatives at ``tokens`` positions: per-position rows for the padding positions (unchunked: spread over
        the catalogue; chunked: PAD_ITEM, masked; the positions weigh 0 either way), in-batch negatives padded with the
        masked id 0, a shared sample unchanged."""
        out = dataclasses.replace(draws)
        if draws.ids is not None and self.loss.negatives == "per_position":
            if draws.distinct is None:  # unchunked: the padding rows' negatives spread over the catalogue, not all
                # PAD_ITEM: the gather-dot's table gradient sums each row's occurrences in one program, and T' - T
                # rows x K of one row made one serial segment (27 ms of a 42 ms step at 16K tokens x 128 negatives;
                # the padding positions weigh 0 in the loss, so their negatives change nothing)
                extra = tokens - draws.ids.shape[0]
                spread = torch.arange(extra * draws.ids.shape[1], device=draws.ids.device) % self.num_items + 1
                out.ids = torch.cat([draws.ids, spread.view(extra, draws.ids.shape[1]).to(draws.ids.dtype)])  # (T', K)
            else:  # chunked: the padding rows' logits are masked by their PAD_ITEM ids
                out.ids = pad_rows(draws.ids, tokens, PAD_ITEM)  # (T', K)
        if draws.in_batch is not None:
            out.in_batch = pad_rows(draws.in_batch, tokens, 0)  # (T',)
            if draws.shared is not None:  # chunked: the shared columns end with the in-batch ones
                out.shared = pad_rows(draws.shared, draws.shared.shape[0] - draws.in_batch.shape[0] + tokens, 0)
        if draws.distinct is not None:
            # chunked: the distinct ids at the size draw_negatives gives T' positions, padded by repeating the first
            # (as it does); the padding rows' rows point anywhere (row 0): their logits are masked by ``ids``
            size = min(out.ids.numel(), self.num_items + 1)
            out.distinct = pad_rows(draws.distinct, size, draws.distinct[:1])
            out.rows = pad_rows(draws.rows, tokens, 0)
        return out
