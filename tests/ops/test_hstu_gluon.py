"""The Gluon HSTU attention, forward and backward (``recforge.ops.triton.hstu_gluon``).

CPU: the three kernels compile for sm_90 with the installed Triton, (nearly) without spills (a subprocess: a compiler
crash must fail this test, not abort the run). GPU (Hopper): against the float64 reference and the Triton kernels on
fresh jagged batches (empty and edge-length sequences, strided q/k/v, bf16/fp16), and they are the paths actually taken.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from _oracles import offsets_of, relative_error

from recforge.jagged.mask import AttentionMask
from recforge.ops.hstu_attention import hstu_attention, hstu_attention_reference
from recforge.ops.triton import hstu_gluon

COMPILE = textwrap.dedent("""
    import re, subprocess, tempfile, pathlib, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from recforge.ops.triton import hstu_gluon as g

    for dim in g.MIN_LEN:
        t = torch.empty(4096, 4, dim, dtype=torch.bfloat16)
        qd, kd, vd = g.descriptors(t, t, t)
        d64 = mangle_type(g.descriptor(t, 64))
        kernels = [  # (kernel, argument types, SILU or None: the kernel has no such constexpr)
            (g._hstu_fwd_gluon, {"q_desc": mangle_type(qd), "k_desc": mangle_type(kd), "v_desc": mangle_type(vd),
                                 "o_desc": d64, "O": "*bf16", "so_t": "i32", "scale": "fp32"}, None),
            *((g._hstu_bwd_dkdv_gluon, {"q_desc": d64, "do_desc": d64, "k_desc": d64, "v_desc": d64, "DK": "*bf16",
                                        "DV": "*bf16", "sdk_t": "i32", "sdv_t": "i32", "xk_desc": d64, "xv_desc": d64,
                                        "scale": "fp32"}, silu) for silu in (False, True)),
            *((g._hstu_bwd_dq_gluon, {"q_desc": d64, "do_desc": d64, "k_desc": d64, "v_desc": d64,
                                      "DQ": "*bf16" if silu else "*fp32", "sdq_t": "i32", "xq_desc": d64,
                                      "dq_scale": "fp32"}, silu) for silu in (False, True)),
        ]
        for kern, types, silu in kernels:
            types = dict(types, offsets="*i64", seq_order="*i64", num_heads="i32", len_key="i32", STAGES="constexpr",
                         SEQ_ORDER="constexpr", SILU="constexpr", QBUF="constexpr")
            sig = {a: types[a] for a in kern.arg_names}
            for order in (False, True):
                stages = g.FORWARD_STAGES if silu is None else (g.DQ_STAGES if "QBUF" in kern.arg_names else
                                                                 g.DKDV_STAGES)[dim]  # fmt: skip
                cx = {(kern.arg_names.index("STAGES"),): stages, (kern.arg_names.index("SEQ_ORDER"),): order}
                if silu is not None:
                    cx[(kern.arg_names.index("SILU"),)] = silu
                if "QBUF" in kern.arg_names:  # the row kernels: as the launch asks
                    cx[(kern.arg_names.index("QBUF"),)] = g.FORWARD_QBUF if silu is None else g.DQ_QBUF[dim]
                k = triton.compile(GluonASTSource(kern, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": 4})
                ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
                with tempfile.TemporaryDirectory() as tmp:
                    pathlib.Path(tmp, "k.ptx").write_text(k.asm["ptx"])
                    log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                                         capture_output=True, text=True, check=True).stderr
                print("kernel", kern.fn.__name__, "dim", dim, "order", order, "silu", silu, "spills",
                      *re.findall(r"(\\d+) bytes spill stores", log), "shared", k.metadata.shared, "wgmma",
                      len(re.findall(r"wgmma.mma_async", k.asm["ptx"])))
""")


# spill stores (bytes) each kernel (head dim, SILU variant) may have: at head dim 128 the dK/dV kernel's two float32
# (64, 128) accumulators and two (64, 64) tiles per thread leave ptxas a few registers short (8 bytes with Triton
# 3.7.1, 16 with 3.6.0; with the SiLU' epilogue 20 with either), and the dQ kernel's SiLU' epilogue in a program of
# two row blocks 20 with 3.7.1, 8 with 3.6.0 (its consumers overlapping two K/V tiles since the 29th session); none at
# head dim 64
SPILL_BYTES = {("_hstu_fwd_gluon", "128", "None"): 0, ("_hstu_bwd_dkdv_gluon", "128", "False"): 16,
               ("_hstu_bwd_dkdv_gluon", "128", "True"): 20, ("_hstu_bwd_dq_gluon", "128", "False"): 0,
               ("_hstu_bwd_dq_gluon", "128", "True"): 20}
SPILL_BYTES |= {(name, "64", silu): 0 for name, _, silu in SPILL_BYTES}


@pytest.mark.skipif(not hstu_gluon.AVAILABLE, reason="this Triton has no Gluon")
def test_kernels_compile_for_hopper_without_spills() -> None:
    done = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0", "HOME": "/tmp"})
    assert done.returncode == 0, f"compiling the Gluon HSTU kernels for sm_90 failed:\n{done.stderr[-3000:]}"
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("kernel")]
    expected = [(k, dim, o, silu) for k, dim, silu in SPILL_BYTES for o in ("False", "True")]
    assert sorted((w[1], w[3], w[5], w[7]) for w in lines) == sorted(expected), done.stdout
    for w in lines:  # kernel NAME dim D order O silu S spills N shared S wgmma W
        assert int(w[9]) <= SPILL_BYTES[w[1], w[3], w[7]], f"more spills than before: {w}"
        assert int(w[13]) > 0, f"no wgmma: {w}"
        assert int(w[11]) <= 227 * 1024, f"over the H100/H200's 227 KiB of shared memory per block: {w}"


def test_not_supported_off_hopper_or_off_the_hot_path(monkeypatch) -> None:
    from recforge.ops.triton._common import mask_args

    q = torch.randn(600, 2, 128, dtype=torch.bfloat16)
    ma = mask_args(AttentionMask(causal=True), offsets_of([600]))
    assert not hstu_gluon.supported(q, q, q, 600, ma, None, None)  # CPU tensors
    assert hstu_gluon.min_len(q.device, q.dtype, 128, 128) is None  # so the block's SiLU + attention op is not routed
    monkeypatch.setenv("RECFORGE_GLUON_HSTU", "maybe")
    with pytest.raises(ValueError, match="RECFORGE_GLUON_HSTU"):
        hstu_gluon.supported(q, q, q, 600, ma, None, None)


# ----------------------------------------------------------------------------------------- GPU


def _batch(gen: torch.Generator, lengths: list[int], heads: int, dtype: torch.dtype, device, fused: bool,
           dim: int = 128):  # fmt: skip
    total = sum(lengths)
    if fused:  # slices of one (T, 3 H D) projection, as the HSTU block makes them
        qkv = torch.randn(total, 3 * heads * dim, generator=gen).to(device=device, dtype=dtype)
        q, k, v = (x.view(total, heads, dim) for x in qkv.split(heads * dim, dim=1))
    else:
        q, k, v = (torch.randn(total, heads, dim, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    return q, k, v, offsets_of(lengths).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fused", [False, True], ids=["packed", "fused-projection"])
@pytest.mark.parametrize("dim", sorted(hstu_gluon.FORWARD_MIN_LEN), ids=lambda d: f"d{d}")
def test_gpu_gluon_forward_matches_reference_and_triton(hopper, monkeypatch, dtype, fused, dim) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator().manual_seed(seed)
    shortest = hstu_gluon.FORWARD_MIN_LEN[dim]  # + 1: batches up to SEQ_ORDER_MIN_LEN (256) take no sequence order
    max_len = int(torch.randint(shortest + 1, shortest + 600, (1,), generator=gen))
    # pairs of row blocks (hstu_gluon._row_blocks): one block, two, three (the middle one alone), four; at head dim 128
    # the first warpgroup of a block ending within 64 rows of its start drains no K/V tile past its diagonal, one else
    lengths = [min(n, max_len) for n in (0, 1, 63, 64, 65, 127, 128, 129, 383, 385, 512)]
    lengths += [max_len] + torch.randint(1, max_len + 1, (6,), generator=gen).tolist()
    q, k, v, offsets = _batch(gen, lengths, 3, dtype, hopper, fused, dim)
    calls = []
    real = hstu_gluon.hstu_forward_gluon
    monkeypatch.setattr(hstu_gluon, "hstu_forward_gluon", lambda *a: calls.append(a[6] is not None) or real(*a))
    mask = AttentionMask(causal=True)
    out = hstu_attention(q, k, v, offsets, max_len, mask, scale=1.0 / max_len, kernel="triton")
    assert calls == [True], "the Gluon forward was not taken (or took no sequence order) on a supported call"
    ref = hstu_attention_reference(*(x.double().cpu() for x in (q, k, v)), offsets.cpu(), max_len, mask, 1.0 / max_len)
    err = relative_error(out.cpu(), ref)
    assert err < (2e-2 if dtype == torch.bfloat16 else 4e-3), f"seed {seed}: relative error {err:.2e} vs float64"
    monkeypatch.setenv("RECFORGE_GLUON_HSTU", "0")
    triton_out = hstu_attention(q, k, v, offsets, max_len, mask, scale=1.0 / max_len, kernel="triton")
    assert len(calls) == 1, "RECFORGE_GLUON_HSTU=0 did not turn the Gluon forward off"
    diff = relative_error(out.float().cpu(), triton_out.float().cpu())
    assert diff < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"seed {seed}: {diff:.2e} from the Triton forward"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fused", [False, True], ids=["packed", "fused-projection"])
@pytest.mark.parametrize("dim", sorted(hstu_gluon.MIN_LEN), ids=lambda d: f"d{d}")
def test_gpu_gluon_backward_matches_reference_and_triton(hopper, monkeypatch, dtype, fused, dim) -> None:
    """dQ, dK, dV by the two Gluon backward kernels against float64 and against the Triton backward (the switch off),
    on sequences of 0, 1 and tile-edge lengths; and dQ * 2 / scale in float32 as the compiled step takes it."""
    from recforge.ops.triton import hstu as triton_hstu
    from recforge.ops.triton._common import mask_args

    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator().manual_seed(seed)
    max_len = int(torch.randint(hstu_gluon.MIN_LEN[dim], hstu_gluon.MIN_LEN[dim] + 600, (1,), generator=gen))
    lengths = [max_len, 0, 1, 63, 64, 65, 127, 128, 129, 383, 385] + torch.randint(1, max_len + 1, (4,),
                                                                                  generator=gen).tolist()
    q, k, v, offsets = _batch(gen, lengths, 2, dtype, hopper, fused, dim)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    calls = []
    real = hstu_gluon.hstu_backward_gluon
    monkeypatch.setattr(hstu_gluon, "hstu_backward_gluon", lambda *a: calls.append(a[7] is not None) or real(*a))
    mask, scale = AttentionMask(causal=True), 1.0 / max_len
    out = hstu_attention(*leaves, offsets, max_len, mask, scale=scale, kernel="triton")
    grad = torch.randn(out.shape, generator=gen).to(hopper, dtype)
    got = torch.autograd.grad(out, leaves, grad)
    assert calls == [True], "the Gluon backward was not taken (or took no sequence order) on a supported call"
    ref_leaves = [x.detach().double().cpu().requires_grad_() for x in leaves]
    ref = hstu_attention_reference(*ref_leaves, offsets.cpu(), max_len, mask, scale)
    want = torch.autograd.grad(ref, ref_leaves, grad.double().cpu())
    for name, g, w in zip("qkv", got, want):
        err = relative_error(g.cpu(), w)
        assert err < (2e-2 if dtype == torch.bfloat16 else 4e-3), f"seed {seed}: d{name} relative error {err:.2e}"
    ma = mask_args(mask, offsets)
    dq32, *_ = triton_hstu.hstu_backward(grad, q, k, v, offsets, max_len, ma, scale, None, None, None, 0, False, False,
                                         unscaled_dq=True)
    assert dq32.dtype == torch.float32 and len(calls) == 2
    err = relative_error((dq32 * (0.5 * scale)).cpu(), want[0])
    assert err < (2e-2 if dtype == torch.bfloat16 else 4e-3), f"seed {seed}: unscaled dQ relative error {err:.2e}"
    monkeypatch.setenv("RECFORGE_GLUON_HSTU", "0")
    out = hstu_attention(*leaves, offsets, max_len, mask, scale=scale, kernel="triton")
    triton_grads = torch.autograd.grad(out, leaves, grad)
    assert len(calls) == 2, "RECFORGE_GLUON_HSTU=0 did not turn the Gluon backward off"
    for name, g, t in zip("qkv", got, triton_grads):
        diff = relative_error(g.float().cpu(), t.float().cpu())
        assert diff < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"seed {seed}: d{name} {diff:.2e} from Triton's"


@pytest.mark.skipif(not hstu_gluon.AVAILABLE, reason="this Triton has no Gluon")
def test_a_failed_launch_says_how_to_turn_it_off() -> None:
    """Without a Hopper GPU the launches fail; the errors name the switch back to the Triton kernels."""
    q = torch.randn(300, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="forward failed .*RECFORGE_GLUON_HSTU=0"):
        hstu_gluon.hstu_forward_gluon(q, q, q, offsets_of([300]), 300, 0.1, None, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="backward failed .*RECFORGE_GLUON_HSTU=0"):
        hstu_gluon.hstu_backward_gluon(q, q, q, q, offsets_of([300]), 300, 0.1, None, torch.empty_like(q),
                                       torch.empty_like(q), torch.empty_like(q), 0.05)


@pytest.mark.gpu
def test_gpu_off_the_hot_path_takes_triton(hopper) -> None:
    """Each case the Gluon kernel does not compute is refused (it would give wrong answers or lose speed there)."""
    from recforge.ops.triton._common import mask_args

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    q, k, v, offsets = _batch(gen, [1100, 900], 2, torch.bfloat16, hopper, fused=False)
    causal = mask_args(AttentionMask(causal=True), offsets)
    assert hstu_gluon.supported(q, k, v, 1100, causal, None, None)
    assert hstu_gluon.supported(*(x[..., :64].contiguous() for x in (q, k, v)), hstu_gluon.MIN_LEN[64], causal, None,
                                None)
    pos_w = torch.zeros(4, device=hopper)
    refused = {
        "targets": (q, k, v, 1100, mask_args(AttentionMask(causal=True, num_targets=torch.tensor([3, 2])), offsets),
                    None, None),
        "window": (q, k, v, 1100, mask_args(AttentionMask(causal=True, max_attn_len=64), offsets), None, None),
        "full": (q, k, v, 1100, mask_args(AttentionMask(causal=False), offsets), None, None),
        "position bias": (q, k, v, 1100, causal, pos_w, None),
        "time bias": (q, k, v, 1100, causal, None, pos_w),
        "short batch": (q, k, v, hstu_gluon.MIN_LEN[128] - 1, causal, None, None),
        "float32": (q.float(), k.float(), v.float(), 1100, causal, None, None),
        "head dim 64, short batch": (*(x[..., :64].contiguous() for x in (q, k, v)), 1100, causal, None, None),
        "head dim 64, heads not packed": (q[..., :64], k[..., :64], v[..., :64], 5000, causal, None, None),
        "head dim 96": (*(x[..., :96].contiguous() for x in (q, k, v)), 5000, causal, None, None),
        "heads not packed": (q.transpose(0, 1).contiguous().transpose(0, 1), k, v, 1100, causal, None, None),
    }
    taken = [name for name, args in refused.items() if hstu_gluon.supported(*args)]
    assert not taken, f"the Gluon kernels accepted calls they do not compute: {taken}"
    # the forward from its own (shorter) thresholds: head dim 64 from 1,024 though its backward from 4,096
    for dim, shortest in hstu_gluon.FORWARD_MIN_LEN.items():
        qkv = [x[..., :dim].contiguous() for x in (q, k, v)]
        assert hstu_gluon.supported(*qkv, shortest, causal, None, None, forward=True), f"head dim {dim}"
        assert not hstu_gluon.supported(*qkv, shortest - 1, causal, None, None, forward=True), f"head dim {dim}"
        assert shortest <= hstu_gluon.MIN_LEN[dim]
    assert hstu_gluon.supported(*(x[..., :64].contiguous() for x in (q, k, v)), 1100, causal, None, None, forward=True)
    assert not hstu_gluon.supported(q, k, v, 1100, mask_args(AttentionMask(causal=False), offsets), None, None,
                                    forward=True)  # fmt: skip
    grad = torch.randn(q.shape, generator=gen).to(hopper, torch.bfloat16)
    assert hstu_gluon.tma_ready(grad, torch.bfloat16)
    assert not hstu_gluon.tma_ready(grad.float(), torch.bfloat16), "a float32 gradient of bf16 inputs"
    assert not hstu_gluon.tma_ready(grad.transpose(0, 1).contiguous().transpose(0, 1), torch.bfloat16)
