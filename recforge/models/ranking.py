"""Multi-task ranking: Prefix -> encoder -> Postfix, with each part saved as its own slice.

    prefix   per-token encoder: (features of T tokens) -> (T, d). It must not mix tokens, so a
             serving engine can compute (and cache) history tokens once.
    encoder  the framework's sequence encoder (HSTU), or ``ContextPool`` for a non-sequential
             DLRM-style baseline: (T, d) tokens + offsets + mask -> (T, d).
    postfix  task heads on the target tokens: (N, d) -> (N, K) logits / predictions.

``RankingModel.split_inputs`` is the one place that turns a batch into the three parts'
inputs; prefix and postfix are ordinary ``nn.Module``s a user can replace. A slice is any
module with ``slice_config()`` (JSON constructor arguments); ``save_slices`` writes
``prefix/ encoder/ postfix/`` (safetensors + config.json each) plus a ``manifest.json``
saying how they connect, and ``load_slices`` rebuilds the model from it.

Heads live in ``ranking_heads.py``, encoders besides HSTU in ``ranking_encoders.py`` and the
slice plumbing in ``slices.py``; their names are re-exported here, so models exported before
the split (whose config.json names ``recforge.models.ranking:MultiTaskMLP``, ...) still load.

Example:
    >>> model = RankingModel(RankingPrefix(num_items=1682, num_actions=5, num_context_values=1027, dim=64),
    ...                      HSTUEncoder(HSTUConfig(dim=64, max_seq_len=256)),
    ...                      MultiTaskMLP(dim=64, num_tasks=2))
    >>> logits = model(batch)                 # (targets in batch, 2)
    >>> save_slices(model, "runs/x/model", tasks=[...]); model = load_slices("runs/x/model")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from recforge.io import atomic_directory, atomic_write_json
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import range_index
from recforge.models.ranking_encoders import (
    ContextCross,
    ContextPool,
    ItemOnly,
    TargetHistoryPool,
    visible_history,
)
from recforge.models.ranking_heads import HEADS, PLE, CandidateTower, MMoE, MultiTaskMLP
from recforge.models.slices import build_slice, slice_spec

SLICES = ("prefix", "encoder", "postfix")
SLICE_FORMAT = 1


class RankingPrefix(nn.Module):
    """Default per-token encoder: item + item side features + action + contextual feature embeddings.

    Every token sums the embeddings of the ids it carries (0 = none for each kind), then
    LayerNorm and dropout. Item side features are a fixed (num_items + 1, F) id table kept
    as a buffer, so a slice holds everything needed to embed an item.

    ``item_table`` / ``context_table`` replace the static item / contextual-feature tables
    (e.g. a ``recforge.sparse.DynamicEmbedding`` keyed by the same ids; it maps (T,) ids to
    (T, dim)). Id 0 never reaches them: it reads zeros, as ``padding_idx=0`` does. Such a
    prefix is not a slice; ``to_static()`` gives the plain one to export.
    """

    def __init__(
        self,
        num_items: int,
        num_actions: int,
        num_context_values: int,
        dim: int,
        item_feature_width: int = 0,
        num_item_feature_values: int = 0,
        dropout: float = 0.0,
        item_table: nn.Module | None = None,
        context_table: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.kwargs = {
            "num_items": num_items, "num_actions": num_actions, "num_context_values": num_context_values, "dim": dim,
            "item_feature_width": item_feature_width, "num_item_feature_values": num_item_feature_values,
            "dropout": dropout,
        }  # fmt: skip
        self.dim = dim
        self.item = item_table if item_table is not None else nn.Embedding(num_items + 1, dim, padding_idx=0)
        self.action = nn.Embedding(num_actions + 1, dim, padding_idx=0)
        self.context = context_table if context_table is not None else nn.Embedding(num_context_values + 1, dim, padding_idx=0)
        self.register_buffer("item_features", torch.zeros(num_items + 1, item_feature_width, dtype=torch.int64))
        self.item_feature = nn.Embedding(num_item_feature_values + 1, dim, padding_idx=0) if item_feature_width else None
        self.norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)
        for emb in (self.item, self.action, self.context, self.item_feature):
            if isinstance(emb, nn.Embedding):
                nn.init.normal_(emb.weight, std=0.02)
                emb.weight.data[0] = 0

    def _dynamic_tables(self) -> dict[str, nn.Module]:
        return {name: table for name, table in (("item", self.item), ("context", self.context)) if not isinstance(table, nn.Embedding)}

    def slice_config(self) -> dict:
        if dynamic := self._dynamic_tables():
            raise TypeError(f"RankingPrefix with dynamic tables ({', '.join(dynamic)}) is not a slice; save prefix.to_static()")
        return dict(self.kwargs)

    def to_static(self) -> RankingPrefix:
        """This prefix with every dynamic table read into a plain ``nn.Embedding``: what ``save_slices``
        writes and serving loads. Row ``i`` holds id ``i``'s row; ids without one (never admitted,
        evicted) read the table's default, as the dynamic lookup does; row 0 stays zero.
        """
        from recforge.sparse import to_dense

        state = self.state_dict()
        sizes = {"item": self.kwargs["num_items"] + 1, "context": self.kwargs["num_context_values"] + 1}
        for name, table in self._dynamic_tables().items():
            state = {k: v for k, v in state.items() if not k.startswith(f"{name}.")}
            weight = to_dense(table, torch.arange(sizes[name])).to(self.norm.weight.device)  # (rows, d)
            weight[0] = 0
            state[f"{name}.weight"] = weight
        static = RankingPrefix(**self.kwargs).to(self.norm.weight.device)
        static.load_state_dict(state)
        return static.train(self.training)

    def _embed(self, table: nn.Module, ids: Tensor) -> Tensor:
        if isinstance(table, nn.Embedding):
            return table(ids)
        # a dynamic table never sees id 0 ("none"), so it neither admits nor trains a row for it
        present = (ids != 0).nonzero().squeeze(1)  # (P,)
        rows = table(ids[present])  # (P, d)
        return rows.new_zeros(ids.shape[0], self.dim).index_copy(0, present, rows)  # (T, d)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        items = features["item_ids"]
        x = self._embed(self.item, items) + self.action(features["actions"]) + self._embed(self.context, features["context_ids"])
        if self.item_feature is not None:
            x = x + self.item_feature(self.item_features[items]).sum(1)  # (T, F, d) -> (T, d); row 0 of the table is all 0
        return self.dropout(self.norm(x))


class RankingModel(nn.Module):
    """Prefix -> encoder -> postfix over ranking batches (see ``recforge.data.ranking``)."""

    def __init__(self, prefix: nn.Module, encoder: nn.Module, postfix: nn.Module) -> None:
        super().__init__()
        self.prefix = prefix
        self.encoder = encoder
        self.postfix = postfix

    @staticmethod
    def split_inputs(batch: JaggedBatch) -> tuple[dict[str, Tensor], dict[str, Any], Tensor]:
        """(prefix features, encoder keyword arguments, target token positions) of a ranking batch."""
        num_targets = batch.mask.num_targets
        if num_targets is None:
            raise ValueError("a ranking batch needs mask.num_targets (the candidate tokens at the end of each sequence)")
        targets, _ = range_index(batch.seq_offsets[1:] - num_targets, num_targets)
        encoder_args = {
            "seq_offsets": batch.seq_offsets,
            "max_seq_len": batch.max_seq_len,
            "mask": batch.mask,
            "timestamps": batch.features.get("timestamps"),
        }
        return batch.features, encoder_args, targets

    def postfix_inputs(self, batch: JaggedBatch) -> Tensor:
        """What the postfix reads: the targets' encoder outputs (N, d), with their prefix
        embeddings beside them (N, 2d) when the postfix ``takes_candidate``."""
        features, encoder_args, targets = self.split_inputs(batch)
        tokens = self.prefix(features)
        encoded = self.encoder(tokens, **encoder_args)
        return self.postfix_input(encoded[targets], tokens[targets])

    def postfix_input(self, encoded: Tensor, embedded: Tensor) -> Tensor:
        """The postfix's input for targets with encoder outputs ``encoded`` and prefix embeddings
        ``embedded`` (each (N, d)): [encoded, embedded] (N, 2d) when the postfix ``takes_candidate``."""
        return torch.cat([encoded, embedded], 1) if getattr(self.postfix, "takes_candidate", False) else encoded

    def forward(self, batch: JaggedBatch) -> Tensor:
        """(sum of num_targets, K) task outputs, in target order."""
        return self.postfix(self.postfix_inputs(batch))


# ----------------------------------------------------------------------------------- slices


def save_slices(
    model: RankingModel,
    out_dir: str | Path,
    *,
    tasks: list[dict] | None = None,
    extra: dict | None = None,
    json_files: dict[str, dict] | None = None,
) -> Path:
    """Write the model as three slices plus a manifest, atomically.

    Layout: ``out_dir/{prefix,encoder,postfix}/{model.safetensors,config.json}`` and
    ``out_dir/manifest.json`` (slice classes, the order they run in, the width each passes on,
    the tasks the postfix outputs). ``json_files`` adds further JSON files (e.g. ``vocab.json``,
    the raw-ID vocabularies a serving engine maps requests with) inside the same atomic write.
    """
    out = Path(out_dir)
    dims = {}
    with atomic_directory(out) as tmp:
        for name in SLICES:
            module = getattr(model, name)
            config = slice_spec(module)
            json.dumps(config)  # fail here, not at load time, when the config is not JSON
            (tmp / name).mkdir()
            weights = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
            save_file(weights, tmp / name / "model.safetensors")
            atomic_write_json(tmp / name / "config.json", config)
            dims[name] = config["kwargs"].get("dim")
        manifest = {
            "format": "recforge-ranking-slices",
            "format_version": SLICE_FORMAT,
            "slices": list(SLICES),
            "connections": [
                {"from": "inputs", "to": "prefix", "carries": "per-token feature ids: item_ids, actions, context_ids"},
                {"from": "prefix", "to": "encoder", "carries": "token embeddings (T, dim)", "dim": dims["prefix"]},
                {"from": "encoder", "to": "postfix", "carries": "target token states (N, dim)", "dim": dims["encoder"]},
            ],
            "tasks": tasks or [],
            **(extra or {}),
        }
        for name, payload in (json_files or {}).items():
            atomic_write_json(tmp / name, payload)
        atomic_write_json(tmp / "manifest.json", manifest)
    return out


def load_slice(slice_dir: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild one slice (prefix, encoder or postfix) from its directory."""
    slice_dir = Path(slice_dir)
    config_path = slice_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{slice_dir} is not a recforge slice (no config.json)")
    config = json.loads(config_path.read_text())
    module = build_slice(config["class"], config["kwargs"])
    module.load_state_dict(load_file(slice_dir / "model.safetensors", device=str(device)))
    return module.to(device)


def load_slices(model_dir: str | Path, device: str | torch.device = "cpu") -> tuple[RankingModel, dict]:
    """Rebuild a ``RankingModel`` saved by ``save_slices``; returns (model, manifest)."""
    model_dir = Path(model_dir)
    manifest_path = model_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{model_dir} holds no manifest.json; it is not a model written by save_slices")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != "recforge-ranking-slices" or manifest.get("format_version") != SLICE_FORMAT:
        raise ValueError(f"{manifest_path}: unsupported slice format {manifest.get('format')} v{manifest.get('format_version')}")
    parts = [load_slice(model_dir / name, device) for name in SLICES]
    return RankingModel(*parts).eval(), manifest


__all__ = [
    "HEADS",
    "PLE",
    "CandidateTower",
    "ContextCross",
    "ContextPool",
    "ItemOnly",
    "MMoE",
    "MultiTaskMLP",
    "RankingModel",
    "RankingPrefix",
    "TargetHistoryPool",
    "load_slice",
    "load_slices",
    "save_slices",
    "visible_history",
]
