"""The fused gather-dot (``recforge.ops.gather_dot``): the Triton kernels against float64 sums of the inputs' values
(logits and both gradients, repeated indices, odd widths, sizes off the tiles), the custom op and a compiled call,
dispatch and the switch, and the sampled-softmax loss through it (unchunked and chunked) against the PyTorch path.

CPU: Triton's interpreter on small shapes; the gpu tests add the real shape and dtypes.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from _cuda import capture_without_syncs
from _oracles import relative_error, sampled_loss_inputs

from recforge.ops.custom_ops import gather_dot_op
from recforge.ops.gather_dot import gather_dot, gather_dot_reference, gather_rows_sum, scatter_rows_sum
from recforge.train.losses import draw_negatives, sampled_softmax_loss

INTERPRETED = "recforge.ops.triton.gather_dot"
DISPATCH = importlib.import_module("recforge.ops.gather_dot")
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative error (outputs in the inputs' dtype)


def _inputs(n: int, r: int, d: int, rows: int, dtype: torch.dtype, device="cpu", index_dtype=torch.int64):
    q = torch.randn(n, d).to(device, dtype).requires_grad_()
    table = torch.randn(rows, d).to(device, dtype).requires_grad_()
    idx = torch.randint(0, rows, (n, r), device=device, dtype=index_dtype)
    return q, table, idx


def _float64(q, table, idx):
    """Logits of the inputs' values in float64, for the gradients by autograd."""
    q64, t64 = q.detach().double().requires_grad_(), table.detach().double().requires_grad_()
    return q64, t64, torch.bmm(t64[idx.long()], q64.unsqueeze(2)).squeeze(2)


def _check(n: int, r: int, d: int, rows: int, dtype=torch.float32, device="cpu", index_dtype=torch.int64) -> None:
    q, table, idx = _inputs(n, r, d, rows, dtype, device, index_dtype)
    logits = gather_dot(q, table, idx, kernel="triton")
    assert logits.dtype == torch.float32 and logits.shape == (n, r)
    q64, t64, expected = _float64(q, table, idx)
    assert (
        relative_error(logits.detach(), expected.detach()) < 1e-6
    )  # float32 sums of the inputs' values, whatever their dtype
    grad = torch.randn(n, r, device=device)
    dq, dtable = torch.autograd.grad(logits, [q, table], grad)
    dq64, dt64 = torch.autograd.grad(expected, [q64, t64], grad.double())
    assert dq.dtype == dtype and dtable.dtype == dtype and dtable.shape == table.shape
    assert relative_error(dq, dq64) < TOL[dtype], "dq"
    assert relative_error(dtable, dt64) < TOL[dtype], "dtable"
    untouched = torch.ones(rows, dtype=torch.bool, device=device)
    untouched[idx.long().reshape(-1)] = False
    assert bool((dtable[untouched] == 0).all())  # rows no index points to: exact zeros, written by their program


@pytest.mark.parametrize(("n", "r", "d", "rows"), [(37, 5, 24, 6), (3, 129, 300, 40), (50, 1, 1, 3), (17, 9, 513, 300)])
def test_float32_matches_float64_sums(interpreter, n: int, r: int, d: int, rows: int) -> None:
    """Odd widths, D over one 256-column block, N off every tile, few rows (repeats) and many (untouched rows)."""
    _check(n, r, d, rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_sum_in_float32(interpreter, dtype: torch.dtype) -> None:
    _check(int(torch.randint(1, 40, ())), 7, 33, 5, dtype, index_dtype=torch.int32)


@pytest.mark.parametrize(("dtype", "n", "r", "d", "rows"), [(torch.float32, 37, 5, 24, 6), (torch.float32, 17, 9, 513, 300),
                                                         (torch.bfloat16, 3, 129, 300, 40)])  # fmt: skip
def test_accumulate_2d_matches_float64_sums(interpreter, monkeypatch, dtype: torch.dtype, n: int, r: int, d: int,
                                           rows: int) -> None:  # fmt: skip
    """The kernels' A/B switch (products kept in a register tile, reduced once after the loop) sums the same."""
    monkeypatch.setattr(importlib.import_module("recforge.ops.triton.gather_dot"), "accumulate_2d", True)
    _check(n, r, d, rows, dtype)


def test_hot_row_and_empty_batch(interpreter) -> None:
    """Every pair on one row (a padded batch's padding positions all target row 0), and N = 0."""
    q, table, _ = _inputs(45, 11, 20, 4, torch.float32)
    idx = torch.zeros(45, 11, dtype=torch.int64)
    grad = torch.randn(45, 11)
    dtable = scatter_rows_sum(grad, q.detach(), idx, 4, kernel="triton")
    expected = (grad.double().sum(1, keepdim=True) * q.detach().double()).sum(0)  # exact up to float64 rounding
    torch.testing.assert_close(dtable[0].double(), expected, rtol=1e-4, atol=1e-4)  # 495 float32 products, any order
    assert bool((dtable[1:] == 0).all())
    empty = gather_dot(q[:0], table, idx[:0], kernel="triton")
    assert empty.shape == (0, 11)
    assert gather_rows_sum(grad[:0], table.detach(), idx[:0], kernel="triton").shape == (0, 20)


@pytest.mark.parametrize(("chunk", "n", "r", "d", "rows"), [(7, 37, 5, 24, 6), (16, 17, 9, 513, 300), (1, 5, 3, 8, 4)])
def test_split_segments_matches_float64_sums(interpreter, monkeypatch, chunk: int, n: int, r: int, d: int,
                                             rows: int) -> None:  # fmt: skip
    """The A/B switch that cuts long rows' pairs into pieces of at most ``chunk`` sums the same."""
    monkeypatch.setattr(importlib.import_module("recforge.ops.triton.gather_dot"), "split_segments", chunk)
    _check(n, r, d, rows, torch.float32)


def test_split_segments_on_a_hot_row_and_empty_rows(interpreter, monkeypatch) -> None:
    """Most pairs on one row, some rows drawn by nobody (zeros) and an index out of range (adds nothing), split into
    pieces of 8 pairs: the same sums as the unsplit kernel, in a fixed order (bit-identical reruns)."""
    kernels = importlib.import_module("recforge.ops.triton.gather_dot")
    q, _, _ = _inputs(40, 6, 20, 10, torch.float32)
    idx = torch.where(torch.rand(40, 6) < 0.8, 2, torch.randint(0, 7, (40, 6)))
    idx[0, 0] = 10  # out of range: adds nothing
    grad = torch.randn(40, 6)
    expected = scatter_rows_sum(grad, q.detach(), idx, 10, kernel="triton")
    monkeypatch.setattr(kernels, "split_segments", 8)
    got = scatter_rows_sum(grad, q.detach(), idx, 10, kernel="triton")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert bool((got[7:] == 0).all()) and torch.equal(got, scatter_rows_sum(grad, q.detach(), idx, 10, kernel="triton"))


def test_primitives_match_their_references(interpreter) -> None:
    q, table, idx = (t.detach() if t.is_floating_point() else t for t in _inputs(23, 6, 40, 9, torch.float32))
    g = torch.randn(23, 6)
    for kernel_fn, args in ((gather_rows_sum, (g, table, idx)), (scatter_rows_sum, (g, q, idx, 9))):
        got, want = kernel_fn(*args, kernel="triton"), kernel_fn(*args, kernel="pytorch")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_custom_op_is_the_eager_kernel_and_compiles_in_one_graph(interpreter) -> None:
    q, table, idx = _inputs(13, 7, 24, 10, torch.float32)
    eager = interpreter.GatherDot.apply(q, table, idx)
    op = gather_dot_op(q, table, idx)
    torch.testing.assert_close(op, eager, rtol=0, atol=0)
    grad = torch.randn_like(eager)
    for g, e in zip(
        torch.autograd.grad(op, [q, table], grad), torch.autograd.grad(eager, [q, table], grad), strict=True
    ):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    torch.library.opcheck(torch.ops.recforge.gather_dot.default, (q, table, idx),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))  # fmt: skip
    torch._dynamo.reset()
    fn = torch.compile(lambda q, t, i: gather_dot(q, t, i, kernel="triton").logsumexp(1).sum(), backend="aot_eager",
                       fullgraph=True)  # fullgraph: a graph break raises  # fmt: skip
    loss = fn(q, table, idx)
    expected = gather_dot_reference(q, table, idx).logsumexp(1).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(loss, [q, table])
    for g, e in zip(got, torch.autograd.grad(expected, [q, table]), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_dispatch_switch_and_refusals(interpreter, monkeypatch) -> None:
    q, table, idx = _inputs(5, 3, 8, 4, torch.float32)
    reference = torch.bmm(F.embedding(idx, table), q.unsqueeze(2)).squeeze(2)
    monkeypatch.setattr(DISPATCH, "default_kernel", "pytorch")  # RECFORGE_FUSED_GATHER_DOT=0
    assert torch.equal(gather_dot(q, table, idx), reference)
    monkeypatch.setattr(DISPATCH, "default_kernel", "auto")  # the default: CPU tensors still take PyTorch
    assert torch.equal(gather_dot(q, table, idx), reference)
    cuda = torch.device("cuda")  # the default's choice on CUDA inputs: float32 only, unless switched on (=1)
    monkeypatch.setattr(DISPATCH, "float32_only", True)
    assert [DISPATCH._backend(cuda, None, None, t) for t in (torch.float32, torch.bfloat16)] == ["triton", "pytorch"]
    assert DISPATCH._backend(cuda, None, "triton", torch.bfloat16) == "triton"  # an explicit kernel is kept
    monkeypatch.setattr(DISPATCH, "float32_only", False)
    assert DISPATCH._backend(cuda, None, None, torch.bfloat16) == "triton"
    with pytest.raises(ValueError, match="float64"):
        gather_dot(q.double(), table.double(), idx, kernel="triton")
    with pytest.raises(ValueError, match="dtypes"):
        gather_dot(q, table.half(), idx, kernel="triton")
    with pytest.raises(ValueError, match="expected"):
        gather_dot(q, table[:, :5], idx, kernel="triton")


def _loss_grads(user, table, targets, sampled, num_items: int, loss_fn=sampled_softmax_loss, **kwargs):
    user.grad = table.grad = None
    loss = loss_fn(F.normalize(user, dim=-1), targets,
                                lambda ids: F.normalize(table if ids is None else table[ids], dim=-1), num_items,
                                sampled=sampled, temperature=0.07, **kwargs)  # fmt: skip
    loss.backward()
    return loss.detach(), user.grad.clone(), table.grad.clone()


@pytest.mark.parametrize("chunk", [0, 7])
def test_sampled_softmax_through_the_kernels_matches_pytorch(interpreter, monkeypatch, chunk: int) -> None:
    """The loss's per-position path (unchunked: [target | negatives] of the whole table; chunked: the distinct
    negatives) with the kernels and with PyTorch's gather + bmm: the same value and gradients."""
    k = 9
    num_items, user, table, targets, weights = sampled_loss_inputs()
    sampled = draw_negatives(targets, num_items, num_negatives=k, chunk_size=chunk)
    kwargs = dict(num_negatives=k, chunk_size=chunk, weights=weights)
    monkeypatch.setattr(DISPATCH, "default_kernel", "pytorch")
    expected = _loss_grads(user, table, targets, sampled, num_items, **kwargs)
    monkeypatch.setattr(DISPATCH, "default_kernel", "triton")
    got = _loss_grads(user, table, targets, sampled, num_items, **kwargs)
    for name, g, e in zip(("loss", "user", "table"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk", [0, pytest.param(7, marks=pytest.mark.slow)])
def test_compiled_loss_through_the_kernels_is_one_graph(interpreter, monkeypatch, chunk: int) -> None:
    """``torch.compile(fullgraph=True)`` of the loss with the kernels (custom ops: no graph break), its value and
    gradients those of the eager PyTorch path."""
    positions, num_items, k = 30, 20, 9
    user, table = torch.randn(positions, 16, requires_grad=True), torch.randn(num_items + 1, 16, requires_grad=True)
    targets = torch.randint(1, num_items + 1, (positions,))
    sampled = draw_negatives(targets, num_items, num_negatives=k, chunk_size=chunk)
    kwargs = dict(num_negatives=k, chunk_size=chunk)
    monkeypatch.setattr(DISPATCH, "default_kernel", "pytorch")
    expected = _loss_grads(user, table, targets, sampled, num_items, **kwargs)
    monkeypatch.setattr(DISPATCH, "default_kernel", "triton")
    torch._dynamo.reset()
    compiled = torch.compile(sampled_softmax_loss, backend="aot_eager", fullgraph=True)
    got = _loss_grads(user, table, targets, sampled, num_items, loss_fn=compiled, **kwargs)
    for name, g, e in zip(("loss", "user", "table"), got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n", "r", "d", "rows"), [(16_384, 129, 1024, 100_001), (4099, 33, 200, 5000), (1000, 8, 64, 3)]
)
def test_gpu_matches_float64_sums(cuda_device, dtype: torch.dtype, n: int, r: int, d: int, rows: int) -> None:
    _check(n, r, d, rows, dtype, cuda_device)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "r", "d", "rows"), [(4099, 33, 200, 5000), (1000, 8, 64, 3)])
def test_gpu_split_segments_matches_float64_sums(cuda_device, monkeypatch, n: int, r: int, d: int, rows: int) -> None:
    monkeypatch.setattr(importlib.import_module("recforge.ops.triton.gather_dot"), "split_segments", 256)
    _check(n, r, d, rows, torch.float32, cuda_device)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [0, 4096])
def test_gpu_sampled_softmax_through_the_kernels_matches_pytorch(cuda_device, monkeypatch, chunk: int) -> None:
    positions, num_items, k = 10_000, 50_000, 128
    user = torch.randn(positions, 256, device=cuda_device, requires_grad=True)
    table = torch.randn(num_items + 1, 256, device=cuda_device, requires_grad=True)
    targets = torch.randint(1, num_items + 1, (positions,), device=cuda_device)
    sampled = draw_negatives(targets, num_items, num_negatives=k, chunk_size=chunk)
    results = []
    for kernel in ("pytorch", "auto"):
        monkeypatch.setattr(DISPATCH, "default_kernel", kernel)
        results.append(_loss_grads(user, table, targets, sampled, num_items, num_negatives=k, chunk_size=chunk))
    for name, g, e in zip(("loss", "user", "table"), results[1], results[0], strict=True):
        assert relative_error(g, e) < 1e-5, name


@pytest.mark.gpu
def test_gpu_graph_capture_without_syncs(cuda_device) -> None:
    """Forward + backward (the sort included) captured in a CUDA graph with no host sync, as ``train.cuda_graphs``
    does; a replay on new indices gives their logits and gradients."""
    q, table, idx = _inputs(4096, 129, 256, 20_000, torch.float32, cuda_device)
    grad = torch.randn(4096, 129, device=cuda_device)

    def step():
        logits = gather_dot(q, table, idx, kernel="triton")
        return (logits, *torch.autograd.grad(logits, [q, table], grad))

    graph, out = capture_without_syncs(step)
    idx.copy_(torch.randint(0, 20_000, idx.shape, device=cuda_device))
    graph.replay()
    q64, t64, expected = _float64(q, table, idx)
    want = (expected, *torch.autograd.grad(expected, [q64, t64], grad.double()))
    for name, g, e in zip(("logits", "dq", "dtable"), out, want, strict=True):
        assert relative_error(g, e.detach()) < 1e-5, name
