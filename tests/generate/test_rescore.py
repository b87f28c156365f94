"""Dense re-scoring of the beam's items (``rescore_items``, ``search_items(dense=..., rescore=...)``): the one path
of evaluation and serving for runs with ``generative.dense_head``."""

from __future__ import annotations

import pytest
import torch

from recforge.generate import SidTrie, beam_search, rescore_items, resolve_items, search_items
from tests.generate.test_beam_search import catalogue, random_step

INF = float("inf")


def test_a_dense_score_reorders_two_beam_items_and_unknown_items_keep_their_sid_score() -> None:
    items = torch.tensor([[3, 7, 9, -1]])
    scores = torch.tensor([[-1.0, -1.5, -2.0, -INF]])
    dense = torch.tensor([[0.0, 2.0, 0.0, 5.0]])  # 9 has no dense row (0); the empty slot's value is ignored
    got_items, got_scores = rescore_items(items, scores, dense, 1.0, k=4)
    assert got_items.tolist() == [[7, 3, 9, -1]]  # -1.5 + 2 > -1.0: the dense head moves 7 ahead of 3
    assert got_scores.tolist() == [[0.5, -1.0, -2.0, -INF]]  # 9 keeps its SID score
    half_items, half_scores = rescore_items(items, scores, dense, 0.2, k=4)  # -1.5 + 0.4 < -1.0: no swap
    assert half_items.tolist() == [[3, 7, 9, -1]] and half_scores[0, 1].item() == pytest.approx(-1.1)
    same_items, same_scores = rescore_items(items, scores, dense, 0.0, k=2)
    assert same_items.tolist() == [[3, 7]] and torch.equal(same_scores, scores[:, :2])
    padded_items, padded_scores = rescore_items(items, scores, dense, 1.0, k=6)
    assert padded_items.tolist() == [[7, 3, 9, -1, -1, -1]] and padded_scores[0, 3:].tolist() == [-INF] * 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_rescores_exactly_the_beams_items(seed: int) -> None:
    vocab, levels, batch, num_items, beam = 6, 3, 4, 120, 8
    codes = catalogue(num_items, vocab, levels, seed)[:, :2]  # 2 levels: many items share a SID
    trie = SidTrie.build(codes, vocab, "dense")
    step = random_step(batch, vocab, 2, seed)
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(batch, num_items, generator=g) * 3  # a stand-in dense head: a logit per (request, item)
    table[:, : num_items // 10] = 0.0  # items without a dense row
    dense = lambda items: table.gather(1, items.clamp_min(0))  # noqa: E731
    item_mask = torch.rand(batch, num_items, generator=g) > 0.2
    plain = search_items(step, trie, batch_size=batch, beam=beam, k=10, item_mask=item_mask)
    zero = search_items(step, trie, batch_size=batch, beam=beam, k=10, item_mask=item_mask, dense=dense, rescore=0.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, zero, strict=True))  # rescore 0: generation only, exactly
    out = beam_search(step, trie, batch_size=batch, beam=beam)
    every_items, every_scores = resolve_items(out, trie, beam * trie.max_items_per_leaf, item_mask=item_mask)
    got_items, got_scores = search_items(step, trie, batch_size=batch, beam=beam, k=10, item_mask=item_mask,
                                         dense=dense, rescore=0.7)  # fmt: skip
    for b in range(batch):
        present = every_items[b] >= 0
        candidates = every_items[b][present]
        combined = every_scores[b][present] + 0.7 * table[b, candidates]
        order = torch.argsort(combined, descending=True, stable=True)[:10]
        n = order.numel()
        assert got_items[b, :n].tolist() == candidates[order].tolist()  # only the beam's items, re-sorted
        torch.testing.assert_close(got_scores[b, :n], combined[order], rtol=0, atol=1e-6)
        assert (got_items[b, n:] == -1).all() and bool(item_mask[b, got_items[b, :n]].all())
    assert not torch.equal(got_items, plain[0])  # the dense term did change some list


def test_negative_rescore_is_refused() -> None:
    with pytest.raises(ValueError, match="rescore=-1"):
        search_items(lambda codes: codes, None, batch_size=1, beam=1, k=1, rescore=-1.0)
