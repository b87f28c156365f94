"""Models: HSTU and SASRec encoders; Prefix -> encoder -> Postfix retrieval and multi-task ranking models."""

from recforge.models.hstu import HSTUConfig, HSTUEncoder
from recforge.models.ranking import (
    PLE,
    ContextPool,
    MMoE,
    MultiTaskMLP,
    RankingModel,
    RankingPrefix,
    load_slices,
    save_slices,
)
from recforge.models.retrieval import ItemPrefix, L2NormPostfix, RetrievalModel
from recforge.models.sasrec import SASRecConfig, SASRecEncoder
from recforge.models.slices import register_slice

__all__ = [
    "PLE",
    "ContextPool",
    "HSTUConfig",
    "HSTUEncoder",
    "ItemPrefix",
    "L2NormPostfix",
    "MMoE",
    "MultiTaskMLP",
    "RankingModel",
    "RankingPrefix",
    "RetrievalModel",
    "SASRecConfig",
    "SASRecEncoder",
    "load_slices",
    "register_slice",
    "save_slices",
]
