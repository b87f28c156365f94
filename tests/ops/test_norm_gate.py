"""The fused ``dropout(layer_norm(a) * u)`` (``recforge.ops.norm_gate``): the Triton kernels against the PyTorch
chain (values and every gradient; with dropout, given the kernel's own mask), the dropout's randomness (fresh
per call, reproducible, none drawn without dropout), dispatch, the custom op, and an HSTU block through it.

CPU: Triton's interpreter on small float32 shapes (bfloat16 too); the gpu tests add the real dtypes and
shapes, and a CUDA graph whose replays draw fresh masks.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from _cuda import capture_without_syncs
from _oracles import relative_error

from recforge.ops.custom_ops import norm_gate_op
from recforge.ops.norm_gate import norm_gate, norm_gate_reference

INTERPRETED = "recforge.ops.triton.norm_gate"
DISPATCH = importlib.import_module("recforge.ops.norm_gate")  # the module (``recforge.ops.norm_gate`` is the function)


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    """The fused path (on unless ``RECFORGE_FUSED_NORM_GATE=0``): on for these tests whatever the environment."""
    monkeypatch.setattr(DISPATCH, "fused", True)
EPS = 1e-5


def _inputs(tokens: int, width: int, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int | None = None):
    """a (T, N), u a column slice of a wider (T, 3N) projection (a row stride != N, as in HSTUBlock), weight, bias."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, ())) if seed is None else seed)
    a = torch.randn(tokens, width, generator=gen).to(device, dtype).requires_grad_()
    proj = torch.randn(tokens, 3 * width, generator=gen).to(dtype)
    # no exact zeros (torch.randn gives some, ~1 in 10^7 draws, and float16 rounds |x| < 3e-8 to 0): a zero gate
    # would make a kept element 0, and _check reads the dropout mask off the output
    proj = torch.where(proj == 0, 1.0, proj).to(device).requires_grad_()
    weight = (1 + 0.5 * torch.randn(width, generator=gen)).to(device).requires_grad_()
    bias = (0.5 * torch.randn(width, generator=gen)).to(device).requires_grad_()
    return a, proj, weight, bias


def _gate(proj: torch.Tensor, width: int) -> torch.Tensor:
    return proj[:, width : 2 * width]


def _float32_chain(a, u, weight, bias, keep=None, p=0.0):
    """The PyTorch chain in float32 (from the inputs' values), dropout given its keep mask."""
    y = F.layer_norm(a.float(), (a.shape[-1],), weight.float(), bias.float(), EPS) * u.float()
    return y if keep is None else torch.where(keep, y / (1 - p), 0.0)


def _check(dtype: torch.dtype, tokens: int, width: int, p: float, device="cpu", tol=(1e-5, 1e-5)) -> None:
    """Fused vs the float32 chain, forward and all four gradients; with dropout, the mask read off the output."""
    a, proj, weight, bias = _inputs(tokens, width, dtype, device)
    u = _gate(proj, width)
    y = norm_gate(a, u, weight, bias, eps=EPS, p=p, training=True, kernel="triton")
    assert y.dtype == dtype and y.shape == (tokens, width)
    keep = None
    if p > 0:
        plain = _float32_chain(a, u, weight, bias).detach()
        keep = y.detach() != 0
        assert bool((plain != 0).all()), "an exact zero of the chain would hide its dropout mask"
        kept = float(keep.float().mean())
        sd = math.sqrt(p * (1 - p) / keep.numel())
        assert abs(kept - (1 - p)) < 5 * sd + 1e-3, (kept, 1 - p)
    expected = _float32_chain(a, u, weight, bias, keep, p)
    rtol, atol = tol
    torch.testing.assert_close(y.float(), expected, rtol=rtol, atol=atol)
    grad = torch.randn_like(expected)
    leaves = [a, proj, weight, bias]
    got = torch.autograd.grad(y.float(), leaves, grad)
    want = torch.autograd.grad(expected, leaves, grad)
    for name, g, e in zip(["a", "u", "weight", "bias"], got, want, strict=True):
        assert relative_error(g.float(), e.float()) < rtol, name


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("width", [24, 64])
def test_float32_matches_chain(interpreter, width: int, p: float) -> None:
    _check(torch.float32, int(torch.randint(1, 70, ())), width, p)


def test_bfloat16_matches_float32_chain(interpreter) -> None:
    """bf16 inputs, float32 math: the output is the float32 chain rounded to bf16."""
    _check(torch.bfloat16, 33, 40, 0.2, tol=(1e-2, 1e-2))


def test_dropout_masks_fresh_reproducible_and_not_drawn_without_dropout(interpreter) -> None:
    a, proj, weight, bias = _inputs(64, 32, torch.float32)
    u = _gate(proj, 32)
    with torch.no_grad():
        first, second = (norm_gate(a, u, weight, bias, p=0.5, training=True, kernel="triton") != 0 for _ in range(2))
        assert (first != second).float().mean() > 0.3  # two calls: independent masks (half of elements differ)
        torch.manual_seed(7)
        again = norm_gate(a, u, weight, bias, p=0.5, training=True, kernel="triton")
        torch.manual_seed(7)
        torch.testing.assert_close(norm_gate(a, u, weight, bias, p=0.5, training=True, kernel="triton"), again,
                                   rtol=0, atol=0)  # fmt: skip
        state = torch.get_rng_state()
        plain = norm_gate(a, u, weight, bias, p=0.0, training=True, kernel="triton")
        evaluated = norm_gate(a, u, weight, bias, p=0.5, training=False, kernel="triton")
        assert torch.equal(torch.get_rng_state(), state)  # no dropout: no random draw
        torch.testing.assert_close(evaluated, plain, rtol=0, atol=0)
        assert (norm_gate(a, u, weight, bias, p=1.0, training=True, kernel="triton") == 0).all()


def test_custom_op_is_the_eager_kernel(interpreter) -> None:
    a, proj, weight, bias = _inputs(20, 24, torch.float32)
    u = _gate(proj, 24)
    seed = torch.randint(0, 2**62, (1,))
    eager = interpreter.NormGate.apply(a, u, weight, bias, seed, EPS, 0.4)
    op = norm_gate_op(a, u, weight, bias, seed, EPS, 0.4)
    torch.testing.assert_close(op, eager, rtol=0, atol=0)
    grad = torch.randn_like(eager)
    for g, e in zip(torch.autograd.grad(op, [a, proj, weight, bias], grad),
                    torch.autograd.grad(eager, [a, proj, weight, bias], grad), strict=True):  # fmt: skip
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    args = (a.detach().requires_grad_(), u.detach().requires_grad_(), weight, bias, seed, EPS, 0.4)
    torch.library.opcheck(torch.ops.recforge.norm_gate.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))  # fmt: skip


def test_compiled_call_uses_the_op_with_fresh_masks(interpreter) -> None:
    """Under torch.compile (Dynamo's capture, no graph break) the seed is drawn inside the graph: each call fresh."""
    a, proj, weight, bias = _inputs(16, 24, torch.float32)
    u = _gate(proj, 24).detach()
    torch._dynamo.reset()
    fn = torch.compile(lambda a, u: norm_gate(a, u, weight, bias, p=0.5, training=True, kernel="triton"),
                       backend="eager", fullgraph=True)  # fmt: skip
    first, second = fn(a, u), fn(a, u)
    for y in (first, second):
        keep = y.detach() != 0
        torch.testing.assert_close(y, _float32_chain(a, u, weight, bias, keep, 0.5), rtol=1e-5, atol=1e-5)
    assert not torch.equal(first != 0, second != 0)


def test_dispatch_cpu_and_flag_run_the_pytorch_chain(interpreter, monkeypatch) -> None:
    a, proj, weight, bias = _inputs(9, 16, torch.float32)
    u = _gate(proj, 16)
    torch.manual_seed(3)
    expected = F.dropout(F.layer_norm(a, (16,), weight, bias, EPS) * u, 0.3, True)
    for kernel in ("auto", "pytorch"):  # CPU tensors: auto is the PyTorch chain, the same draws bit for bit
        torch.manual_seed(3)
        assert torch.equal(norm_gate(a, u, weight, bias, eps=EPS, p=0.3, training=True, kernel=kernel), expected)
    monkeypatch.setattr(DISPATCH, "fused", False)
    torch.manual_seed(3)
    assert torch.equal(norm_gate(a, u, weight, bias, eps=EPS, p=0.3, training=True, kernel="triton"), expected)
    assert torch.equal(norm_gate_reference(a, u, weight, bias, EPS, 0.3, False), F.layer_norm(a, (16,), weight, bias, EPS) * u)


def test_triton_refuses_what_it_cannot_take(interpreter) -> None:
    a, proj, weight, bias = _inputs(4, 8, torch.float64)
    with pytest.raises(ValueError, match="float64"):
        norm_gate(a, _gate(proj, 8), weight, bias, kernel="triton")
    with pytest.raises(ValueError, match="without weight"):
        norm_gate(a.float(), _gate(proj, 8).float(), None, None, kernel="triton")
    with pytest.raises(ValueError, match="not in"):
        norm_gate(a, _gate(proj, 8), weight, bias, p=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(38_000, 128), (16_384, 512), (1000, 200)])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_gpu_matches_chain(cuda_device, dtype: torch.dtype, shape: tuple[int, int], p: float) -> None:
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    _check(dtype, *shape, p, device=cuda_device, tol=tol)


@pytest.mark.gpu
def test_gpu_graph_replays_draw_fresh_masks_without_syncs(cuda_device) -> None:
    """Forward + backward captured in a CUDA graph (no host sync): each replay a new mask, the output consistent with it."""
    a, proj, weight, bias = _inputs(4096, 128, torch.bfloat16, cuda_device)
    grad = torch.randn(4096, 128, device=cuda_device, dtype=torch.bfloat16)

    def step():
        # the gate sliced inside the captured step, as in a training step: a node recorded outside the capture
        # would run its backward on the stream it ran on (the legacy default stream), which a capture forbids
        y = norm_gate(a, _gate(proj, 128), weight, bias, p=0.3, training=True, kernel="triton")
        y.backward(grad)
        return y

    def clear_grads() -> None:
        for t in (a, proj, weight, bias):
            t.grad = None  # allocated inside the capture, from the graph's pool

    graph, out = capture_without_syncs(step, before=clear_grads)
    masks = []
    for _ in range(2):
        graph.replay()
        keep = out.detach() != 0
        masks.append(keep.clone())
        expected = _float32_chain(a, _gate(proj, 128), weight, bias, keep, 0.3)
        torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    assert (masks[0] != masks[1]).float().mean() > 0.2


def _encoder(dropout: float, kernel: str, checkpoint_blocks: int = 0):
    from recforge.models.hstu import HSTUConfig, HSTUEncoder

    cfg = HSTUConfig(dim=16, num_blocks=2, num_heads=2, dqk=8, dv=12, dropout=dropout, max_seq_len=12,
                     num_time_buckets=0, kernel=kernel, checkpoint_blocks=checkpoint_blocks)  # fmt: skip
    return HSTUEncoder(cfg)


def _encoder_grads(encoder, x, offsets, seed: int):
    from recforge.jagged.mask import AttentionMask

    torch.manual_seed(seed)
    y = encoder(x, offsets, 12, AttentionMask())
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    return y, torch.autograd.grad((y * weights).sum(), [x, *encoder.parameters()])


def test_hstu_block_fused_combine_matches_pytorch(interpreter) -> None:
    """``HSTUBlock.combine`` through the kernel (kernel="triton") and the PyTorch chain, without dropout."""
    fused, plain = _encoder(0.0, "triton"), _encoder(0.0, "pytorch")
    plain.load_state_dict(fused.state_dict())
    block, ref = fused.blocks[0], plain.blocks[0]
    tokens = int(torch.randint(1, 40, ()))
    x, attn, proj = torch.randn(tokens, 16), torch.randn(tokens, 2, 12), torch.randn(tokens, 48)
    leaves = [attn, proj, *block.parameters()]
    for t in (x, attn, proj):
        t.requires_grad_()
    u = proj[:, :24]
    got, expected = block.combine(x, attn, u, kernel="triton"), ref.combine(x, attn, u)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(got)
    for g, e in zip(torch.autograd.grad(got, leaves, grad, allow_unused=True),
                    torch.autograd.grad(expected, [attn, proj, *ref.parameters()], grad, allow_unused=True),
                    strict=True):  # fmt: skip
        assert (g is None) == (e is None)
        if g is not None:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_checkpointed_blocks_replay_the_fused_dropout(interpreter) -> None:
    """Activation checkpointing recomputes a block with the RNG state restored: the same seed, so the same mask."""
    from recforge.jagged.index import offsets_from_lengths

    plain, checkpointed = _encoder(0.4, "triton"), _encoder(0.4, "triton", checkpoint_blocks=2)
    checkpointed.load_state_dict(plain.state_dict())
    offsets = offsets_from_lengths(torch.tensor([5, 12, 3]))
    x = torch.randn(20, 16, requires_grad=True)
    seed = int(torch.randint(0, 2**30, ()))
    y, grads = _encoder_grads(plain, x, offsets, seed)
    y_ckpt, grads_ckpt = _encoder_grads(checkpointed, x, offsets, seed)
    torch.testing.assert_close(y_ckpt, y, rtol=0, atol=0)
    for g, e in zip(grads_ckpt, grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    _, other = _encoder_grads(plain, x, offsets, seed + 1)
    assert not torch.equal(other[0], grads[0])  # another seed: other masks


def test_block_with_rows_too_wide_for_the_kernel_runs_the_chain(interpreter) -> None:
    """A model whose attention runs Triton (kernel="triton") still trains with rows the fused kernel does not take
    (H * Dv > MAX_TRITON_WIDTH): its combine runs the PyTorch chain instead of refusing."""
    from recforge.models.hstu import HSTUConfig, HSTUEncoder
    from recforge.ops.norm_gate import MAX_TRITON_WIDTH

    dv = MAX_TRITON_WIDTH // 2 + 4
    make = lambda kernel: HSTUEncoder(HSTUConfig(dim=8, num_blocks=1, num_heads=2, dqk=4, dv=dv, dropout=0.0,  # noqa: E731
                                                 max_seq_len=4, num_time_buckets=0, kernel=kernel))  # fmt: skip
    wide, plain = make("triton"), make("pytorch")
    plain.load_state_dict(wide.state_dict())
    tokens = int(torch.randint(1, 4, ()))
    x, attn, u = torch.randn(tokens, 8), torch.randn(tokens, 2, dv), torch.randn(tokens, 2 * dv)
    got = wide.blocks[0].combine(x, attn, u, kernel="triton")
    torch.testing.assert_close(got, plain.blocks[0].combine(x, attn, u), rtol=1e-5, atol=1e-5)
