"""The chunked sampled-softmax loss: the unchunked loss's value and gradients, without its big tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from recforge.train.chunked_softmax import chunked_full_softmax_cross_entropy, chunked_softmax_cross_entropy
from recforge.train.losses import _distinct_rows, batch_distinct, draw_negatives, sampled_softmax_loss

TOL = {"rtol": 1e-9, "atol": 1e-12}


def _inputs(num_positions: int, num_items: int, dim: int):
    table = torch.randn(num_items + 1, dim, dtype=torch.float64, requires_grad=True)
    user = torch.randn(num_positions, dim, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(1, num_items + 1, (num_positions,))
    return user, table, targets


def _loss_and_grads(user, table, targets, num_items: int, seed: int, **kwargs):
    user.grad = table.grad = None
    torch.manual_seed(seed)  # the same negatives in both runs
    loss = sampled_softmax_loss(F.normalize(user, dim=-1), targets, lambda ids: F.normalize(table if ids is None else table[ids], dim=-1),
                                num_items, **kwargs)  # fmt: skip
    loss.backward()
    return loss.detach(), user.grad.clone(), table.grad.clone()


@pytest.mark.parametrize(
    ("negatives", "in_batch", "chunk"),
    [("per_position", False, 7), ("per_position", True, 16), ("shared", False, 5), ("shared", True, 1),
     ("full", False, 9), ("full", True, 40)],
)  # fmt: skip
def test_chunked_equals_unchunked(negatives: str, in_batch: bool, chunk: int) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()))
    torch.manual_seed(seed)
    num_items = int(torch.randint(5, 60, ()))  # few items: accidental hits and repeated negatives are common
    user, table, targets = _inputs(int(torch.randint(chunk + 1, 4 * chunk + 20, ())), num_items, 8)
    kwargs = dict(negatives=negatives, num_negatives=13, in_batch_negatives=in_batch, temperature=0.07)
    loss, d_user, d_table = _loss_and_grads(user, table, targets, num_items, seed, **kwargs)
    loss_c, d_user_c, d_table_c = _loss_and_grads(user, table, targets, num_items, seed, chunk_size=chunk, **kwargs)
    torch.testing.assert_close(loss_c, loss, **TOL)
    torch.testing.assert_close(d_user_c, d_user, **TOL)
    torch.testing.assert_close(d_table_c, d_table, **TOL)


@pytest.mark.parametrize("blocks", ["shared", "own", "both"])
def test_chunk_zero_is_every_position_in_one_chunk(blocks: str) -> None:
    """``chunk=0``: one chunk of all positions (what the unchunked shared-negatives loss runs), equal to small
    chunks, for shared columns, per-position ones and both."""
    num, items, k = int(torch.randint(8, 30, ())), 12, 5
    user, table, targets = _inputs(num, items, 6)
    shared_ids = torch.randint(0, items + 1, (7,)) if blocks != "own" else None  # 0: padding columns, masked
    own_ids = torch.randint(1, items + 1, (num, k)) if blocks != "shared" else None
    got = []
    for chunk in (0, 3):
        user.grad = table.grad = None
        loss = chunked_softmax_cross_entropy(
            user, table[targets], targets, shared=None if shared_ids is None else table[shared_ids],
            shared_ids=shared_ids, own=None if own_ids is None else table, own_rows=own_ids, own_ids=own_ids,
            temperature=0.1, chunk=chunk)  # fmt: skip
        (3.0 * loss).backward()
        got.append((loss.detach(), user.grad.clone(), table.grad.clone()))
    for one, small in zip(*got, strict=True):
        torch.testing.assert_close(one, small, **TOL)


def test_chunked_scales_with_upstream_gradient_and_autocast() -> None:
    user, table, targets = _inputs(50, 30, 8)
    item_vectors = lambda ids: table if ids is None else table[ids]
    torch.manual_seed(1)
    (3.0 * sampled_softmax_loss(user, targets, item_vectors, 30, negatives="full", chunk_size=8)).backward()
    expected = user.grad.clone()
    user.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the loss still runs in float32 (float64 here)
        loss = sampled_softmax_loss(user, targets, item_vectors, 30, negatives="full", chunk_size=8)
    assert loss.dtype == torch.float64
    (3.0 * loss).backward()
    torch.testing.assert_close(user.grad, expected, **TOL)


def test_no_gradients_without_grad_mode() -> None:
    user, table, targets = _inputs(20, 30, 8)
    with torch.no_grad():
        loss = sampled_softmax_loss(user, targets, lambda ids: table[ids], 30, chunk_size=4)
    assert loss.ndim == 0 and torch.isfinite(loss) and not loss.requires_grad


class _LargestAllocation(TorchDispatchMode):
    """Records the largest floating-point tensor any op (forward or backward) returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("negatives", ["per_position", "full"])
def test_chunked_never_allocates_positions_by_negatives(negatives: str) -> None:
    positions, num_items, k, dim, chunk = 600, 500, 64, 8, 32
    user, table, targets = _inputs(positions, num_items, dim)
    item_vectors = lambda ids: F.normalize(table if ids is None else table[ids], dim=-1)
    columns = k if negatives == "per_position" else num_items + 1
    sizes = {}
    for chunk_size in (0, chunk):
        with _LargestAllocation() as mode:
            loss = sampled_softmax_loss(user, targets, item_vectors, num_items, negatives=negatives, num_negatives=k,
                                        chunk_size=chunk_size)  # fmt: skip
            loss.backward()
        sizes[chunk_size] = mode.largest
    assert sizes[0] >= positions * columns  # the unchunked loss does hold the full logits (this test can fail)
    # chunked: at most one chunk's logits or gathered negatives, and the (N+1, d) table / (T, d) users
    assert sizes[chunk] <= max(chunk * (columns + 1) * (dim if negatives == "per_position" else 1),
                               (num_items + 1) * dim, positions * dim)  # fmt: skip
    assert sizes[chunk] < positions * columns


def test_distinct_rows_matches_unique() -> None:
    ids = torch.randint(1, 40, (37, 5))
    distinct, rows = _distinct_rows(ids, 41)
    assert distinct.shape == (min(ids.numel(), 41),)
    torch.testing.assert_close(distinct[rows], ids, rtol=0, atol=0)
    unique = torch.unique(ids)
    torch.testing.assert_close(distinct[: unique.numel()], unique, rtol=0, atol=0)


def test_chunked_cross_entropy_checks_arguments() -> None:
    user = torch.randn(4, 3)
    with pytest.raises(ValueError, match="chunk=-1"):
        chunked_softmax_cross_entropy(user, user, torch.ones(4, dtype=torch.int64), temperature=1.0, chunk=-1)
    with pytest.raises(ValueError, match="shared with shared_ids"):
        chunked_softmax_cross_entropy(user, user, torch.ones(4, dtype=torch.int64), shared=user, temperature=1.0, chunk=2)


def test_chunked_full_softmax_is_cross_entropy_with_padding_masked() -> None:
    num_items = int(torch.randint(3, 50, ()))
    chunk = int(torch.randint(1, 12, ()))
    user, table, targets = _inputs(int(torch.randint(chunk, 5 * chunk + 3, ())), num_items, 6)
    logits = user @ table.T / 0.05
    logits[:, 0] = float("-inf")
    expected = F.cross_entropy(logits, targets)
    expected_grads = torch.autograd.grad(2.0 * expected, (user, table))
    loss = chunked_full_softmax_cross_entropy(user, table, targets, temperature=0.05, chunk=chunk)
    torch.testing.assert_close(loss, expected, **TOL)
    for got, want in zip(torch.autograd.grad(2.0 * loss, (user, table)), expected_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(ValueError, match="chunk=0"):
        chunked_full_softmax_cross_entropy(user, table, targets, temperature=0.05, chunk=0)


CASES = [("per_position", False), ("per_position", True), ("shared", False), ("shared", True), ("full", False)]


def _weighted(user, table, targets, num_items: int, sampled, weights, chunk: int):
    user.grad = table.grad = None
    vectors = lambda ids: F.normalize(table if ids is None else table[ids], dim=-1)  # noqa: E731
    loss = sampled_softmax_loss(F.normalize(user, dim=-1), targets, vectors, num_items, negatives=sampled[0],
                                in_batch_negatives=sampled[1], temperature=0.07, chunk_size=chunk, sampled=sampled[2],
                                weights=weights)  # fmt: skip
    (2.0 * loss).backward()
    return loss.detach(), user.grad.clone(), table.grad.clone()


def _keep(sampled, keep: torch.Tensor):
    """``sampled`` restricted to the positions ``keep`` (the same negatives, shared sets unchanged)."""
    rows = {f: getattr(sampled, f)[keep] for f in ("rows",) if getattr(sampled, f) is not None}
    if sampled.ids is not None and sampled.ids.ndim == 2:
        rows["ids"] = sampled.ids[keep]
    return dataclasses.replace(sampled, **rows)


@pytest.mark.parametrize(("negatives", "in_batch"), CASES)
@pytest.mark.parametrize("chunk", [0, 6])
def test_zero_weights_drop_positions(negatives: str, in_batch: bool, chunk: int) -> None:
    """Weights 0/1: the loss and every gradient of the weight-1 positions alone (their own negatives, the shared
    and in-batch sets of the whole batch), unchunked and chunked; padding-like rows (all negatives hits) too."""
    num_items = int(torch.randint(5, 40, ()))
    user, table, targets = _inputs(int(torch.randint(2 * chunk + 2, 60, ())), num_items, 8)
    keep = torch.rand(targets.shape) < 0.6
    keep[0] = True
    sampled = draw_negatives(targets, num_items, negatives=negatives, num_negatives=11, in_batch_negatives=in_batch,
                             chunk_size=chunk)  # fmt: skip
    if sampled.ids is not None and sampled.ids.ndim == 2 and chunk == 0:
        sampled.ids[~keep] = targets[~keep, None]  # every negative an accidental hit: the row's loss is 0, not NaN
    weights = keep.to(torch.float32)  # the loss casts it to the compute dtype
    got = _weighted(user, table, targets, num_items, (negatives, in_batch, sampled), weights, chunk)
    sub_user = user.detach()[keep].clone().requires_grad_(True)
    want = _weighted(sub_user, table, targets[keep], num_items, (negatives, in_batch, _keep(sampled, keep)), None,
                     chunk if int(keep.sum()) > chunk else 0)  # fmt: skip
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1][keep], want[1], **TOL)
    assert got[1][~keep].eq(0).all()  # no gradient at all through a weight-0 position
    torch.testing.assert_close(got[2], want[2], **TOL)


@pytest.mark.parametrize(("negatives", "in_batch"), CASES)
def test_weighted_chunked_equals_unchunked(negatives: str, in_batch: bool) -> None:
    num_items = int(torch.randint(5, 40, ()))
    user, table, targets = _inputs(int(torch.randint(20, 70, ())), num_items, 8)
    weights = torch.rand(targets.shape, dtype=torch.float64) * 3
    sampled = draw_negatives(targets, num_items, negatives=negatives, num_negatives=9, in_batch_negatives=in_batch,
                             chunk_size=5)  # fmt: skip
    chunked = _weighted(user, table, targets, num_items, (negatives, in_batch, sampled), weights, 5)
    plain = _weighted(user, table, targets, num_items, (negatives, in_batch, sampled), weights, 0)
    ones = _weighted(user, table, targets, num_items, (negatives, in_batch, sampled), torch.ones_like(weights), 5)
    unweighted = _weighted(user, table, targets, num_items, (negatives, in_batch, sampled), None, 5)
    for a, b, c, d in zip(chunked, plain, ones, unweighted, strict=True):
        torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(c, d, **TOL)
    with pytest.raises(ValueError, match="one per position"):
        _weighted(user, table, targets, num_items, (negatives, in_batch, sampled), weights[1:], 5)


def test_batch_distinct_is_unique_without_a_sync() -> None:
    targets = torch.randint(1, int(torch.randint(2, 30, ())), (int(torch.randint(1, 80, ())),))
    distinct = batch_distinct(targets)
    assert distinct.shape == targets.shape
    torch.testing.assert_close(distinct[distinct != 0], torch.unique(targets), rtol=0, atol=0)


@pytest.mark.parametrize(("negatives", "chunk"), [("per_position", 0), ("per_position", 6), ("shared", 0), ("shared", 6)])
def test_fixed_size_in_batch_negatives_give_the_unique_loss(negatives: str, chunk: int) -> None:
    """In-batch negatives from ``batch_distinct`` (repeats as the masked id 0) score as ``torch.unique``'s do."""
    num_items = int(torch.randint(5, 30, ()))  # few items: many repeated targets
    user, table, targets = _inputs(int(torch.randint(14, 60, ())), num_items, 8)
    fixed = draw_negatives(targets, num_items, negatives=negatives, num_negatives=7, in_batch_negatives=True, chunk_size=chunk)
    assert fixed.in_batch.shape == targets.shape and fixed.in_batch.eq(0).any() == (targets.unique().numel() < targets.numel())
    exact = dataclasses.replace(fixed, in_batch=torch.unique(targets))
    if fixed.shared is not None:
        exact.shared = torch.cat([fixed.ids, exact.in_batch]) if negatives == "shared" else exact.in_batch
    got = _weighted(user, table, targets, num_items, (negatives, True, fixed), None, chunk)
    want = _weighted(user, table, targets, num_items, (negatives, True, exact), None, chunk)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_unweighted_full_softmax_is_exactly_cross_entropy() -> None:
    """weights=None keeps the loss as it was: bit for bit ``F.cross_entropy`` of the masked logits."""
    user, table, targets = _inputs(int(torch.randint(5, 40, ())), int(torch.randint(3, 30, ())), 6)
    logits = user @ table.T / 0.05
    logits[:, 0] = float("-inf")
    loss = sampled_softmax_loss(user, targets, lambda ids: table if ids is None else table[ids], table.shape[0] - 1,
                                negatives="full", temperature=0.05)  # fmt: skip
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets), rtol=0, atol=0)


def test_compiled_full_softmax_is_whole_and_equals_the_chunked_one() -> None:
    """Under torch.compile a full softmax within ``COMPILED_WHOLE_LOGITS`` is computed whole (one traced graph for
    every batch size): the same loss and gradients as the eager, chunked one (weights with a zero included)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def loss_and_grads(fn, user, table, targets, weights):
        user, table = user.detach().requires_grad_(), table.detach().requires_grad_()
        loss = fn(user, table, targets, weights)
        return (loss.detach(), *torch.autograd.grad(loss, [user, table]))

    def loss_fn(user, table, targets, weights):
        return sampled_softmax_loss(F.normalize(user, dim=-1), targets,
                                    lambda ids: F.normalize(table if ids is None else table[ids], dim=-1), 30,
                                    negatives="full", chunk_size=8, weights=weights)  # fmt: skip

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss_fn, backend=counter, dynamic=True)
    for positions in (37, 23, 50):  # all over the chunk size: eager runs chunks
        user, table, targets = _inputs(positions, 30, 6)
        weights = torch.rand(positions, dtype=torch.float64)
        weights[0] = 0.0
        got = loss_and_grads(compiled, user, table, targets, weights)
        want = loss_and_grads(loss_fn, user, table, targets, weights)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    assert counter.frame_count == 1


@pytest.mark.parametrize("negatives", ["shared", "per_position"])
def test_chunked_weights_of_another_dtype(negatives: str) -> None:
    """Called directly with float32 vectors and float64 weights: the same loss and gradients as float32 weights (the
    chunks' gradient buffers keep the vectors' dtype)."""
    num_items = int(torch.randint(5, 40, ()))
    user, table, targets = _inputs(int(torch.randint(12, 40, ())), num_items, 8)
    user, table = user.detach().float().requires_grad_(True), table.detach().float().requires_grad_(True)
    sampled = draw_negatives(targets, num_items, negatives=negatives, num_negatives=9, chunk_size=5)
    weights = torch.rand(targets.shape, dtype=torch.float64) + 0.5
    results = []
    for w in (weights, weights.float()):
        user.grad = table.grad = None
        kwargs = dict(shared=table[sampled.shared], shared_ids=sampled.shared) if negatives == "shared" else dict(
            own=table[sampled.distinct], own_rows=sampled.rows, own_ids=sampled.ids)  # fmt: skip
        loss = chunked_softmax_cross_entropy(user, table[targets], targets, temperature=0.07, chunk=5, weights=w, **kwargs)
        loss.backward()
        results.append((loss.detach(), user.grad.clone(), table.grad.clone()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=1e-5, atol=1e-6)
