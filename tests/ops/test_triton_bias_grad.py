"""Gradients of the HSTU position and time-bucket weights from the Triton dK/dV kernel
(``recforge.ops.triton.bias_grad``) against the float64 PyTorch reference.

CPU: Triton's interpreter (16 x 16 tiles) on jagged batches long enough that distances run far
past the P position weights (or stay under them), with timestamps that put nearly every pair in
one time bucket (or spread them over many), contextual tokens and targets; float32 (the
interpreter computes bfloat16 tiles wrongly, forward included). The GPU cases (``pytest -m gpu``)
add bfloat16 and take the autotuned tiles on 1-2K-token sequences. Fresh random inputs each run.
"""

from __future__ import annotations


import pytest
import torch
from _oracles import offsets_of, relative_error

from recforge.jagged.mask import AttentionMask
from recforge.ops.hstu_attention import hstu_attention, hstu_attention_reference

# relative error of the bias gradients: sums of dS over every pair and head, whose terms cancel
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _timestamps(gen: torch.Generator, lengths: list[int], spread: str) -> torch.Tensor:
    """'one': gaps of 30..90 s, so every pair but i == j lands in the top bucket of 8 buckets
    (|delta| >= 11 s); 'many': log-uniform gaps from 1 s to ~2 h, and equal stamps, over 64 buckets."""
    total = sum(lengths)
    if spread == "one":
        gaps = torch.randint(30, 90, (total,), generator=gen)
    else:
        gaps = torch.exp(torch.rand(total, dtype=torch.float64, generator=gen) * 9).long()
        gaps = gaps * (torch.rand(total, generator=gen) < 0.8)
    return 1_700_000_000 + torch.cumsum(gaps, 0)


def _mask(kind: str, gen: torch.Generator, lengths: list[int]) -> AttentionMask:
    if kind == "causal":
        return AttentionMask()
    if kind == "full":
        return AttentionMask(causal=False)
    # a few contextual tokens and targets per sequence, as in ranking
    c = [int(torch.randint(0, min(n, 6) + 1, (1,), generator=gen)) for n in lengths]
    t = [int(torch.randint(0, min(n - ci, 9) + 1, (1,), generator=gen)) for n, ci in zip(lengths, c)]
    return AttentionMask(num_contextual=torch.tensor(c), num_targets=torch.tensor(t))


def bias_grad_errors(kind: str, num_pos: int, spread: str, dtype: torch.dtype, device: str, seed: int,
                     lengths: list[int], heads: int = 2, dim: int = 16) -> dict[str, float]:
    """Relative errors of the Triton kernel's d pos_weights / d time_weights (and d q, k, v) against
    the float64 reference, on fresh random inputs."""
    gen = torch.Generator().manual_seed(seed)
    total, max_len = sum(lengths), max(lengths)
    offsets = offsets_of(lengths)
    ts = _timestamps(gen, lengths, spread)
    mask = _mask(kind, gen, lengths)
    num_buckets = 8 if spread == "one" else 64
    q, k, v, grad = (torch.randn(total, heads, dim, generator=gen) for _ in range(4))
    pos_w = torch.randn(num_pos, generator=gen)
    time_w = torch.randn(num_buckets + 1, generator=gen)
    low = [x.to(device=device, dtype=dtype if n < 3 else torch.float32).requires_grad_()
           for n, x in enumerate((q, k, v, pos_w, time_w))]
    ref_in = [x.detach().cpu().double().requires_grad_() for x in low]
    scale = 1.0 / max_len

    out = hstu_attention(*low[:3], offsets.to(device), max_len, mask.to(device), scale=scale, pos_weights=low[3],
                         timestamps=ts.to(device), time_weights=low[4], kernel="triton")
    ref = hstu_attention_reference(*ref_in[:3], offsets, max_len, mask, scale, ref_in[3], ts, ref_in[4])
    grads = torch.autograd.grad(out, low, grad.to(device, dtype))
    ref_grads = torch.autograd.grad(ref, ref_in, grad.to(dtype).double())
    names = ["q", "k", "v", "pos_weights", "time_weights"]
    return {name: relative_error(g.cpu(), e) for name, g, e in zip(names, grads, ref_grads)}




def _lengths(gen: torch.Generator, longest: int) -> list[int]:
    """A jagged batch: one sequence of ``longest`` tokens, one short, one empty, one in between."""
    return [longest, int(torch.randint(2, 20, (1,), generator=gen)), 0, int(torch.randint(20, longest, (1,), generator=gen))]


@pytest.mark.parametrize(
    ("kind", "num_pos", "spread", "steps", "walk"),
    [
        ("context_targets", 9, "one", 4, "split"),  # distances far past P; nearly all pairs in one time bucket
        ("context_targets", 300, "many", 1, "split"),  # no distance clamped; many buckets, the lower by atomics
        ("full", 7, "many", 1, "unrolled"),  # negative distances clamp to 0; masked tiles unrolled too
        ("context_targets", 40, "many", 2, "merged"),  # one tile loop (GPU fixed-tile launches)
        pytest.param("causal", 5, "one", 4, "split", marks=pytest.mark.slow),
        pytest.param("context_targets", 40, "many", 4, "unrolled", marks=pytest.mark.slow),
    ],
)
def test_interpreter_bias_grads(interpreter, monkeypatch, kind: str, num_pos: int, spread: str, steps: int,
                                walk: str) -> None:
    """``walk``: two tile loops, the masked tiles' buckets in a loop (autotuned GPU launches); the
    same with every tile's buckets unrolled (``time_loop_in_masked_tiles`` off); one loop."""
    from recforge.ops.triton import tuning

    monkeypatch.setattr(interpreter, "TIME_STEPS", steps)
    monkeypatch.setattr(interpreter, "time_loop_in_masked_tiles", walk != "unrolled")
    monkeypatch.setattr(tuning, "split_loops", lambda fixed_tile: walk != "merged")
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    lengths = _lengths(torch.Generator().manual_seed(seed), 96)
    errors = bias_grad_errors(kind, num_pos, spread, torch.float32, "cpu", seed, lengths)
    bad = {k: e for k, e in errors.items() if not e <= TOL[torch.float32]}
    assert not bad, f"{kind} P={num_pos} {spread} steps={steps} {walk} seed {seed}: relative errors {bad}"


@pytest.mark.parametrize("walk", ["split", "merged"])
def test_interpreter_time_buckets_computed_twice_agree(interpreter, monkeypatch, walk: str) -> None:
    """``reuse_time_bucket`` off (on by default: the time gradient summed by the buckets of the scores) gives the
    reference's gradients (q, k, v and both weights) too, with two tile loops and with one."""
    from recforge.ops.triton import tuning

    monkeypatch.setattr(interpreter, "reuse_time_bucket", not interpreter.reuse_time_bucket)
    monkeypatch.setattr(tuning, "split_loops", lambda fixed_tile: walk != "merged")
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    lengths = _lengths(torch.Generator().manual_seed(seed), 72)
    errors = bias_grad_errors("context_targets", 40, "many", torch.float32, "cpu", seed, lengths)
    assert all(e <= TOL[torch.float32] for e in errors.values()), f"{walk} seed {seed}: {errors}"


@pytest.mark.slow
def test_interpreter_pair_atomics_agree(interpreter, monkeypatch) -> None:
    """The per-pair atomics kept for A/B benchmarks still give the reference's gradients."""
    monkeypatch.setattr(interpreter, "pair_atomics", True)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    lengths = _lengths(torch.Generator().manual_seed(seed), 60)
    errors = bias_grad_errors("context_targets", 20, "many", torch.float32, "cpu", seed, lengths)
    assert all(e <= TOL[torch.float32] for e in errors.values()), f"seed {seed}: {errors}"


# ----------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("kind", "num_pos", "spread"),
                         [("causal", 64, "one"), ("context_targets", 2048, "many"), ("full", 100, "many")])
def test_gpu_bias_grads_long(cuda_device, dtype: torch.dtype, kind: str, num_pos: int, spread: str) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator().manual_seed(seed)
    lengths = [1500, int(torch.randint(300, 1500, (1,), generator=gen)), 1, 700]  # > 256: autotuned tiles in bf16
    errors = bias_grad_errors(kind, num_pos, spread, dtype, cuda_device, seed, lengths, heads=2, dim=64)
    bad = {k: e for k, e in errors.items() if k.endswith("_weights") and not e <= TOL[dtype]}
    assert not bad, f"{kind} P={num_pos} {spread} {dtype} seed {seed}: relative errors {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["reuse_time_bucket", "bias_grad_fixed_warps"])
def test_gpu_bias_grad_ab_switches(cuda_device, monkeypatch, switch: str) -> None:
    """The A/B switches of the dK/dV kernel (``attention_bias_grad.py``'s variants), each away from its default,
    keep the reference's gradients: short sequences (the fixed-tile launch that ``bias_grad_fixed_warps`` changes)
    and long ones."""
    from recforge.ops.triton import hstu, tuning

    if switch == "reuse_time_bucket":
        monkeypatch.setattr(hstu, switch, not getattr(hstu, switch))
    else:
        monkeypatch.setattr(tuning, "bias_grad_fixed_warps", None if tuning.bias_grad_fixed_warps else 8)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator().manual_seed(seed)
    for lengths in ([200, int(torch.randint(2, 200, (1,), generator=gen)), 1, 77], [1500, 700, 1]):
        errors = bias_grad_errors("context_targets", 300, "many", torch.bfloat16, cuda_device, seed, lengths, heads=2, dim=64)
        bad = {k: e for k, e in errors.items() if not e <= TOL[torch.bfloat16]}
        assert not bad, f"{switch} lengths {lengths} seed {seed}: relative errors {bad}"
