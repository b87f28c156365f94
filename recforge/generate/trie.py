"""The set of valid semantic IDs as a trie of per-level dense child tables, ready for the GPU.

Node ``n`` at depth ``d`` (a valid prefix of ``d`` digits) has children
``children[d][n, token]`` (the node id at depth ``d + 1``, or -1 when that digit makes the
prefix invalid). A decode step reads the rows of its beams' nodes: one gather, no host work::

    depth 0            depth 1               depth 2 = leaves -> items (CSR)
    root ─ 3 ─► node 0 ─ 7 ─► leaf 0 ─────► leaf_offsets[0:2] -> leaf_items = [item 12]
         └ 5 ─► node 1 ─ 2 ─► leaf 1 ─────► [item 4, item 9]   (a collision: both items)

A dense table costs nodes x vocab x 4 bytes per level (12 MB for 12k items at 256 codes; about
1 GB for a million-item level), which buys a single gather per step.

Example:
    >>> trie = SidTrie.build(codes, vocab_size=256)   # codes (N, L): item i's SID
    >>> trie = trie.to("cuda")
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class SidTrie:
    """Valid SIDs of a catalogue (see the module docstring).

    Attributes:
        children: per depth d < L, (nodes_d, vocab) int32 child node ids (-1: invalid digit).
        item_nodes: per depth d = 1..L, (N,) int64 the node of each item's d-digit prefix.
        leaf_offsets: (leaves + 1,) int64 CSR offsets of ``leaf_items``.
        leaf_items: (N,) int64 item indices grouped by leaf, ascending within a leaf.
        max_items_per_leaf: the most items sharing one full SID (1 with a collision level).
    """

    children: list[Tensor]
    item_nodes: list[Tensor]
    leaf_offsets: Tensor
    leaf_items: Tensor
    vocab_size: int
    max_items_per_leaf: int

    @property
    def num_levels(self) -> int:
        return len(self.children)

    @property
    def num_items(self) -> int:
        return self.leaf_items.numel()

    @staticmethod
    def build(codes: Tensor, vocab_size: int) -> SidTrie:
        """Trie of the rows of ``codes`` (N, L) int64; row i is item index i's SID."""
        codes = codes.long().cpu()
        n, levels = codes.shape
        if n == 0 or levels == 0:
            raise ValueError("a SID trie needs at least one item and one level")
        if int(codes.min()) < 0 or int(codes.max()) >= vocab_size:
            raise ValueError(f"SID digits must lie in [0, {vocab_size}); got [{int(codes.min())}, {int(codes.max())}]")
        parent = torch.zeros(n, dtype=torch.long)  # depth-0 node of every item: the root
        children, item_nodes = [], []
        for depth in range(1, levels + 1):
            _, node = torch.unique(codes[:, :depth], dim=0, return_inverse=True)  # (N,) node at this depth
            table = torch.full((int(parent.max()) + 1, vocab_size), -1, dtype=torch.int32)
            table[parent, codes[:, depth - 1]] = node.to(torch.int32)
            children.append(table)
            item_nodes.append(node)
            parent = node
        leaf = parent
        leaf_items = torch.argsort(leaf, stable=True)
        counts = torch.bincount(leaf)
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(counts, 0)
        return SidTrie(children, item_nodes, offsets, leaf_items, vocab_size, int(counts.max()))

    def to(self, device: torch.device | str) -> SidTrie:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = value.to(device)
            elif isinstance(value, list):
                value = [v.to(device) for v in value]
            moved[f.name] = value
        return SidTrie(**moved)

    def nbytes(self) -> int:
        tensors = [*self.children, *self.item_nodes, self.leaf_offsets, self.leaf_items]
        return sum(t.numel() * t.element_size() for t in tensors)

    def allowed_nodes(self, item_mask: Tensor) -> list[Tensor]:
        """Per depth 1..L, (B, nodes_d) bool: the prefixes with at least one allowed item below.

        ``item_mask`` (B, N) bool marks the items each request may return. Scatters on the
        device; no host synchronisation.
        """
        out = []
        for depth, nodes in enumerate(self.item_nodes, start=1):
            size = self.children[depth].shape[0] if depth < self.num_levels else self.leaf_offsets.numel() - 1
            counts = torch.zeros(item_mask.shape[0], size, dtype=torch.int32, device=item_mask.device)
            counts.scatter_add_(1, nodes.expand(item_mask.shape[0], -1), item_mask.to(torch.int32))  # allowed items below
            out.append(counts > 0)
        return out
