"""Builders: turn a ``ModelConfig`` into flat constructor arguments (retrieval and ranking models)."""

from __future__ import annotations

from recforge.config import ModelConfig, SparseConfig
from recforge.models.hstu import HSTUConfig, HSTUEncoder
from recforge.models.ranking import (
    PLE,
    CandidateTower,
    ContextCross,
    ContextPool,
    ItemOnly,
    MMoE,
    MultiTaskMLP,
    RankingModel,
    RankingPrefix,
    TargetHistoryPool,
)
from recforge.models.retrieval import ItemPrefix, L2NormPostfix, RetrievalModel
from recforge.models.sasrec import SASRecConfig, SASRecEncoder
from recforge.sparse import (
    AdmissionConfig,
    DynamicEmbedding,
    EvictionConfig,
    SparseOptimConfig,
    TableConfig,
)


def hstu_encoder(cfg: ModelConfig, max_seq_len: int) -> HSTUEncoder:
    """The HSTU encoder ``cfg`` describes."""
    return HSTUEncoder(
        HSTUConfig(
            dim=cfg.dim,
            num_blocks=cfg.num_blocks,
            num_heads=cfg.num_heads,
            dqk=cfg.dqk,
            dv=cfg.dv,
            dropout=cfg.dropout,
            max_seq_len=max_seq_len,
            num_time_buckets=cfg.num_time_buckets,
            relative_bias=cfg.relative_bias,
            kernel=cfg.kernel,
            attn_norm=cfg.attn_norm,
            residual_dtype=cfg.residual_dtype,
            checkpoint_blocks=cfg.num_blocks if cfg.checkpoint_blocks is True else int(cfg.checkpoint_blocks),
        )
    )


def dynamic_item_table(
    cfg: ModelConfig, sparse: SparseConfig, num_items: int, *, name: str = "item", seed: int = 0
) -> DynamicEmbedding:
    """The ``model.embedding=dynamic`` item table: raw item IDs -> rows, per ``sparse``.

    ``name``/``seed`` build another table of ids under the same policies (ranking's contextual
    features); a distinct seed keeps its new rows from repeating the item table's.
    """
    probability = sparse.admission == "probability"
    return DynamicEmbedding(
        TableConfig(
            name=name,
            dim=cfg.dim,
            capacity=sparse.capacity or num_items + 1,
            max_rows=sparse.max_rows,
            init_std=0.02,  # as the static table's trunc_normal_(std=0.02)
            admission=AdmissionConfig(
                kind=sparse.admission,
                threshold=sparse.admission_threshold,
                probability=sparse.admission_threshold if probability else 1.0,
            ),
            eviction=EvictionConfig(kind=sparse.eviction, every_steps=sparse.eviction_every, ttl_steps=sparse.ttl_steps),
            optimizer=SparseOptimConfig(kind=sparse.optimizer, lr=sparse.lr),
            cache_rows=sparse.cache_rows,
            seed=seed,
        )
    )


def build_retrieval_model(
    cfg: ModelConfig, num_items: int, max_seq_len: int, sparse: SparseConfig | None = None
) -> RetrievalModel:
    """Retrieval model of ``cfg.kind`` (hstu | sasrec) over a catalogue of ``num_items`` items.

    ``cfg.embedding == "dynamic"`` puts the item IDs in a ``DynamicEmbedding`` built from ``sparse``.
    """
    if cfg.kind == "hstu":
        encoder = hstu_encoder(cfg, max_seq_len)
    elif cfg.kind == "sasrec":
        encoder = SASRecEncoder(
            SASRecConfig(
                dim=cfg.dim,
                num_blocks=cfg.num_blocks,
                num_heads=cfg.num_heads,
                ffn_dim=cfg.ffn_dim,
                dropout=cfg.dropout,
                max_seq_len=max_seq_len,
                kernel=cfg.kernel,
            )
        )
    else:
        raise ValueError(f"model.kind={cfg.kind!r}: expected hstu or sasrec")
    item_table = dynamic_item_table(cfg, sparse or SparseConfig(), num_items) if cfg.embedding == "dynamic" else None
    return RetrievalModel(ItemPrefix(num_items, cfg.dim, max_seq_len, cfg.dropout, item_table), encoder, L2NormPostfix())


def hstu_small(num_items: int, max_seq_len: int = 200) -> RetrievalModel:
    """The HSTU paper's ML-1M configuration: 2 blocks x 1 head, d = 50."""
    return build_retrieval_model(ModelConfig(kind="hstu"), num_items, max_seq_len)


def hstu_large(num_items: int, max_seq_len: int = 200) -> RetrievalModel:
    """The HSTU paper's HSTU-large: 8 blocks x 2 heads of width 25, d = 50."""
    return build_retrieval_model(ModelConfig(kind="hstu", num_blocks=8, num_heads=2, dqk=25, dv=25), num_items, max_seq_len)


def build_ranking_model(
    cfg: ModelConfig,
    *,
    max_seq_len: int,
    num_tasks: int,
    num_items: int,
    num_actions: int,
    num_context_values: int,
    item_feature_width: int = 0,
    num_item_feature_values: int = 0,
    sparse: SparseConfig | None = None,
) -> RankingModel:
    """Ranking model: ``RankingPrefix`` -> HSTU (``kind=hstu``), ``ContextPool`` (``kind=dlrm``) or nothing (``kind=item``) -> heads.

    ``cfg.embedding == "dynamic"`` puts the item IDs and the contextual feature ids (one table
    for all user features) in ``DynamicEmbedding`` tables built from ``sparse``.
    """
    item_table = context_table = None
    if cfg.embedding == "dynamic":
        item_table = dynamic_item_table(cfg, sparse or SparseConfig(), num_items)
        context_table = dynamic_item_table(cfg, sparse or SparseConfig(), num_context_values, name="context", seed=1)
    prefix = RankingPrefix(
        num_items, num_actions, num_context_values, cfg.dim, item_feature_width, num_item_feature_values, cfg.dropout,
        item_table, context_table,
    )  # fmt: skip
    if cfg.kind == "hstu":
        encoder = hstu_encoder(cfg, max_seq_len)
    elif cfg.kind == "dlrm":
        encoder = ContextPool(cfg.dim, hidden=cfg.head_hidden * 2, dropout=cfg.dropout)
    elif cfg.kind == "item":
        encoder = ItemOnly(cfg.dim)
    else:
        raise ValueError(f"model.kind={cfg.kind!r}: ranking supports hstu, dlrm and item")
    if cfg.context_cross:
        encoder = ContextCross.wrap(encoder, cfg.dim, hidden=cfg.head_hidden * 2, dropout=cfg.dropout)
    if cfg.target_attention == "din":
        encoder = TargetHistoryPool.wrap(encoder, cfg.dim, dropout=cfg.dropout)
    if cfg.head == "mlp":
        postfix = MultiTaskMLP(cfg.dim, num_tasks, cfg.head_hidden, cfg.dropout)
    elif cfg.head == "mmoe":
        postfix = MMoE(cfg.dim, num_tasks, cfg.num_experts, cfg.head_hidden, cfg.dropout)
    else:
        postfix = PLE(cfg.dim, num_tasks, shared_experts=cfg.num_experts, hidden=cfg.head_hidden, dropout=cfg.dropout)
    if cfg.item_tower:
        postfix = CandidateTower.wrap(postfix, MultiTaskMLP(cfg.dim, num_tasks, cfg.head_hidden, cfg.dropout), cfg.item_tower)
    return RankingModel(prefix, encoder, postfix)
