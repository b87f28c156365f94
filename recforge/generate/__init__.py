"""Semantic-ID decoding: the valid-SID trie, constrained beam search, and the retrieve engine."""

from recforge.generate.beam_search import (
    BeamOutput, DenseCandidates, add_dense_candidates, beam_search, rescore_items, resolve_items, search_items,
)  # fmt: skip
from recforge.generate.history_cache import HistoryCache
from recforge.generate.requests import EncodedRetrieve, RetrieveConfig, RetrieveRequest, RetrieveResult
from recforge.generate.retriever import Retriever
from recforge.generate.trie import SidTrie

__all__ = [
    "BeamOutput", "DenseCandidates", "EncodedRetrieve", "HistoryCache", "RetrieveConfig", "RetrieveRequest", "RetrieveResult", "Retriever", "SidTrie",
    "add_dense_candidates", "beam_search", "rescore_items", "resolve_items", "search_items",
]  # fmt: skip
