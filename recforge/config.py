"""Typed run configuration: dataclasses, YAML files, ``key=value`` overrides.

Every problem found (unknown key, wrong type, invalid value) is collected and
reported together in one ``ConfigError``.

Example:
    >>> cfg = load_config("configs/ml1m-hstu.yaml", ["train.epochs=10", "model.num_blocks=4"])
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from recforge.io import atomic_file


# ---------------------------------------------- the run's settings: one dataclass per YAML section


class ConfigError(ValueError):
    """One or more configuration problems, all listed in the message."""


@dataclass
class DataConfig:
    path: str = ""  # canonical dataset directory (see `recforge data prepare`)
    protocol: str = "paper"  # paper | clean (see recforge.data.sequences)
    max_seq_len: int = 200  # most recent items a model sees
    train_windows: str = "last"  # last: each user's most recent window; all: also older history in windows


@dataclass
class RankingConfig:
    """Ranking recipe data: tasks, action signals, contextual features, aggregation, splits."""

    tasks: list[str] = field(default_factory=list)  # e.g. ["like:rating>=4", "rating:rating"] (see data.ranking.Task)
    task_weights: list[float] = field(default_factory=list)  # loss weight per task (empty: all 1)
    action_column: str = ""  # events column used as the history's action signal ("" for none)
    action_encoding: str = "sum"  # sum: item + action embedding per token | interleave: item token, action token
    user_features: list[str] = field(default_factory=list)  # contextual tokens: user_id and/or users.parquet columns
    item_features: list[str] = field(default_factory=list)  # items.parquet columns summed into item tokens
    period_seconds: int = 86400  # one sample per user per period holds all that period's impressions
    max_targets: int = 64  # impressions per sample at most (longer periods are split)
    valid_fraction: float = 0.1  # per user, of the latest events before the test ones
    test_fraction: float = 0.1  # per user, of the latest events
    listwise_weight: float = 0.0  # weight of the listwise softmax loss on the first binary task (0: off)
    refit: bool = False  # train on train + valid impressions (epochs fixed beforehand) and evaluate the last checkpoint


@dataclass
class ModelConfig:
    kind: str = "hstu"  # hstu | sasrec (retrieval) | hstu | dlrm | item (ranking; item = non-personalised baseline)
    dim: int = 50  # embedding / model width
    num_blocks: int = 2
    num_heads: int = 1
    dqk: int = 50  # HSTU per-head query/key width
    dv: int = 50  # HSTU per-head value width
    ffn_dim: int = 50  # SASRec feed-forward width
    dropout: float = 0.2
    num_time_buckets: int = 128  # HSTU time bias (0: none); ignored when the data has no timestamps
    relative_bias: bool = True  # HSTU learned bias per causal distance (the paper's rab); false: none (faster attention)
    kernel: str = "auto"  # attention backend: auto | pytorch | triton
    head: str = "mlp"  # ranking task heads: mlp | mmoe | ple
    head_hidden: int = 128  # ranking head / expert width
    num_experts: int = 4  # MMoE experts; PLE shared experts
    attn_norm: str = "layernorm"  # HSTU attention output: layernorm (paper) | visible_mean (no LayerNorm, divided by the keys each query sees)
    context_cross: bool = False  # ranking: after the encoder, a DLRM-style target x user-feature cross (ContextPool) on its outputs
    item_tower: float = 0.0  # ranking: > 0 adds a candidate-only tower with its own loss; score = (1 - w) * main + w * tower
    target_attention: str = "none"  # ranking: none | din (DIN-style pooling of each candidate's visible history, added to its encoder output)
    # HSTU activation checkpointing per block: true (all blocks) | false | N (the first N); each
    # checkpointed block keeps only its (T, d) input and recomputes the rest in backward
    checkpoint_blocks: bool | int = False
    # HSTU residual stream under mixed precision (train.precision bfloat16/float16): auto (compute under bfloat16,
    # float32 under float16, whose range an unbounded stream can leave) | float32 (autocast's: each block's output is
    # added to a float32 stream) | compute (the stream in the autocast dtype: half the bytes for every LayerNorm,
    # residual add and their gradients; LayerNorm statistics stay float32). No effect in float32 runs.
    residual_dtype: str = "auto"
    embedding: str = "static"  # item IDs (ranking: also user features): static (nn.Embedding) | dynamic (recforge.sparse tables, see sparse:)


@dataclass
class SparseConfig:
    """The dynamic tables (``model.embedding=dynamic``): their own sparse optimizer and policies."""

    optimizer: str = "adam"  # sgd | adagrad | rowwise_adagrad | adam (lazy) | adamw
    lr: float = 1e-3
    capacity: int = 0  # rows at start (0: catalogue size + 1); the table grows up to max_rows
    max_rows: int = 0  # 0: no limit
    cache_rows: int = 0  # > 0: table in host memory, this many rows cached on the device
    admission: str = "always"  # always | count | probability
    admission_threshold: float = 1.0  # count: occurrences; probability: chance per occurrence
    eviction: str = "none"  # none | lru | lfu | ttl | l2 | time_freq
    eviction_every: int = 0  # steps between scheduled eviction passes (0: only on capacity pressure)
    ttl_steps: int = 0  # lru/ttl: rows unseen this many steps are evicted by a scheduled pass


@dataclass
class LossConfig:
    negatives: str = "per_position"  # per_position | shared | full (softmax over the whole catalogue)
    num_negatives: int = 128  # uniformly sampled negatives (per_position / shared)
    in_batch_negatives: bool = False  # also use the batch's other target items as negatives
    temperature: float = 0.05
    # positions per loss chunk: larger batches compute the loss this many positions at a time, so no
    # (positions x negatives) logits are held (same value and gradients; 0: never chunk). A dynamic item
    # table (sparse.*) then counts each distinct sampled negative once per batch, not once per draw
    chunk_size: int = 8192
    # float16: on CUDA the logits of shared / in-batch / whole-catalogue negatives come from float16-input matmuls
    # with float32 sums and outputs (TF32's 10-bit mantissa at twice its throughput; recforge.ops.half_matmul), their
    # gradients from bfloat16-input ones (a bf16 backward's precision). float32: float32 matmuls (TF32 on CUDA).
    # CPU always float32
    matmul: str = "float32"


@dataclass
class OptimConfig:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    weight_decay: float = 0.0
    grad_clip: float = 0.0  # max gradient norm; 0 disables clipping
    schedule: str = "constant"  # learning rate over the run: constant | cosine | linear (decay after warmup)
    warmup_steps: int = 0  # linear warm-up from 0 to lr over this many steps
    min_lr_fraction: float = 0.0  # cosine / linear decay ends at lr * min_lr_fraction


@dataclass
class TrainConfig:
    epochs: int = 100
    batch_size: int = 128  # sequences per step
    seed: int = 42
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # float32 | bfloat16: bfloat16 runs each training step's forward and loss under torch.autocast
    # (matmuls and attention in bf16, e.g. the Triton kernels' tensor-core path); weights, gradients
    # and optimizer state stay float32, and evaluation runs in float32
    precision: str = "float32"
    eval_every: int = 5  # epochs between evaluations (0: only at the end)
    checkpoint_every: int = 0  # steps between checkpoints (0: at each epoch end)
    keep_checkpoints: int = 2  # most recent checkpoints kept (plus the best)
    max_steps: int = 0  # stop after this many steps (0: no limit)
    max_minutes: float = 0.0  # stop after this much wall time (0: no limit)
    log_every: int = 20  # steps between TensorBoard scalars
    log_seconds: float = 30.0  # without a terminal (CI, nohup, a cluster job's log): seconds between progress lines
    output_dir: str = "runs/{name}"
    threads: int = 0  # torch CPU threads (0: PyTorch's default)
    loader: str = "memory"  # memory: batches built in memory each step | pipeline: streamed from Parquet by the sample engine
    loader_workers: int = 2  # pipeline loader: Parquet reader threads
    token_budget: int = 0  # pipeline loader: 0 = batch_size rows per batch; > 0 = about this many tokens (token-weighted loss)
    # none | default | max-autotune-no-cudagraphs: torch.compile the step's forward + loss (backward through
    # AOTAutograd; the Triton attention stays one custom op per block); CUDA only (on CPU it is off, logged once)
    compile: str = "none"
    # capture the whole step (forward, loss, backward, clipping, AdamW) as one CUDA graph per shape bucket and
    # replay it: no per-kernel launch cost (small models are host-bound). Each batch is padded to a bucket; the
    # padding changes no gradient nor the logged loss. Retrieval, CUDA, one process, dist.grad_accum=1, static tables;
    # elsewhere off (logged once). Combines with train.compile (its kernels are captured). docs/training_speed.md
    cuda_graphs: bool = False
    graph_bucket_ratio: float = 1.125  # buckets: each about this times the last (tokens and sequences padded <= ~12.5%)
    peak_tflops: float = 0.0  # the device's dense matmul peak for MFU in the log (0: from recforge.train.flops' table)


@dataclass
class DistConfig:
    """Multi-process training under ``torchrun``. A plain ``recforge train`` uses only ``pipeline`` (its
    input prefetch: the next step's batches are built and copied while this one computes; results are
    identical either way) and ``grad_accum``; the other fields need a process group.

    ``train.batch_size`` and ``train.token_budget`` stay *global* (per optimizer step): each rank
    trains on 1/world_size of them per micro-batch, split again into ``grad_accum`` micro-batches,
    so N ranks follow the loss curve of one process on the same data.
    """

    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    dense: str = "ddp"  # ddp (replicated dense weights, gradients all-reduced) | fsdp2 (fully_shard: sharded weights and optimizer state)
    grad_accum: int = 1  # micro-batches per optimizer step (DDP syncs gradients only on the last)
    pipeline: bool = True  # overlap the next batch's fetch + build + H2D copy (and, sharded, its ID all-to-all) with this step
    timeout_minutes: float = 10.0  # collectives wait this long for a missing rank before the run fails


@dataclass
class EvalConfig:
    ks: list[int] = field(default_factory=lambda: [1, 5, 10, 50, 200])
    batch_size: int = 1024  # users per evaluation batch
    select_metric: str = "ndcg@10"  # validation metric choosing the best checkpoint (clean protocol)


@dataclass
class GenerativeConfig:
    """Generative retrieval over semantic IDs (``recipe: generative``, ``model.kind: tiger | sid_hstu``)."""

    sids: str = ""  # SID directory from `recforge sid fit` ("" = DATA_PATH/sids)
    decoder_blocks: int = 4  # tiger: decoder layers (model.num_blocks counts the encoder's); unused by sid_hstu
    beam: int = 20  # beam width at evaluation: SIDs generated per user
    exclude_seen_in_search: bool = True  # the user's other history items are excluded during the search, not only after
    trie: str = "dense"  # valid-SID trie layout: dense (one gather per step) | csr (edges only, for huge catalogues)
    # tiger: also add a learned embedding of each history item's ID to its SID tokens in the encoder (hybrid
    # ID + SID input); items without a row (coded after training) read a zero row. The decoder still generates SIDs
    item_id_embedding: bool = False
    # tiger: also train a dense head (LIGER): a user vector from the encoder and an item table over the training
    # catalogue, with dense_weight * full-catalogue softmax cross-entropy (loss.temperature) added to the SID loss
    dense_head: bool = False
    dense_weight: float = 1.0  # weight of the dense head's loss
    # evaluation and /v1/retrieve: the beam's items are re-sorted by log p(SID) + rescore * cos(user, item) /
    # loss.temperature (needs dense_head; items without a dense row keep their SID score). 0: generation only
    rescore: float = 0.0
    # evaluation and /v1/retrieve: the dense head's top K items over the catalogue (allowed, with a SID) join the
    # beam's items, scored log p(SID) (teacher forced) + rescore * cos / loss.temperature, so items beyond the beam
    # can be found (needs dense_head; with rescore=0 the SID score ranks them all). 0: the beam's items only
    dense_candidates: int = 0
    # tiger: initialise the item tables (dense head, item-ID embedding) from this retrieval run's item embeddings
    # (its best checkpoint (latest for a paper-protocol run), rows matched by raw item ID; the run must be trained on data.path with at least this
    # protocol's held-out items). "": random init. Its table's width must equal item_dim (or model.dim)
    dense_init: str = ""
    dense_freeze: bool = False  # keep the loaded item tables fixed (needs dense_init): only the user tower learns
    # width of the item tables (0: model.dim); set it to the dense_init run's model.dim when that differs: the dense
    # user tower then projects the encoder's output to it, and a learned projection maps item-ID rows to model.dim
    item_dim: int = 0
    # > 0: the dense_init run also becomes a frozen teacher of the dense head: each training step adds dense_distill *
    # KL(teacher || dense head) over the whole catalogue (the run's last-token user vector . its items / its
    # loss.temperature). Needs dense_init and dense_head. 0: off
    dense_distill: float = 0.0
    # evaluation and /v1/retrieve: a trained ID-retrieval run (recipe: retrieval, e.g. SASRec) on the same dataset
    # scores items for rescore and dense_candidates in place of the dense head: its user vector for the history (its
    # data.max_seq_len most recent items) . its L2-normalised item row / its loss.temperature (best checkpoint; the
    # catalogue and leakage checked as for dense_init). Works with or without dense_head (tiger or sid_hstu).
    # "": the dense head scores (if any). Settable at training time or as a `recforge eval` override
    dense_scorer: str = ""


@dataclass
class RunConfig:
    recipe: str = "retrieval"  # retrieval | ranking | generative
    name: str = "run"
    data: DataConfig = field(default_factory=DataConfig)
    ranking: RankingConfig = field(default_factory=RankingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    generative: GenerativeConfig = field(default_factory=GenerativeConfig)

    @property
    def eval_ks(self) -> list[int]:
        """``eval.ks`` plus the cut-off of ``eval.select_metric``, so model selection always has it."""
        extra = [int(self.eval.select_metric.split("@")[1])] if "@" in self.eval.select_metric else []
        return sorted(set(self.eval.ks) | set(extra))

    @property
    def run_dir(self) -> Path:
        return Path(self.train.output_dir.format(name=self.name))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------- value rules: choices, positives, zero-allowed keys, intervals


CHOICES = {
    "recipe": ("retrieval", "ranking", "generative"),
    "ranking.action_encoding": ("sum", "interleave"),
    "model.head": ("mlp", "mmoe", "ple"),
    "data.protocol": ("paper", "clean"),
    "data.train_windows": ("last", "all"),
    "model.kind": ("hstu", "sasrec", "dlrm", "item", "tiger", "sid_hstu"),
    "generative.trie": ("dense", "csr"),
    "model.kernel": ("auto", "pytorch", "triton"),
    "optim.schedule": ("constant", "cosine", "linear"),
    "loss.negatives": ("per_position", "shared", "full"),
    "loss.matmul": ("float32", "float16"),
    "model.embedding": ("static", "dynamic"),
    "model.target_attention": ("none", "din"),
    "model.attn_norm": ("layernorm", "visible_mean"),
    "model.residual_dtype": ("auto", "float32", "compute"),
    "train.loader": ("memory", "pipeline"),
    "train.precision": ("float32", "bfloat16"),
    "train.compile": ("none", "default", "max-autotune-no-cudagraphs"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "dist.dense": ("ddp", "fsdp2"),
    "sparse.optimizer": ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw"),
    "sparse.admission": ("always", "count", "probability"),
    "sparse.eviction": ("none", "lru", "lfu", "ttl", "l2", "time_freq"),
}
POSITIVE = (
    "data.max_seq_len", "model.dim", "model.num_blocks", "model.num_heads", "model.dqk", "model.dv",
    "model.ffn_dim", "model.head_hidden", "model.num_experts", "ranking.period_seconds",
    "ranking.max_targets", "train.epochs", "train.batch_size", "eval.batch_size", "train.keep_checkpoints",
    "train.log_every", "train.log_seconds", "dist.grad_accum", "dist.timeout_minutes", "optim.lr", "sparse.lr",
    "loss.temperature", "generative.decoder_blocks", "generative.beam", "generative.dense_weight",
)  # fmt: skip
# Keys that may be 0 (the comment says what 0 means), never negative.
NON_NEGATIVE = {
    "optim.weight_decay": "", "optim.grad_clip": " (0 turns clipping off)", "optim.warmup_steps": " (0: no warm-up)",
    "train.seed": "", "train.eval_every": " (0: evaluate only at the end)",
    "train.checkpoint_every": " (0: a checkpoint at each epoch's end)", "train.max_steps": " (0: no limit)",
    "train.max_minutes": " (0: no limit)", "train.threads": " (0: PyTorch's default)",
    "train.peak_tflops": " (0: the device's peak from recforge.train.flops)", "loss.chunk_size": " (0: never chunk)",
    "model.num_time_buckets": " (0: no time bias)",
    "train.token_budget": " (0: train.batch_size rows per batch)", "ranking.listwise_weight": " (0: off)",
    "sparse.capacity": " (0: catalogue size + 1)", "sparse.max_rows": " (0: no limit)", "sparse.cache_rows": " (0: no cache)",
    "sparse.eviction_every": " (0: only on capacity pressure)", "sparse.ttl_steps": "",
    "generative.rescore": " (0: generation only)",
    "generative.dense_candidates": " (0: the beam's items only)", "generative.item_dim": " (0: model.dim)",
    "generative.dense_distill": " (0: off)",
}  # fmt: skip
# Keys bounded on both sides: (low, high, high included).
INTERVALS = {
    "optim.min_lr_fraction": (0.0, 1.0, True), "model.dropout": (0.0, 1.0, False), "model.item_tower": (0.0, 1.0, False),
    "train.graph_bucket_ratio": (1.0, 4.0, True),
}  # fmt: skip


# -------------------------------------------------- building a RunConfig from YAML and checking it


_INVALID = object()  # marks a value that failed its type check: the field keeps its default


def _check_type(value: Any, hint: Any, where: str, problems: list[str]) -> Any:
    origin = typing.get_origin(hint)
    if origin is list:
        (inner,) = typing.get_args(hint)
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {value!r}")
            return _INVALID
        items = [_check_type(v, inner, f"{where}[{i}]", problems) for i, v in enumerate(value)]
        return _INVALID if any(v is _INVALID for v in items) else items
    if origin in (typing.Union, types.UnionType):
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool) and (not isinstance(value, hint) or (hint is int and isinstance(value, bool))):
        problems.append(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
        return _INVALID
    return value


def _build(cls: type, raw: dict, prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        where = f"{prefix}{key}"
        if key not in hints:
            known = ", ".join(hints)
            problems.append(f"{where}: unknown key (known: {known})")
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                problems.append(f"{where}: expected a mapping, got {value!r}")
                continue
            kwargs[key] = _build(hint, value, f"{where}.", problems)
        else:
            checked = _check_type(value, hint, where, problems)
            if checked is not _INVALID:
                kwargs[key] = checked
    return cls(**kwargs)


def _lookup(cfg: RunConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: RunConfig) -> list[str]:
    """Return every value-level problem of ``cfg`` (empty when valid)."""
    problems = []
    for key, allowed in CHOICES.items():
        if _lookup(cfg, key) not in allowed:
            problems.append(f"{key}: {_lookup(cfg, key)!r} is not one of {allowed}")
    problems += _validate_ranges(cfg)
    if cfg.loss.negatives != "full" and cfg.loss.num_negatives <= 0:
        problems.append("loss.num_negatives: must be > 0 unless loss.negatives=full")
    if len(cfg.optim.betas) != 2:
        problems.append(f"optim.betas: expected two numbers, got {cfg.optim.betas}")
    elif not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        problems.append(f"optim.betas: each must be in [0, 1) (AdamW's moment decay rates), got {cfg.optim.betas}")
    if cfg.ranking.task_weights and (any(w < 0 for w in cfg.ranking.task_weights) or not any(cfg.ranking.task_weights)):
        problems.append(f"ranking.task_weights: must be >= 0 and not all 0, got {cfg.ranking.task_weights}")
    if cfg.sparse.admission == "probability" and not 0.0 < cfg.sparse.admission_threshold <= 1.0:
        problems.append(f"sparse.admission_threshold: a probability (sparse.admission=probability) must be in (0, 1], "
                        f"got {cfg.sparse.admission_threshold}")  # fmt: skip
    elif cfg.sparse.admission == "count" and cfg.sparse.admission_threshold < 1:
        problems.append(f"sparse.admission_threshold: an occurrence count (sparse.admission=count) must be >= 1, "
                        f"got {cfg.sparse.admission_threshold}")  # fmt: skip
    if 0 < cfg.sparse.max_rows < cfg.sparse.capacity:
        problems.append(f"sparse.max_rows ({cfg.sparse.max_rows}) must be >= sparse.capacity ({cfg.sparse.capacity}) "
                        "or 0 (no limit)")  # fmt: skip
    if cfg.optim.schedule != "constant" and cfg.train.max_steps and cfg.optim.warmup_steps >= cfg.train.max_steps:
        problems.append(f"optim.warmup_steps ({cfg.optim.warmup_steps}) must be < train.max_steps "
                        f"({cfg.train.max_steps}) for the {cfg.optim.schedule} schedule to decay")  # fmt: skip
    cb = cfg.model.checkpoint_blocks
    if not isinstance(cb, int) or (not isinstance(cb, bool) and cb < 0):
        problems.append(f"model.checkpoint_blocks: expected true, false or a number of blocks >= 0, got {cb!r}")
    if not cfg.model.relative_bias and cfg.model.kind not in ("hstu", "sid_hstu"):
        problems.append(f"model.relative_bias=false: the switch of the HSTU blocks (model.kind=hstu or sid_hstu), not "
                        f"of model.kind={cfg.model.kind}; remove it")  # fmt: skip
    if cfg.model.kind == "sasrec" and cfg.model.dim % cfg.model.num_heads:
        problems.append(f"model.dim {cfg.model.dim} must be divisible by model.num_heads {cfg.model.num_heads} for SASRec")
    if cfg.recipe == "ranking":
        problems += _validate_ranking(cfg)
    elif not re.fullmatch(r"(hr|ndcg)@[1-9][0-9]*|mrr", cfg.eval.select_metric):
        problems.append(f"eval.select_metric: {cfg.eval.select_metric!r} is not a metric; use hr@K, ndcg@K or mrr")
    if cfg.recipe == "generative":
        problems += _validate_generative(cfg)
    elif cfg.model.kind in ("tiger", "sid_hstu"):
        problems.append(f"model.kind: {cfg.model.kind} is a semantic-ID model; use recipe: generative")
    if cfg.recipe == "retrieval" and cfg.model.kind in ("dlrm", "item"):
        problems.append(f"model.kind: {cfg.model.kind} is a ranking baseline; use recipe: ranking (or model.kind hstu/sasrec)")
    if any(k <= 0 for k in cfg.eval.ks):
        problems.append(f"eval.ks: cut-offs must be > 0, got {cfg.eval.ks}")
    if cfg.train.loader_workers < 1:
        problems.append(f"train.loader_workers: must be >= 1, got {cfg.train.loader_workers}")
    if cfg.train.loader == "memory" and cfg.train.token_budget:
        problems.append(f"train.token_budget={cfg.train.token_budget} needs train.loader=pipeline (or set it to 0)")
    if not cfg.data.path:
        problems.append("data.path: required (a directory written by `recforge data prepare`)")
    return problems + _validate_dist(cfg)


def _numeric_fields(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every int/float field and float list under ``obj``, dataclasses walked."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _numeric_fields(value, f"{prefix}{f.name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{f.name}", value


def _validate_ranges(cfg: RunConfig) -> list[str]:
    """Every numeric key finite and in its range (``POSITIVE``, ``NON_NEGATIVE``, ``INTERVALS``)."""
    problems = []
    values = dict(_numeric_fields(cfg))
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{key}: must be a finite number, got {value}")
        elif key in POSITIVE and value <= 0:
            problems.append(f"{key}: must be > 0, got {value}")
        elif key in NON_NEGATIVE and value < 0:
            problems.append(f"{key}: must be >= 0{NON_NEGATIVE[key]}, got {value}")
        elif key in INTERVALS:
            low, high, closed = INTERVALS[key]
            if not (low <= value <= high if closed else low <= value < high):
                problems.append(f"{key}: must be in [{low:g}, {high:g}{']' if closed else ')'}, got {value}")
    for key, value in (("optim.betas", cfg.optim.betas), ("ranking.task_weights", cfg.ranking.task_weights)):
        if any(isinstance(v, float) and not math.isfinite(v) for v in value):
            problems.append(f"{key}: must be finite numbers, got {value}")
    return problems


def _validate_dist(cfg: RunConfig) -> list[str]:
    """The global batch must split into world size x ``dist.grad_accum`` micro-batches (checked again, with
    the process group's world size, by ``train.distributed.split_budget``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; 1 for a plain `recforge train`
    parts, t = world * max(cfg.dist.grad_accum, 1), cfg.train
    if t.loader != "pipeline":
        return []  # the memory loader splits each global batch as evenly as it can
    if t.token_budget and t.token_budget // parts < 1:
        return [f"train.token_budget={t.token_budget} is less than one token per micro-batch over {world} rank(s) x "
                f"dist.grad_accum={cfg.dist.grad_accum}; raise it"]  # fmt: skip
    if not t.token_budget and t.batch_size % parts:
        return [f"train.batch_size={t.batch_size} (global, per optimizer step) must divide evenly into {world} rank(s) x "
                f"dist.grad_accum={cfg.dist.grad_accum} micro-batches with train.loader=pipeline; use a multiple of {parts}"]  # fmt: skip
    return []


def _validate_ranking(cfg: RunConfig) -> list[str]:
    # late import: config must not pull in torch at import time
    from recforge.data.ranking import Task, fraction_check

    r, problems = cfg.ranking, []
    names = []
    for spec in r.tasks:
        try:
            names.append(Task.parse(spec))
        except ValueError as err:
            problems.append(f"ranking.tasks: {err}")
    if not r.tasks:
        problems.append("ranking.tasks: at least one task is needed, e.g. ['like:rating>=4']")
    if r.task_weights and len(r.task_weights) != len(r.tasks):
        problems.append(f"ranking.task_weights: {len(r.task_weights)} weights for {len(r.tasks)} tasks")
    try:
        fraction_check(r.valid_fraction, r.test_fraction)
    except ValueError as err:
        problems.append(f"ranking.valid_fraction, ranking.test_fraction: {err}")
    if cfg.model.kind == "sasrec":
        problems.append("model.kind: the ranking recipe supports hstu, dlrm and item")
    if cfg.model.kind == "hstu" and not cfg.model.relative_bias and cfg.model.num_time_buckets == 0:
        problems.append("model.relative_bias=false with model.num_time_buckets=0: the ranking HSTU has no absolute "
                        "positions, so it would see its history as an unordered set; keep one of the two biases")  # fmt: skip
    binary = [t.name for t in names if t.kind == "binary"]
    if r.listwise_weight and not binary:
        problems.append("ranking.listwise_weight: needs a binary task")
    if cfg.model.item_tower and (r.listwise_weight or cfg.train.token_budget):
        problems.append("model.item_tower: trains its towers with pointwise losses on fixed batches only; "
                        "set ranking.listwise_weight=0 and train.token_budget=0")  # fmt: skip
    m = re.fullmatch(r"(?P<task>[\w-]+)/(auc|gauc)", cfg.eval.select_metric)
    if m is None or (names and m.group("task") not in binary):
        problems.append(
            f"eval.select_metric: {cfg.eval.select_metric!r}; for ranking use TASK/auc or TASK/gauc with a binary task "
            f"({', '.join(binary) or 'none defined'})"
        )
    if r.max_targets + len(r.user_features) >= cfg.data.max_seq_len:
        problems.append(
            f"ranking.max_targets ({r.max_targets}) + contextual features ({len(r.user_features)}) must be < "
            f"data.max_seq_len ({cfg.data.max_seq_len}) to leave room for history"
        )
    return problems


def _validate_generative(cfg: RunConfig) -> list[str]:
    g, problems = cfg.generative, []
    if cfg.model.kind not in ("tiger", "sid_hstu"):
        problems.append(f"model.kind: the generative recipe supports tiger (encoder-decoder) and sid_hstu "
                        f"(decoder-only HSTU), got {cfg.model.kind!r}")
    if cfg.model.dim % cfg.model.num_heads:
        problems.append(f"model.dim {cfg.model.dim} must be divisible by model.num_heads {cfg.model.num_heads}")
    if g.item_id_embedding and cfg.model.kind != "tiger":
        problems.append(f"generative.item_id_embedding: only model.kind=tiger reads history item IDs (its encoder; "
                        f"in {cfg.model.kind} every SID token is also a target, so an item's ID would give away its "
                        "own digits); set generative.item_id_embedding=false or use model.kind=tiger")
    if g.dense_head and cfg.model.kind != "tiger":
        problems.append("generative.dense_head: only model.kind=tiger has a dense head (its encoder's user vector); "
                        "set generative.dense_head=false or use model.kind=tiger")
    if g.rescore and not (g.dense_head or g.dense_scorer):
        problems.append(f"generative.rescore={g.rescore} re-scores the beam's items with dense scores, but "
                        "generative.dense_head is off and generative.dense_scorer is empty; set "
                        "generative.dense_scorer=RETRIEVAL_RUN_DIR (a trained SASRec/HSTU run on this dataset), or "
                        "generative.dense_head=true (and train), or generative.rescore=0")  # fmt: skip
    if g.dense_candidates and not (g.dense_head or g.dense_scorer):
        problems.append(f"generative.dense_candidates={g.dense_candidates} adds dense top items to the beam's, but "
                        "generative.dense_head is off and generative.dense_scorer is empty; set "
                        "generative.dense_scorer=RETRIEVAL_RUN_DIR (a trained SASRec/HSTU run on this dataset), or "
                        "generative.dense_head=true (and train), or generative.dense_candidates=0")  # fmt: skip
    tables = g.item_id_embedding or g.dense_head
    for key, value in (("dense_init", g.dense_init), ("item_dim", g.item_dim)):
        if value and not tables:
            problems.append(f"generative.{key}={value} applies to the item tables, but generative.dense_head and "
                            "generative.item_id_embedding are off; turn one on, or unset it")  # fmt: skip
    if g.dense_freeze and not g.dense_init:
        problems.append("generative.dense_freeze keeps loaded item tables fixed, but generative.dense_init is empty "
                        "(they would stay random); set generative.dense_init=RETRIEVAL_RUN_DIR or dense_freeze=false")
    if g.dense_distill and not (g.dense_init and g.dense_head):
        problems.append(f"generative.dense_distill={g.dense_distill} distils the generative.dense_init run into the dense "
                        "head, but " + ("generative.dense_init is empty; set generative.dense_init=RETRIEVAL_RUN_DIR"
                        if not g.dense_init else "generative.dense_head is off; set generative.dense_head=true")
                        + " or generative.dense_distill=0")  # fmt: skip
    if cfg.eval_ks and max(cfg.eval_ks) > g.beam + g.dense_candidates:
        problems.append(f"eval.ks / eval.select_metric go up to {max(cfg.eval_ks)} but generative.beam is {g.beam}"
                        f"{f' (+ {g.dense_candidates} dense candidates)' if g.dense_candidates else ''}: a beam yields "
                        "one SID each, so larger cut-offs mostly count misses; raise generative.beam or drop them")
    if cfg.train.loader != "memory" or cfg.model.embedding != "static":
        problems.append("the generative recipe needs train.loader=memory and model.embedding=static")
    return problems


# ------------------------------------------------------------------- loading, overrides and saving


def parse_overrides(overrides: list[str], problems: list[str]) -> dict:
    """``["train.epochs=5", "model.kind=sasrec"]`` -> nested dict (values parsed as YAML scalars)."""
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r}: expected key=value, e.g. train.epochs=5")
            continue
        key, value = item.split("=", 1)
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r}: {part!r} was already given a value by another override")
                break
        else:
            node[parts[-1]] = yaml.safe_load(value) if value else ""
    return nested


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config_from_dict(raw: dict, overrides: list[str] | None = None, source: str = "config") -> RunConfig:
    """Build and validate a ``RunConfig``; raise ``ConfigError`` listing all problems."""
    problems: list[str] = []
    merged = _merge(raw or {}, parse_overrides(overrides or [], problems))
    cfg = _build(RunConfig, merged, "", problems)  # invalid fields keep their defaults...
    problems += validate(cfg)  # ...so value checks run too and everything is reported at once
    if problems:
        raise ConfigError(f"{source}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config file, apply ``key=value`` overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (see configs/ for examples)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections (data:, model:, ...)")
    return config_from_dict(raw, overrides, str(path))


def save_config(cfg: RunConfig, path: Path) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
