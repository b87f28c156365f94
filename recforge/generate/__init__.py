"""Semantic-ID decoding: the valid-SID trie, constrained beam search, and the retrieval entry point.

``Retriever`` (``recforge.generate.retriever``) is imported lazily: it loads runs through the
training recipe, which this package must not import at import time.
"""

from recforge.generate.beam_search import BeamOutput, beam_search, resolve_items
from recforge.generate.trie import SidTrie

__all__ = ["BeamOutput", "Retriever", "SidTrie", "beam_search", "resolve_items"]


def __getattr__(name: str):
    if name == "Retriever":
        from recforge.generate.retriever import Retriever

        return Retriever
    raise AttributeError(name)
