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

__all__ = [
    "PLE",
    "ContextPool",
    "MMoE",
    "MultiTaskMLP",
    "RankingModel",
    "RankingPrefix",
    "load_slices",
    "save_slices",
    "HSTUConfig",
    "HSTUEncoder",
    "ItemPrefix",
    "L2NormPostfix",
    "RetrievalModel",
    "SASRecConfig",
    "SASRecEncoder",
]
