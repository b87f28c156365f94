"""Models: HSTU and SASRec encoders, and the Prefix -> encoder -> Postfix retrieval model."""

from recforge.models.hstu import HSTUConfig, HSTUEncoder
from recforge.models.retrieval import ItemPrefix, L2NormPostfix, RetrievalModel
from recforge.models.sasrec import SASRecConfig, SASRecEncoder

__all__ = [
    "HSTUConfig",
    "HSTUEncoder",
    "ItemPrefix",
    "L2NormPostfix",
    "RetrievalModel",
    "SASRecConfig",
    "SASRecEncoder",
]
