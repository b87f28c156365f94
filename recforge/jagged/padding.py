"""Padding a jagged batch up to fixed token and sequence counts (shape buckets), e.g. for CUDA graphs.

A CUDA graph replays fixed shapes, so each batch is padded up to a bucket of a geometric ladder
(``bucket``). Padding tokens form sequences of their own, each at most ``max_seq_len`` long (no
kernel sees a longer sequence than the batch says, and a padding token attends only to padding
tokens), then empty sequences fill the batch up to its sequence bucket::

    real          u0: [a b c]  u1: [d e]                            T = 5, B = 2
    padded        u0: [a b c]  u1: [d e]  p0: [0 0 0]  p1: [0]  [] []   T' = 9, B' = 6 (max_seq_len 3)
    seq_offsets   [0, 3, 5, 8, 9, 9, 9]

Token features and dense features are padded with zeros (item 0 is the padding item); labels with
what the caller gives per label, so that a padding token adds nothing to the loss (the recipe's
call, e.g. ``recforge.train.step_padding``). Nothing here reads a device value: padding a batch on
the GPU never waits for it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from recforge.jagged.batch import JaggedBatch

Fill = float | int | Tensor  # a number, or a one-element tensor on the values' device (read by the device, not the host)


def bucket(n: int, ratio: float, multiple: int) -> int:
    """The smallest size >= ``n`` on the ladder ``multiple``, then each size about ``ratio`` times the last
    (at least ``multiple`` more), rounded up to a multiple of ``multiple``: at most ~``ratio`` - 1 of padding.

    Example:
        >>> [bucket(n, 1.25, 64) for n in (1, 64, 65, 300, 1000)]
        [64, 64, 128, 320, 1024]
    """
    if ratio < 1.0 or multiple < 1:
        raise ValueError(f"bucket: ratio={ratio} must be >= 1 and multiple={multiple} >= 1")
    size = multiple
    while size < n:
        size = max(size + multiple, math.ceil(size * ratio / multiple) * multiple)
    return size


def padding_sequences(tokens: int, padded_tokens: int, max_seq_len: int) -> int:
    """How many sequences of at most ``max_seq_len`` tokens hold ``padded_tokens - tokens`` padding tokens."""
    return -(-(padded_tokens - tokens) // max_seq_len)


def pad_offsets(offsets: Tensor, tokens: int, padded_tokens: int, padded_sequences: int, max_seq_len: int) -> Tensor:
    """(B'+1,) offsets: ``offsets`` (B+1,) of ``tokens`` tokens, then padding sequences of ``max_seq_len``
    tokens (the last one shorter) up to ``padded_tokens``, then empty sequences up to ``padded_sequences``."""
    batch = offsets.numel() - 1
    needed = batch + padding_sequences(tokens, padded_tokens, max_seq_len)
    if padded_tokens < tokens or padded_sequences < needed:
        raise ValueError(f"pad_offsets: {batch} sequences of {tokens} tokens do not fit {padded_sequences} sequences of "
                         f"{padded_tokens} tokens with at most {max_seq_len} tokens each (need {needed} sequences)")  # fmt: skip
    ends = torch.arange(1, padded_sequences - batch + 1, device=offsets.device, dtype=offsets.dtype) * max_seq_len + tokens
    return torch.cat([offsets, ends.clamp_(max=padded_tokens)])  # (B'+1,)


def pad_rows(values: Tensor, rows: int, fill: Fill = 0) -> Tensor:
    """``values`` (N, ...) followed by ``rows - N`` rows of ``fill``: (rows, ...)."""
    extra = rows - values.shape[0]
    if extra < 0:
        raise ValueError(f"pad_rows: {values.shape[0]} rows do not fit {rows}")
    if extra == 0:
        return values
    if isinstance(fill, Tensor):
        tail = fill.reshape(1, *([1] * (values.dim() - 1))).to(values.dtype).expand(extra, *values.shape[1:])
    else:
        tail = values.new_full((extra, *values.shape[1:]), fill)
    return torch.cat([values, tail])


def pad_batch(batch: JaggedBatch, tokens: int, sequences: int, label_fill: dict[str, Fill]) -> JaggedBatch:
    """``batch`` padded to ``tokens`` tokens in ``sequences`` sequences (see the module doc).

    Args:
        batch: the real batch (any device); its token count is read from its features' rows.
        tokens, sequences: the padded sizes (T' >= T, B' >= B + the padding sequences T' - T needs).
        label_fill: per label, what its padding rows hold (token-aligned (T, ...) and per-sequence (B, ...)
            labels); every label must be named, so that no recipe pads a label by accident.
    """
    real_tokens, real_sequences = batch.num_tokens, batch.batch_size
    missing = sorted(set(batch.labels) - set(label_fill))
    if missing:
        raise ValueError(f"pad_batch: say what the padding rows of labels {missing} hold (label_fill)")
    labels = {}
    for name, values in batch.labels.items():
        if values.shape[0] == real_tokens:
            labels[name] = pad_rows(values, tokens, label_fill[name])
        elif values.shape[0] == real_sequences:
            labels[name] = pad_rows(values, sequences, label_fill[name])
        else:
            raise ValueError(f"pad_batch: label {name!r} has {values.shape[0]} rows, neither the batch's {real_tokens} "
                             f"tokens nor its {real_sequences} sequences (per-target labels are not padded)")  # fmt: skip
    mask = batch.mask
    pad_seq = lambda t: None if t is None else pad_rows(t, sequences)  # noqa: E731 - 0 targets / contextual / segments
    mask = dataclasses.replace(mask, num_targets=pad_seq(mask.num_targets), num_contextual=pad_seq(mask.num_contextual),
                               segment_lengths=pad_seq(mask.segment_lengths),
                               timestamps=None if mask.timestamps is None else pad_rows(mask.timestamps, tokens))  # fmt: skip
    return JaggedBatch(
        pad_offsets(batch.seq_offsets, real_tokens, tokens, sequences, batch.max_seq_len),
        {name: pad_rows(values, tokens) for name, values in batch.features.items()},
        batch.max_seq_len,
        {name: pad_rows(values, sequences) for name, values in batch.dense.items()},
        labels,
        mask,
    )
