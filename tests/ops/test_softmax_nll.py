"""``recforge.ops.softmax_nll``: each row's sampled-softmax loss and logit gradients in one pass (Triton kernel)
against a float64 oracle written from the definition (concatenate, log-softmax, autograd), and the losses that use it
(``sampled_softmax_loss`` with shared negatives, chunked or as one chunk) with the kernel and with PyTorch's ops.

CPU: Triton's interpreter on small shapes; the gpu tests add the real shapes."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from _oracles import sampled_loss_inputs

from recforge.ops.custom_ops import softmax_nll_op
from recforge.ops.softmax_nll import softmax_nll, softmax_nll_reference
from recforge.train.losses import draw_negatives, sampled_softmax_loss

INTERPRETED = "recforge.ops.triton.softmax_nll"
DISPATCH = importlib.import_module("recforge.ops.softmax_nll")


def _inputs(t: int, k: int, per_row: bool, weighted: bool, device="cpu", items: int = 30):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    logits = (torch.randn(t, k, generator=gen) * 8).to(device)
    pos = (torch.randn(t, generator=gen) * 8).to(device)
    ids = torch.randint(0, items, (t, k) if per_row else (k,), generator=gen).to(device)  # 0: padding columns
    targets = torch.randint(1, items, (t,), generator=gen).to(device)
    share = torch.rand(t, generator=gen).to(device) if weighted else None
    return logits, pos, ids, targets, share


def _oracle(logits, pos, ids, targets, share):
    """float64 ``-log_softmax(cat([pos, masked logits]))[:, 0]`` and its gradients (times share) by autograd."""
    s = logits.double().requires_grad_()
    p = pos.double().requires_grad_()
    masked = (ids == targets[:, None]) | (ids == 0)
    nll = -F.log_softmax(torch.cat([p[:, None], s.masked_fill(masked, float("-inf"))], 1), 1)[:, 0]
    weight = torch.ones_like(nll) if share is None else share.double()
    g_s, g_p = torch.autograd.grad((nll * weight).sum(), (s, p))
    return nll.detach(), g_s, g_p


def _check(got, want, grad_tol: float) -> None:
    for name, g, w, tol in zip(("nll", "grad", "grad_pos"), got, want, (1e-5, grad_tol, 1e-5), strict=True):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_matches_the_float64_oracle(interpreter, per_row: bool, weighted: bool) -> None:
    t, k = int(torch.randint(1, 30, ())), int(torch.randint(1, 70, ()))
    inputs = _inputs(t, k, per_row, weighted)
    want = _oracle(*inputs)
    _check(softmax_nll(*inputs, kernel="triton"), want, 1e-5)
    got = softmax_nll(*inputs, grad_dtype=torch.bfloat16, kernel="triton")
    assert got[1].dtype == torch.bfloat16 and got[0].dtype == torch.float32
    _check(got, want, 4e-3)  # bfloat16's rounding of entries in [0, 1]
    _check(softmax_nll_reference(*inputs), want, 1e-5)


def test_rows_wider_than_a_program_take_two_passes(interpreter, monkeypatch) -> None:
    monkeypatch.setattr(interpreter, "WHOLE_ROW", 16)  # 16-column tiles: several per row, the last one partial
    for per_row in (False, True):
        inputs = _inputs(int(torch.randint(1, 20, ())), int(torch.randint(17, 90, ())), per_row, True)
        _check(softmax_nll(*inputs, kernel="triton"), _oracle(*inputs), 1e-5)


def test_masked_rows_empty_batch_and_half_logits(interpreter) -> None:
    logits, pos, ids, targets, share = _inputs(11, 40, False, False)
    ids[:] = 0  # every column padding: each row's softmax is its positive alone
    nll, grad, grad_pos = softmax_nll(logits, pos, ids, targets, kernel="triton")
    assert torch.equal(nll, torch.zeros(11)) and torch.equal(grad, torch.zeros(11, 40))
    assert torch.equal(grad_pos, torch.zeros(11))
    empty = _inputs(0, 8, False, True)
    assert [tuple(x.shape) for x in softmax_nll(*empty, kernel="triton")] == [(0,), (0, 8), (0,)]
    logits, pos, ids, targets, share = _inputs(9, 33, False, True)
    strided = (logits.repeat_interleave(2, 1)[:, ::2], pos.repeat_interleave(2)[::2], ids,
               targets.repeat_interleave(2)[::2], share.repeat_interleave(2)[::2])  # strided views of the same values
    _check(softmax_nll(*strided, kernel="triton"), _oracle(logits, pos, ids, targets, share), 1e-5)
    inputs = _inputs(9, 33, True, False)
    half = (inputs[0].half(), *inputs[1:])
    _check(softmax_nll(*half, grad_dtype=torch.float32, kernel="triton"), _oracle(*half), 1e-5)  # float32 sums
    assert softmax_nll(*half, kernel="triton")[1].dtype == torch.float16  # the gradient in the logits' dtype


def test_refusals_name_the_problem(interpreter) -> None:
    logits, pos, ids, targets, share = _inputs(5, 7, False, False)
    for args, match in [((logits, pos[:4], ids, targets), "pos"), ((logits, pos, ids[:6], targets), "ids"),
                        ((logits, pos, ids, targets, torch.ones(3)), "share"),
                        ((logits.double(), pos, ids, targets), "float64"),
                        ((logits, pos, ids.float(), targets), "ids")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            softmax_nll(*args, kernel="triton")


def test_custom_op_is_the_eager_kernel(interpreter) -> None:
    inputs = _inputs(13, 21, False, True)
    eager = softmax_nll(*inputs, grad_dtype=torch.bfloat16, kernel="triton")
    op = softmax_nll_op(*inputs, torch.bfloat16)
    for g, e in zip(op, eager, strict=True):
        assert torch.equal(g, e)
    torch.library.opcheck(torch.ops.recforge.softmax_nll.default, (*inputs, torch.float32),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def _loss_grads(user, table, targets, sampled, num_items: int, loss_fn=sampled_softmax_loss, **kwargs):
    user.grad = table.grad = None
    loss = loss_fn(F.normalize(user, dim=-1), targets,
                   lambda ids: F.normalize(table if ids is None else table[ids], dim=-1), num_items,
                   sampled=sampled, temperature=0.07, negatives="shared", **kwargs)  # fmt: skip
    (2.0 * loss).backward()  # an upstream gradient other than 1: the backward scales the forward's gradients
    return loss.detach(), user.grad.clone(), table.grad.clone()


@pytest.mark.parametrize(("chunk", "in_batch"), [(0, False), (0, True), (7, False), (7, True)])
def test_shared_negatives_loss_through_the_kernel_matches_pytorch(interpreter, monkeypatch, chunk: int,
                                                                   in_batch: bool) -> None:  # fmt: skip
    """Shared negatives (and in-batch ones), unchunked (one chunk) or chunked, weighted: the kernel's loss and
    gradients equal PyTorch's ops'."""
    k = 9
    num_items, user, table, targets, weights = sampled_loss_inputs()
    sampled = draw_negatives(targets, num_items, negatives="shared", num_negatives=k, chunk_size=chunk,
                             in_batch_negatives=in_batch)  # fmt: skip
    kwargs = dict(num_negatives=k, chunk_size=chunk, weights=weights, in_batch_negatives=in_batch)
    monkeypatch.setattr(DISPATCH, "default_kernel", "pytorch")
    expected = _loss_grads(user, table, targets, sampled, num_items, **kwargs)
    monkeypatch.setattr(DISPATCH, "default_kernel", "triton")
    got = _loss_grads(user, table, targets, sampled, num_items, **kwargs)
    for name, g, e in zip(("loss", "user", "table"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_one_chunk_loss_is_one_graph(interpreter, monkeypatch) -> None:
    """``torch.compile(fullgraph=True)`` of the unchunked shared-negatives loss with the kernel (the custom op, no
    loop over chunks: no graph break), its value and gradients those of the eager PyTorch path."""
    positions, num_items, k = 30, 20, 9
    user, table = torch.randn(positions, 16, requires_grad=True), torch.randn(num_items + 1, 16, requires_grad=True)
    targets = torch.randint(1, num_items + 1, (positions,))
    sampled = draw_negatives(targets, num_items, negatives="shared", num_negatives=k)
    monkeypatch.setattr(DISPATCH, "default_kernel", "pytorch")
    expected = _loss_grads(user, table, targets, sampled, num_items, num_negatives=k)
    monkeypatch.setattr(DISPATCH, "default_kernel", "triton")
    torch._dynamo.reset()
    compiled = torch.compile(sampled_softmax_loss, backend="aot_eager", fullgraph=True)
    got = _loss_grads(user, table, targets, sampled, num_items, loss_fn=compiled, num_negatives=k)
    for name, g, e in zip(("loss", "user", "table"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "k", "per_row"), [(4099, 8192, False), (1000, 20000, False), (513, 129, True)])
def test_gpu_matches_the_float64_oracle(cuda_device, t: int, k: int, per_row: bool) -> None:
    inputs = _inputs(t, k, per_row, True, cuda_device, items=100_000)
    want = _oracle(*inputs)
    _check(softmax_nll(*inputs), want, 1e-5)  # "auto": the kernel on CUDA
    _check(softmax_nll(*inputs, grad_dtype=torch.bfloat16), want, 4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("half", [False, True])
def test_gpu_loss_compiled_equals_eager_and_pytorch(cuda_device, monkeypatch, half: bool) -> None:
    """The unchunked shared-negatives loss on CUDA (the kernel, float16 logits with ``half``): eager, compiled by
    Inductor, and PyTorch's ops agree."""
    positions, num_items, k = 3000, 5000, 1024
    user = torch.randn(positions, 64, device=cuda_device, requires_grad=True)
    table = torch.randn(num_items + 1, 64, device=cuda_device, requires_grad=True)
    targets = torch.randint(1, num_items + 1, (positions,), device=cuda_device)
    sampled = draw_negatives(targets, num_items, negatives="shared", num_negatives=k)
    kwargs = dict(num_negatives=k, matmul="float16" if half else "float32")
    got = _loss_grads(user, table, targets, sampled, num_items, **kwargs)
    torch._dynamo.reset()
    compiled = _loss_grads(user, table, targets, sampled, num_items, loss_fn=torch.compile(sampled_softmax_loss),
                           **kwargs)  # fmt: skip
    monkeypatch.setattr(DISPATCH, "default_kernel", "pytorch")
    expected = _loss_grads(user, table, targets, sampled, num_items, **kwargs)
    for other in (compiled, expected):
        for name, g, e in zip(("loss", "user", "table"), got, other, strict=True):
            torch.testing.assert_close(g, e, rtol=2e-3 if half else 1e-4, atol=1e-5, msg=name)
