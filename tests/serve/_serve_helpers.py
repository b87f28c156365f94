"""Helpers for the serving tests: a tiny ranking model, its exported run, random histories."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from recforge.models import HSTUConfig, HSTUEncoder
from recforge.models.ranking import CandidateTower, MultiTaskMLP, RankingModel, RankingPrefix, save_slices

DIM = 16
MAX_LEN = 128
NUM_ITEMS = 50
ACTIONS = ["pv", "cart", "buy"]
TASKS = [{"name": "click", "kind": "binary"}, {"name": "rating", "kind": "regression"}]


def build_model(seed: int = 0, max_len: int = MAX_LEN, time_buckets: int = 16, tower: bool = False,
                num_blocks: int = 2, relative_bias: bool = True) -> RankingModel:  # fmt: skip
    """``tower``: the postfix is a ``CandidateTower`` (model.item_tower), which also reads the candidates' embeddings.
    ``relative_bias``: HSTUConfig.relative_bias (False: the blocks have no ``pos_weights``)."""
    torch.manual_seed(seed)
    prefix = RankingPrefix(NUM_ITEMS, len(ACTIONS), num_context_values=6, dim=DIM, item_feature_width=1,
                           num_item_feature_values=5)  # fmt: skip
    prefix.item_features.copy_(torch.randint(1, 6, (NUM_ITEMS + 1, 1)))
    prefix.item_features[0] = 0
    encoder = HSTUEncoder(HSTUConfig(dim=DIM, num_blocks=num_blocks, num_heads=2, dqk=8, dv=8, dropout=0.0, max_seq_len=max_len,
                                     num_time_buckets=time_buckets, relative_bias=relative_bias))  # fmt: skip
    for block in encoder.blocks:  # non-zero relative biases, so they are exercised too
        if block.pos_weights is not None:
            nn.init.normal_(block.pos_weights, std=0.5)
        if block.time_weights is not None:
            nn.init.normal_(block.time_weights, std=0.5)
    postfix = MultiTaskMLP(DIM, 2, hidden=32)
    if tower:
        postfix = CandidateTower.wrap(postfix, MultiTaskMLP(DIM, 2, hidden=16), weight=0.3)
    return RankingModel(prefix, encoder, postfix).eval()


def vocab() -> dict:
    return {
        "item_ids": [1000 + i for i in range(NUM_ITEMS)],  # raw ID 1000 + c - 1 has code c
        "action_column": "action",
        "actions": ACTIONS,
        "user_features": {"user_id": {"offset": 0, "values": ["u1", "u2", "u3"]},
                          "gender": {"offset": 3, "values": ["f", "m", "x"]}},
    }  # fmt: skip


def export(model: RankingModel, out: Path, action_encoding: str = "sum", step: int = 1) -> Path:
    encoder = getattr(model.encoder, "inner", model.encoder)  # ContextCross / TargetHistoryPool wrap an HSTU encoder
    extra = {"step": step, "action_encoding": action_encoding, "max_seq_len": encoder.cfg.max_seq_len,
             "num_contextual": 2, "user_features": ["user_id", "gender"], "item_features": ["cluster"]}  # fmt: skip
    save_slices(model, out / "model", tasks=TASKS, extra=extra, json_files={"vocab.json": vocab()})
    return out


def random_history(n: int, seed: int, start: int = 1_000_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    gaps = torch.randint(1, 5000, (n,), generator=g)
    return {
        "items": (1000 + torch.randint(0, NUM_ITEMS, (n,), generator=g)).tolist(),
        "timestamps": (start + torch.cumsum(gaps, 0)).tolist(),
        "actions": [ACTIONS[i] for i in torch.randint(0, len(ACTIONS), (n,), generator=g).tolist()],
    }
