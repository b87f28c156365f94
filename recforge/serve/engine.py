"""The ranking engine: a trained run's prefix/HSTU/postfix slices, scoring C candidates after an
L-event history in O(L + C) token work instead of O(L * C).

The history (contextual + history tokens, the *prefix*) runs through the HSTU blocks once; each
block's keys and values of the prefix are kept in a ``PrefixState``. Candidates then run
through the blocks on their own: at each block a candidate attends to the cached keys/values it
may see (contextual tokens, history events strictly before its time) and to itself, never to
other candidates, exactly as the training mask says. A long prefix is computed in chunks of
``prefill_chunk`` tokens; a cached prefix is extended with only its new tokens.

Example:
    >>> engine = RankEngine.from_run("runs/ranking-taobao-hstu")
    >>> result = engine.rank("u1", History(items=[5, 9], timestamps=[100, 200], actions=["pv", "cart"]),
    ...                      candidates=[3, 7, 11], timestamp=300)
    >>> result.scores                        # (3, num_tasks) raw head outputs (logits for binary tasks)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recforge.models.hstu import HSTUEncoder
from recforge.ops.dispatch import resolve_device
from recforge.models.ranking import RankingModel, load_slices
from recforge.serve.attention import CachedPass
from recforge.serve.graphs import GraphCaptureError, GraphRunner
from recforge.serve.layout import (
    EncodedRequest,
    History,
    Vocab,
    candidate_tokens,
    encode_request,
    prefix_tokens,
    training_batch,
)
from recforge.serve.model_dir import model_dir_of, model_version, read_vocab, stage_model, swap_slices
from recforge.serve.state import PrefixState, WorkItem, copy_state, token_identity

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Serving limits and numerics."""

    device: str = "cpu"  # cpu | cuda | auto (cuda when available)
    dtype: str = "float32"  # float32 | bfloat16 | float16 (weights and activations; scores come back float32)
    prefill_chunk: int = 1024  # prefix tokens computed per step; bounds attention memory to chunk x prefix
    max_candidates: int = 2000  # a request with more candidates is rejected
    max_history_events: int = 100_000  # a request with more events is rejected; the model sees the latest that fit
    unknown_ids: str = "error"  # items and actions outside the vocabulary: error (422) | zero (the "none" embedding)
    unknown_feature_values: str = "zero"  # user feature values never seen in training (a new user_id): zero | error
    cuda_graphs: int = 32  # on CUDA: replay passes as CUDA graphs, keeping this many shape buckets (0 = eager)

    def validate(self) -> None:
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r}: expected one of {tuple(DTYPES)}")
        if self.device not in ("cpu", "auto") and not self.device.startswith("cuda"):
            problems.append(f"device={self.device!r}: expected cpu, cuda[:N] or auto")
        for name in ("unknown_ids", "unknown_feature_values"):
            if getattr(self, name) not in ("error", "zero"):
                problems.append(f"{name}={getattr(self, name)!r}: expected error or zero")
        for name in ("prefill_chunk", "max_candidates", "max_history_events"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cuda_graphs < 0:
            problems.append(f"cuda_graphs must be >= 0 (0 turns them off), got {self.cuda_graphs}")
        if problems:
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
        self.pool = None  # a KVCachePool (set by the server or the caller); kept across reload()
        self._configure(model.eval().to(self.device, self.dtype), manifest, vocab, version)

    def _configure(self, model: RankingModel, manifest: dict, vocab: dict | None, version: str) -> None:
        """Everything derived from the model and its manifest (run at start and by ``apply_reload``)."""
        self.model = model
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
        per_event = 2 if self.action_encoding == "interleave" else 1
        # a prefix of at most max_seq_len - 1 tokens leaves the candidates' position (the history end) in range
        self.max_events = max(0, (self.max_seq_len - 1 - self.num_contextual) // per_event)

    @classmethod
    def from_run(cls, run_dir: str | Path, config: EngineConfig | None = None) -> RankEngine:
        """Load ``RUN_DIR/model`` (or a model directory itself) written by ``save_slices``."""
        model_dir = model_dir_of(run_dir)
        model, manifest = load_slices(model_dir)
        vocab = read_vocab(model_dir)
        if vocab is None:
            log.warning("%s has no vocab.json: requests must carry model codes, not raw IDs", model_dir)
        return cls(model, manifest, vocab, config, version=model_version(model_dir))

    # ------------------------------------------------------------------------------- requests

    def encode(self, user: Any, history: History | dict, candidates: list[Any], *,
               user_features: dict[str, Any] | None = None, timestamp: int | None = None) -> EncodedRequest:  # fmt: skip
        """Validate a request and map it to model codes; raises ``RequestError`` saying what is wrong."""
        return encode_request(self.vocab, self.config, self.max_events, user, history, candidates,
                              user_features=user_features, timestamp=timestamp)  # fmt: skip

    def rank(self, user: Any, history: History | dict, candidates: list[Any], *,
             user_features: dict[str, Any] | None = None, timestamp: int | None = None,
             state: PrefixState | None = None) -> RankResult:  # fmt: skip
        """Score ``candidates`` for ``user`` after ``history``: one prefix pass, then every candidate
        attends to the cached history. ``state``: a cached prefix to extend (see ``prefix_state``)."""
        return self.rank_encoded(self.encode(user, history, candidates, user_features=user_features, timestamp=timestamp), state)

    @torch.no_grad()
    def rank_encoded(self, req: EncodedRequest, state: PrefixState | None = None) -> RankResult:
        t0 = time.perf_counter()
        if not self.cached:
            batch = training_batch(req, self.action_encoding, self.max_seq_len).to(self.device)
            scores = self.model(batch).float().cpu()
            return RankResult(scores, self.tasks, 0, batch.num_tokens - req.num_candidates, req.truncated,
                              model_version=self.version)  # fmt: skip
        tokens = prefix_tokens(req, self.action_encoding)
        pooled = state is None and self.pool is not None
        if state is None:
            state = self.acquire(req, tokens)
        reused = state.length
        state = self.prefix_state(req, tokens, state)
        if pooled:
            self.release(req, state, reused)
        t1 = time.perf_counter()
        scores = self.score(state, candidate_tokens(req))
        t2 = time.perf_counter()
        timings = {"prefill": (t1 - t0) * 1e3, "candidates": (t2 - t1) * 1e3}
        return RankResult(scores, self.tasks, reused, state.length - reused, req.truncated, timings, self.version)

    def acquire(self, req: EncodedRequest, tokens: dict[str, Tensor]) -> PrefixState:
        """A working state for ``req``'s prefix with room for all of it: the pool's cached prefix of
        ``req.user`` when it is a prefix of this request (``length`` tokens already computed), else
        an empty one. It records the model version and the pool entry's generation it started from."""
        total = tokens["item_ids"].numel()
        state = self.pool.get(req.user, total) if self.pool is not None else None
        if state is not None and not self.reusable(state, req, tokens):
            self.pool.mark_stale(req.user)
            state = None
        if state is None or state.capacity < total:
            fresh = self.new_state(req, total)
            if state is not None:
                copy_state(state, fresh)
            state = fresh
        state.version = self.version
        state.generation = self.pool.generation_of(req.user) if self.pool is not None else 0
        return state

    def release(self, req: EncodedRequest, state: PrefixState, reused: int) -> bool:
        """Write the request's prefix back to the pool (only the tokens computed after ``reused``); False
        when the pool refused it (a newer entry for the user, or another model version)."""
        self.pool.record(reused, state.length - reused)
        return self.pool.put(req.user, state, reused)

    # ------------------------------------------------------------------------------- compute

    def new_state(self, req: EncodedRequest, capacity: int) -> PrefixState:
        cfg = self.model.encoder.cfg
        state = PrefixState(cfg.num_blocks, capacity, cfg.num_heads, cfg.dqk, cfg.dv, req.context_ids.numel(),
                            self.dtype, self.device)  # fmt: skip
        state.version = self.version
        return state

    def reusable(self, state: PrefixState, req: EncodedRequest, tokens: dict[str, Tensor]) -> bool:
        """True when ``state`` is a prefix of this request's tokens (same contextual features and events).

        The request time does not matter: contextual tokens carry no time bias, so the history's
        keys and values are the same whenever the user returns."""
        n = state.length
        if n > tokens["item_ids"].numel() or state.num_contextual != req.context_ids.numel():
            return False
        return bool((state.tokens[:n] == token_identity(tokens)[:n]).all())

    def prefix_state(self, req: EncodedRequest, tokens: dict[str, Tensor], state: PrefixState | None = None) -> PrefixState:
        """Compute (or extend ``state`` to) the prefix of ``req``, in chunks of ``prefill_chunk`` tokens."""
        total = tokens["item_ids"].numel()
        if state is not None and not self.reusable(state, req, tokens):
            raise ValueError("prefix_state: the given state is not a prefix of this request (use reusable() first)")
        if state is None or state.capacity < total:
            fresh = self.new_state(req, total)
            if state is not None:
                copy_state(state, fresh)
            state = fresh
        for item in self.prefill_items(state, tokens):
            self.run([item])
        return state

    def prefill_items(self, state: PrefixState, tokens: dict[str, Tensor]) -> list[WorkItem]:
        """The chunks still to compute for ``state`` to cover ``tokens``."""
        total, chunk = tokens["item_ids"].numel(), self.config.prefill_chunk
        # contextual tokens attend to each other in both directions: they always share the first chunk
        bounds = [state.length] if state.length >= state.num_contextual else [0, max(state.num_contextual, chunk)]
        while bounds[-1] < total:
            bounds.append(bounds[-1] + chunk)
        bounds[-1] = min(bounds[-1], total)
        return [
            WorkItem(state, {k: v[s:e] for k, v in tokens.items()}, "prefix", s)
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s
        ]

    def score(self, state: PrefixState, candidates: dict[str, Tensor]) -> Tensor:
        """(C, K) float32 head outputs of the candidates after ``state``."""
        return self.run([WorkItem(state, candidates, "targets")])[0]

    @torch.no_grad()
    def run(self, items: list[WorkItem]) -> list[Tensor | None]:
        """One pass of several requests' work items through prefix -> blocks (-> postfix for targets).

        Prefix items are written into their states; returns (C, K) scores per targets item, None per
        prefix item. On CUDA each item replays the CUDA graph of its shape bucket (``graphs.py``);
        otherwise linear layers run on all items' tokens at once and attention is one
        ``ops.cached_hstu_attention`` call per block over every item's cache (``serve.attention``).
        """
        if self.graphs is not None:
            try:
                return [self.graphs.run(it) for it in items]
            except GraphCaptureError as err:  # items are idempotent: the eager pass below redoes them all
                log.warning("%s; serving without CUDA graphs", err)
                self.graphs = None
        enc: HSTUEncoder = self.model.encoder
        feats = {k: torch.cat([it.features[k] for it in items]).to(self.device) for k in items[0].features}
        x = self.model.prefix(feats)  # (T, d)
        spans, lo = [], 0
        for it in items:
            spans.append((lo, lo + it.size))
            lo += it.size
            if it.kind == "prefix":
                s, e = it.start, it.start + it.size
                it.state.timestamps[s:e] = it.features["timestamps"].to(self.device)
                it.state.tokens[s:e] = token_identity(it.features)
        cached = CachedPass(items, feats["timestamps"], self.time_bias, 1.0 / enc.cfg.max_seq_len, enc.cfg.kernel)
        embedded, x = x, enc.encode(x, cached.attend)
        results: list[Tensor | None] = []
        for it, (a, b) in zip(items, spans):
            if it.kind == "prefix":
                it.state.length = it.start + it.size
                results.append(None)
            else:
                results.append(self.model.postfix(self.model.postfix_input(x[a:b], embedded[a:b])).float().cpu())
        return results

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

    # ------------------------------------------------------------------------------- reload

    def stage_reload(self, run_dir: str | Path) -> RankEngine:
        """Load and check a newly exported run without touching this engine.

        Returns a host-side engine of the new model (CPU, this engine's dtype and limits, no pool,
        no CUDA graphs) on which a probe request was scored; raises ``ValueError`` saying what is
        wrong (missing or truncated files, a manifest that does not fit its slices, non-finite
        scores). ``apply_reload`` then swaps it in."""
        model, manifest, vocab, version = stage_model(run_dir, self.dtype)
        staged = RankEngine(model, manifest, vocab, replace(self.config, device="cpu", cuda_graphs=0), version)
        staged.probe()
        return staged

    def probe(self) -> None:
        """Score one synthetic request (every code 1, no features); ``ValueError`` unless the scores are finite
        and have one column per task."""
        one = torch.ones(2, dtype=torch.int64)
        req = EncodedRequest("__probe__", torch.zeros(self.num_contextual, dtype=torch.int64), one, one * 0,
                             torch.arange(2), one[:1], 2)  # fmt: skip
        try:
            scores = self.rank_encoded(req).scores
        except Exception as err:  # noqa: BLE001 - any failure means the model cannot serve
            raise ValueError(f"model {self.version} fails on a probe request: {type(err).__name__}: {err}") from err
        if scores.shape != (1, max(len(self.tasks), 1)) or not bool(torch.isfinite(scores).all()):
            raise ValueError(f"model {self.version} gives scores {scores.tolist()} on a probe request "
                             f"(expected {len(self.tasks)} finite values)")  # fmt: skip

    def apply_reload(self, staged: RankEngine) -> None:
        """Make ``staged`` (from ``stage_reload``) the live model: weights moved slice by slice (the device
        never holds two whole models), CUDA graphs recaptured, every KV-cache entry invalidated (the
        pool is rebuilt when the new encoder's shapes differ). The caller makes sure no pass runs."""
        model = staged.model if self.device.type == "cpu" else swap_slices(self.model, staged.model, self.device)
        self._configure(model, staged.manifest, staged.vocab_json, staged.version)
        if self.pool is None:
            return
        cfg = self.model.encoder.cfg if self.cached else None
        shape = (cfg.num_blocks, self.pool.config.block_size, cfg.num_heads, cfg.dqk) if cfg else None
        if shape is not None and tuple(self.pool.keys.shape[1:]) == shape and self.pool.keys.dtype == self.dtype:
            self.pool.invalidate(self.version)
        else:
            from recforge.serve.kv_pool import KVCachePool

            config, self.pool = self.pool.config, None  # free the old pages before allocating new ones
            self.pool = KVCachePool.for_engine(self, config) if self.cached else None

    def reload(self, run_dir: str | Path) -> None:
        """``apply_reload(stage_reload(run_dir))``: a failure leaves the live model untouched."""
        self.apply_reload(self.stage_reload(run_dir))


__all__ = ["EngineConfig", "PrefixState", "RankEngine", "RankResult", "WorkItem", "model_version", "token_identity"]
