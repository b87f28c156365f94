"""hstu_attention against a per-sequence float64 loop, forward and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _oracles import offsets_of, random_lengths, random_split, time_bucket_ref, visible_ref

from recforge.jagged import AttentionMask
from recforge.ops import hstu_attention
from recforge.ops.time_bias import time_buckets

NUM_POS = 4  # small, so clamping at P - 1 is exercised
NUM_BUCKETS = 20  # small, so clamping at the top bucket is exercised


def hstu_loop(q, k, v, lengths, scale, pos_w=None, ts=None, time_w=None, contextual=None, targets=None, window=None):
    """out_i = sum_j mask_ij * silu(q_i . k_j + pos_w[clamp(p_i - p_j, 0, P-1)] + time_w[bucket(ts_i - ts_j)]) * scale * v_j

    with p_x = min(x, n - t): every target takes the history end's position; the time term only
    between non-contextual tokens."""
    rows = []
    start = 0
    for b, n in enumerate(lengths):
        c = contextual[b] if contextual is not None else 0
        t = targets[b] if targets is not None else 0
        for i in range(n):
            acc = torch.zeros(v.shape[1:], dtype=v.dtype)
            for j in range(n):
                if not visible_ref(i, j, n, c, t, True, window):
                    continue
                s = (q[start + i] * k[start + j]).sum(-1)  # (H,)
                if pos_w is not None:
                    h = n - t
                    s = s + pos_w[min(max(min(i, h) - min(j, h), 0), pos_w.numel() - 1)]
                if time_w is not None and i >= c and j >= c:  # contextual tokens: no time bias
                    delta = int(ts[start + i]) - int(ts[start + j])
                    s = s + time_w[time_bucket_ref(delta, time_w.numel() - 1)]
                acc = acc + (F.silu(s) * scale).unsqueeze(-1) * v[start + j]
            rows.append(acc)
        start += n
    if not rows:
        return v.new_zeros(0, *v.shape[1:])
    return torch.stack(rows)


def _inputs(seed, batch=5, max_len=7, heads=2, dqk=3, dv=4, bias=True, with_time=True):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, batch, max_len)
    total = sum(lengths)
    f64 = dict(dtype=torch.float64, generator=gen)
    q = torch.randn(total, heads, dqk, **f64).requires_grad_()
    k = torch.randn(total, heads, dqk, **f64).requires_grad_()
    v = torch.randn(total, heads, dv, **f64).requires_grad_()
    pos_w = torch.randn(NUM_POS, **f64).requires_grad_() if bias else None
    time_w = torch.randn(NUM_BUCKETS + 1, **f64).requires_grad_() if with_time else None
    # increasing per sequence; log-uniform gaps from 1 s to ~30 min, a fifth of them 0 s (same second)
    gaps = torch.exp(torch.rand(total, dtype=torch.float64, generator=gen) * 7.5).long()
    gaps = gaps * (torch.rand(total, generator=gen) < 0.8)
    ts = 1_600_000_000 + torch.cumsum(gaps, 0)
    return lengths, q, k, v, pos_w, ts if with_time else None, time_w, gen


def _compare(out, ref, leaves):
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    if out.numel() == 0:
        return
    torch.manual_seed(1234)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    exp = torch.autograd.grad(ref, leaves, grad_out, allow_unused=True)
    for g, e, leaf in zip(got, exp, leaves):
        g = torch.zeros_like(leaf) if g is None else g
        e = torch.zeros_like(leaf) if e is None else e
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "heads,dqk,dv", [(1, 4, 4), (2, 3, 5), (3, 8, 2)], ids=["h1", "h2", "h3"]
)
@pytest.mark.parametrize(
    "bias,with_time", [(False, False), (True, False), (True, True), (False, True)], ids=["nobias", "pos", "pos+time", "time"]
)
def test_causal_against_loop(seed, heads, dqk, dv, bias, with_time) -> None:
    lengths, q, k, v, pos_w, ts, time_w, _ = _inputs(seed, heads=heads, dqk=dqk, dv=dv, bias=bias, with_time=with_time)
    max_len = max(lengths) + seed  # also with padding beyond the longest sequence
    scale = 0.37
    out = hstu_attention(
        q, k, v, offsets_of(lengths), max_len, AttentionMask(),
        scale=scale, pos_weights=pos_w, timestamps=ts, time_weights=time_w, kernel="pytorch",
    )
    assert out.shape == (sum(lengths), heads, dv) and out.dtype == torch.float64
    ref = hstu_loop(q, k, v, lengths, scale, pos_w, ts, time_w)
    _compare(out, ref, [x for x in (q, k, v, pos_w, time_w) if x is not None])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("use_targets", [False, True])
@pytest.mark.parametrize("use_contextual", [False, True])
@pytest.mark.parametrize("window", [None, 2])
def test_masks_against_loop(seed, use_targets, use_contextual, window) -> None:
    lengths, q, k, v, pos_w, ts, time_w, gen = _inputs(seed)
    contextual, targets = random_split(gen, lengths)
    mask = AttentionMask(
        num_targets=torch.tensor(targets) if use_targets else None,
        num_contextual=torch.tensor(contextual) if use_contextual else None,
        max_attn_len=window,
    )
    max_len = max(lengths)
    out = hstu_attention(
        q, k, v, offsets_of(lengths), max_len, mask,
        scale=0.5, pos_weights=pos_w, timestamps=ts, time_weights=time_w, kernel="pytorch",
    )
    ref = hstu_loop(
        q, k, v, lengths, 0.5, pos_w, ts, time_w,
        contextual=contextual if use_contextual else None,
        targets=targets if use_targets else None,
        window=window,
    )
    _compare(out, ref, [q, k, v, pos_w, time_w])


def test_auto_kernel_matches_pytorch() -> None:
    lengths, q, k, v, pos_w, ts, time_w, gen = _inputs(7)
    _, targets = random_split(gen, lengths)
    args = (q, k, v, offsets_of(lengths), max(lengths), AttentionMask(num_targets=torch.tensor(targets)))
    kw = dict(scale=0.3, pos_weights=pos_w, timestamps=ts, time_weights=time_w)
    out_auto = hstu_attention(*args, **kw, kernel="auto")
    out_default = hstu_attention(*args, **kw)
    ref = hstu_loop(q, k, v, lengths, 0.3, pos_w, ts, time_w, targets=targets)
    torch.testing.assert_close(out_default, out_auto, rtol=0, atol=0)
    _compare(out_auto, ref, [q, k, v, pos_w, time_w])


def test_default_scale_is_one_over_max_seq_len() -> None:
    lengths, q, k, v, pos_w, _, _, _ = _inputs(3, with_time=False)
    offsets = offsets_of(lengths)
    for max_len in (max(lengths), max(lengths) + 5):
        out = hstu_attention(q, k, v, offsets, max_len, AttentionMask(), pos_weights=pos_w)
        ref = hstu_loop(q, k, v, lengths, 1.0 / max_len, pos_w)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_timestamps_without_time_weights_are_ignored() -> None:
    lengths, q, k, v, pos_w, ts, _, _ = _inputs(4)
    out = hstu_attention(q, k, v, offsets_of(lengths), max(lengths), AttentionMask(), scale=1.0, pos_weights=pos_w, timestamps=ts)
    torch.testing.assert_close(out, hstu_loop(q, k, v, lengths, 1.0, pos_w), rtol=1e-10, atol=1e-12)


def test_all_sequences_empty() -> None:
    q = torch.zeros(0, 2, 3, dtype=torch.float64)
    v = torch.zeros(0, 2, 4, dtype=torch.float64)
    out = hstu_attention(q, q, v, offsets_of([0, 0, 0]), 1, AttentionMask(), pos_weights=torch.zeros(4, dtype=torch.float64))
    assert out.shape == (0, 2, 4)


def test_time_buckets_against_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    deltas = torch.cat([torch.tensor([0, 1, -1, 2, 3, -3, 10**9]), torch.randint(-(10**7), 10**7, (500,), generator=gen)])
    for num_buckets in (5, 40, 128):
        got = time_buckets(deltas, num_buckets).tolist()
        assert got == [time_bucket_ref(int(d), num_buckets) for d in deltas]


def _tiny():
    q = torch.randn(3, 1, 2)
    return q, q, q, offsets_of([1, 2]), 2, AttentionMask()


def test_triton_kernel_on_cpu_raises(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="hstu_attention: kernel='triton' needs (CUDA tensors|the triton package)"):
        hstu_attention(*_tiny(), kernel="triton")


def test_unknown_kernel_raises() -> None:
    with pytest.raises(ValueError, match=r"kernel='cuda' is not one of \('auto', 'pytorch', 'triton'\)"):
        hstu_attention(*_tiny(), kernel="cuda")


def test_time_weights_without_timestamps_raises() -> None:
    with pytest.raises(ValueError, match="time_weights given without timestamps"):
        hstu_attention(*_tiny(), time_weights=torch.zeros(5))


def test_candidates_are_permutation_equivariant() -> None:
    """Targets share the history end's position: permuting candidates permutes their outputs."""
    gen = torch.Generator().manual_seed(11)
    n, t, heads, d = 9, 4, 2, 4
    q, k, v = (torch.randn(n, heads, d, generator=gen, dtype=torch.float64) for _ in range(3))
    pos_w = torch.randn(12, generator=gen, dtype=torch.float64)
    ts = torch.sort(torch.randint(0, 10**6, (n,), generator=gen)).values
    time_w = torch.randn(NUM_BUCKETS + 1, generator=gen, dtype=torch.float64)
    mask = AttentionMask(num_targets=torch.tensor([t]))
    offsets = offsets_of([n])
    kw = {"pos_weights": pos_w, "timestamps": ts, "time_weights": time_w}
    out = hstu_attention(q, k, v, offsets, n, mask, **kw)
    perm = torch.cat([torch.arange(n - t), n - t + torch.randperm(t, generator=gen)])
    ts_p = ts[perm]
    out_p = hstu_attention(q[perm], k[perm], v[perm], offsets, n, mask, **{**kw, "timestamps": ts_p})
    torch.testing.assert_close(out_p, out[perm], rtol=1e-12, atol=1e-12)
