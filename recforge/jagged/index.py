"""Vectorised helpers for jagged (values + offsets) tensors. No per-sequence Python loops."""

from __future__ import annotations

import torch
from torch import Tensor


def lengths_from_offsets(offsets: Tensor) -> Tensor:
    """(B+1,) offsets -> (B,) lengths."""
    return offsets[1:] - offsets[:-1]


def offsets_from_lengths(lengths: Tensor) -> Tensor:
    """(B,) lengths -> (B+1,) int64 offsets starting at 0."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def positions_in_sequence(offsets: Tensor, total: int | None = None) -> Tensor:
    """Index of every token inside its own sequence: (T,) int64, 0 at each sequence start."""
    lengths = lengths_from_offsets(offsets)
    total = int(offsets[-1]) if total is None else total
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=total)
    return torch.arange(total, device=offsets.device) - starts


def sequence_ids(offsets: Tensor, total: int | None = None) -> Tensor:
    """Which sequence every token belongs to: (T,) int64."""
    lengths = lengths_from_offsets(offsets)
    total = int(offsets[-1]) if total is None else total
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total)


def range_index(starts: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Concatenate the index ranges ``[starts[b], starts[b] + lengths[b])`` without a loop.

    Returns:
        (index, offsets): (sum(lengths),) int64 index and the (B+1,) offsets of its ranges.
    """
    offsets = offsets_from_lengths(lengths)
    total = int(offsets[-1])
    index = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=total)
    return index + torch.arange(total, device=starts.device), offsets


def trim_sequences(offsets: Tensor, *, drop_last: int = 0, keep_last: int | None = None) -> tuple[Tensor, Tensor]:
    """Select, per sequence, a contiguous window ending ``drop_last`` tokens before its end.

    The window holds at most ``keep_last`` tokens (all when None). Sequences shorter than
    ``drop_last`` become empty.

    Returns:
        (index, new_offsets): ``values[index]`` is the trimmed values tensor, (T',) int64,
        and ``new_offsets`` (B+1,) its offsets.
    """
    lengths = lengths_from_offsets(offsets)
    ends = offsets[1:] - torch.clamp(lengths, max=drop_last)
    new_lengths = ends - offsets[:-1]
    if keep_last is not None:
        new_lengths = torch.clamp(new_lengths, max=keep_last)
    return range_index(ends - new_lengths, new_lengths)


_padding_index_cache: list = [None, -1, 0, None]  # [offsets, offsets._version, total, (seq_ids, positions)]


def padding_index(offsets: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """(sequence id, position) of every token: the scatter/gather index between jagged and padded.

    Every layer of an encoder pads and unpads the same batch, so the last result is kept.
    The cache holds a reference to ``offsets`` and checks identity and version, so a new or
    modified offsets tensor can never hit a stale entry.
    """
    # inference tensors have no version counter, and under torch.compile (which cannot trace is_inference) the
    # traced graph computes it once anyway: don't cache
    if torch.compiler.is_compiling() or offsets.is_inference():
        return sequence_ids(offsets, total), positions_in_sequence(offsets, total)
    cache = _padding_index_cache
    if cache[0] is offsets and cache[1] == offsets._version and cache[2] == total:
        return cache[3]
    result = (sequence_ids(offsets, total), positions_in_sequence(offsets, total))
    cache[:] = [offsets, offsets._version, total, result]
    return result


def clear_padding_index_cache() -> None:
    """Forget ``padding_index``'s last result (e.g. before a CUDA graph capture, which must compute it itself:
    a result cached for the same offsets buffer holds another batch's indices)."""
    _padding_index_cache[:] = [None, -1, 0, None]


def jagged_to_padded(values: Tensor, offsets: Tensor, max_len: int, pad_value: float = 0.0) -> Tensor:
    """(T, *rest) jagged values -> (B, max_len, *rest) right-padded dense tensor."""
    batch = offsets.numel() - 1
    out = values.new_full((batch, max_len, *values.shape[1:]), pad_value)
    out[padding_index(offsets, values.shape[0])] = values
    return out


def jagged_rows(values: Tensor, offsets: Tensor, max_len: int) -> Tensor:
    """(T, *rest) jagged values -> (B, max_len, *rest), zeros past each sequence's end, by gathering.

    Unlike ``jagged_to_padded`` it needs no host synchronisation nor ``T == offsets[-1]``: rows of
    ``values`` past ``offsets[-1]`` are ignored (a preallocated buffer can be passed as it is),
    so it also runs inside CUDA graphs and exported programs."""
    pos = torch.arange(max_len, device=offsets.device).view(1, -1)
    real = pos < lengths_from_offsets(offsets).view(-1, 1)  # (B, max_len)
    if values.shape[0] == 0:
        return values.new_zeros(real.shape[0], max_len, *values.shape[1:])
    rows = values[(offsets[:-1].view(-1, 1) + pos).clamp(0, values.shape[0] - 1)]
    return torch.where(real.view(*real.shape, *(1,) * (values.dim() - 1)), rows, 0)


def padded_to_jagged(padded: Tensor, offsets: Tensor, total: int | None = None) -> Tensor:
    """(B, N, *rest) right-padded dense tensor -> (T, *rest) jagged values.

    Pass ``total`` (= offsets[-1]) when known to avoid a device-to-host sync.
    """
    total = int(offsets[-1]) if total is None else total
    return padded[padding_index(offsets, total)]


def gather_sequences(offsets: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Select whole sequences ``rows`` (in that order) from a jagged tensor.

    Returns:
        (index, new_offsets): ``values[index]`` holds the selected sequences back to back.
    """
    return range_index(offsets[:-1][rows], lengths_from_offsets(offsets)[rows])
