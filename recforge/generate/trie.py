"""The set of valid semantic IDs as a trie of per-level dense child tables, ready for the GPU.

Node ``n`` at depth ``d`` (a valid prefix of ``d`` digits) has children
``children[d][n, token]`` (the node id at depth ``d + 1``, or -1 when that digit makes the
prefix invalid). A decode step reads the rows of its beams' nodes: one gather, no host work::

    depth 0            depth 1               depth 2 = leaves -> items (CSR)
    root ─ 3 ─► node 0 ─ 7 ─► leaf 0 ─────► leaf_offsets[0:2] -> leaf_items = [item 12]
         └ 5 ─► node 1 ─ 2 ─► leaf 1 ─────► [item 4, item 9]   (a collision: both items)

A dense table costs nodes x vocab x 4 bytes per level (12 MB for 12k items at 256 codes; about
1 GB for a million-item level), which buys a single gather per step. ``layout="csr"`` keeps only
the existing edges (per level: offsets per node, digits, child ids) and expands the beams' rows
to (beams, vocab) in each step, for catalogues where dense levels would not fit.

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
        children: ``layout="dense"``: per depth d < L, (nodes_d, vocab) int32 child node ids (-1: invalid).
        csr_offsets / csr_tokens / csr_children: ``layout="csr"``: per depth d < L, each node's
            valid digits and their child nodes, (nodes_d + 1,), (edges,), (edges,) int64.
        max_fanout: per depth, the most children of one node (the CSR rows' padded width).
        num_nodes: per depth d = 1..L, how many distinct d-digit prefixes exist.
        item_nodes: per depth d = 1..L, (N,) int64 the node of each item's d-digit prefix.
        leaf_offsets: (leaves + 1,) int64 CSR offsets of ``leaf_items``.
        leaf_items: (N,) int64 item indices grouped by leaf, ascending within a leaf.
        max_items_per_leaf: the most items sharing one full SID (1 with a collision level).
    """

    layout: str
    children: list[Tensor]
    csr_offsets: list[Tensor]
    csr_tokens: list[Tensor]
    csr_children: list[Tensor]
    max_fanout: list[int]
    num_nodes: list[int]
    item_nodes: list[Tensor]
    leaf_offsets: Tensor
    leaf_items: Tensor
    vocab_size: int
    max_items_per_leaf: int

    @property
    def num_levels(self) -> int:
        return len(self.item_nodes)

    @property
    def num_items(self) -> int:
        return self.leaf_items.numel()

    @staticmethod
    def build(codes: Tensor, vocab_size: int, layout: str = "dense") -> SidTrie:
        """Trie of the rows of ``codes`` (N, L) int64; row i is item index i's SID.

        ``layout``: ``dense`` (one (nodes, vocab) child table per level: one gather per step) or
        ``csr`` (only the existing edges: memory O(items x levels), for catalogues where a dense
        level would not fit; each step expands the beams' rows to (beams, vocab) on the fly).
        """
        if layout not in ("dense", "csr"):
            raise ValueError(f"layout={layout!r}: expected dense or csr")
        codes = codes.long().cpu()
        n, levels = codes.shape
        if n == 0 or levels == 0:
            raise ValueError("a SID trie needs at least one item and one level")
        if int(codes.min()) < 0 or int(codes.max()) >= vocab_size:
            raise ValueError(f"SID digits must lie in [0, {vocab_size}); got [{int(codes.min())}, {int(codes.max())}]")
        parent = torch.zeros(n, dtype=torch.long)  # depth-0 node of every item: the root
        parents_count = 1
        tables, offsets_l, tokens_l, kids_l, fanout, num_nodes, item_nodes = [], [], [], [], [], [], []
        for depth in range(1, levels + 1):
            _, node = torch.unique(codes[:, :depth], dim=0, return_inverse=True)  # (N,) node at this depth
            edges, first = torch.unique(parent * vocab_size + codes[:, depth - 1], return_inverse=True)  # sorted (parent, digit)
            kid = torch.empty(edges.numel(), dtype=torch.long).scatter_(0, first, node)
            per_parent = torch.bincount(torch.div(edges, vocab_size, rounding_mode="floor"), minlength=parents_count)
            fanout.append(int(per_parent.max()))
            if layout == "dense":
                table = torch.full((parents_count, vocab_size), -1, dtype=torch.int32)
                table.view(-1)[edges] = kid.to(torch.int32)
                tables.append(table)
            else:
                offsets_l.append(torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(per_parent, 0)]))
                tokens_l.append(edges % vocab_size)
                kids_l.append(kid)
            item_nodes.append(node)
            parents_count = int(node.max()) + 1
            num_nodes.append(parents_count)
            parent = node
        leaf_items = torch.argsort(parent, stable=True)
        counts = torch.bincount(parent)
        leaf_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
        return SidTrie(layout, tables, offsets_l, tokens_l, kids_l, fanout, num_nodes, item_nodes, leaf_offsets,
                       leaf_items, vocab_size, int(counts.max()))  # fmt: skip

    def child_rows(self, level: int, nodes: Tensor) -> Tensor:
        """(..., vocab) int64 child node of every digit after ``nodes`` (...,) at depth ``level``.

        -1 marks an invalid digit; a node < 0 (a prefix already outside the trie) has none.
        Device ops only, with shapes fixed by the trie: no host synchronisation.
        """
        safe = nodes.clamp_min(0)
        if self.layout == "dense":
            child = self.children[level][safe].long()
        else:
            offsets, tokens, kids = self.csr_offsets[level], self.csr_tokens[level], self.csr_children[level]
            start = offsets[safe]
            count = offsets[safe + 1] - start
            j = torch.arange(self.max_fanout[level], device=nodes.device)
            ok = j < count[..., None]  # (..., F)
            edge = (start[..., None] + j).clamp_max(tokens.numel() - 1)
            column = torch.where(ok, tokens[edge], self.vocab_size)  # padding goes to a spare column
            child = torch.full((*nodes.shape, self.vocab_size + 1), -1, dtype=torch.long, device=nodes.device)
            child = child.scatter_(-1, column, torch.where(ok, kids[edge], -1))[..., : self.vocab_size]
        return torch.where(nodes[..., None] >= 0, child, -1)

    def to(self, device: torch.device | str) -> SidTrie:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = value.to(device)
            elif isinstance(value, list):
                value = [v.to(device) if isinstance(v, Tensor) else v for v in value]
            moved[f.name] = value
        return SidTrie(**moved)

    def nbytes(self) -> int:
        tensors = [*self.children, *self.csr_offsets, *self.csr_tokens, *self.csr_children, *self.item_nodes,
                   self.leaf_offsets, self.leaf_items]  # fmt: skip
        return sum(t.numel() * t.element_size() for t in tensors)

    def allowed_nodes(self, item_mask: Tensor) -> list[Tensor]:
        """Per depth 1..L, (B, nodes_d) bool: the prefixes with at least one allowed item below.

        ``item_mask`` (B, N) bool marks the items each request may return. Scatters on the
        device; no host synchronisation.
        """
        out = []
        for nodes, size in zip(self.item_nodes, self.num_nodes, strict=True):
            counts = torch.zeros(item_mask.shape[0], size, dtype=torch.int32, device=item_mask.device)
            counts.scatter_add_(1, nodes.expand(item_mask.shape[0], -1), item_mask.to(torch.int32))  # allowed items below
            out.append(counts > 0)
        return out
