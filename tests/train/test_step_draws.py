"""Random inputs drawn before the step (``recforge.train.step_draws``) and the loss given them (``draw_negatives``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recforge.train.losses import draw_negatives, sampled_softmax_loss
from recforge.train.step_draws import StepDraws, micro_seed, rank_seed

SETTINGS = [("per_position", 0, False), ("per_position", 4, False), ("per_position", 4, True), ("shared", 0, False),
            ("shared", 4, False)]  # fmt: skip


@pytest.mark.parametrize(("negatives", "chunk_size", "exact_distinct"), SETTINGS)
@pytest.mark.parametrize("in_batch", [False, True])
def test_negatives_drawn_before_the_loss_give_the_loss_drawn_in_it(negatives: str, chunk_size: int, exact_distinct: bool,
                                                                    in_batch: bool) -> None:  # fmt: skip
    """The loss given ``draw_negatives``' draws equals the loss that draws them itself from the same generator state,
    value and gradients bitwise, and the item table sees the same lookups in the same order."""
    positions, num_items = int(torch.randint(9, 20, ())), 25
    user = F.normalize(torch.randn(positions, 6, dtype=torch.float64), dim=-1).requires_grad_()
    table = torch.randn(num_items + 1, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(1, num_items + 1, (positions,))
    kw = dict(
        negatives=negatives,
        num_negatives=7,
        in_batch_negatives=in_batch,
        chunk_size=chunk_size,
        exact_distinct=exact_distinct,
    )
    runs = []
    seed = int(torch.randint(0, 2**31, ()))
    for predrawn in (False, True):
        looked_up = []

        def item_vectors(ids, looked_up=looked_up):
            looked_up.append(None if ids is None else ids.clone())
            return F.normalize(table if ids is None else table[ids], dim=-1)

        torch.manual_seed(seed)
        sampled = draw_negatives(targets, num_items, **kw) if predrawn else None
        loss = sampled_softmax_loss(user, targets, item_vectors, num_items, temperature=0.1, sampled=sampled, **kw)
        grads = torch.autograd.grad(loss, (user, table))
        runs.append((loss, grads, looked_up))
    (loss_a, grads_a, ids_a), (loss_b, grads_b, ids_b) = runs
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    same = lambda a, b: a is b is None or (a is not None and b is not None and torch.equal(a, b))  # noqa: E731 (None: the table)
    assert len(ids_a) == len(ids_b) and all(same(a, b) for a, b in zip(ids_a, ids_b, strict=True))


def test_the_loss_refuses_draws_made_for_other_settings() -> None:
    user, targets = F.normalize(torch.randn(10, 4), dim=-1), torch.randint(1, 30, (10,))
    item_vectors = lambda ids: F.normalize(torch.ones(31, 4)[ids], dim=-1)  # noqa: E731
    unchunked = draw_negatives(targets, 30, num_negatives=5)
    with pytest.raises(ValueError, match="chunk_size=4"):
        sampled_softmax_loss(user, targets, item_vectors, 30, num_negatives=5, chunk_size=4, sampled=unchunked)
    with pytest.raises(ValueError, match="in_batch_negatives=True"):
        sampled_softmax_loss(
            user, targets, item_vectors, 30, num_negatives=5, in_batch_negatives=True, sampled=unchunked
        )


def _run(first_step: int, steps: int, reseed: bool, ahead: bool) -> tuple[list[int], int]:
    """The seeds each step's micro-batch 0 draws under, from ``first_step`` on (a resumed run starts later);
    ``ahead``: drawn during the previous step as a pipeline does."""
    seen = []
    draws = StepDraws(lambda batch, seed: seen.append(seed) or seed)
    batches = [object() for _ in range(steps)]
    torch.manual_seed(77)
    for i, step in enumerate(range(first_step, first_step + steps)):
        if reseed:
            torch.manual_seed(5 * 1_000_003 + step)  # the loop's per-step seed
        draws.begin_step()
        used = draws(batches[i], 0)
        draws(batches[i], 1)  # a second micro-batch: its own seed
        if ahead and i + 1 < steps:
            draws.keep(draws.ahead(batches[i + 1])())
        seen.append(("used", used))
    return [u for tag, u in (x for x in seen if isinstance(x, tuple))], draws.reused


def test_step_draws_are_the_same_pipelined_or_not_and_after_a_resume() -> None:
    off, _ = _run(0, 8, reseed=True, ahead=False)
    on, reused = _run(0, 8, reseed=True, ahead=True)
    assert on == off and reused == 7  # every draw made ahead was the step's own
    assert len(set(off)) == 8
    resumed, _ = _run(5, 3, reseed=True, ahead=True)
    assert resumed == off[5:]
    assert off[0] == micro_seed(5 * 1_000_003, 0, 0) and off[0] != micro_seed(5 * 1_000_003, 0, 1)


def test_step_draws_change_every_step_without_reseeding() -> None:
    """A caller that never re-seeds still gets new draws each step; after one step the pipeline predicts them."""
    off, _ = _run(0, 6, reseed=False, ahead=False)
    on, reused = _run(0, 6, reseed=False, ahead=True)
    assert on == off and len(set(off)) == 6
    assert reused == 4  # the 2nd step's seed could not be predicted yet (no change seen)


def test_rank_seed_differs_per_rank() -> None:
    seed = int(torch.randint(0, 2**62, ()))
    assert len({rank_seed(seed, r) for r in range(8)}) == 8
