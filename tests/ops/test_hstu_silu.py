"""The HSTU block's SiLU and attention as one op (``recforge.ops.hstu_silu_attention``, ``ops.triton.hstu_silu``).

CPU: Triton's interpreter on tiny float32 shapes: the op (eager ``autograd.Function`` and the custom op) gives the
two-step values and projection gradient through its fallback backward (Triton backward + SiLU-backward passes).
GPU (Hopper): the Gluon backward's fused stores against float64 and the unfused path, the routing, and a compiled
HSTU encoder against eager.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from _oracles import offsets_of, random_lengths, relative_error

from recforge.jagged.mask import AttentionMask
from recforge.ops.hstu_attention import hstu_attention_reference, hstu_silu_attention
from recforge.ops.triton import hstu_gluon


def _two_steps(pre, heads, dqk, dv, offsets, max_len, scale):
    """The reference: SiLU, split, then the padded PyTorch attention."""
    tokens = pre.shape[0]
    u, v, q, k = F.silu(pre).split([heads * dv, heads * dv, heads * dqk, heads * dqk], dim=-1)
    a = hstu_attention_reference(q.reshape(tokens, heads, dqk), k.reshape(tokens, heads, dqk),
                                 v.reshape(tokens, heads, dv), offsets, max_len, AttentionMask(), scale)  # fmt: skip
    return u, a


def _tiny(seed: int, dqk: int = 8, dv: int = 4):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, 4, 12) + [0, 1]
    heads = 2
    pre = torch.randn(sum(lengths), heads * (2 * dv + 2 * dqk), generator=gen).requires_grad_()
    return pre, (heads, dqk, dv), offsets_of(lengths), max(lengths), gen


@pytest.mark.parametrize(("entry", "dims"), [("function", (8, 4)), ("custom_op", (8, 4)), ("function", (2, 8))])
def test_op_matches_two_steps(interpreter, entry: str, dims: tuple[int, int]) -> None:
    from recforge.ops.custom_ops import hstu_silu_attention_op
    from recforge.ops.triton.hstu_silu import hstu_silu_attention_triton

    seed = int(torch.randint(0, 2**30, ()))
    pre, (heads, dqk, dv), offsets, max_len, gen = _tiny(seed, *dims)  # (2, 8): u's width no divisor of v|q|k's
    fn = hstu_silu_attention_triton if entry == "function" else hstu_silu_attention_op
    u, a = fn(pre, offsets, max_len, 0.3, heads, dqk, dv)
    u_ref, a_ref = _two_steps(pre, heads, dqk, dv, offsets, max_len, 0.3)
    torch.testing.assert_close(u, u_ref, rtol=1e-6, atol=1e-7)  # SiLU of a column slice: the same up to rounding
    torch.testing.assert_close(a, a_ref, rtol=1e-5, atol=1e-6)
    gu, ga = torch.randn(u.shape, generator=gen), torch.randn(a.shape, generator=gen)
    got = torch.autograd.grad((u * gu).sum() + (a * ga).sum(), pre)[0]
    want = torch.autograd.grad((u_ref * gu).sum() + (a_ref * ga).sum(), pre)[0]
    assert relative_error(got, want) < 1e-5, f"seed {seed}"
    only_attention = torch.autograd.grad((fn(pre, offsets, max_len, 0.3, heads, dqk, dv)[1] * ga).sum(), pre)[0]
    want = torch.autograd.grad((_two_steps(pre, heads, dqk, dv, offsets, max_len, 0.3)[1] * ga).sum(), pre)[0]
    assert relative_error(only_attention, want) < 1e-5, f"seed {seed}: the gate's gradient is not zero when unused"


def test_backward_without_gradients_is_zero(interpreter) -> None:
    from recforge.ops.triton.hstu_silu import silu_attention_backward, silu_attention_forward

    pre, (heads, dqk, dv), offsets, max_len, _ = _tiny(int(torch.randint(0, 2**30, ())))
    pre = pre.detach()
    _, y, _ = silu_attention_forward(pre, offsets, max_len, 0.3, heads, dqk, dv)
    d_pre = silu_attention_backward(None, None, pre, y, offsets, max_len, 0.3, heads, dqk, dv)
    assert d_pre.shape == pre.shape and not d_pre.any()


def test_opcheck(interpreter) -> None:
    """torch.library's checks of the forward op: schema, fake implementation, autograd registration."""
    pre, (heads, dqk, dv), offsets, max_len, _ = _tiny(int(torch.randint(0, 2**30, ())))
    torch.library.opcheck(torch.ops.recforge.hstu_silu_attention.default, (pre, offsets, max_len, 0.3, heads, dqk, dv),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))  # fmt: skip


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("entry", ["function", "custom_op"])
def test_gate_op_matches_two_steps(interpreter, entry: str, p: float) -> None:
    """dropout(LayerNorm(a) * u) as one op (the gate read from the projection's columns, its gradient written into
    the projection's) against the (u, a) op and the norm-gate kernels with the same dropout seed."""
    from recforge.ops.custom_ops import hstu_silu_attention_gate_op
    from recforge.ops.triton.hstu_silu import hstu_silu_attention_gate_triton, hstu_silu_attention_triton
    from recforge.ops.triton.norm_gate import NormGate

    seed = int(torch.randint(0, 2**30, ()))
    pre, (heads, dqk, dv), offsets, max_len, gen = _tiny(seed)
    weight = (1 + 0.1 * torch.randn(heads * dv, generator=gen)).requires_grad_()
    bias = (0.1 * torch.randn(heads * dv, generator=gen)).requires_grad_()
    drop_seed = torch.randint(0, 2**40, (1,), generator=gen) if p > 0 else None
    op = hstu_silu_attention_gate_triton if entry == "function" else hstu_silu_attention_gate_op
    g = op(pre, offsets, max_len, 0.3, heads, dqk, dv, weight, bias, drop_seed, 1e-5, p)
    u, a = hstu_silu_attention_triton(pre, offsets, max_len, 0.3, heads, dqk, dv)
    want = NormGate.apply(a.reshape(a.shape[0], heads * dv), u, weight, bias, drop_seed, 1e-5, p)
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    dg = torch.randn(g.shape, generator=gen)
    got = torch.autograd.grad((g * dg).sum(), (pre, weight, bias))
    expected = torch.autograd.grad((want * dg).sum(), (pre, weight, bias))
    for name, x, e in zip(("pre", "weight", "bias"), got, expected, strict=True):
        assert relative_error(x, e) < 1e-5, f"seed {seed}: d{name}"


def test_gate_opcheck(interpreter) -> None:
    pre, (heads, dqk, dv), offsets, max_len, gen = _tiny(int(torch.randint(0, 2**30, ())))
    weight, bias = torch.randn(heads * dv, generator=gen).requires_grad_(), torch.randn(heads * dv).requires_grad_()
    torch.library.opcheck(torch.ops.recforge.hstu_silu_attention_gate.default,
                          (pre, offsets, max_len, 0.3, heads, dqk, dv, weight, bias, None, 1e-5, 0.0),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))  # fmt: skip


def test_routing_is_a_constant_to_torch_compile() -> None:
    """The Gluon check is marked the way ``torch.compiler.assume_constant_result`` marks functions (set directly: that
    API imports torch._dynamo), so a compiled step bakes it in instead of tracing the device and switch queries."""
    module = importlib.import_module("recforge.ops.hstu_attention")  # the package's attribute is the function
    marked = torch.compiler.assume_constant_result(lambda: 0)
    names = [n for n in vars(marked) if not n.startswith("__")]
    assert names and all(getattr(module._fused_silu_min_len, n) == getattr(marked, n) for n in names), names


def test_cpu_takes_the_two_steps() -> None:
    """Off Hopper the entry point is SiLU, split and ``hstu_attention``: the same values as before the op existed."""
    pre, (heads, dqk, dv), offsets, max_len, _ = _tiny(int(torch.randint(0, 2**30, ())))
    u, a = hstu_silu_attention(pre, heads, dqk, dv, offsets, max_len, AttentionMask(), scale=0.3, kernel="pytorch")
    u_ref, a_ref = _two_steps(pre, heads, dqk, dv, offsets, max_len, 0.3)
    torch.testing.assert_close(u, u_ref, rtol=0, atol=0)
    torch.testing.assert_close(a, a_ref, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------- GPU


def _gpu_batch(device, dtype, dim: int = 128):
    """(seed, generator, max_len, heads, offsets, pre): a fresh jagged batch with sequences of 0, 1 and tile-edge
    lengths, a projection of 256 columns each (u | v | q | k): 2 heads of 128 or 4 of 64."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator().manual_seed(seed)
    shortest = hstu_gluon.MIN_LEN[dim]
    max_len = int(torch.randint(shortest, shortest + 600, (1,), generator=gen))
    lengths = [max_len, 0, 1, 63, 64, 65, 127, 128, 129] + torch.randint(1, max_len + 1, (4,), generator=gen).tolist()
    pre = (torch.randn(sum(lengths), 2 * 512, generator=gen) * 2).to(device, dtype).requires_grad_()
    return seed, gen, max_len, 256 // dim, offsets_of(lengths).to(device), pre


def _spy_on_fused_backward(monkeypatch) -> list[bool]:
    """A list that gets, per Gluon backward launch, whether it took the SiLU' stores (``pre=``)."""
    fused: list[bool] = []
    real = hstu_gluon.hstu_backward_gluon
    monkeypatch.setattr(hstu_gluon, "hstu_backward_gluon",
                        lambda *a, **kw: fused.append(kw.get("pre") is not None) or real(*a, **kw))
    return fused


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", sorted(hstu_gluon.MIN_LEN), ids=lambda d: f"d{d}")
def test_gpu_fused_projection_gradient(hopper, monkeypatch, dtype, dim) -> None:
    """The projection's gradient from the Gluon backward's SiLU'-multiplied stores against float64 and against the
    two-step path (the switch off), on sequences of 0, 1 and tile-edge lengths; the fused path is the one taken."""
    seed, gen, max_len, heads, offsets, pre = _gpu_batch(hopper, dtype, dim)
    scale = 1.0 / max_len
    fused = _spy_on_fused_backward(monkeypatch)
    u, a = hstu_silu_attention(pre, heads, dim, dim, offsets, max_len, AttentionMask(), scale=scale, kernel="triton")
    gu = torch.randn(u.shape, generator=gen).to(hopper, dtype)
    ga = torch.randn(a.shape, generator=gen).to(hopper, dtype)
    got = torch.autograd.grad((u * gu).float().sum() + (a * ga).float().sum(), pre)[0]
    assert fused == [True], "the fused Gluon backward was not taken on a supported call"
    ref_pre = pre.detach().double().cpu().requires_grad_()
    u_ref, a_ref = _two_steps(ref_pre, heads, dim, dim, offsets.cpu(), max_len, scale)
    assert relative_error(a.cpu(), a_ref) < (2e-2 if dtype == torch.bfloat16 else 4e-3), f"seed {seed}"
    want = torch.autograd.grad((u_ref * gu.cpu()).sum() + (a_ref * ga.cpu()).sum(), ref_pre)[0]
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    width = heads * dim
    for name, cols in (("u", slice(0, width)), ("v", slice(width, 2 * width)), ("q", slice(2 * width, 3 * width)),
                       ("k", slice(3 * width, 4 * width))):  # fmt: skip
        err = relative_error(got[:, cols].cpu(), want[:, cols])
        assert err < tol, f"seed {seed}: d{name} relative error {err:.2e} vs float64"
    monkeypatch.setenv("RECFORGE_GLUON_HSTU", "0")
    u2, a2 = hstu_silu_attention(pre, heads, dim, dim, offsets, max_len, AttentionMask(), scale=scale, kernel="triton")
    two_step = torch.autograd.grad((u2 * gu).float().sum() + (a2 * ga).float().sum(), pre)[0]
    assert fused == [True], "RECFORGE_GLUON_HSTU=0 did not turn the fused backward off"
    diff = relative_error(got.float().cpu(), two_step.float().cpu())
    assert diff < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"seed {seed}: {diff:.2e} from the two-step gradient"


@pytest.mark.gpu
def test_gpu_routing(hopper, monkeypatch) -> None:
    """The one op for the Gluon kernels' calls only: a bias, another mask, a short batch or head dim 64 take the two
    steps (the same values)."""
    from recforge.ops.triton import hstu_silu

    taken = []
    real = hstu_silu.hstu_silu_attention_triton
    monkeypatch.setattr(hstu_silu, "hstu_silu_attention_triton", lambda *a: taken.append(a[2]) or real(*a))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    offsets = offsets_of([1100, 700]).to(hopper)
    pre = torch.randn(1800, 2 * 512, generator=gen).to(hopper, torch.bfloat16)
    hstu_silu_attention(pre, 2, 128, 128, offsets, 1100, AttentionMask(), kernel="triton")
    assert taken == [1100]
    hstu_silu_attention(pre, 2, 128, 128, offsets, 1100, AttentionMask(), pos_weights=torch.zeros(8, device=hopper))
    hstu_silu_attention(pre, 2, 128, 128, offsets, 1100, AttentionMask(max_attn_len=64))
    hstu_silu_attention(pre, 2, 128, 128, offsets, 1100, AttentionMask(causal=False))
    short = hstu_gluon.MIN_LEN[128] - 1
    hstu_silu_attention(pre[: 2 * short], 2, 128, 128, offsets_of([short, short]).to(hopper), short, AttentionMask())
    hstu_silu_attention(pre.float(), 2, 128, 128, offsets, 1100, AttentionMask())
    hstu_silu_attention(pre, 4, 64, 64, offsets, 1100, AttentionMask())  # head dim 64: from MIN_LEN[64]
    hstu_silu_attention(pre, 2, 128, 128, offsets, 1100, AttentionMask(), kernel="pytorch")
    assert taken == [1100], "a call off the Gluon kernels' path took the one op"
    long = hstu_gluon.MIN_LEN[64]
    pre = torch.randn(long + 700, 2 * 512, generator=gen).to(hopper, torch.bfloat16)
    hstu_silu_attention(pre, 4, 64, 64, offsets_of([long, 700]).to(hopper), long, AttentionMask(), kernel="triton")
    assert taken == [1100, long], "head dim 64 from its MIN_LEN did not take the one op"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_fused_gate_gradient(hopper, monkeypatch, dtype) -> None:
    """dropout(LayerNorm(a) * u) as one op on Hopper (the gate's gradient from the norm-gate kernel, the rest from
    the Gluon stores) against float64 and against the two steps (the switch off)."""
    from recforge.ops.hstu_attention import hstu_silu_attention_gate
    from recforge.ops.norm_gate import norm_gate_reference

    seed, gen, max_len, heads, offsets, pre = _gpu_batch(hopper, dtype)
    scale = 1.0 / max_len
    weight = (1 + 0.1 * torch.randn(heads * 128, generator=gen)).to(hopper).requires_grad_()
    bias = (0.1 * torch.randn(heads * 128, generator=gen)).to(hopper).requires_grad_()
    fused = _spy_on_fused_backward(monkeypatch)

    def run():
        return hstu_silu_attention_gate(pre, heads, 128, 128, offsets, max_len, AttentionMask(), weight, bias,
                                        scale=scale, kernel="triton")  # fmt: skip

    g = run()
    dg = torch.randn(g.shape, generator=gen).to(hopper, dtype)
    leaves = (pre, weight, bias)
    got = torch.autograd.grad((g * dg).float().sum(), leaves)
    assert fused == [True], "the fused Gluon backward was not taken on a supported call"
    ref = [t.detach().double().cpu().requires_grad_() for t in leaves]
    u_ref, a_ref = _two_steps(ref[0], heads, 128, 128, offsets.cpu(), max_len, scale)
    g_ref = norm_gate_reference(a_ref.reshape(-1, heads * 128), u_ref, ref[1], ref[2], 1e-5, 0.0, False)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert relative_error(g.cpu(), g_ref) < tol, f"seed {seed}"
    want = torch.autograd.grad((g_ref * dg.cpu()).sum(), ref)
    for name, x, w in zip(("pre", "weight", "bias"), got, want, strict=True):
        assert relative_error(x.cpu(), w) < tol, f"seed {seed}: d{name} vs float64"
    monkeypatch.setenv("RECFORGE_GLUON_HSTU", "0")
    two_step = torch.autograd.grad((run() * dg).float().sum(), leaves)
    assert fused == [True], "RECFORGE_GLUON_HSTU=0 did not turn the fused backward off"
    for name, x, t in zip(("pre", "weight", "bias"), got, two_step, strict=True):
        diff = relative_error(x.float().cpu(), t.float().cpu())
        assert diff < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"seed {seed}: d{name} {diff:.2e} from two steps"


@pytest.mark.gpu
def test_gpu_compiled_encoder_matches_eager(hopper) -> None:
    """A compiled bf16 HSTU encoder whose blocks take the one op with the gate (custom op) gives eager's outputs and
    gradients."""
    from recforge.models.hstu import HSTUConfig, HSTUEncoder
    from recforge.ops.triton import hstu_silu

    torch.manual_seed(int(torch.randint(0, 2**30, ())))
    enc = HSTUEncoder(HSTUConfig(dim=256, num_blocks=2, num_heads=2, dqk=128, dv=128, dropout=0.0, max_seq_len=1400,
                                 relative_bias=False, num_time_buckets=0)).to(hopper)  # fmt: skip
    lengths = [1300, 1, 640, 129]
    offsets = offsets_of(lengths).to(hopper)
    x = torch.randn(sum(lengths), 256, device=hopper)
    w = torch.randn(256, device=hopper)

    def loss():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return (enc(x, offsets, 1300, AttentionMask()).float() @ w).square().mean()

    calls = []
    real = hstu_silu.silu_attention_gate_forward
    hstu_silu.silu_attention_gate_forward = lambda *a: calls.append(1) or real(*a)
    try:
        eager = loss()
        want = torch.autograd.grad(eager, list(enc.parameters()))
        compiled = torch.compile(loss)()
        got = torch.autograd.grad(compiled, list(enc.parameters()))
    finally:
        hstu_silu.silu_attention_gate_forward = real
    assert len(calls) == 4, "the blocks did not take the one op, eagerly and compiled"
    assert relative_error(compiled, eager) < 1e-2
    for (name, _), g, e in zip(enc.named_parameters(), got, want, strict=True):
        assert relative_error(g, e) < 3e-2, name
