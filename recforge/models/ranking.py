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

Example:
    >>> model = RankingModel(RankingPrefix(num_items=1682, num_actions=5, num_context_values=1027, dim=64),
    ...                      HSTUEncoder(HSTUConfig(dim=64, max_seq_len=256)),
    ...                      MultiTaskMLP(dim=64, num_tasks=2))
    >>> logits = model(batch)                 # (targets in batch, 2)
    >>> save_slices(model, "runs/x/model", tasks=[...]); model = load_slices("runs/x/model")
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from recforge.data.batch import JaggedBatch
from recforge.io import atomic_directory, atomic_write_json
from recforge.models.hstu import HSTUConfig, HSTUEncoder
from recforge.ops.jagged import range_index, sequence_ids
from recforge.ops.mask import AttentionMask

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


class MultiTaskMLP(nn.Module):
    """Shared MLP tower, one output per task."""

    def __init__(self, dim: int, num_tasks: int, hidden: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"dim": dim, "num_tasks": num_tasks, "hidden": hidden, "dropout": dropout}
        self.net = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.SiLU(), nn.Dropout(dropout), nn.Linear(hidden, num_tasks)
        )

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _expert(dim: int, hidden: int, dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Dropout(dropout))


class MMoE(nn.Module):
    """Multi-gate mixture of experts (Ma et al. 2018): shared experts, one softmax gate and tower per task."""

    def __init__(self, dim: int, num_tasks: int, num_experts: int = 4, hidden: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"dim": dim, "num_tasks": num_tasks, "num_experts": num_experts, "hidden": hidden, "dropout": dropout}
        self.norm = nn.LayerNorm(dim)
        self.experts = nn.ModuleList(_expert(dim, hidden, dropout) for _ in range(num_experts))
        self.gates = nn.Linear(dim, num_tasks * num_experts)
        self.towers = nn.ModuleList(nn.Linear(hidden, 1) for _ in range(num_tasks))
        self.num_tasks, self.num_experts = num_tasks, num_experts

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        experts = torch.stack([e(x) for e in self.experts], 1)  # (N, E, h)
        gates = self.gates(x).view(-1, self.num_tasks, self.num_experts).softmax(-1)  # (N, K, E)
        mixed = torch.einsum("nke,neh->nkh", gates, experts)
        return torch.cat([tower(mixed[:, k]) for k, tower in enumerate(self.towers)], 1)


class PLE(nn.Module):
    """Progressive layered extraction (Tang et al. 2020), one extraction layer (CGC).

    Each task mixes its own experts with the shared ones through its own gate; task-specific
    experts reduce the negative transfer of MMoE's fully shared pool.
    """

    def __init__(
        self, dim: int, num_tasks: int, shared_experts: int = 2, task_experts: int = 1, hidden: int = 128,
        dropout: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.kwargs = {
            "dim": dim, "num_tasks": num_tasks, "shared_experts": shared_experts, "task_experts": task_experts,
            "hidden": hidden, "dropout": dropout,
        }  # fmt: skip
        self.norm = nn.LayerNorm(dim)
        self.shared = nn.ModuleList(_expert(dim, hidden, dropout) for _ in range(shared_experts))
        self.specific = nn.ModuleList(
            nn.ModuleList(_expert(dim, hidden, dropout) for _ in range(task_experts)) for _ in range(num_tasks)
        )
        self.gates = nn.ModuleList(nn.Linear(dim, shared_experts + task_experts) for _ in range(num_tasks))
        self.towers = nn.ModuleList(nn.Linear(hidden, 1) for _ in range(num_tasks))

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        shared = [e(x) for e in self.shared]
        outs = []
        for specific, gate, tower in zip(self.specific, self.gates, self.towers):
            experts = torch.stack(shared + [e(x) for e in specific], 1)  # (N, E, h)
            weights = gate(x).softmax(-1).unsqueeze(2)  # (N, E, 1)
            outs.append(tower((weights * experts).sum(1)))
        return torch.cat(outs, 1)


HEADS = {"mlp": MultiTaskMLP, "mmoe": MMoE, "ple": PLE}


class CandidateTower(nn.Module):
    """Postfix with a second, candidate-only tower: an ensemble of the sequence model and an
    item-only scorer inside one model, on shared embeddings.

    Input (N, 2d) = [target encoder output, candidate prefix embedding]. ``parts`` gives the two
    towers' outputs, each trained with the task losses on its own (so the candidate tower is a
    non-personalised item scorer, not a correction of the main one); the score mixes them:
    ``(1 - weight) * main + weight * candidate``. RankingModel feeds this input when the postfix
    has ``takes_candidate``.
    """

    takes_candidate = True

    def __init__(self, main: dict, candidate: dict, weight: float = 0.5) -> None:
        super().__init__()
        self.kwargs = {"main": main, "candidate": candidate, "weight": weight}
        self.main = _build_slice(main["class"], main["kwargs"])
        self.candidate = _build_slice(candidate["class"], candidate["kwargs"])
        self.weight = weight

    @classmethod
    def wrap(cls, main: nn.Module, candidate: nn.Module, weight: float) -> CandidateTower:
        tower = cls(_slice_spec(main), _slice_spec(candidate), weight)
        tower.main, tower.candidate = main, candidate
        return tower

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def parts(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(main tower outputs, candidate tower outputs), each (N, K)."""
        dim = self.kwargs["main"]["kwargs"].get("dim")
        if dim is not None and x.shape[1] != 2 * dim:
            raise ValueError(
                f"CandidateTower reads [target encoder output, candidate prefix embedding] of width {2 * dim}, got "
                f"{x.shape[1]}: feed it RankingModel.postfix_inputs(batch), not the encoder output alone"
            )
        h, e = x.chunk(2, dim=1)  # (N, d) each
        return self.main(h), self.candidate(e)

    def forward(self, x: Tensor) -> Tensor:
        main, candidate = self.parts(x)
        return (1 - self.weight) * main + self.weight * candidate


class ContextPool(nn.Module):
    """Non-sequential encoder for a DLRM-style baseline: each target sees only the contextual
    tokens (user features) and itself, never the history.

    out_target = MLP([x_target, mean(contextual), x_target * mean(contextual)]); other tokens pass through.
    """

    def __init__(self, dim: int, hidden: int = 256, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"dim": dim, "hidden": hidden, "dropout": dropout}
        self.mlp = nn.Sequential(
            nn.Linear(3 * dim, hidden), nn.SiLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, dim),
        )  # fmt: skip

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(
        self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None = None
    ) -> Tensor:
        batch = seq_offsets.numel() - 1
        c = mask.num_contextual if mask.num_contextual is not None else torch.zeros(batch, dtype=torch.int64)
        t = mask.num_targets if mask.num_targets is not None else torch.zeros(batch, dtype=torch.int64)
        ctx_index, ctx_off = range_index(seq_offsets[:-1], c)
        ctx_sum = torch.zeros(batch, x.shape[1], dtype=x.dtype, device=x.device)
        ctx_sum.index_add_(0, sequence_ids(ctx_off, ctx_index.numel()), x[ctx_index])
        ctx_mean = ctx_sum / c.clamp(min=1).unsqueeze(1).to(x.dtype)
        tgt_index, tgt_off = range_index(seq_offsets[1:] - t, t)
        target = x[tgt_index]
        context = ctx_mean[sequence_ids(tgt_off, tgt_index.numel())]
        out = x.clone()
        out[tgt_index] = target + self.mlp(torch.cat([target, context, target * context], 1))
        return out


class ContextCross(nn.Module):
    """An encoder followed by ``ContextPool`` on its outputs: each target also gets the DLRM-style
    cross ``MLP([h_t, mean(contextual), h_t * mean(contextual)])`` of its encoded state with the
    encoded user features, a direct candidate x user-feature path beside the attention.
    """

    def __init__(self, inner: dict, dim: int, hidden: int = 256, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"inner": inner, "dim": dim, "hidden": hidden, "dropout": dropout}
        self.inner = _build_slice(inner["class"], inner["kwargs"])
        self.cross = ContextPool(dim, hidden, dropout)

    @classmethod
    def wrap(cls, inner: nn.Module, dim: int, **kwargs: Any) -> ContextCross:
        cross = cls(_slice_spec(inner), dim, **kwargs)
        cross.inner = inner
        return cross

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(
        self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None = None
    ) -> Tensor:
        return self.cross(self.inner(x, seq_offsets, max_seq_len, mask, timestamps), seq_offsets, max_seq_len, mask)


class ItemOnly(nn.Module):
    """Non-personalised baseline encoder: every token passes through unchanged, so a target's
    score depends on the candidate item (and its side features) alone, never on the user.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.kwargs = {"dim": dim}

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(
        self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None = None
    ) -> Tensor:
        return x


class TargetHistoryPool(nn.Module):
    """An encoder plus DIN-style target attention (Zhou et al. 2018): each candidate pools the
    history events it may see, weighted by a learned match with the candidate.

    For target t (prefix embedding e_t) and each visible history token j (prefix embedding x_j,
    recency r = how many visible events come after it, 0 = the previous event)::

        w_tj     = sigmoid(v . SiLU(A e_t + B x_j + C (e_t * x_j) + R[min(r, R - 1)]))
        pooled_t = sum_j w_tj x_j / (visible events)      # a learned, candidate-specific share
        out_t    = inner(x)_t + MLP([pooled_t, pooled_t * e_t])

    Unnormalised sigmoid weights keep *how much* of the history matches the candidate (softmax
    would only say which events match), and the recency table lets it single out the previous
    event. Visibility is the ranking mask's: history events strictly before the target's
    timestamp (all history when there are no timestamps). Non-target tokens pass through.
    """

    def __init__(self, inner: dict, dim: int, hidden: int = 32, recency_buckets: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.kwargs = {"inner": inner, "dim": dim, "hidden": hidden, "recency_buckets": recency_buckets, "dropout": dropout}
        self.inner = _build_slice(inner["class"], inner["kwargs"])
        self.query = nn.Linear(dim, hidden)
        self.key = nn.Linear(dim, hidden, bias=False)
        self.cross = nn.Linear(dim, hidden, bias=False)
        self.recency = nn.Embedding(recency_buckets, hidden)
        nn.init.zeros_(self.recency.weight)
        self.score = nn.Linear(hidden, 1)
        self.out = nn.Sequential(nn.Linear(2 * dim, 2 * dim), nn.SiLU(), nn.Dropout(dropout), nn.Linear(2 * dim, dim))
        self.recency_buckets = recency_buckets

    @classmethod
    def wrap(cls, inner: nn.Module, dim: int, **kwargs: Any) -> TargetHistoryPool:
        """Wrap an existing encoder (its weights are kept)."""
        pool = cls(_slice_spec(inner), dim, **kwargs)
        pool.inner = inner
        return pool

    def slice_config(self) -> dict:
        return dict(self.kwargs)

    def forward(
        self, x: Tensor, seq_offsets: Tensor, max_seq_len: int, mask: AttentionMask, timestamps: Tensor | None = None
    ) -> Tensor:
        encoded = self.inner(x, seq_offsets, max_seq_len, mask, timestamps)
        hist, visible, target_index = visible_history(seq_offsets, mask)  # (N, H), (N, H), (N,)
        if target_index.numel() == 0 or hist.shape[1] == 0:
            return encoded
        e = x[target_index]  # (N, d)
        xh = x[hist]  # (N, H, d)
        count = visible.sum(1, keepdim=True)  # (N, 1)
        recency = (count - 1 - torch.arange(hist.shape[1], device=x.device)).clamp(0, self.recency_buckets - 1)  # (N, H)
        z = self.query(e).unsqueeze(1) + self.key(xh) + self.cross(xh * e.unsqueeze(1)) + self.recency(recency)  # (N, H, h)
        weight = torch.sigmoid(self.score(F.silu(z)).squeeze(2)) * visible  # (N, H)
        pooled = (weight.unsqueeze(2) * xh).sum(1) / count.clamp(min=1).to(x.dtype)  # (N, d)
        out = encoded.clone()
        out[target_index] = encoded[target_index] + self.out(torch.cat([pooled, pooled * e], 1))
        return out


def visible_history(seq_offsets: Tensor, mask: AttentionMask) -> tuple[Tensor, Tensor, Tensor]:
    """Each target's history as a padded index: (hist (N, H) token index, visible (N, H) bool,
    target token index (N,)), N = targets in the batch, H = the longest history.

    History tokens sit between the contextual prefix and the targets, in time order; a target sees
    those strictly before its own timestamp when ``mask.timestamps`` is set, else all of them.
    """
    batch = seq_offsets.numel() - 1
    device = seq_offsets.device
    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    c = mask.num_contextual if mask.num_contextual is not None else zeros
    t = mask.num_targets if mask.num_targets is not None else zeros
    lengths = seq_offsets[1:] - seq_offsets[:-1]
    hist_len = lengths - c - t  # (B,)
    target_index, target_off = range_index(seq_offsets[1:] - t, t)
    seq = sequence_ids(target_off, target_index.numel())  # (N,) sequence of each target
    width = int(hist_len.max()) if batch else 0
    cols = torch.arange(width, device=device)
    hist = (seq_offsets[:-1] + c)[seq].unsqueeze(1) + cols  # (N, H)
    visible = cols < hist_len[seq].unsqueeze(1)
    hist = torch.where(visible, hist, target_index.unsqueeze(1))  # padding reads the target itself (masked)
    if mask.timestamps is not None:
        visible = visible & (mask.timestamps[hist] < mask.timestamps[target_index].unsqueeze(1))
    return hist, visible, target_index


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


def _slice_config(module: nn.Module) -> dict:
    if isinstance(module, HSTUEncoder):
        return dataclasses.asdict(module.cfg)
    if not hasattr(module, "slice_config"):
        raise TypeError(
            f"{type(module).__name__} cannot be saved as a slice: give it a slice_config() method returning its "
            "constructor arguments as a JSON-serialisable dict"
        )
    return module.slice_config()


def _slice_spec(module: nn.Module) -> dict:
    """``{"class", "kwargs"}`` of a module: what a slice's config.json holds, and how a wrapper
    slice (TargetHistoryPool, ContextCross, CandidateTower) names the modules inside it."""
    cls = type(module)
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "kwargs": _slice_config(module)}


def _build_slice(class_path: str, kwargs: dict) -> nn.Module:
    module_name, _, qualname = class_path.partition(":")
    try:
        cls: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"slice class {class_path!r} cannot be imported ({err}); install the package that defines it") from err
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"slice class {class_path!r} is not an nn.Module")
    if cls is HSTUEncoder:
        return HSTUEncoder(HSTUConfig(**kwargs))
    return cls(**kwargs)


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
            config = _slice_spec(module)
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
    module = _build_slice(config["class"], config["kwargs"])
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


def pointwise_loss(outputs: Tensor, labels: Tensor, kinds: list[str], weights: list[float]) -> tuple[Tensor, list[float]]:
    """Weighted sum over tasks of BCE-with-logits (binary) or MSE (regression), ignoring NaN labels.

    Returns the total loss and each task's unweighted mean loss.
    """
    total = outputs.new_zeros(())
    per_task = []
    for k, (kind, weight) in enumerate(zip(kinds, weights)):
        known = ~torch.isnan(labels[:, k])
        if not bool(known.any()):
            per_task.append(float("nan"))
            continue
        y, z = labels[known, k], outputs[known, k]
        loss = F.binary_cross_entropy_with_logits(z, y) if kind == "binary" else F.mse_loss(z, y)
        per_task.append(float(loss.detach()))
        total = total + weight * loss
    return total, per_task


def listwise_loss(outputs: Tensor, labels: Tensor, num_targets: Tensor) -> Tensor:
    """Softmax cross-entropy over each sample's candidates, per binary task column given.

    ``outputs``/``labels`` are (N, K'); a sample's loss is ``-sum_i y_i log softmax(z)_i / sum_i y_i``,
    averaged over samples with at least one positive (samples without one carry no list signal).
    """
    offsets = torch.cat([num_targets.new_zeros(1), torch.cumsum(num_targets, 0)])
    seq = sequence_ids(offsets, outputs.shape[0])
    batch = num_targets.numel()
    y = torch.nan_to_num(labels, nan=0.0)
    # log-softmax within each sample: subtract the per-sample max, then log-sum-exp by index_add
    zmax = torch.full((batch, outputs.shape[1]), float("-inf"), device=outputs.device, dtype=outputs.dtype)
    zmax = zmax.scatter_reduce(0, seq.unsqueeze(1).expand_as(outputs), outputs.detach(), "amax")
    shifted = outputs - zmax[seq]
    denom = torch.zeros_like(zmax).index_add_(0, seq, shifted.exp())
    log_p = shifted - denom.clamp_min(1e-30).log()[seq]
    positives = torch.zeros_like(zmax).index_add_(0, seq, y)
    per_sample = -torch.zeros_like(zmax).index_add_(0, seq, y * log_p) / positives.clamp_min(1)
    has_pos = positives > 0
    return per_sample[has_pos].mean() if bool(has_pos.any()) else outputs.sum() * 0


__all__ = [
    "HEADS",
    "PLE",
    "CandidateTower",
    "ContextCross",
    "ContextPool",
    "MMoE",
    "MultiTaskMLP",
    "RankingModel",
    "RankingPrefix",
    "TargetHistoryPool",
    "listwise_loss",
    "load_slice",
    "load_slices",
    "pointwise_loss",
    "save_slices",
    "visible_history",
]
