"""CUDA graphs for the engine's passes at steady-state shapes.

At serving sizes (d = 64, a few blocks) an engine pass is bound by kernel launches, not FLOPs:
scoring 1,000 candidates after a 2,000-event history is ~60 small kernels. A CUDA graph replays
all of them as one launch. A graph needs fixed shapes and addresses, so each work item is padded
to a *bucket*:

- M query tokens (candidates, or a prefill chunk / incremental extension) round up to the next
  of 16, 24, 32, 48, 64, 96, ... (steps of x1.5 and x4/3, so at most 50% padding);
- N cached keys round up the same way.

The item's tokens and the state's keys/values are copied into the bucket's static buffers, the
graph replays prefix -> every HSTU block -> postfix, and the real rows are copied out. Where a
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

import torch
from torch import Tensor

from recforge.jagged.mask import AttentionMask
from recforge.serve.attention import attend_cached
from recforge.serve.state import WorkItem, token_identity

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
        self.features = torch.zeros(len(FEATURES), m, dtype=torch.int64, device=device)
        self.keys = torch.zeros(cfg.num_blocks, n, cfg.num_heads, cfg.dqk, dtype=dtype, device=device)
        self.values = torch.zeros(cfg.num_blocks, n, cfg.num_heads, cfg.dv, dtype=dtype, device=device)
        # the whole sequence's times: the cached tokens', then the new tokens' (rows past them: ignored)
        self.times = torch.zeros(n + m, dtype=torch.int64, device=device)
        # (B+1,) offsets of the op, B = 1: the new tokens (fixed, M) and the cached keys (the real count, on the device)
        self.q_offsets = torch.tensor([0, m], dtype=torch.int64, device=device)
        self.cache_offsets = torch.zeros(2, dtype=torch.int64, device=device)
        self.num_contextual = torch.zeros(1, dtype=torch.int64, device=device)
        if kind == "targets":
            targets = torch.full((1,), m, dtype=torch.int64, device=device)
            self.mask = AttentionMask(num_contextual=self.num_contextual, num_targets=targets, timestamps=self.times)
        else:  # a prefill chunk: no targets (the timestamp rule is for targets only)
            self.mask = AttentionMask(num_contextual=self.num_contextual)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Tensor | None = None

    def load(self, item: WorkItem) -> None:
        """Copy ``item``'s tokens and the keys/values it attends to into the static buffers."""
        st, size = item.state, item.size
        host = torch.zeros(len(FEATURES), self.m, dtype=torch.int64)
        host[:, :size] = torch.stack([item.features[name].cpu() for name in FEATURES])
        self.features.copy_(host)
        start = st.length if item.kind == "targets" else item.start
        if item.kind == "prefix":  # the chunk's own identities and times go into the state first, as in the eager pass
            st.timestamps[start : start + size] = item.features["timestamps"].to(st.timestamps.device)
            st.tokens[start : start + size] = token_identity(item.features)
        self.keys[:, :start].copy_(st.keys[:, :start])
        self.values[:, :start].copy_(st.values[:, :start])
        # rows past them keep an earlier request's keys: the op reads only the first ``start`` (cache_offsets)
        host_times = torch.zeros(self.times.numel(), dtype=torch.int64)
        host_times[:start] = st.timestamps[:start].cpu()
        host_times[start : start + size] = item.features["timestamps"].cpu()
        self.times.copy_(host_times)
        self.cache_offsets.copy_(torch.tensor([0, start]))
        self.num_contextual.fill_(st.num_contextual)

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

    def finish(self, item: WorkItem, out: Tensor | None) -> Tensor | None:
        """Copy the real rows out: (size, K) float32 scores on the CPU, or the chunk's keys into the state."""
        if item.kind == "targets":
            return out[: item.size].float().cpu()
        st, s, e = item.state, item.start, item.start + item.size
        st.keys[:, s:e] = self.keys[:, s:e]
        st.values[:, s:e] = self.values[:, s:e]
        st.length = e
        return None


class GraphCaptureError(RuntimeError):
    """The model's passes cannot be captured as CUDA graphs (e.g. a module synchronises with the host)."""


class GraphRunner:
    """Runs work items through padded passes, replaying one captured CUDA graph per bucket.

    ``capture=False`` runs the padded pass eagerly (the CPU check of the padding arithmetic).
    """

    def __init__(self, engine: RankEngine, limit: int, capture: bool = True) -> None:
        self.engine, self.limit, self.capture = engine, limit, capture
        self.passes: OrderedDict[tuple[str, int, int], PaddedPass] = OrderedDict()
        self.stats = {"captures": 0, "replays": 0, "evictions": 0}

    def run(self, item: WorkItem) -> Tensor | None:
        key = bucket_of(item)
        padded = self.passes.get(key)
        if padded is None:
            padded = self.passes[key] = PaddedPass(self.engine, *key)
            while len(self.passes) > self.limit:
                self.passes.popitem(last=False)
                self.stats["evictions"] += 1
        self.passes.move_to_end(key)
        padded.load(item)
        if not self.capture:
            return padded.finish(item, padded.compute())
        if padded.graph is None:
            try:
                padded.capture()
            except Exception as err:  # a module that cannot be captured: the engine goes eager
                del self.passes[key]
                raise GraphCaptureError(f"CUDA graph capture of a {item.kind} pass failed: {err}") from err
            self.stats["captures"] += 1
        with torch.cuda.device(padded.features.device):
            padded.graph.replay()
        self.stats["replays"] += 1
        return padded.finish(item, padded.out)

    def report(self) -> dict[str, int]:
        return {"graphs": len(self.passes), **self.stats}


__all__ = ["GraphCaptureError", "GraphRunner", "PaddedPass", "bucket", "bucket_of"]
