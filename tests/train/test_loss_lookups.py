"""The unchunked per-position sampled softmax: the table-row lookup and bmm scoring give the per-draw
normalisation + einsum computation's loss and gradients, and make no (T, K, d) copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from recforge.train.losses import draw_negatives, sampled_softmax_loss

TOL64 = {"rtol": 1e-10, "atol": 1e-12}


def _per_draw_reference(user, targets, weight, sampled, temperature, weights):
    """The loss as computed before: every draw's row gathered and normalised, negatives scored by einsum."""
    vectors = lambda ids: F.normalize(F.embedding(ids, weight), dim=-1)  # noqa: E731
    pos = (user * vectors(targets)).sum(-1, keepdim=True) / temperature
    neg = torch.einsum("td,tkd->tk", user, vectors(sampled.ids)) / temperature
    parts = [pos, neg.masked_fill(sampled.ids == targets[:, None], float("-inf"))]
    if sampled.in_batch is not None:
        batch = user @ vectors(sampled.in_batch).T / temperature
        hit = (sampled.in_batch[None, :] == targets[:, None]) | (sampled.in_batch == 0)[None, :]
        parts.append(batch.masked_fill(hit, float("-inf")))
    nll = -F.log_softmax(torch.cat(parts, 1), 1)[:, 0]
    return nll.mean() if weights is None else (nll * weights).sum() / weights.sum()


def _inputs(positions: int, num_items: int, dim: int, dtype=torch.float64):
    user = F.normalize(torch.randn(positions, dim, dtype=dtype), dim=-1).requires_grad_()
    weight = (torch.randn(num_items + 1, dim, dtype=dtype) * 0.1).requires_grad_()
    targets = torch.randint(1, num_items + 1, (positions,))
    return user, weight, targets


@pytest.mark.parametrize("num_items", [40, 5000])  # 13 x 16 draws: more than the table's rows, then fewer
@pytest.mark.parametrize("in_batch", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_per_position_loss_and_gradients_match_per_draw_normalisation(num_items, in_batch, weighted) -> None:
    positions, k, dim, temperature = 13, 16, 8, 0.05
    user, weight, targets = _inputs(positions, num_items, dim)
    weights = torch.rand(positions, dtype=torch.float64) if weighted else None
    if weighted:
        weights[0] = 0.0  # a padding position: adds nothing
    sampled = draw_negatives(targets, num_items, num_negatives=k, in_batch_negatives=in_batch,
                             generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))))  # fmt: skip
    if num_items < 100:
        assert (sampled.ids == targets[:, None]).any(), "the test needs an accidental hit"
    calls: list[bool] = []

    def item_vectors(ids):
        calls.append(ids is None)
        return F.normalize(weight if ids is None else F.embedding(ids, weight), dim=-1)

    loss = sampled_softmax_loss(user, targets, item_vectors, num_items, num_negatives=k, in_batch_negatives=in_batch,
                                temperature=temperature, sampled=sampled, weights=weights)  # fmt: skip
    assert calls[0] == (positions * k > num_items + 1)  # the whole table when it has fewer rows than the draws
    got = torch.autograd.grad(loss * 3.0, (user, weight))
    ref = _per_draw_reference(user, targets, weight, sampled, temperature, weights)
    want = torch.autograd.grad(ref * 3.0, (user, weight))
    torch.testing.assert_close(loss, ref, **TOL64)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL64)


def test_float32_matches_float64() -> None:
    positions, k, num_items, dim = 64, 32, 300, 16
    user, weight, targets = _inputs(positions, num_items, dim)
    sampled = draw_negatives(targets, num_items, num_negatives=k, generator=torch.Generator().manual_seed(3))
    results = []
    for dtype in (torch.float64, torch.float32):
        u, w = user.detach().to(dtype).requires_grad_(), weight.detach().to(dtype).requires_grad_()
        loss = sampled_softmax_loss(u, targets, lambda ids, w=w: F.normalize(w if ids is None else w[ids], dim=-1),
                                    num_items, num_negatives=k, sampled=sampled)  # fmt: skip
        results.append((loss, *torch.autograd.grad(loss, (u, w))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b.double(), a, rtol=1e-4, atol=1e-6)


def test_item_vectors_of_the_wrong_size_is_refused() -> None:
    user, weight, targets = _inputs(8, 10, 4)
    with pytest.raises(ValueError, match="num_items \\+ 1 = 11"):
        sampled_softmax_loss(user, targets, lambda ids: weight[1:] if ids is None else weight[ids], 10, num_negatives=4)


@pytest.mark.parametrize("num_items", [50, 100_000])
def test_no_copy_of_the_lookup(num_items: int) -> None:
    """Forward + backward copy nothing of the (T, K, d) lookup's size (einsum's transposed gradient was copied
    whole before the embedding scatter)."""
    positions, k, dim = 64, 32, 16
    user, weight, targets = _inputs(positions, num_items, dim, torch.float32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = sampled_softmax_loss(user, targets, lambda ids: F.normalize(weight if ids is None else F.embedding(ids, weight),
                                                                           dim=-1), num_items, num_negatives=k)  # fmt: skip
        loss.backward()  # F.embedding's backward (as nn.Embedding's) makes its gradient contiguous
    copies = [(e.name, e.input_shapes[0]) for e in prof.events() if e.name in ("aten::copy_", "aten::clone")
              and e.input_shapes and e.input_shapes[0] and torch.Size(e.input_shapes[0]).numel() >= positions * k * dim]  # fmt: skip
    assert not copies, copies


@pytest.mark.parametrize("negatives", ["per_position", "shared"])
def test_lookups_with_side_effects_read_targets_first(negatives: str) -> None:
    """``exact_distinct`` tables (dynamic embeddings) admit and evict rows in lookup order: the targets are looked up
    before the negatives, as before the bmm scoring, so a full table never gives the positives' rows to random
    draws (a review found the per-position branch had turned the order around)."""
    user, weight, targets = _inputs(12, 200, 8)
    calls = []

    def vectors(ids):
        calls.append(None if ids is None else tuple(ids.shape))
        return F.normalize(F.embedding(ids, weight), dim=-1)

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    sampled = draw_negatives(targets, 200, negatives=negatives, num_negatives=6, generator=gen)
    sampled_softmax_loss(user, targets, vectors, 200, negatives=negatives, num_negatives=6, exact_distinct=True,
                         sampled=sampled)  # fmt: skip
    assert calls[0] == (12,), f"first lookup {calls[0]}: the targets must come first"
