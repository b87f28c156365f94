"""The fused HSTU mixing step (``recforge.ops.hstu_mixer``): SiLU(pre) -> attention -> LayerNorm * u * dropout as one
node whose backward writes the pre-activation's gradient directly, against the unfused chain (the PyTorch reference,
and the same Triton kernels unfused, which draw the same dropout masks); its custom op; dispatch; an HSTU block.

CPU: Triton's interpreter on tiny float32 / float16 shapes; ``tests/train/test_compiled_step.py`` (gpu) runs it in
real training steps against eager.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _oracles import offsets_of, random_lengths, random_mask, relative_error

from recforge.ops.custom_ops import hstu_mixer_op
from recforge.ops.hstu_mixer import hstu_mixer

MIXER = importlib.import_module("recforge.ops.hstu_mixer")
NORM_GATE = importlib.import_module("recforge.ops.norm_gate")
H, DQK, DV = 2, 8, 16  # unequal widths: a wrong u|v|q|k split shows


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    """The fused paths on for these tests whatever the environment."""
    monkeypatch.setattr(MIXER, "fused", True)
    monkeypatch.setattr(NORM_GATE, "fused", True)


def _inputs(kind: str, dtype: torch.dtype = torch.float32, device="cpu", seed: int | None = None):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, ())) if seed is None else seed)
    lengths = random_lengths(gen, 4, 12)
    total = sum(lengths)
    ts = 1_600_000_000 + torch.cumsum(torch.randint(0, 5000, (total,), generator=gen), 0)
    mask = random_mask(kind, gen, lengths, ts)
    pre = (2 * torch.randn(total, H * (2 * DV + 2 * DQK), generator=gen)).to(device, dtype).requires_grad_()
    weight = (1 + 0.5 * torch.randn(H * DV, generator=gen)).to(device).requires_grad_()
    bias = (0.5 * torch.randn(H * DV, generator=gen)).to(device).requires_grad_()
    pos_w = torch.randn(6, generator=gen).to(device).requires_grad_()
    time_w = torch.randn(9, generator=gen).to(device).requires_grad_()
    if device != "cpu":
        mask = mask.to(device)
    kw = dict(num_heads=H, dqk=DQK, dv=DV, norm_weight=weight, norm_bias=bias, scale=0.3, pos_weights=pos_w,
              timestamps=ts.to(device), time_weights=time_w)  # fmt: skip
    return (pre, offsets_of(lengths).to(device), 12, mask), kw, [pre, weight, bias, pos_w, time_w]


def _grads(y: torch.Tensor, leaves: list[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(y, leaves, dy)


@pytest.mark.parametrize("fused_dq", [False, True])
@pytest.mark.parametrize("kind", ["causal", pytest.param("all", marks=pytest.mark.slow),
                                  pytest.param("targets", marks=pytest.mark.slow)])
def test_fused_matches_reference(interpreter, monkeypatch, kind: str, fused_dq: bool) -> None:
    """Values and every gradient (pre, LayerNorm weight and bias, both biases) against the PyTorch chain; dQ
    through its own kernel and through the dK/dV kernel's float32 sums (then one SiLU' pass)."""
    monkeypatch.setattr(interpreter, "fused_dq", fused_dq)
    args, kw, leaves = _inputs(kind)
    got = hstu_mixer(*args, kernel="triton", **kw)
    expected = hstu_mixer(*args, kernel="pytorch", **kw)
    assert type(got.grad_fn).__name__ == "HSTUMixerBackward" and "HSTUMixer" not in type(expected.grad_fn).__name__
    assert relative_error(got, expected) < 1e-5
    dy = torch.randn_like(expected)
    for name, g, e in zip(["pre", "weight", "bias", "pos", "time"], _grads(got, leaves, dy), _grads(expected, leaves, dy),
                          strict=True):  # fmt: skip
        assert relative_error(g, e) < 2e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_matches_unfused_triton_with_dropout(interpreter, dtype: torch.dtype) -> None:
    """With dropout the fused node and the unfused Triton chain draw the same masks (same seed, same kernel): equal
    values and gradients; the pre-activation's gradient in one tensor instead of four concatenated."""
    args, kw, leaves = _inputs("causal", dtype)
    state = torch.get_rng_state()
    got = hstu_mixer(*args, kernel="triton", p=0.3, training=True, **kw)
    torch.set_rng_state(state)
    MIXER.fused = False
    expected = hstu_mixer(*args, kernel="triton", p=0.3, training=True, **kw)
    MIXER.fused = True
    assert type(got.grad_fn).__name__ == "HSTUMixerBackward" and "HSTUMixer" not in type(expected.grad_fn).__name__
    assert got.dtype == expected.dtype == dtype
    assert (got == 0).any() and relative_error(got, expected) < (1e-6 if dtype == torch.float32 else 1e-3)
    dy = torch.randn_like(expected)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for name, g, e in zip(["pre", "weight", "bias", "pos", "time"], _grads(got, leaves, dy), _grads(expected, leaves, dy),
                          strict=True):  # fmt: skip
        assert g.dtype == e.dtype and relative_error(g, e) < tol, name


def test_custom_op_matches_eager(interpreter) -> None:
    """What a compiled model calls: the custom op gives the eager node's values and gradients."""
    args, kw, leaves = _inputs("targets")
    pre, offsets, max_len, mask = args
    eager = hstu_mixer(*args, kernel="triton", **kw)
    op = hstu_mixer_op(pre, offsets, max_len, mask, kw["scale"], kw["pos_weights"], kw["timestamps"],
                       kw["time_weights"], kw["norm_weight"], kw["norm_bias"], None, 1e-5, 0.0, H, DQK, DV)  # fmt: skip
    torch.testing.assert_close(op, eager, rtol=0, atol=0)
    dy = torch.randn_like(eager)
    for name, g, e in zip(["pre", "weight", "bias", "pos", "time"], _grads(op, leaves, dy), _grads(eager, leaves, dy),
                          strict=True):  # fmt: skip
        assert relative_error(g, e) == 0.0, name


def test_opcheck(interpreter) -> None:
    """torch.library's checks of ``recforge::hstu_mixer``: schema, fake implementation, autograd registration."""
    args, kw, _ = _inputs("causal")
    pre, offsets, max_len, mask = args
    op_args = (pre, offsets, max_len, mask.num_targets, mask.num_contextual, mask.segment_lengths, mask.timestamps,
               mask.causal, -1, 0, 0.3, kw["pos_weights"], kw["timestamps"], kw["time_weights"], kw["norm_weight"],
               kw["norm_bias"], None, 1e-5, 0.0, H, DQK, DV)  # fmt: skip
    torch.library.opcheck(torch.ops.recforge.hstu_mixer.default, op_args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))  # fmt: skip


def test_bad_inputs_are_refused() -> None:
    args, kw, _ = _inputs("causal")
    pre = args[0]
    with pytest.raises(ValueError, match=r"expected \(T, 96\)"):
        hstu_mixer(pre[:, :-1], *args[1:], **kw)
    with pytest.raises(ValueError, match="not in"):
        hstu_mixer(*args, p=1.5, **kw)
    with pytest.raises(ValueError, match="without timestamps"):
        hstu_mixer(*args, **dict(kw, timestamps=None))


def test_cpu_runs_the_unfused_chain() -> None:
    """On CPU (no interpreter) "auto" runs the PyTorch functions: the block's own chain, gradient and all."""
    args, kw, leaves = _inputs("causal")
    y = hstu_mixer(*args, **kw)
    assert y.shape == (args[0].shape[0], H * DV)
    grads = _grads(y, leaves, torch.randn_like(y))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused_dq", [False, True])
def test_gpu_fused_matches_unfused(cuda_device, monkeypatch, dtype: torch.dtype, fused_dq: bool) -> None:
    """On the GPU, long enough for the autotuned kernels (both dQ paths): the fused node against the unfused chain
    with the same kernels."""
    from recforge.ops.triton import hstu

    monkeypatch.setattr(hstu, "fused_dq", fused_dq)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, ())))
    lengths = torch.randint(300, 1200, (5,), generator=gen).tolist()
    heads, dqk, dv = 2, 64, 64
    pre = torch.randn(sum(lengths), heads * (2 * dv + 2 * dqk), generator=gen).to("cuda", dtype).requires_grad_()
    weight = (1 + 0.5 * torch.randn(heads * dv, generator=gen)).cuda().requires_grad_()
    bias = (0.5 * torch.randn(heads * dv, generator=gen)).cuda().requires_grad_()
    from recforge.jagged.mask import AttentionMask

    args = (pre, offsets_of(lengths).cuda(), max(lengths), AttentionMask())
    kw = dict(num_heads=heads, dqk=dqk, dv=dv, norm_weight=weight, norm_bias=bias, p=0.2, training=True)
    state = torch.cuda.get_rng_state()
    got = hstu_mixer(*args, **kw)
    torch.cuda.set_rng_state(state)
    MIXER.fused = False
    expected = hstu_mixer(*args, **kw)
    MIXER.fused = True
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(got, expected) < tol
    dy = torch.randn_like(expected)
    leaves = [pre, weight, bias]
    for name, g, e in zip(["pre", "weight", "bias"], _grads(got, leaves, dy), _grads(expected, leaves, dy), strict=True):
        assert relative_error(g, e) < (1e-4 if dtype == torch.float32 else 2e-2), name
