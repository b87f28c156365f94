"""CUDA graphs for the engine's passes at steady-state shapes.

At serving sizes (d = 64, a few blocks) an engine pass is bound by kernel launches, not FLOPs:
scoring 1,000 candidates after a 2,000-event history is ~60 small kernels. A CUDA graph replays
all of them as one launch. A graph needs fixed shapes and addresses, so each work item is padded
to a *bucket*:

- M query tokens (candidates, or a prefill chunk / incremental extension) round up to the next
  of 16, 24, 32, 48, 64, 96, ... (steps of x1.5 and x4/3, so at most 50% padding);
- N cached keys round up the same way.

The item's tokens and the state's keys/values are copied into the bucket's static buffers, the
graph replays prefix -> every HSTU block -> postfix, and the real rows are copied out. A pass's
items share one host -> device copy of their tokens and one device -> host copy of their scores
(``staging.py``): every other copy stays on the device, so a pass waits for the device once. Where a
query stands (the history end for candidates, the chunk start for a prefill) and how many keys
are real are device tensors, so one graph serves every request in its bucket: padded keys are
invisible, padded queries are computed and dropped. The attention is the engine's own op
(``ops.cached_hstu_attention`` through ``serve.attention.attend_cached``, the Triton kernel on
CUDA) with the cache length a device tensor, so scores equal the eager pass within rounding
(tested on CPU without capture, on CUDA with it).

The static buffers make a runner (like the engine and its KV pool) single-threaded: one thread,
the ``BatchRunner``'s in the server, drives an engine.

Graphs are captured on the first use of a bucket and kept in an LRU of ``limit`` buckets. A
prefix or postfix module that cannot be captured (it synchronises with the host, say) turns
graphs off for the engine with one warning; the eager pass then serves every request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from recforge.jagged.mask import AttentionMask
from recforge.serve.attention import attend_cached
from recforge.serve.staging import HostStaging, ResultBuffer, host_numpy
from recforge.serve.state import WorkItem

if TYPE_CHECKING:
    from recforge.serve.engine import RankEngine

log = logging.getLogger(__name__)
FEATURES = ("item_ids", "actions", "context_ids", "timestamps")


def bucket(n: int, smallest: int = 16) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, 128, ... that holds ``n``."""
    size = smallest
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def bucket_of(item: WorkItem) -> tuple[str, int, int]:
    """(kind, M, N) of a work item: its tokens and the keys it attends to, each rounded up to a bucket.

    A prefill chunk writes its (padded) keys at [start, start + M), so its N bucket holds them all."""
    m = bucket(item.size)
    return item.kind, m, bucket(item.state.length if item.kind == "targets" else item.start + m)


class PaddedPass:
    """Static buffers of one (kind, M queries, N keys) bucket and, once captured, its CUDA graph."""

    def __init__(self, engine: RankEngine, kind: str, m: int, n: int) -> None:
        cfg = engine.model.encoder.cfg
        device, dtype = engine.device, engine.dtype
        self.engine, self.kind, self.m, self.n = engine, kind, m, n
        # the item's inputs in one buffer (one copy from the pass's staged inputs): its features (F, M), then the
        # op's cache offsets (B+1,) = (0, the real count of cached keys), then its contextual count (1,)
        f = len(FEATURES) * m
        self.inputs = torch.zeros(f + 3, dtype=torch.int64, device=device)
        self.features = self.inputs[:f].view(len(FEATURES), m)
        self.cache_offsets, self.num_contextual = self.inputs[f : f + 2], self.inputs[f + 2 :]
        self.keys = torch.zeros(cfg.num_blocks, n, cfg.num_heads, cfg.dqk, dtype=dtype, device=device)
        self.values = torch.zeros(cfg.num_blocks, n, cfg.num_heads, cfg.dv, dtype=dtype, device=device)
        # the whole sequence's times: the cached tokens', then the new tokens' (rows past them: ignored)
        self.times = torch.zeros(n + m, dtype=torch.int64, device=device)
        # (B+1,) offsets of the op, B = 1: the new tokens (fixed, M) and the cached keys (the real count, on the device)
        self.q_offsets = torch.tensor([0, m], dtype=torch.int64, device=device)
        if kind == "targets":
            targets = torch.full((1,), m, dtype=torch.int64, device=device)
            self.mask = AttentionMask(num_contextual=self.num_contextual, num_targets=targets, timestamps=self.times)
        else:  # a prefill chunk: no targets (the timestamp rule is for targets only)
            self.mask = AttentionMask(num_contextual=self.num_contextual)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Tensor | None = None

    @property
    def width(self) -> int:
        """int64 values of one item's staged inputs (``stage``)."""
        return self.inputs.numel()

    def stage(self, item: WorkItem, host: np.ndarray) -> None:
        """Write ``item``'s inputs into ``host`` (``width`` values, the layout of ``self.inputs``): its features
        zero-padded to M, then 0, where its queries start, its contextual count. Host memory only."""
        m, size = self.m, item.size
        feats = host[: len(FEATURES) * m].reshape(len(FEATURES), m)
        for row, name in zip(feats, FEATURES):
            row[:size] = host_numpy(item.features[name])
        feats[:, size:] = 0
        host[-3:] = (0, _start(item), item.state.num_contextual)

    def load(self, item: WorkItem, staged: Tensor) -> None:
        """Fill the static buffers from ``staged`` (``stage``'s values, on the device) and the item's state: every
        copy device -> device, queued on the current stream (nothing waits)."""
        st, size, start = item.state, item.size, _start(item)
        self.inputs.copy_(staged)
        times = self.features[FEATURES.index("timestamps")]
        if item.kind == "prefix":  # the chunk's own identities and times go into the state first, as in the eager pass
            st.timestamps[start : start + size].copy_(times[:size])
            st.tokens[start : start + size] = item.token_identities()
        self.keys[:, :start].copy_(st.keys[:, :start])
        self.values[:, :start].copy_(st.values[:, :start])
        # rows past them keep an earlier request's keys and times: the op reads only the first ``start`` keys
        # (cache_offsets) and ``start + M`` times (the new tokens' padded with zeros)
        self.times[:start].copy_(st.timestamps[:start])
        self.times[start : start + self.m].copy_(times)

    def compute(self) -> Tensor | None:
        """The padded pass; no host synchronisation, so it can be captured. (M, K) head outputs for
        targets; for a prefill the chunk's keys/values land in ``self.keys``/``self.values``."""
        engine = self.engine
        enc = engine.model.encoder
        cfg = enc.cfg
        m, device = self.m, self.features.device
        feats = dict(zip(FEATURES, self.features))
        # what the op keeps on the mask between blocks must be computed inside this pass (and so inside its
        # graph), never carried over from an earlier one: a replay would reuse a stale request's plan
        self.mask.forget()
        x = engine.model.prefix(feats)  # (M, d)
        q_pos = self.cache_offsets[1] + torch.arange(m, device=device)  # where a prefill chunk's keys go
        times = self.times if engine.time_bias else None

        def attend(layer: int, block, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if self.kind == "prefix":  # finish() copies the chunk's keys/values into the state
                self.keys[layer].index_copy_(0, q_pos, k)
                self.values[layer].index_copy_(0, q_pos, v)
            return attend_cached(block, q, k, v, self.keys[layer], self.values[layer], self.q_offsets, self.cache_offsets,
                                 m, self.n, self.mask, times, 1.0 / cfg.max_seq_len, cfg.kernel)  # fmt: skip

        embedded, x = x, enc.encode(x, attend)
        return engine.model.postfix(engine.model.postfix_input(x, embedded)) if self.kind == "targets" else None

    def capture(self) -> None:
        """Warm up on a side stream (allocator, cuBLAS handles), then capture ``compute`` on the
        engine's device (which need not be the current one)."""
        device = self.features.device
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self.compute()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.out = self.compute()
        self.graph = graph

    def finish(self, item: WorkItem, out: Tensor | None, scores: Tensor | None) -> None:
        """Copy the real rows out (on the device): candidates' (size, K) head outputs into ``scores``, or the
        chunk's keys into the state."""
        if item.kind == "targets":
            scores.copy_(out[: item.size])
            return
        st, s, e = item.state, item.start, item.start + item.size
        st.keys[:, s:e] = self.keys[:, s:e]
        st.values[:, s:e] = self.values[:, s:e]
        st.length = e


def _start(item: WorkItem) -> int:
    """Where the item's queries stand: after the whole state (candidates), at the chunk's start (a prefill)."""
    return item.state.length if item.kind == "targets" else item.start


class GraphCaptureError(RuntimeError):
    """The model's passes cannot be captured as CUDA graphs (e.g. a module synchronises with the host)."""


class GraphRunner:
    """Runs a pass's work items through padded passes, replaying one captured CUDA graph per bucket.

    A pass moves its inputs in one host -> device copy and its scores in one device -> host copy (the
    pass's one synchronisation; none for a pass of prefill chunks only): ``staging.py``.
    ``capture=False`` runs the padded pass eagerly (the CPU check of the padding arithmetic).
    """

    def __init__(self, engine: RankEngine, limit: int, capture: bool = True) -> None:
        self.engine, self.limit, self.capture = engine, limit, capture
        self.passes: OrderedDict[tuple[str, int, int], PaddedPass] = OrderedDict()
        self.stats = {"captures": 0, "replays": 0, "evictions": 0, "uploads": 0, "downloads": 0, "staging_waits": 0}
        self.staging = HostStaging(engine.device, self.stats)
        self.results = ResultBuffer(engine.device, self.stats)

    def run(self, item: WorkItem) -> Tensor | None:
        """One item alone: ``run_pass([item])[0]``."""
        return self.run_pass([item])[0]

    def run_pass(self, items: list[WorkItem]) -> list[Tensor | None]:
        """Execute ``items`` (one engine pass): None per prefill chunk (written into its state), (size, K)
        float32 CPU scores per candidates item."""
        padded = [self._padded(bucket_of(item)) for item in items]
        widths = [p.width for p in padded]
        host = self.staging.take(sum(widths))
        lo = 0
        for p, item, w in zip(padded, items, widths):
            p.stage(item, host[lo : lo + w])
            lo += w
        staged = self.staging.upload(lo)
        rows = sum(item.size for item in items if item.kind == "targets")
        scores, spans, lo, row = None, [], 0, 0
        for p, item, w in zip(padded, items, widths):
            p.load(item, staged[lo : lo + w])
            lo += w
            out = self._execute(p, item)
            if item.kind == "targets":
                if scores is None:  # the head's width is known from the first output
                    scores = self.results.reserve(rows, tuple(out.shape[1:]))
                p.finish(item, out, scores[row : row + item.size])
                spans.append((row, row + item.size))
                row += item.size
            else:
                p.finish(item, None, None)
                spans.append(None)
        if scores is None:
            return [None] * len(items)
        host_scores = self.results.download(scores)
        return [None if span is None else host_scores[span[0] : span[1]] for span in spans]

    def _padded(self, key: tuple[str, int, int]) -> PaddedPass:
        padded = self.passes.get(key)
        if padded is None:
            padded = self.passes[key] = PaddedPass(self.engine, *key)
            while len(self.passes) > self.limit:  # a pass may still use an evicted bucket: it holds the object
                self.passes.popitem(last=False)
                self.stats["evictions"] += 1
        self.passes.move_to_end(key)
        return padded

    def _execute(self, padded: PaddedPass, item: WorkItem) -> Tensor | None:
        if not self.capture:
            return padded.compute()
        if padded.graph is None:
            try:
                padded.capture()
            except Exception as err:  # a module that cannot be captured: the engine goes eager
                self.passes.pop((padded.kind, padded.m, padded.n), None)
                raise GraphCaptureError(f"CUDA graph capture of a {item.kind} pass failed: {err}") from err
            self.stats["captures"] += 1
        with torch.cuda.device(padded.features.device):
            padded.graph.replay()
        self.stats["replays"] += 1
        return padded.out

    def report(self) -> dict[str, int]:
        return {"graphs": len(self.passes), **self.stats}


__all__ = ["GraphCaptureError", "GraphRunner", "PaddedPass", "bucket", "bucket_of"]
