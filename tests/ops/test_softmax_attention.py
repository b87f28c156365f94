"""softmax_attention against a per-sequence float64 loop, forward and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from _oracles import offsets_of, random_lengths, random_split, visible_ref

from recforge.jagged import AttentionMask
from recforge.ops import softmax_attention


def softmax_loop(q, k, v, lengths, contextual=None, targets=None, window=None, causal=True):
    """out_i = sum_{j visible} softmax_j(q_i . k_j / sqrt(D)) v_j, one sequence and one query at a time."""
    rows = []
    start = 0
    scale = 1.0 / math.sqrt(q.shape[-1])
    for b, n in enumerate(lengths):
        c = contextual[b] if contextual is not None else 0
        t = targets[b] if targets is not None else 0
        for i in range(n):
            js = [j for j in range(n) if visible_ref(i, j, n, c, t, causal, window)]
            scores = torch.stack([(q[start + i] * k[start + j]).sum(-1) * scale for j in js])  # (J, H)
            probs = torch.softmax(scores, dim=0)
            rows.append(sum(probs[m].unsqueeze(-1) * v[start + j] for m, j in enumerate(js)))
        start += n
    if not rows:
        return v.new_zeros(0, *v.shape[1:])
    return torch.stack(rows)


def _inputs(seed, batch=5, max_len=7, heads=2, dim=4):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, batch, max_len)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3))
    return lengths, q, k, v, gen


def _compare(out, ref, leaves):
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.manual_seed(99)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad_out)
    exp = torch.autograd.grad(ref, leaves, grad_out)
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("heads,dim", [(1, 4), (2, 3), (4, 2)])
def test_causal_against_loop(seed, heads, dim) -> None:
    lengths, q, k, v, _ = _inputs(seed, heads=heads, dim=dim)
    max_len = max(lengths) + seed
    out = softmax_attention(q, k, v, offsets_of(lengths), max_len, AttentionMask(), kernel="pytorch")
    assert out.shape == (sum(lengths), heads, dim)
    _compare(out, softmax_loop(q, k, v, lengths), [q, k, v])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("use_targets", [False, True])
@pytest.mark.parametrize("use_contextual", [False, True])
@pytest.mark.parametrize("window", [None, 2])
def test_masks_against_loop(seed, use_targets, use_contextual, window) -> None:
    lengths, q, k, v, gen = _inputs(seed)
    contextual, targets = random_split(gen, lengths)
    mask = AttentionMask(
        num_targets=torch.tensor(targets) if use_targets else None,
        num_contextual=torch.tensor(contextual) if use_contextual else None,
        max_attn_len=window,
    )
    out = softmax_attention(q, k, v, offsets_of(lengths), max(lengths), mask)
    ref = softmax_loop(
        q, k, v, lengths,
        contextual=contextual if use_contextual else None,
        targets=targets if use_targets else None,
        window=window,
    )
    _compare(out, ref, [q, k, v])


def test_auto_kernel_matches_loop() -> None:
    lengths, q, k, v, gen = _inputs(7, heads=2, dim=3)
    _, targets = random_split(gen, lengths)
    mask = AttentionMask(num_targets=torch.tensor(targets))
    out = softmax_attention(q, k, v, offsets_of(lengths), max(lengths), mask, kernel="auto")
    _compare(out, softmax_loop(q, k, v, lengths, targets=targets), [q, k, v])


def test_non_causal_against_loop() -> None:
    lengths, q, k, v, gen = _inputs(5)
    _, targets = random_split(gen, lengths)
    mask = AttentionMask(causal=False, num_targets=torch.tensor(targets))
    out = softmax_attention(q, k, v, offsets_of(lengths), max(lengths) + 1, mask)
    _compare(out, softmax_loop(q, k, v, lengths, targets=targets, causal=False), [q, k, v])


def test_dropout_zero_is_deterministic_and_dropout_one_gives_zeros() -> None:
    lengths, q, k, v, _ = _inputs(6)
    offsets = offsets_of(lengths)
    a = softmax_attention(q, k, v, offsets, max(lengths), AttentionMask(), dropout=0.0)
    b = softmax_attention(q, k, v, offsets, max(lengths), AttentionMask())
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    dropped = softmax_attention(q, k, v, offsets, max(lengths), AttentionMask(), dropout=1.0)
    assert torch.equal(dropped, torch.zeros_like(dropped))


def _tiny():
    q = torch.randn(3, 1, 2)
    return q, q, q, offsets_of([1, 2]), 2, AttentionMask()


def test_triton_kernel_on_cpu_raises(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="softmax_attention: kernel='triton' needs (CUDA tensors|the triton package)"):
        softmax_attention(*_tiny(), kernel="triton")


def test_unknown_kernel_raises() -> None:
    with pytest.raises(ValueError, match="softmax_attention: kernel='flash' is not one of"):
        softmax_attention(*_tiny(), kernel="flash")
