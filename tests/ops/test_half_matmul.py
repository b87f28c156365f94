"""``loss.matmul: float16`` (``recforge.ops.half_matmul``): the loss's logit matmuls from float16 inputs with float32
sums and outputs, their gradients from bfloat16 inputs. Against float64 on the same inputs: the logits within float16
input rounding, the gradients within bfloat16's, for the unchunked and chunked losses, plain and weighted; the switch
and its check. CPU runs the emulation (float16 values widened to float32); the gpu tests the
cuBLAS path, eager and compiled.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from _oracles import relative_error

from recforge.config import ConfigError, load_config
from recforge.ops.half_matmul import half_input_logits, mm_f32, mm_f32_add_, use_half
from recforge.train.chunked_softmax import chunked_full_softmax_cross_entropy, chunked_softmax_cross_entropy
from recforge.train.losses import draw_negatives, sampled_softmax_loss

LOSSES = importlib.import_module("recforge.train.losses")
# float16 inputs carry 2^-11 relative rounding, bfloat16 2^-8 (the backward): relative to the result's norm
HALF_TOL = 2e-3
GRAD_TOL = 8e-3


def _unit(n: int, d: int, device="cpu") -> torch.Tensor:
    return F.normalize(torch.randn(n, d, device=device), dim=-1)


def test_logits_are_float16_inputs_summed_in_float32() -> None:
    a, b = _unit(int(torch.randint(5, 60, ())), 48) * 20, _unit(int(torch.randint(5, 60, ())), 48)
    got = half_input_logits(a, b)
    assert got.dtype == torch.float32
    exact = a.half().double() @ b.half().double().T  # the rounded inputs' products, summed exactly
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-5)
    assert 1e-5 < relative_error(got, a.double() @ b.double().T) < HALF_TOL  # float16 input rounding, no more


@pytest.mark.parametrize("grad_scale", [1.0, 1e-9, 1e6])
def test_gradients_keep_their_precision_at_any_scale(grad_scale: float) -> None:
    """The output gradient in bfloat16 (float32's range): 1e-9 (1 / positions x temperature, say) keeps its relative
    precision instead of flushing to zero as float16 would."""
    a = _unit(int(torch.randint(20, 80, ())), 32).requires_grad_()
    b = _unit(int(torch.randint(20, 80, ())), 32).requires_grad_()
    grad = torch.randn(a.shape[0], b.shape[0]) * grad_scale
    half_input_logits(a, b).backward(grad)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    (a64 @ b64.T).backward(grad.double())
    assert relative_error(a.grad, a64.grad) < GRAD_TOL
    assert relative_error(b.grad, b64.grad) < GRAD_TOL


def test_zero_gradient_gives_zeros() -> None:
    a, b = _unit(7, 16).requires_grad_(), _unit(5, 16).requires_grad_()
    half_input_logits(a, b).backward(torch.zeros(7, 5))
    assert a.grad.eq(0).all() and b.grad.eq(0).all()


def test_mm_f32_bias_alpha_and_accumulation() -> None:
    a, b, bias = torch.randn(6, 8).half(), torch.randn(8, 5).half(), torch.randn(5)
    torch.testing.assert_close(mm_f32(a, b, bias=bias, alpha=3.0), 3.0 * (a.float() @ b.float()) + bias)
    acc = torch.randn(6, 5)
    want = acc + a.float() @ b.float()
    assert mm_f32_add_(acc, a, b) is acc
    torch.testing.assert_close(acc, want)


def test_inputs_must_be_float32_and_the_switch_checks_its_value() -> None:
    with pytest.raises(TypeError, match="float32 inputs"):
        half_input_logits(torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="loss.matmul='bf16'"):
        use_half("bf16", torch.device("cpu"))
    assert not use_half("float16", torch.device("cpu"))  # CPU: float32 matmuls
    assert use_half("float16", torch.device("cuda")) and not use_half("float32", torch.device("cuda"))


def test_config_accepts_float16_and_names_the_choices(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("recipe: retrieval\ndata: {path: data/x}\n")
    assert load_config(path, ["loss.matmul=float16"]).loss.matmul == "float16"
    with pytest.raises(ConfigError, match="float32"):
        load_config(path, ["loss.matmul=half"])


def _loss_grads(user, table, targets, sampled, num_items, half: bool, monkeypatch, **kwargs):
    monkeypatch.setattr(LOSSES, "use_half", lambda matmul, device: half)
    user, table = user.detach().requires_grad_(), table.detach().requires_grad_()
    loss = sampled_softmax_loss(F.normalize(user, dim=-1), targets,
                                lambda ids: F.normalize(table if ids is None else table[ids], dim=-1), num_items,
                                sampled=sampled, **kwargs)  # fmt: skip
    loss.backward()
    return loss.detach(), user.grad, table.grad


@pytest.mark.parametrize(
    ("negatives", "in_batch", "chunk", "weighted"),
    [("shared", False, 0, False), ("shared", True, 0, True), ("shared", False, 7, False), ("shared", True, 9, True),
     ("full", False, 0, False), ("full", False, 11, True), ("per_position", True, 0, False),
     ("per_position", True, 6, True)],
)  # fmt: skip
def test_loss_with_half_matmuls_matches_float32(monkeypatch, negatives, in_batch, chunk, weighted) -> None:
    """The whole loss (value, user and item gradients) with float16-input matmuls against float32 matmuls on the
    same draws: the loss within float16 input rounding, the gradients within bfloat16's (unchunked) or float16's
    (chunked); per-position negatives keep their gather-dot (only the in-batch columns change)."""
    num_items = int(torch.randint(20, 300, ()))
    positions = int(torch.randint(chunk + 2, 4 * chunk + 40, ()))
    user, table = torch.randn(positions, 32), torch.randn(num_items + 1, 32)
    targets = torch.randint(1, num_items + 1, (positions,))
    weights = torch.rand(positions) * 3 if weighted else None
    sampled = draw_negatives(targets, num_items, negatives=negatives, num_negatives=17, in_batch_negatives=in_batch,
                             chunk_size=chunk)  # fmt: skip
    kwargs = dict(negatives=negatives, num_negatives=17, in_batch_negatives=in_batch, temperature=0.05,
                  chunk_size=chunk, weights=weights)  # fmt: skip
    want = _loss_grads(user, table, targets, sampled, num_items, False, monkeypatch, **kwargs)
    got = _loss_grads(user, table, targets, sampled, num_items, True, monkeypatch, **kwargs)
    for name, g, w, tol in zip(("loss", "user", "table"), got, want, (HALF_TOL, GRAD_TOL, GRAD_TOL), strict=True):
        assert relative_error(g, w) < tol, name
    assert relative_error(got[1], want[1]) > 1e-6  # the reduced-precision matmuls ran (the float32 path twice: 0)


@pytest.mark.parametrize("full", [False, True])
def test_chunked_half_equals_unchunked_half(full: bool) -> None:
    """Chunked float16-input losses, one chunk vs several, on the same inputs: the same logits up to float32
    summation order, which can move a gradient entry's bfloat16 rounding by one step (~4e-3 relative)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    positions, items, d = int(torch.randint(30, 90, ())), int(torch.randint(10, 50, ())), 24
    user, table = _unit(positions, d).requires_grad_(), _unit(items + 1, d).requires_grad_()
    targets = torch.randint(1, items + 1, (positions,))
    weights = torch.rand(positions)
    results = []
    for chunk in (positions, 8):
        user.grad = table.grad = None
        if full:
            loss = chunked_full_softmax_cross_entropy(user, table, targets, temperature=0.05, chunk=chunk,
                                                      weights=weights, half=True)  # fmt: skip
        else:
            loss = chunked_softmax_cross_entropy(user, table[targets], targets, shared=table, shared_ids=torch.arange(items + 1),
                                                 temperature=0.05, chunk=chunk, weights=weights, half=True)  # fmt: skip
        loss.backward()
        results.append((loss.detach(), user.grad.clone(), table.grad.clone()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)  # the loss: float32 logits
    for g, w in zip(results[1][1:], results[0][1:], strict=True):
        assert relative_error(g, w) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [0, 4096])
@pytest.mark.parametrize("negatives", ["shared", "full"])
def test_gpu_half_matmuls_match_float32(cuda_device, monkeypatch, negatives: str, chunk: int) -> None:
    """cuBLAS's float16-input, float32-output matmuls against exact float32 ones (TF32 off), eager and compiled
    (a compiled full softmax stays chunked: its whole-logits threshold lowered)."""
    monkeypatch.setattr(LOSSES, "COMPILED_WHOLE_LOGITS", 0 if chunk else LOSSES.COMPILED_WHOLE_LOGITS)
    positions, num_items, d = 10_000, 20_000, 256
    user = torch.randn(positions, d, device=cuda_device)
    table = torch.randn(num_items + 1, d, device=cuda_device)
    targets = torch.randint(1, num_items + 1, (positions,), device=cuda_device)
    sampled = draw_negatives(targets, num_items, negatives=negatives, num_negatives=2048, in_batch_negatives=True,
                             chunk_size=chunk)  # fmt: skip

    def run(matmul: str, fn=sampled_softmax_loss):
        u, t = user.clone().requires_grad_(), table.clone().requires_grad_()
        loss = fn(F.normalize(u, dim=-1), targets, lambda ids: F.normalize(t if ids is None else t[ids], dim=-1),
                  num_items, negatives=negatives, num_negatives=2048, in_batch_negatives=True, chunk_size=chunk,
                  sampled=sampled, matmul=matmul)  # fmt: skip
        loss.backward()
        return loss.detach(), u.grad, t.grad

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = run("float32")
        eager = run("float16")
        compiled = run("float16", torch.compile(sampled_softmax_loss))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for got in (eager, compiled):
        for name, g, w, tol in zip(("loss", "user", "table"), got, want, (HALF_TOL, GRAD_TOL, GRAD_TOL), strict=True):
            assert relative_error(g, w) < tol, f"{name}: {relative_error(g, w):.2e}"
        assert relative_error(got[1], want[1]) > 1e-5  # the reduced-precision matmuls ran
