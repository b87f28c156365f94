"""``cached_hstu_attention`` equals the whole-sequence ``hstu_attention`` on the new tokens' rows.

Every mask kind, random jagged lengths, random split points between cached and new tokens
(any split: the cached op computes rows of the whole sequence's attention). CPU: the PyTorch
reference against the float64 training reference, and Triton's interpreter on tiny shapes.
GPU (``pytest -m gpu``): the Triton kernel, float32/bfloat16, short and serving-sized shapes.
"""

from __future__ import annotations


import pytest
import torch
from _oracles import offsets_of, random_lengths, random_mask, relative_error

from recforge.jagged import AttentionMask
from recforge.ops import cached_hstu_attention
from recforge.ops.hstu_attention import hstu_attention_reference

MASK_KINDS = ["causal", "full", "contextual", "targets", "window", "segments", "timestamps", "all"]


def _split(x: torch.Tensor, lengths: list[int], cached: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged whole-sequence rows -> (cached rows, new rows), each jagged per request."""
    old, new, lo = [], [], 0
    for n, c in zip(lengths, cached):
        old.append(x[lo : lo + c])
        new.append(x[lo + c : lo + n])
        lo += n
    return torch.cat(old), torch.cat(new)


def _case(kind: str, seed: int, batch: int, max_len: int, heads: int, dqk: int, dv: int, dtype: torch.dtype,
          device, kernel: str, split: str = "random") -> float:  # fmt: skip
    """Relative error of the cached op (``kernel``) against the float64 whole-sequence training reference."""
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, batch, max_len)
    total = sum(lengths)
    gaps = torch.exp(torch.rand(total, dtype=torch.float64, generator=gen) * 9).long()
    ts = 1_600_000_000 + torch.cumsum(gaps * (torch.rand(total, generator=gen) < 0.8), 0)
    mask = random_mask(kind, gen, lengths, ts)
    if split == "targets" and mask.num_targets is not None:  # serving's candidates: the new tokens are the targets
        cached = [n - int(t) for n, t in zip(lengths, mask.num_targets)]
    else:
        cached = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lengths]
    q, k = (torch.randn(total, heads, dqk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(total, heads, dv, generator=gen).to(dtype)
    pos_w, time_w = torch.randn(6, generator=gen), torch.randn(13, generator=gen)
    offsets = offsets_of(lengths)
    whole = hstu_attention_reference(q.double(), k.double(), v.double(), offsets, max_len, mask, 0.7, pos_w.double(),
                                     ts, time_w.double())  # fmt: skip
    _, expected = _split(whole, lengths, cached)
    q_new = _split(q, lengths, cached)[1]
    k_old, k_new = _split(k, lengths, cached)
    v_old, v_new = _split(v, lengths, cached)
    new_lengths = [n - c for n, c in zip(lengths, cached)]
    dev = lambda x: x.to(device)  # noqa: E731
    if dtype == torch.float64:  # the float64 check adds the biases in float64 too
        pos_w, time_w = pos_w.double(), time_w.double()
    out = cached_hstu_attention(dev(q_new), dev(k_new), dev(v_new), dev(k_old), dev(v_old), dev(offsets_of(new_lengths)),
                                dev(offsets_of(cached)), max(new_lengths + [1]), max(cached + [1]), mask.to(device),
                                scale=0.7, pos_weights=dev(pos_w), timestamps=dev(ts), time_weights=dev(time_w),
                                kernel=kernel)  # fmt: skip
    assert out.shape == expected.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    return relative_error(out.cpu().double(), expected)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("split", ["random", "targets"])
def test_reference_equals_whole_sequence(kind: str, split: str) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    err = _case(kind, seed, batch=5, max_len=23, heads=2, dqk=8, dv=6, dtype=torch.float64, device="cpu",
                kernel="pytorch", split=split)  # fmt: skip
    assert err < 1e-12, f"{kind}/{split} seed {seed}: relative error {err}"


@pytest.mark.parametrize("kind", ["causal", "contextual", "timestamps", "all"])
def test_reference_one_request_without_padding(kind: str) -> None:
    # one request whose buffers are exactly its tokens: the reference's unpadded path
    for seed in range(4):
        err = _case(kind, seed, batch=1, max_len=19, heads=2, dqk=8, dv=6, dtype=torch.float64, device="cpu",
                    kernel="pytorch")  # fmt: skip
        assert err < 1e-12, f"{kind} seed {seed}: relative error {err}"


def test_stale_rows_past_the_cache_do_not_leak() -> None:
    # a preallocated cache buffer: rows past cache_offsets[-1] may hold anything (inf from an earlier request)
    q = torch.randn(2, 1, 4)
    k_cache, v_cache = torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    k_cache[3:], v_cache[3:] = float("inf"), float("nan")
    mask = AttentionMask(num_targets=torch.tensor([2]))
    args = (q, q, q, k_cache, v_cache, torch.tensor([0, 2]), torch.tensor([0, 3]), 2, 3, mask)
    out = cached_hstu_attention(*args, scale=0.1, kernel="pytorch")
    trimmed = cached_hstu_attention(*args[:3], k_cache[:3], v_cache[:3], *args[5:], scale=0.1, kernel="pytorch")
    assert torch.isfinite(out).all() and torch.equal(out, trimmed)


def test_mismatched_inputs_say_what_is_wrong() -> None:
    q = torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match="one entry per request"):
        cached_hstu_attention(q, q, q, q, q, torch.tensor([0, 2]), torch.tensor([0, 1, 2]), 2, 2, AttentionMask(), scale=1.0)
    with pytest.raises(ValueError, match="time_weights given without timestamps"):
        cached_hstu_attention(q, q, q, q, q, torch.tensor([0, 2]), torch.tensor([0, 2]), 2, 2, AttentionMask(), scale=1.0,
                              time_weights=torch.zeros(3))  # fmt: skip


INTERPRETED = "recforge.ops.triton.cached"  # the kernels the ``interpreter`` fixture (conftest.py) loads


@pytest.mark.parametrize("kind", ["causal", "full", "targets", "window", "segments", "all"])
@pytest.mark.parametrize("split", ["random", "targets"])
@pytest.mark.parametrize("key_splits", [1, 3])
def test_interpreter_equals_whole_sequence(interpreter, monkeypatch, kind: str, split: str, key_splits: int) -> None:
    # key_splits: programs sharing one query block's keys (their partial sums added up), as on a GPU
    import recforge.ops.triton.cached as cached_mod

    monkeypatch.setattr(cached_mod, "num_splits", lambda *args: key_splits)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    err = _case(kind, seed, batch=3, max_len=29, heads=2, dqk=12, dv=10, dtype=torch.float32, device="cpu",
                kernel="triton", split=split)  # fmt: skip
    assert err < 1e-5, f"{kind}/{split} seed {seed}: relative error {err}"


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", ["random", "targets"])
@pytest.mark.parametrize("key_splits", [None, 3])
def test_gpu_equals_whole_sequence(cuda_device, monkeypatch, kind: str, dtype: torch.dtype, split: str,
                                   key_splits: int | None) -> None:  # fmt: skip
    if key_splits is not None:  # None: the kernel's own choice
        import recforge.ops.triton.cached as cached_mod

        monkeypatch.setattr(cached_mod, "num_splits", lambda *args: key_splits)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    err = _case(kind, seed, batch=6, max_len=150, heads=2, dqk=32, dv=32, dtype=dtype, device=cuda_device,
                kernel="triton", split=split)  # fmt: skip
    assert err < TOL[dtype], f"{kind}/{dtype}/{split} seed {seed}: relative error {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", ["random", "targets"])
def test_gpu_serving_sizes_autotuned(cuda_device, dtype: torch.dtype, split: str) -> None:
    # long sequences (the autotuned path for bf16): every kind at once
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    err = _case("all", seed, batch=3, max_len=1500, heads=2, dqk=64, dv=64, dtype=dtype, device=cuda_device,
                kernel="triton", split=split)  # fmt: skip
    assert err < TOL[dtype], f"{dtype}/{split} seed {seed}: relative error {err}"


@pytest.mark.gpu
def test_gpu_auto_dispatch_equals_reference(cuda_device) -> None:
    q = torch.randn(5, 2, 16, device=cuda_device)
    kc = torch.randn(7, 2, 16, device=cuda_device)
    args = (q, q, q, kc, kc, torch.tensor([0, 5], device=cuda_device), torch.tensor([0, 7], device=cuda_device), 5, 7,
            AttentionMask(num_targets=torch.tensor([5], device=cuda_device)))  # fmt: skip
    auto = cached_hstu_attention(*args, scale=0.1, kernel="auto")
    ref = cached_hstu_attention(*args, scale=0.1, kernel="pytorch")
    assert relative_error(auto.cpu().double(), ref.cpu().double()) < 2e-5
