"""Softmax cross-entropy over positions x negatives, computed in chunks of positions.

For each position t (T of them) the logits are, divided by the temperature::

    [ u_t . p_t | u_t . s_1 ... u_t . s_S | u_t . n_t1 ... u_t . n_tK ]
      positive    shared columns            the position's own negatives
                  (whole catalogue, a       (per-position sampling)
                  shared sample, in-batch)

with a column masked out (-inf) where its item is the target (an accidental hit) or the padding
item 0. The loss is the mean over positions of ``logsumexp(logits_t) - logits_t[0]`` (or its weighted
mean: each position's loss and gradients scaled by w_t / sum(w), a device tensor, so no host sync).

The unchunked computation holds the (T, S + K) logits several times over, and for per-position
negatives the (T, K, d) gathered negative vectors. Here the forward walks ``chunk`` positions at a
time and computes the gradients of the inputs as it goes (the loss is a scalar, so backward only
scales them), the approach of fused linear cross-entropy kernels (e.g. Liger-Kernel): the largest
temporaries are (chunk, S + K) logits and (chunk, K, d) vectors, nothing of size T x (S + K) is
ever allocated in float, and no logit is computed twice. Per-position negatives are passed as
(T, K) row indices into their distinct vectors (U, d), so the index tensors stay O(T K) integers.

With the fused gather-dot (float32 on CUDA by default, ``recforge.ops.gather_dot``) the per-position
negatives' (chunk, K, d) vectors are not gathered either: each chunk's logits and user gradient come from the
Triton kernels, its (chunk, K) logit gradients are kept in one (T, K) float32 buffer (half the bytes of the
(T, K) int64 rows), and the gradient of the distinct vectors is one sorted segmented sum after the last chunk.

Shared negatives alone (no per-position ones) take each chunk's loss and logit gradients from one read of its
(c, S) logits (``recforge.ops.softmax_nll``: one Triton kernel on CUDA). The unchunked loss with shared negatives
(``chunk_size: 0``) runs here too, as one chunk (``chunk=0``): the logits' gradient is computed in the forward, in
bfloat16 with ``half``, and the backward only scales the (T, d) and (S, d) gradients.

The full-catalogue softmax (``chunked_full_softmax_cross_entropy``) needs no positive column: the
target's own column of the catalogue's logits is the positive, so each chunk is a plain
cross-entropy over (c, N+1) logits with the padding column biased to -inf: 8 ops per chunk
(addmm, log_softmax, gather, neg, exp, scatter_add, mm, addmm) instead of ~25, fewer passes over
the logits, and no host synchronisation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recforge.ops.gather_dot import gather_dot_logits, gather_rows_sum, scatter_rows_sum, use_triton
from recforge.ops.half_matmul import mm_f32, mm_f32_add_
from recforge.ops.softmax_nll import softmax_nll


def logsumexp_of_blocks(parts: list[Tensor]) -> Tensor:
    """(T,) ``torch.logsumexp(torch.cat(parts, 1), 1)`` of blocks of columns (each (T, n_i)) without the
    concatenation: each block's logsumexp, then theirs. The concatenated copy (2 GiB of float32 at 64K positions x
    8,193 shared columns) is never written."""
    lse = [part.logsumexp(1) for part in parts]
    return lse[0] if len(lse) == 1 else torch.logsumexp(torch.stack(lse, 1), 1)


class _ChunkedSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, user: Tensor, positive: Tensor, shared: Tensor | None, own: Tensor | None, targets: Tensor,
                shared_ids: Tensor | None, own_rows: Tensor | None, own_ids: Tensor | None, inv_temp: float,
                chunk: int, want_grads: bool, weights: Tensor | None, half: bool) -> Tensor:  # fmt: skip
        num_pos = user.shape[0]
        share = None if weights is None else weights / weights.sum()  # (T,) each position's w / W, on the device
        # the chunks scale each row's logit gradients by w / max(w) (in [0, 1]), and max(w) / W is applied once at
        # the end
        rel = None if share is None else (weights / weights.max()).to(user.dtype)
        # once for every position, not per chunk: 1/temperature on the user side, the positive logits, and
        # the shared columns' padding mask as an additive bias (fused into the chunks' matmul)
        scaled = user * inv_temp  # (T, d)
        pos = (scaled * positive).sum(-1, keepdim=True)  # (T, 1)
        pad_bias = None
        if shared is not None and own is not None:  # (shared columns alone: ``_shared_chunk`` masks in its pass)
            pad_bias = torch.zeros(shared_ids.shape, dtype=user.dtype, device=user.device).masked_fill_(shared_ids == 0, float("-inf"))
        nll = user.new_empty(num_pos)  # (T,) each position's loss
        fused = own is not None and use_triton(scaled, own, own_rows)  # the gather-dot kernels: no (c, K, d) vectors
        # ``half``: the shared columns' matmuls from reduced-precision copies (recforge.ops.half_matmul), made once:
        # float16 for the logits, bfloat16 for the two gradient matmuls
        half_inputs = None
        if half and shared is not None:
            half_inputs = (scaled.to(torch.float16), shared.to(torch.float16), shared.to(torch.bfloat16),
                           user.to(torch.bfloat16))  # fmt: skip
        grads = own_grad = None
        if want_grads:
            grads = [torch.empty_like(user), torch.empty_like(positive), None if shared is None else torch.zeros_like(shared),
                     None if own is None or fused else torch.zeros_like(own)]  # fmt: skip
            own_grad = user.new_empty(own_rows.shape) if fused else None  # (T, K) d nll / d own logits
        for lo in range(0, num_pos, chunk) if 0 < chunk < num_pos else (0,):  # one chunk: no loop, T may be symbolic
            hi = min(lo + chunk, num_pos) if chunk > 0 else num_pos
            _chunk(user[lo:hi], scaled[lo:hi], pos[lo:hi], positive[lo:hi], shared, pad_bias, own, targets[lo:hi],
                   shared_ids, None if own_rows is None else own_rows[lo:hi], None if own_ids is None else own_ids[lo:hi],
                   nll[lo:hi], grads, lo, None if rel is None else rel[lo:hi, None], fused,
                   None if own_grad is None else own_grad[lo:hi],
                   None if half_inputs is None else (half_inputs[0][lo:hi], *half_inputs[1:3], half_inputs[3][lo:hi]))  # fmt: skip
        if grads is not None and fused:  # every row of own written once, from all positions' logit gradients
            grads[3] = scatter_rows_sum(own_grad, user, own_rows, own.shape[0], kernel="triton")
        if grads is not None:  # the chunks summed d nll / d logits times the unscaled inputs: 1/T and 1/temperature, once
            # weighted: the chunks applied w / max(w); max(w) / W here
            scale = inv_temp / num_pos if share is None else inv_temp * weights.max() / weights.sum()
            ctx.save_for_backward(*(g.mul_(scale) for g in grads if g is not None))
            ctx.present = [g is not None for g in grads]
        return nll.mean() if share is None else (nll * share).sum()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        if not hasattr(ctx, "present"):
            raise RuntimeError("chunked sampled softmax: backward through a loss computed without gradients "
                               "(computed under torch.no_grad, or with inputs that need none)")  # fmt: skip
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) * grad_out if present else None for present in ctx.present]
        return (*grads, None, None, None, None, None, None, None, None, None)


def _chunk(user: Tensor, scaled: Tensor, pos: Tensor, positive: Tensor, shared: Tensor | None, pad_bias: Tensor | None,
           own: Tensor | None, targets: Tensor, shared_ids: Tensor | None, own_rows: Tensor | None,
           own_ids: Tensor | None, nll: Tensor, grads: list[Tensor | None] | None, lo: int,
           share: Tensor | None, fused: bool = False, own_grad: Tensor | None = None,
           half: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> None:  # fmt: skip
    """One chunk of c positions: writes their losses into ``nll`` (c,) and adds d nll / d logits times the unscaled
    inputs into ``grads`` (the caller applies 1/temperature and the mean once). ``scaled``: ``user`` / temperature,
    ``pos`` (c, 1) the positive logits, ``pad_bias`` (S,) -inf at the shared padding columns; ``share`` (c, 1):
    each row's weight relative to the largest (weighted), its d nll / d logits scaled by it. ``fused``: the own
    negatives' logits and user gradient by the gather-dot kernels, their logit gradients written to ``own_grad``
    (c, K) for the caller. ``half``: float16 copies of ``scaled`` and ``shared`` (the logits), bfloat16 copies of
    ``shared`` and ``user`` (the gradients, with the logit gradients cast to bfloat16); float32 sums and outputs."""
    if shared is not None and own is None:  # one block of columns: the loss and its logit gradients in one pass
        _shared_chunk(user, scaled, pos, positive, shared, shared_ids, targets, nll, grads, lo, share, half)
        return
    parts = [pos]
    if shared is not None and half is not None:
        s = mm_f32(half[0], half[1].T, bias=pad_bias)  # (c, S)
        parts.append(s.masked_fill_(shared_ids == targets[:, None], float("-inf")))
    elif shared is not None:
        s = torch.addmm(pad_bias, scaled, shared.T)  # (c, S)
        parts.append(s.masked_fill_(shared_ids == targets[:, None], float("-inf")))
    if own is not None and fused:
        o = gather_dot_logits(scaled, own, own_rows, kernel="triton").to(scaled.dtype)  # (c, K)
        parts.append(o.masked_fill_(own_ids == targets[:, None], float("-inf")))
    elif own is not None:
        own_vec = own[own_rows]  # (c, K, d)
        o = torch.bmm(own_vec, scaled.unsqueeze(2)).squeeze(2)  # (c, K)
        parts.append(o.masked_fill_(own_ids == targets[:, None], float("-inf")))
    lse = logsumexp_of_blocks(parts)  # (c,): no (c, 1 + S + K) concatenated copy
    torch.sub(lse, pos[:, 0], out=nll)
    if grads is None:
        return

    def softmax_of(block: Tensor, out: Tensor | None = None) -> Tensor:
        """d nll / d logits of a block of columns, in place of the block (its logits are not needed after) or in
        ``out``: the softmax (the positive's minus 1 below), times each row's ``share``."""
        g = block.sub_(lse[:, None]).exp_() if out is None else torch.exp(block - lse[:, None], out=out)
        return g if share is None else g.mul_(share)

    g_pos = softmax_of(pos.clone()) - (1.0 if share is None else share)  # (c, 1); ``pos`` is the caller's
    hi = lo + user.shape[0]
    grad_user = torch.mul(g_pos, positive, out=grads[0][lo:hi])  # (c, d)
    torch.mul(g_pos, user, out=grads[1][lo:hi])
    col = 1
    if shared is not None:
        g_s = softmax_of(parts[col])  # (c, S)
        if half is not None:
            g16 = g_s.to(torch.bfloat16)
            mm_f32_add_(grad_user, g16, half[2])
            mm_f32_add_(grads[2], g16.T, half[3])
        else:
            grad_user.addmm_(g_s, shared)
            grads[2].addmm_(g_s.T, user)
        col += 1
    if own is not None and fused:
        g_o = softmax_of(parts[col], out=own_grad)  # (c, K)
        grad_user.add_(gather_rows_sum(g_o, own, own_rows, kernel="triton"))
    elif own is not None:
        g_o = softmax_of(parts[col])  # (c, K)
        grad_user.add_(torch.bmm(g_o.unsqueeze(1), own_vec).squeeze(1))
        grads[3].index_add_(0, own_rows.reshape(-1), (g_o.unsqueeze(2) * user.unsqueeze(1)).reshape(-1, user.shape[1]))


def _shared_chunk(user: Tensor, scaled: Tensor, pos: Tensor, positive: Tensor, shared: Tensor, shared_ids: Tensor,
                  targets: Tensor, nll: Tensor, grads: list[Tensor | None] | None, lo: int, share: Tensor | None,
                  half: tuple[Tensor, Tensor, Tensor, Tensor] | None) -> None:  # fmt: skip
    """``_chunk`` for the shared columns alone: their logits, then each row's loss and d nll / d logits from one read
    of them (``recforge.ops.softmax_nll``: one Triton kernel on CUDA, where PyTorch's logsumexp and softmax read the
    (c, S) float32 logits twice and write masked copies), in bfloat16 for the ``half`` gradient matmuls."""
    logits = mm_f32(half[0], half[1].T) if half is not None else scaled @ shared.T  # (c, S)
    loss, g_s, g_pos = softmax_nll(logits, pos[:, 0], shared_ids, targets, None if share is None else share[:, 0],
                                   grad_dtype=torch.bfloat16 if half is not None else None)  # fmt: skip
    nll.copy_(loss)
    if grads is None:
        return
    g_pos = g_pos[:, None].to(user.dtype)  # (c, 1)
    hi = lo + user.shape[0]
    grad_user = torch.mul(g_pos, positive, out=grads[0][lo:hi])  # (c, d)
    torch.mul(g_pos, user, out=grads[1][lo:hi])
    if half is not None:
        mm_f32_add_(grad_user, g_s, half[2])
        mm_f32_add_(grads[2], g_s.T, half[3])
    else:
        grad_user.addmm_(g_s.to(user.dtype), shared)
        grads[2].addmm_(g_s.T.to(user.dtype), user)


class _ChunkedFullSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, user: Tensor, table: Tensor, targets: Tensor, inv_temp: float, chunk: int, want_grads: bool,
                weights: Tensor | None, half: bool) -> Tensor:  # fmt: skip
        num_pos = user.shape[0]
        share = None if weights is None else (weights / weights.sum()).view(-1, 1)  # (T, 1) each w / W, on the device
        rel = None if share is None else (weights / weights.max()).view(-1, 1)  # w / max(w), in [0, 1] (float16 keeps it)
        # ``half``: the logits from float16 copies, the gradients from bfloat16 ones (recforge.ops.half_matmul), made once
        user16, table16 = (user.to(torch.float16), table.to(torch.float16)) if half else (None, None)
        user_b, table_b = (user.to(torch.bfloat16), table.to(torch.bfloat16)) if half and want_grads else (None, None)
        pad_bias = user.new_zeros(table.shape[0])  # (N+1,): the padding item 0 is not an item
        pad_bias[:1].fill_(float("-inf"))  # not `pad_bias[0] = ...`: __setitem__ copies a host scalar (a sync)
        nll = user.new_empty(num_pos)  # (T,) each position's loss
        targets = targets.view(-1, 1)  # (T, 1)
        if want_grads:
            grad_user, grad_table = torch.empty_like(user), torch.zeros_like(table)
            minus_one = user.new_full((min(chunk, num_pos), 1), -1.0)
        for lo in range(0, num_pos, chunk):
            hi = min(lo + chunk, num_pos)
            u, t = user[lo:hi], targets[lo:hi]
            if half:
                logits = mm_f32(user16[lo:hi], table16.T, bias=pad_bias, alpha=inv_temp)  # (c, N+1)
            else:
                logits = torch.addmm(pad_bias, u, table.T, alpha=inv_temp)
            log_p = logits.log_softmax(1)
            torch.neg(log_p.gather(1, t).squeeze(1), out=nll[lo:hi])
            if want_grads:  # d nll / d logits = softmax - onehot(target), in place of log_p
                g = log_p.exp_().scatter_add_(1, t, minus_one[: hi - lo])  # (c, N+1)
                if rel is not None:
                    g.mul_(rel[lo:hi])
                if half:
                    g16 = g.to(torch.bfloat16)
                    grad_user[lo:hi] = mm_f32(g16, table_b)
                    mm_f32_add_(grad_table, g16.T, user_b[lo:hi])
                else:
                    torch.mm(g, table, out=grad_user[lo:hi])  # (c, d)
                    grad_table.addmm_(g.T, u)  # (N+1, d)
        if want_grads:  # the mean over positions (weighted: w / max(w) per chunk, max(w) / W here) and 1/temperature
            scale = inv_temp / num_pos if share is None else inv_temp * weights.max() / weights.sum()
            ctx.save_for_backward(grad_user.mul_(scale), grad_table.mul_(scale))
        return nll.mean() if share is None else (nll * share.view(-1)).sum()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        if not ctx.saved_tensors:
            raise RuntimeError("chunked full softmax: backward through a loss computed without gradients "
                               "(computed under torch.no_grad, or with inputs that need none)")  # fmt: skip
        grad_user, grad_table = ctx.saved_tensors
        return grad_user * grad_out, grad_table * grad_out, None, None, None, None, None, None


def chunked_full_softmax_cross_entropy(user: Tensor, table: Tensor, targets: Tensor, *, temperature: float,
                                       chunk: int, weights: Tensor | None = None, half: bool = False) -> Tensor:  # fmt: skip
    """Mean softmax cross-entropy of each position's target over the whole catalogue, ``chunk`` positions at a time.

    Args:
        user: (T, d) user vectors.
        table: (N+1, d) every item's vector; row 0 is the padding item, never a class.
        targets: (T,) target item ids in 1..N.
        temperature: logits are dot products / temperature.
        chunk: positions per chunk (> 0).
        weights: (T,) each position's weight (sum > 0): the loss is the weighted mean, each row's loss and
            gradient scaled by w / sum(w) on the device (no host sync). None: the plain mean.
        half: the logits from float16 inputs, the gradients from bfloat16 ones, float32 sums and outputs
            (``recforge.ops.half_matmul``; the caller decides: ``loss.matmul`` float16 on CUDA).

    Returns:
        The scalar loss (``F.cross_entropy`` of the (T, N+1) logits with column 0 at -inf, up to float
        rounding); gradients flow to ``user`` and ``table``.
    """
    if chunk <= 0:
        raise ValueError(f"chunked_full_softmax_cross_entropy: chunk={chunk} must be > 0")
    want_grads = torch.is_grad_enabled() and (user.requires_grad or table.requires_grad)
    return _ChunkedFullSoftmaxCE.apply(user, table, targets, 1.0 / temperature, int(chunk), want_grads, weights, half)


def chunked_softmax_cross_entropy(
    user: Tensor,
    positive: Tensor,
    targets: Tensor,
    *,
    shared: Tensor | None = None,
    shared_ids: Tensor | None = None,
    own: Tensor | None = None,
    own_rows: Tensor | None = None,
    own_ids: Tensor | None = None,
    temperature: float,
    chunk: int,
    weights: Tensor | None = None,
    half: bool = False,
) -> Tensor:
    """Mean softmax cross-entropy of each position's positive against its negatives, ``chunk`` positions at a time.

    Args:
        user: (T, d) user vectors.
        positive: (T, d) each position's target vector.
        targets: (T,) target item ids (for masking accidental hits).
        shared: (S, d) negative vectors every position scores; ``shared_ids`` (S,) their item ids.
        own: (U, d) vectors of per-position negatives; ``own_rows`` (T, K) each position's rows of
            ``own``, ``own_ids`` (T, K) their item ids.
        temperature: logits are dot products / temperature.
        chunk: positions per chunk; 0: all of them as one (no loop: a compiled step keeps its symbolic T).
        weights: (T,) each position's weight (sum > 0): the weighted mean, as ``chunked_full_softmax_cross_entropy``.
        half: the shared columns' matmuls in reduced precision, as ``chunked_full_softmax_cross_entropy``.

    Returns:
        The scalar loss; gradients flow to ``user``, ``positive``, ``shared`` and ``own``.
    """
    if chunk < 0:
        raise ValueError(f"chunked_softmax_cross_entropy: chunk={chunk} must be >= 0 (0: every position in one chunk)")
    if (shared is None) != (shared_ids is None) or (own is None) != (own_rows is None or own_ids is None):
        raise ValueError("chunked_softmax_cross_entropy: give shared with shared_ids, own with own_rows and own_ids")
    inputs = [t for t in (user, positive, shared, own) if t is not None]
    want_grads = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return _ChunkedSoftmaxCE.apply(user, positive, shared, own, targets, shared_ids, own_rows, own_ids,
                                   1.0 / temperature, int(chunk), want_grads, weights, half)  # fmt: skip
