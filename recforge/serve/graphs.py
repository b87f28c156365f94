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
invisible, padded queries are computed and dropped. The arithmetic is the engine's own
(``cached_attention``, ``self_attention_term``, ``BiasIndex``) with general (M, N) masks, so
scores equal the eager pass within rounding (tested on CPU without capture, on CUDA with it).

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

from recforge.ops.hstu_attention import time_buckets
from recforge.serve.attention import BiasIndex, cached_attention, self_attention_term
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
        self.key_times = torch.zeros(n, dtype=torch.int64, device=device)
        # where the queries stand: the history end (targets) or the chunk start (prefix); then the contextual count
        self.where = torch.zeros(2, dtype=torch.int64, device=device)
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
        # past them: zeros. The mask hides those keys, but an invisible value still meets a zero weight,
        # and 0 * inf is NaN: an earlier request's non-finite values must not leak into this one
        self.keys[:, start:].zero_()
        self.values[:, start:].zero_()
        n_times = start + (size if item.kind == "prefix" else 0)
        self.key_times[:n_times].copy_(st.timestamps[:n_times])
        self.where.copy_(torch.tensor([start, st.num_contextual]))

    def compute(self) -> Tensor | None:
        """The padded pass; no host synchronisation, so it can be captured. (M, K) head outputs for
        targets; for a prefill the chunk's keys/values land in ``self.keys``/``self.values``."""
        engine = self.engine
        enc = engine.model.encoder
        cfg = enc.cfg
        m, device = self.m, self.features.device
        feats = dict(zip(FEATURES, self.features))
        x = engine.model.prefix(feats)  # (M, d)
        start, num_contextual = self.where[0], self.where[1]
        k_pos = torch.arange(self.n, device=device)
        q_ts = feats["timestamps"]
        key_is_context = k_pos < num_contextual
        first = enc.blocks[0]
        num_pos = first.pos_weights.numel()
        use_time = first.time_weights is not None and engine.time_bias
        if self.kind == "targets":  # every candidate sits at the history end, sees context and strictly earlier events
            distance = (start - k_pos).clamp(0, num_pos - 1).view(1, -1)
            visible = (k_pos < start) & (key_is_context | (self.key_times.view(1, -1) < q_ts.view(-1, 1)))
            events = ~key_is_context.view(1, -1)
        else:  # causal chunk at [start, start + M): contextual queries see context, event queries see context + the past
            q_pos = start + torch.arange(m, device=device)  # the bucket holds start + M keys (keys_needed)
            distance = (q_pos.view(-1, 1) - k_pos.view(1, -1)).clamp(0, num_pos - 1)
            query_is_event = (q_pos >= num_contextual).view(-1, 1)
            visible = key_is_context.view(1, -1) | (query_is_event & (k_pos.view(1, -1) <= q_pos.view(-1, 1)))
            events = query_is_event & ~key_is_context.view(1, -1)
        time_index = time_buckets(q_ts.view(-1, 1) - self.key_times.view(1, -1), first.time_weights.numel() - 1) if use_time else None
        index = BiasIndex(distance, time_index, events if use_time else None)
        scale = 1.0 / cfg.max_seq_len

        def attend(layer: int, block, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if self.kind == "prefix":
                self.keys[layer].index_copy_(0, q_pos, k)
                self.values[layer].index_copy_(0, q_pos, v)
            out = cached_attention(q, self.keys[layer], self.values[layer], visible=visible,
                                   bias=index.bias(block.pos_weights, block.time_weights), scale=scale)  # fmt: skip
            if self.kind == "targets":
                out = out + self_attention_term(q, k, v, q_ts, block.pos_weights, block.time_weights, scale)
            return out

        embedded, x = x, encode_blocks(enc, x, attend)
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


def encode_blocks(encoder, x: Tensor, attend) -> Tensor:
    """x through every HSTU block with ``attend(layer, block, q, k, v) -> (T, H, Dv)`` as its attention."""
    for layer, block in enumerate(encoder.blocks):
        u, q, k, v = block.project(x)
        x = block.combine(x, attend(layer, block, q, k, v), u)
    return x


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


__all__ = ["GraphCaptureError", "GraphRunner", "PaddedPass", "bucket", "bucket_of", "encode_blocks"]
