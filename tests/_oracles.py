"""Plain-Python oracles shared by the ops tests: written per element / per sequence, independent
of the vectorised code under test."""

from __future__ import annotations

import math

import torch


def random_lengths(gen: torch.Generator, batch: int, max_len: int) -> list[int]:
    """Random sequence lengths in [0, max_len]; always includes a 0 and a 1 when batch >= 2."""
    lengths = torch.randint(0, max_len + 1, (batch,), generator=gen).tolist()
    if batch >= 2:
        lengths[0], lengths[-1] = 0, 1
    if batch >= 3:
        lengths[1] = max_len
    perm = torch.randperm(batch, generator=gen).tolist()
    return [lengths[p] for p in perm]


def offsets_of(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int64)


def random_split(gen: torch.Generator, lengths: list[int]) -> tuple[list[int], list[int]]:
    """Random (num_contextual, num_targets) per sequence with c + t <= n."""
    cs, ts = [], []
    for n in lengths:
        c = int(torch.randint(0, n + 1, (1,), generator=gen))
        t = int(torch.randint(0, n - c + 1, (1,), generator=gen))
        cs.append(c)
        ts.append(t)
    return cs, ts


def visible_ref(
    i: int,
    j: int,
    n: int,
    c: int,
    t: int,
    causal: bool,
    window: int | None,
    segments: list[int] | None = None,
    segment_full: list[bool] | None = None,
    ts: list[int] | None = None,
) -> bool:
    """Does query i see key j in a sequence of n tokens with c contextual and t target tokens?

    Layout: | contextual c | history n - c - t (segments, then the rest) | targets t |.
    ``ts``: per-token times of this sequence; a target sees only history strictly before it.
    """
    if i >= n or j >= n:  # padding: a padding row sees only itself, nobody sees padding
        return i == j
    if i < c:  # contextual queries: full attention inside the prefix, nothing else
        return j < c
    if j < c:  # the contextual prefix is visible to every later token
        return True
    history_end = n - t
    if j >= history_end:  # a target key: only the target itself sees it
        return i == j
    if i == j:
        return True
    # j is a history token; a target query sees what the last history token sees
    q = i if i < history_end else history_end - 1
    bounds = [c]  # segment start positions
    for length in segments or []:
        bounds.append(bounds[-1] + length)
    flags = list(segment_full or []) + [not causal]

    def seg_of(p: int) -> int:
        return sum(1 for end in bounds[1:] if p >= end)

    sq, sj = seg_of(q), seg_of(j)
    ok = sj < sq or (sj == sq and (flags[sq] or j <= q))
    if window is not None and j < q:
        ok = ok and (q - j < window)
    if ts is not None and i >= history_end:
        ok = ok and ts[j] < ts[i]
    return ok


def dense_ref(
    lengths: list[int],
    max_len: int,
    causal: bool = True,
    contextual: list[int] | None = None,
    targets: list[int] | None = None,
    window: int | None = None,
    segments: list[list[int]] | None = None,
    segment_full: list[bool] | None = None,
    timestamps: list[list[int]] | None = None,
) -> torch.Tensor:
    out = torch.zeros(len(lengths), max_len, max_len, dtype=torch.bool)
    for b, n in enumerate(lengths):
        c = contextual[b] if contextual is not None else 0
        t = targets[b] if targets is not None else 0
        seg = segments[b] if segments is not None else None
        ts = timestamps[b] if timestamps is not None else None
        for i in range(max_len):
            for j in range(max_len):
                out[b, i, j] = visible_ref(i, j, n, c, t, causal, window, seg, segment_full, ts)
    return out


def random_segments(gen: torch.Generator, lengths: list[int], contextual: list[int], targets: list[int], num: int) -> list[list[int]]:
    """``num`` random segment lengths per sequence covering part or all of its history."""
    out = []
    for n, c, t in zip(lengths, contextual, targets):
        left = n - c - t
        segs = []
        for _ in range(num):
            s = int(torch.randint(0, left + 1, (1,), generator=gen))
            segs.append(s)
            left -= s
        out.append(segs)
    return out


def time_bucket_ref(delta: int, num_buckets: int) -> int:
    """floor(ln(max(|delta|, 1)) / 0.301), clamped to [0, num_buckets]."""
    d = max(abs(delta), 1)
    return min(max(math.floor(math.log(d) / 0.301), 0), num_buckets)


def sampled_loss_inputs(dim: int = 16) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_items, user (T, dim), table (N + 1, dim), targets (T,), weights (T,)) for a sampled-softmax loss: fresh
    sizes (20-39 positions, 5-29 items), leaf user and table, weights of 0 or 1 (the first 1)."""
    positions, num_items = int(torch.randint(20, 40, ())), int(torch.randint(5, 30, ()))
    user = torch.randn(positions, dim, requires_grad=True)
    table = torch.randn(num_items + 1, dim, requires_grad=True)
    targets = torch.randint(1, num_items + 1, (positions,))
    weights = (torch.rand(positions) > 0.2).float()
    weights[0] = 1.0
    return num_items, user, table, targets, weights


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected|| in float64 (0 when both are empty or zero)."""
    got, expected = got.double(), expected.double()
    denom = float(expected.norm())
    diff = float((got - expected).norm())
    return diff / denom if denom > 0 else diff


def random_mask(kind: str, gen: torch.Generator, lengths: list[int], timestamps: torch.Tensor | None = None):
    """An AttentionMask of one kind over ``lengths``: causal, full, contextual, targets, window,
    segments, timestamps, or all (everything at once)."""
    from recforge.jagged.mask import AttentionMask

    contextual, targets = random_split(gen, lengths)
    c = torch.tensor(contextual) if kind in ("contextual", "all") else None
    t = torch.tensor(targets) if kind in ("targets", "timestamps", "all") else None
    segs = None
    if kind in ("segments", "all"):
        segs = torch.tensor(
            random_segments(gen, lengths, contextual if c is not None else [0] * len(lengths),
                            targets if t is not None else [0] * len(lengths), 3)
        )
    return AttentionMask(
        causal=kind != "full",
        num_targets=t,
        num_contextual=c,
        max_attn_len=5 if kind in ("window", "all") else None,
        segment_lengths=segs,
        segment_full=(True, False, True) if segs is not None else None,
        timestamps=timestamps if kind in ("timestamps", "all") else None,
    )
