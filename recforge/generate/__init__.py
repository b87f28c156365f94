"""Semantic-ID decoding: the valid-SID trie, constrained beam search, and the retrieval entry point."""

from recforge.generate.beam_search import BeamOutput, beam_search, resolve_items, search_items
from recforge.generate.retriever import Retriever
from recforge.generate.trie import SidTrie

__all__ = ["BeamOutput", "Retriever", "SidTrie", "beam_search", "resolve_items", "search_items"]
