"""The retrieval model: Prefix (per-token embeddings) -> encoder -> Postfix (L2-normalised user vector).

The prefix never mixes tokens (so prefix caching stays valid); the encoder is the only
place information moves between tokens; the postfix maps encoder states to the space
where items are scored. The item table is shared between input and output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import positions_in_sequence


class ItemPrefix(nn.Module):
    """Per-token input: scaled item embedding + learned absolute position embedding, dropout.

    ``item_table`` replaces the static ``nn.Embedding`` (e.g. a ``recforge.sparse.DynamicEmbedding``
    keyed by raw item IDs); it maps (T,) IDs to (T, dim).
    """

    def __init__(self, num_items: int, dim: int, max_seq_len: int, dropout: float, item_table: nn.Module | None = None) -> None:
        super().__init__()
        self.num_items = num_items
        self.item_embedding = item_table if item_table is not None else nn.Embedding(num_items + 1, dim, padding_idx=0)
        self.position_embedding = nn.Embedding(max_seq_len, dim)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(dim)
        if item_table is None:
            nn.init.trunc_normal_(self.item_embedding.weight, std=0.02)
            self.item_embedding.weight.data[0].zero_()
        nn.init.trunc_normal_(self.position_embedding.weight, std=0.02)

    def forward(self, batch: JaggedBatch) -> Tensor:
        positions = positions_in_sequence(batch.seq_offsets, batch.num_tokens)  # (T,)
        x = self.item_embedding(batch.item_ids) * self.scale + self.position_embedding(positions)
        return self.dropout(x)  # (T, d)


class L2NormPostfix(nn.Module):
    """Unit-normalises encoder outputs so scores are cosine similarities."""

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=-1)


class RetrievalModel(nn.Module):
    """Prefix -> encoder -> postfix, scoring against the shared, L2-normalised item table.

    Example:
        >>> model = RetrievalModel(ItemPrefix(3706, 50, 200, 0.2), HSTUEncoder(HSTUConfig()), L2NormPostfix())
        >>> user_vectors = model(batch)           # (T, 50), one per token
        >>> scores = user_vectors @ model.item_vectors().T
    """

    def __init__(self, prefix: ItemPrefix, encoder: nn.Module, postfix: nn.Module) -> None:
        super().__init__()
        self.prefix = prefix
        self.encoder = encoder
        self.postfix = postfix

    def forward(self, batch: JaggedBatch) -> Tensor:
        x = self.prefix(batch)
        x = self.encoder(x, batch.seq_offsets, batch.max_seq_len, batch.mask, batch.timestamps)
        return self.postfix(x)  # (T, d)

    def item_vectors(self, item_ids: Tensor | None = None) -> Tensor:
        """L2-normalised item embeddings (all rows, padding included, when ``item_ids`` is None)."""
        table = self.prefix.item_embedding
        if item_ids is not None:
            weight = table(item_ids)
        elif isinstance(table, nn.Embedding):
            weight = table.weight
        else:  # a dynamic table: score the catalogue without admitting its unseen items
            all_ids = torch.arange(self.prefix.num_items + 1, device=self.prefix.position_embedding.weight.device)
            weight = table(all_ids, admit=False)
        return F.normalize(weight, dim=-1)

    def last_token_vectors(self, batch: JaggedBatch) -> Tensor:
        """(B, d) the user vector at each sequence's last token: what to score the next item with."""
        if bool((batch.lengths == 0).any()):
            raise ValueError("last_token_vectors: the batch has empty sequences, which have no last token")
        return self(batch)[batch.seq_offsets[1:] - 1]
