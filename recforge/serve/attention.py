"""Work items -> one ``recforge.ops.cached_hstu_attention`` call per block.

Each work item is one request's whole sequence as the training mask sees it: the state's cached
tokens (contextual + history so far), then the item's new tokens. A prefill chunk's new tokens
are the next history tokens (causal among themselves, appended to the cache); candidates are
the sequence's targets (``num_targets = m``: each sees the contextual tokens, the history events
strictly before its time, and itself). Visibility and biases are the op's, i.e. the training
rules of ``recforge.jagged.mask`` and ``recforge.ops.hstu_attention``: nothing is re-derived here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.jagged.mask import AttentionMask
from recforge.ops import cached_hstu_attention
from recforge.serve.state import WorkItem


class CachedPass:
    """The op's arguments for one eager pass of several work items (the same in every block).

    ``attend`` is the encoder's attention hook (``HSTUEncoder.encode``): it writes a prefill chunk's
    keys/values into its state and runs the op over every item's cache at once.

    Args:
        items: the pass's work items; ``q_ts`` (T,) the times of their new tokens, concatenated.
        time_bias: the model has a time bias (the blocks' ``time_weights`` are used).
        scale: the attention scale (1 / max_seq_len); ``kernel``: the encoder's attention backend.
        staged: ``host_values(items)`` already on the device (copied with the pass's other inputs); None: copied here.
    """

    def __init__(self, items: list[WorkItem], q_ts: Tensor, time_bias: bool, scale: float, kernel: str,
                 staged: Tensor | None = None) -> None:  # fmt: skip
        device = q_ts.device
        self.items, self.scale, self.kernel = items, scale, kernel
        cached = [it.start if it.kind == "prefix" else it.state.length for it in items]
        sizes = [it.size for it in items]
        self.spans = [(a, a + m) for a, m in zip(_starts(sizes), sizes)]
        self.cached, self.max_q, self.max_cache = cached, max(sizes), max(cached)
        if staged is None:  # the caller did not bring them to the device with its other inputs
            staged = torch.tensor(self.host_values(items), dtype=torch.int64).to(device)
        b = len(items)
        self.q_offsets, self.cache_offsets = staged[: 2 * (b + 1)].view(2, b + 1).unbind(0)
        contextual, targets = staged[2 * (b + 1) :].view(2, b).unbind(0)
        # the whole sequences' times: per item its cached tokens' times, then its new tokens' (a prefill
        # chunk's are already in its state)
        times = []
        for it, n, (a, b) in zip(items, cached, self.spans):
            times.append(it.state.timestamps[: n + it.size] if it.kind == "prefix" else torch.cat([it.state.timestamps[:n], q_ts[a:b]]))
        self.timestamps = times[0] if len(times) == 1 else torch.cat(times)
        if any(it.kind == "targets" for it in items):
            self.mask = AttentionMask(num_contextual=contextual, num_targets=targets, timestamps=self.timestamps)
        else:  # prefill only: no targets, so the timestamp rule (for targets) has nothing to do
            self.mask = AttentionMask(num_contextual=contextual)
        self.time_bias = time_bias

    @staticmethod
    def host_values(items: list[WorkItem]) -> list[int]:
        """The op's offsets and counts of a pass, as ``staged`` holds them (4B + 2 int64): the new tokens' and the
        cached tokens' offsets (B+1 each), then per item its contextual count and its target count."""
        cached = [it.start if it.kind == "prefix" else it.state.length for it in items]
        sizes = [it.size for it in items]
        return [*_starts(sizes), sum(sizes), *_starts(cached), sum(cached),
                *(it.state.num_contextual for it in items), *(it.size if it.kind == "targets" else 0 for it in items)]

    def cache(self, layer: int) -> tuple[Tensor, Tensor]:
        """(keys, values) of every item's cached tokens at ``layer``, jagged (a view for one item)."""
        keys = [it.state.keys[layer, :n] for it, n in zip(self.items, self.cached)]
        values = [it.state.values[layer, :n] for it, n in zip(self.items, self.cached)]
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys), torch.cat(values)

    def attend(self, layer: int, block, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        for it, (a, b) in zip(self.items, self.spans):
            if it.kind == "prefix":
                s = it.start
                it.state.keys[layer, s : s + it.size] = k[a:b]
                it.state.values[layer, s : s + it.size] = v[a:b]
        k_cache, v_cache = self.cache(layer)
        return attend_cached(block, q, k, v, k_cache, v_cache, self.q_offsets, self.cache_offsets, self.max_q,
                             self.max_cache, self.mask, self.timestamps if self.time_bias else None, self.scale,
                             self.kernel)  # fmt: skip


def attend_cached(block, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, q_offsets: Tensor,
                  cache_offsets: Tensor, max_q: int, max_cache: int, mask: AttentionMask, timestamps: Tensor | None,
                  scale: float, kernel: str) -> Tensor:  # fmt: skip
    """``cached_hstu_attention`` with ``block``'s bias weights (its time bias only when ``timestamps`` is given)."""
    use_time = timestamps is not None and block.time_weights is not None
    return cached_hstu_attention(q, k, v, k_cache, v_cache, q_offsets, cache_offsets, max_q, max_cache, mask,
                                 scale=scale, pos_weights=block.pos_weights, timestamps=timestamps if use_time else None,
                                 time_weights=block.time_weights if use_time else None, kernel=kernel)  # fmt: skip


def _starts(sizes: list[int]) -> list[int]:
    out, lo = [], 0
    for n in sizes:
        out.append(lo)
        lo += n
    return out


__all__ = ["CachedPass", "attend_cached"]
