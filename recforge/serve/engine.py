"""The ranking engine: a trained run's prefix/HSTU/postfix slices, scoring C candidates after an
L-event history in O(L + C) token work instead of O(L * C).

The history (contextual + history tokens, the *prefix*) runs through the HSTU blocks once; each
block's keys and values of the prefix are kept in a ``PrefixState``. Candidates then run
through the blocks on their own: at each block a candidate attends to the cached keys/values it
may see (contextual tokens, history events strictly before its time) and to itself, never to
other candidates, exactly as the training mask says.

The engine executes passes (``run``: the work items of a ``scheduler.Plan``); which tokens go in a
pass, chunked prefill and the KV-cache bookkeeping are the scheduler's (``scheduler.py`` with its
``cache_manager.py``). ``rank`` drives a private scheduler for one request. An engine is built
once per model version and never changed: a reload builds a new engine (``BatchRunner.reload``).

Example:
    >>> engine = RankEngine.from_run("runs/ranking-taobao-hstu")
    >>> result = engine.rank("u1", History(items=[5, 9], timestamps=[100, 200], actions=["pv", "cart"]),
    ...                      candidates=[3, 7, 11], timestamp=300)
    >>> result.scores                        # (3, num_tasks) raw head outputs (logits for binary tasks)
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recforge.models.hstu import HSTUEncoder
from recforge.ops.dispatch import resolve_device
from recforge.models.ranking import RankingModel
from recforge.serve.attention import CachedPass
from recforge.serve.cache_manager import CacheManager
from recforge.serve.graphs import GraphCaptureError, GraphRunner
from recforge.serve.layout import (
    EncodedRequest,
    History,
    Vocab,
    candidate_tokens,
    encode_request,
    training_batch,
)
from recforge.serve.model_dir import stage_model
from recforge.serve.scheduler import prefill_alone
from recforge.serve.staging import HostStaging, ResultBuffer, host_numpy
from recforge.serve.state import PrefixState, WorkItem, token_identity

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Serving limits and numerics."""

    device: str = "cpu"  # cpu | cuda | auto (cuda when available)
    dtype: str = "float32"  # float32 | bfloat16 | float16 (weights and activations; scores come back float32)
    prefill_chunk: int = 1024  # rank()'s prefix tokens per pass (the server's batching uses SchedulerConfig's)
    max_candidates: int = 2000  # a request with more candidates is rejected
    max_history_events: int = 100_000  # a request with more events is rejected; the model sees the latest that fit
    unknown_ids: str = "error"  # items and actions outside the vocabulary: error (422) | zero (the "none" embedding)
    unknown_feature_values: str = "zero"  # user feature values never seen in training (a new user_id): zero | error
    cuda_graphs: int = 32  # on CUDA: replay passes as CUDA graphs, keeping this many shape buckets (0 = eager)

    def problems(self) -> list[str]:
        """Every invalid field, each message starting with the field's name."""
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"dtype: {self.dtype!r} is not one of {tuple(DTYPES)}")
        if self.device not in ("cpu", "auto") and not self.device.startswith("cuda"):
            problems.append(f"device: {self.device!r} is not cpu, cuda[:N] or auto")
        for name in ("unknown_ids", "unknown_feature_values"):
            if getattr(self, name) not in ("error", "zero"):
                problems.append(f"{name}: {getattr(self, name)!r} is not error or zero")
        for name in ("prefill_chunk", "max_candidates", "max_history_events"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.cuda_graphs < 0:
            problems.append(f"cuda_graphs: must be >= 0 (0 turns them off), got {self.cuda_graphs}")
        return problems

    def validate(self) -> None:
        if problems := self.problems():
            raise ValueError("EngineConfig: " + "; ".join(problems))


@dataclass
class RankResult:
    """Scores of one request: ``scores`` (C, K) raw head outputs, in candidate order."""

    scores: Tensor
    tasks: list[dict]
    cached_tokens: int = 0  # prefix tokens reused from the KV cache
    computed_tokens: int = 0  # prefix tokens computed for this request
    truncated_events: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    model_version: str = ""  # the model that computed every score of this result

    def task_scores(self) -> dict[str, list[float]]:
        """Per task: probabilities (binary tasks) or predicted values (regression)."""
        out = {}
        for k, task in enumerate(self.tasks):
            column = self.scores[:, k]
            out[task.get("name", f"task{k}")] = (torch.sigmoid(column) if task.get("kind") == "binary" else column).tolist()
        return out


class RankEngine:
    """Prefix-cached ranking with a ``RankingModel`` (HSTU encoder); see the module docstring."""

    def __init__(self, model: RankingModel, manifest: dict, vocab: dict | None = None,
                 config: EngineConfig | None = None, version: str = "0") -> None:  # fmt: skip
        self.config = config or EngineConfig()
        self.config.validate()
        self.device = resolve_device(self.config.device)
        self.dtype = DTYPES[self.config.dtype]
        self.pool = None  # the KVCachePool its schedulers reuse and fill (set before serving; see cache_manager)
        self.model = model = model.eval().to(self.device, self.dtype)
        self.manifest = manifest
        self.vocab_json = vocab
        self.tasks = list(manifest.get("tasks") or [])
        self.action_encoding = manifest.get("action_encoding", "sum")
        prefix_cfg = getattr(model.prefix, "kwargs", {})
        self.vocab = Vocab.from_json(vocab, manifest, prefix_cfg.get("num_items", 0), prefix_cfg.get("num_actions", 0))
        if "num_contextual" not in manifest and prefix_cfg.get("num_context_values", 0) > 0:
            raise ValueError(
                "the model's manifest.json does not say how many contextual (user feature) tokens it was trained "
                "with (exported before serving support); re-export it with `recforge eval RUN_DIR`"
            )
        self.num_contextual = int(manifest.get("num_contextual", 0))
        if len(self.vocab.feature_names) != self.num_contextual:
            raise ValueError(
                f"manifest says {self.num_contextual} contextual tokens but names {len(self.vocab.feature_names)} user "
                "features; re-export the run (recforge eval RUN_DIR) to write user_features into manifest.json"
            )
        self.version = version
        hstu = isinstance(model.encoder, HSTUEncoder)
        # the cached passes serve HSTU with attn_norm=layernorm; visible_mean divides each block's attention by
        # its visible-key count, which they do not carry: such a model (and any other encoder) runs the full forward
        self.cached = hstu and model.encoder.cfg.attn_norm == "layernorm"
        self.max_seq_len = model.encoder.cfg.max_seq_len if hstu else int(manifest.get("max_seq_len", 1 << 30))
        self.time_bias = self.cached and any(b.time_weights is not None for b in model.encoder.blocks)
        if not self.cached:
            log.info("encoder %s%s: no prefix cache, each request runs the full forward pass with all candidates as "
                     "targets", type(model.encoder).__name__, " (attn_norm=visible_mean)" if hstu else "")  # fmt: skip
        use_graphs = self.cached and self.device.type == "cuda" and self.config.cuda_graphs > 0
        self.graphs = GraphRunner(self, self.config.cuda_graphs) if use_graphs else None
        # the eager pass's reusable transfer buffers (``staging.py``): an engine is driven by one thread
        self.transfers = {"uploads": 0, "downloads": 0, "staging_waits": 0}
        self._staging, self._results = HostStaging(self.device, self.transfers), ResultBuffer(self.device, self.transfers)
        per_event = 2 if self.action_encoding == "interleave" else 1
        # a prefix of at most max_seq_len - 1 tokens leaves the candidates' position (the history end) in range
        self.max_events = max(0, (self.max_seq_len - 1 - self.num_contextual) // per_event)
        self.encoding = _encoding_key(vocab, manifest, self.max_events, self.config)

    @classmethod
    def from_run(cls, run_dir: str | Path, config: EngineConfig | None = None) -> RankEngine:
        """Load ``RUN_DIR/model`` (or a model directory itself) written by ``save_slices``; ``ValueError``
        naming what is wrong with the directory."""
        config = config or EngineConfig()
        config.validate()
        model, manifest, vocab, version = stage_model(run_dir, DTYPES[config.dtype])
        if vocab is None:
            log.warning("%s has no vocab.json: requests must carry model codes, not raw IDs", run_dir)
        return cls(model, manifest, vocab, config, version)

    @classmethod
    def load_checked(cls, run_dir: str | Path, config: EngineConfig) -> RankEngine:
        """``from_run`` then ``probe``: a complete engine that has scored a request, or ``ValueError`` saying
        why ``run_dir`` cannot be served. Nothing outside the new engine is touched (what a reload builds)."""
        try:
            engine = cls.from_run(run_dir, config)
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - a manifest that does not fit its slices, a device error...
            raise ValueError(f"cannot serve the model in {run_dir}: {type(err).__name__}: {err}") from err
        engine.probe()
        return engine

    # ------------------------------------------------------------------------------- requests

    def encode(self, user: Any, history: History | dict, candidates: list[Any], *,
               user_features: dict[str, Any] | None = None, timestamp: int | None = None) -> EncodedRequest:  # fmt: skip
        """Validate a request and map it to model codes; raises ``RequestError`` saying what is wrong."""
        req = encode_request(self.vocab, self.config, self.max_events, user, history, candidates,
                             user_features=user_features, timestamp=timestamp)  # fmt: skip
        req.encoding = self.encoding
        return req

    def rank(self, user: Any, history: History | dict, candidates: list[Any], *,
             user_features: dict[str, Any] | None = None, timestamp: int | None = None,
             state: PrefixState | None = None) -> RankResult:  # fmt: skip
        """Score ``candidates`` for ``user`` after ``history``: one prefix pass, then every candidate
        attends to the cached history. ``state``: a cached prefix to extend (see ``prefix_state``)."""
        return self.rank_encoded(self.encode(user, history, candidates, user_features=user_features, timestamp=timestamp), state)

    @torch.no_grad()
    def rank_encoded(self, req: EncodedRequest, state: PrefixState | None = None) -> RankResult:
        """``rank`` for an encoded request. The prefix starts from ``state`` when given (extended, not cached),
        else from the user's entry in ``self.pool`` (written back once complete)."""
        t0 = time.perf_counter()
        if not self.cached:
            batch = training_batch(req, self.action_encoding, self.max_seq_len).to(self.device)
            scores = self.model(batch).float().cpu()
            return RankResult(scores, self.tasks, 0, batch.num_tokens - req.num_candidates, req.truncated,
                              model_version=self.version)  # fmt: skip
        seq = prefill_alone(self, req, state)
        t1 = time.perf_counter()
        scores = self.score(seq.state, candidate_tokens(req))
        t2 = time.perf_counter()
        timings = {"prefill": (t1 - t0) * 1e3, "candidates": (t2 - t1) * 1e3}
        return RankResult(scores, self.tasks, seq.reused, seq.state.length - seq.reused, req.truncated, timings,
                          self.version)  # fmt: skip

    @torch.no_grad()
    def prefix_state(self, req: EncodedRequest, state: PrefixState | None = None) -> PrefixState:
        """``req``'s prefix keys/values (computed, or ``state`` extended), without scoring; see ``rank_encoded``."""
        return prefill_alone(self, req, state).state

    # ------------------------------------------------------------------------------- compute

    def score(self, state: PrefixState, candidates: dict[str, Tensor]) -> Tensor:
        """(C, K) float32 head outputs of the candidates after ``state``."""
        return self.run([WorkItem(state, candidates, "targets")])[0]

    @torch.no_grad()
    def run(self, items: list[WorkItem]) -> list[Tensor | None]:
        """Execute one scheduled pass (``Plan.items``): prefix items are written into their states (None each),
        targets items give (C, K) float32 scores. On CUDA each item replays the CUDA graph of its shape
        bucket (``graphs.py``), else ``forward`` runs them all at once."""
        if self.graphs is not None:
            try:
                return self.graphs.run_pass(items)
            except GraphCaptureError as err:  # items are idempotent: the eager pass below redoes them all
                log.warning("%s; serving without CUDA graphs", err)
                self.graphs = None
        return self.forward(items)

    @torch.no_grad()
    def forward(self, items: list[WorkItem]) -> list[Tensor | None]:
        """The eager pass of ``run``: linear layers on all items' tokens at once, one
        ``ops.cached_hstu_attention`` call per block over every item's cache (``serve.attention``). The
        items' tokens go to the device in one copy, their scores come back in one (``staging.py``)."""
        enc: HSTUEncoder = self.model.encoder
        names, total = list(items[0].features), sum(it.size for it in items)
        counts = CachedPass.host_values(items)
        f = len(names) * total
        host = self._staging.take(f + len(counts))
        tokens = host[:f].reshape(len(names), total)
        spans, lo = [], 0
        for it in items:
            spans.append((lo, lo + it.size))
            for row, name in zip(tokens, names):
                row[lo : lo + it.size] = host_numpy(it.features[name])
            lo += it.size
        host[f : f + len(counts)] = counts
        staged = self._staging.upload(f + len(counts))
        feats = dict(zip(names, staged[:f].view(len(names), total)))
        x = self.model.prefix(feats)  # (T, d)
        for it, (a, b) in zip(items, spans):
            if it.kind == "prefix":
                s, e = it.start, it.start + it.size
                it.state.timestamps[s:e] = feats["timestamps"][a:b]
                it.state.tokens[s:e] = it.token_identities()
        cached = CachedPass(items, feats["timestamps"], self.time_bias, 1.0 / enc.cfg.max_seq_len, enc.cfg.kernel,
                            staged[f:])  # fmt: skip
        embedded, x = x, enc.encode(x, cached.attend)
        rows = sum(it.size for it in items if it.kind == "targets")
        scores, out_spans, row = None, [], 0
        for it, (a, b) in zip(items, spans):
            if it.kind == "prefix":
                it.state.length = it.start + it.size
                out_spans.append(None)
                continue
            out = self.model.postfix(self.model.postfix_input(x[a:b], embedded[a:b]))
            if scores is None:
                scores = self._results.reserve(rows, tuple(out.shape[1:]))
            scores[row : row + it.size].copy_(out)
            out_spans.append((row, row + it.size))
            row += it.size
        if scores is None:
            return [None] * len(items)
        host_scores = self._results.download(scores)
        return [None if span is None else host_scores[span[0] : span[1]] for span in out_spans]

    # ------------------------------------------------------------------------------- baselines

    @torch.no_grad()
    def rank_naive(self, req: EncodedRequest, sequences_per_batch: int = 8) -> Tensor:
        """(C, K) scores the naive way: the training forward pass on one [history, candidate] sequence
        per candidate (the history recomputed C times). For benchmarks and tests."""
        outs = []
        for lo in range(0, req.num_candidates, sequences_per_batch):
            part = EncodedRequest(**{**req.__dict__, "candidates": req.candidates[lo : lo + sequences_per_batch]})
            batch = training_batch(part, self.action_encoding, 0, per_candidate=True).to(self.device)
            outs.append(self.model(batch).float().cpu())
        return torch.cat(outs)

    # ------------------------------------------------------------------------------- checks

    @torch.no_grad()
    def probe(self) -> None:
        """Score one synthetic request (every code 1, no features) with the eager pass (no pool, no CUDA graph
        capture); ``ValueError`` unless the scores are finite and have one column per task."""
        one = torch.ones(2, dtype=torch.int64)
        req = EncodedRequest("__probe__", torch.zeros(self.num_contextual, dtype=torch.int64), one, one * 0,
                             torch.arange(2), one[:1], 2)  # fmt: skip
        try:
            if self.cached:  # from a state of its own: the probe never touches the pool
                seq = prefill_alone(self, req, CacheManager.for_engine(self).new_state(self.num_contextual, 0),
                                    execute=self.forward)  # fmt: skip
                scores = self.forward([WorkItem(seq.state, candidate_tokens(req), "targets")])[0]
            else:
                scores = self.rank_encoded(req).scores
        except Exception as err:  # noqa: BLE001 - any failure means the model cannot serve
            raise ValueError(f"model {self.version} fails on a probe request: {type(err).__name__}: {err}") from err
        if scores.shape != (1, max(len(self.tasks), 1)) or not bool(torch.isfinite(scores).all()):
            raise ValueError(f"model {self.version} gives scores {scores.tolist()} on a probe request "
                             f"(expected {len(self.tasks)} finite values)")  # fmt: skip


def _encoding_key(vocab: dict | None, manifest: dict, max_events: int, config: EngineConfig) -> str:
    """A digest of everything ``encode`` depends on: requests encoded by one engine may run on another only
    when their keys are equal (a reload that changes the vocabulary must not run old requests)."""
    parts = [vocab, manifest.get("user_features"), manifest.get("num_contextual"), manifest.get("action_encoding"),
             max_events, config.unknown_ids, config.unknown_feature_values, config.max_candidates,
             config.max_history_events]  # fmt: skip
    return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


__all__ = ["EngineConfig", "PrefixState", "RankEngine", "RankResult", "WorkItem", "token_identity"]
