"""Every training loss of recforge, in one place.

- ``sampled_softmax_loss``: retrieval, next item against sampled (or all) negatives on L2-normalised
  user and item vectors.
- ``pointwise_loss``, ``listwise_loss``: multi-task ranking, per target (BCE / MSE) and per sample's
  candidate list (softmax cross-entropy).
- ``token_loss_scale``, ``token_weighted_ranking_loss``: the weights that give token-budget batches
  (a varying number of rows per batch, ``recforge.data.token_batching``) fixed-batch semantics.

Every loss is computed in float32, also under bfloat16 autocast. The SID models' teacher-forced
next-token losses stay methods of those models (``model.loss``), where their logits are made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.data.ranking_samples import TokenReference
from recforge.jagged.index import offsets_from_lengths, sequence_ids
from recforge.ops.gather_dot import gather_dot
from recforge.ops.half_matmul import half_input_logits, use_half
from recforge.train.chunked_softmax import (chunked_full_softmax_cross_entropy, chunked_softmax_cross_entropy,
                                            logsumexp_of_blocks)
from recforge.train.distributed import several_ranks


# A masked logit (an accidental hit, an in-batch padding column): the lowest finite float32, not -inf, so that a
# block of columns masked whole in a row (every in-batch column the target or padding) has a finite logsumexp and
# no NaN arises even in intermediate gradients (with -inf, logsumexp's backward makes NaN there, exp(x - lse) at
# x = lse = -inf, which only masked_fill's backward then zeroes). exp(MASKED - lse) is exactly 0.
MASKED = torch.finfo(torch.float32).min


@dataclass
class SampledNegatives:
    """A batch's sampled negatives, drawn before its step (``draw_negatives``): exactly the id tensors the loss
    looks up, so a pipeline can look them up a step ahead (``recforge.train.pipeline_step``)."""

    ids: Tensor | None = None  # (T, K) per position or (K,) shared: the sampled items (masks accidental hits)
    distinct: Tensor | None = None  # chunked per-position: (M,) the distinct sampled items looked up...
    rows: Tensor | None = None  # ... and (T, K) each draw's row of them
    in_batch: Tensor | None = None  # (T,) the batch's distinct targets, repeats as 0 (batch_distinct; exact: (U,))
    shared: Tensor | None = None  # chunked: (S,) every shared column's item (sampled shared set, then in-batch)


def draw_negatives(targets: Tensor, num_items: int, *, negatives: str = "per_position", num_negatives: int = 128,
                   in_batch_negatives: bool = False, chunk_size: int = 0, exact_distinct: bool = False,
                   generator: torch.Generator | None = None) -> SampledNegatives:  # fmt: skip
    """The negatives ``sampled_softmax_loss`` scores for ``targets`` (T,), drawn uniformly from 1..num_items.

    Arguments as ``sampled_softmax_loss``'s. ``generator``: where the draws come from (on ``targets``' device);
    None: the default generator (what the loss does when given no negatives). Chunked per-position negatives
    are also reduced to their distinct items here (``exact_distinct``: ``torch.unique``, one host sync), so
    the loss does no sampling work and a pipeline can do this a step ahead.

    Example:
        >>> gen = torch.Generator(targets.device).manual_seed(seed)
        >>> sampled = draw_negatives(targets, num_items, num_negatives=128, generator=gen)
        >>> loss = sampled_softmax_loss(user, targets, model.item_vectors, num_items, sampled=sampled)
    """
    device, out = targets.device, SampledNegatives()
    if negatives == "full":
        return out
    if negatives == "per_position":
        out.ids = torch.randint(1, num_items + 1, (targets.shape[0], num_negatives), device=device, generator=generator)  # (T, K)
    elif negatives == "shared":
        out.ids = torch.randint(1, num_items + 1, (num_negatives,), device=device, generator=generator)  # (K,)
    else:
        raise ValueError(f"negatives={negatives!r}: expected per_position, shared or full")
    if in_batch_negatives:  # exact_distinct: the table sees each target once, not the padding id 0
        out.in_batch = torch.unique(targets) if exact_distinct else batch_distinct(targets)  # (U,) / (T,)
    if not use_chunks(chunk_size, targets.shape[0]):
        return out
    shared = [out.ids] if negatives == "shared" else []
    shared += [out.in_batch] if in_batch_negatives else []
    out.shared = torch.cat(shared) if shared else None
    if negatives == "per_position":
        if exact_distinct:  # a counting table: no padding repeats (one host sync)
            out.distinct, out.rows = torch.unique(out.ids, return_inverse=True)  # (M,), (T, K)
        else:
            out.distinct, out.rows = _distinct_rows(out.ids, num_items + 1)  # (M,), (T, K)
    return out


def _float32(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for the loss, entered only when autocast is on: a float32 step's compiled graph then holds no
    autocast region (before ``train.compiled._autocast_cacheable``, one kept it out of AOTAutograd's cache)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def sampled_softmax_loss(
    user: Tensor,
    targets: Tensor,
    item_vectors: Callable[[Tensor | None], Tensor],
    num_items: int,
    *,
    negatives: str = "per_position",
    num_negatives: int = 128,
    in_batch_negatives: bool = False,
    temperature: float = 0.05,
    chunk_size: int = 0,
    exact_distinct: bool = False,
    sampled: SampledNegatives | None = None,
    weights: Tensor | None = None,
    matmul: str = "float32",
) -> Tensor:
    """Softmax cross-entropy of each position's next item against negatives.

    Args:
        user: (T, d) L2-normalised user vectors, one per position with a target.
        targets: (T,) target item indices in 1..num_items.
        item_vectors: ``f(ids) -> L2-normalised vectors``; ``f(None)`` returns the whole table.
        num_items: catalogue size; negatives are drawn uniformly from 1..num_items.
        negatives: ``per_position`` draws ``num_negatives`` per position (the HSTU paper),
            ``shared`` one set for the batch, ``full`` scores the whole catalogue.
        in_batch_negatives: add the batch's distinct target items as negatives.
        temperature: logits are cosine / temperature.
        chunk_size: > 0 and fewer than the batch's positions: compute the loss ``chunk_size``
            positions at a time (``recforge.train.chunked_softmax``), so no (positions x negatives)
            logits nor (positions x negatives x d) vectors are ever allocated; same value and
            gradients up to float rounding, the same negatives drawn. Per-position negatives are
            looked up once per distinct item (``item_vectors`` sees each sampled ID once, with
            fixed-size padding that repeats one of them); no host synchronisation.
        exact_distinct: ``item_vectors`` counts the ids it is given (a dynamic table: admission, LFU,
            stats): chunked per-position negatives are looked up as their exact distinct ids
            (``torch.unique``, one host sync), so no padding repeat is counted. Such a table counts
            each distinct sampled negative once per batch, not once per draw as unchunked.
        sampled: the negatives, drawn before the step by ``draw_negatives`` with the same settings;
            None: drawn here, from the default generator.
        weights: (T,) each position's weight (e.g. 0 at a shape bucket's padding positions, 1 elsewhere:
            ``recforge.train.step_padding``), sum > 0; the loss is the weighted mean, and a position of weight 0
            adds nothing to the loss or any gradient. None: the plain mean.
        matmul: ``float16``: on CUDA the logits of the shared, in-batch and whole-catalogue columns come from
            float16-input matmuls with float32 sums and outputs (``recforge.ops.half_matmul``: TF32's 10-bit
            mantissa at twice its throughput), their gradients from bfloat16-input ones (a bf16 backward's
            precision); ``float32`` (default) or a CPU tensor: float32 matmuls.

    Sampled negatives equal to the target ("accidental hits") and in-batch columns of the padding id 0 are
    masked out.

    Unchunked per-position negatives with more draws (T x K) than the table has rows, and ``exact_distinct``
    off (lookups without side effects), are scored as rows of ``item_vectors(None)``: each item is normalised
    once instead of once per draw, and the (T, K, d) lookup's gradient is one scatter; the same value and
    gradients up to float rounding.

    Returns:
        Mean (or weighted mean) loss over positions (scalar), computed in float32 also under bfloat16 autocast: at
        temperature 0.05 bf16's ~3 significant digits would put ~0.1 of noise on each logit.
    """
    with _float32(user.device.type):
        dtype = torch.promote_types(user.dtype, torch.float32)  # bf16/fp16 -> float32
        if sampled is None:  # the draws come first, as they always did: the default generator's order is unchanged
            sampled = draw_negatives(targets, num_items, negatives=negatives, num_negatives=num_negatives,
                                     in_batch_negatives=in_batch_negatives, chunk_size=chunk_size,
                                     exact_distinct=exact_distinct)  # fmt: skip
        elif negatives != "full" and (sampled.ids is None or (in_batch_negatives and sampled.in_batch is None)):
            raise ValueError(f"sampled_softmax_loss: the sampled negatives given do not match negatives={negatives!r}, "
                             f"in_batch_negatives={in_batch_negatives}; draw them with draw_negatives and these settings")  # fmt: skip
        vectors = lambda ids: item_vectors(ids).to(dtype)  # noqa: E731
        if weights is not None:
            if weights.shape != targets.shape:
                raise ValueError(f"sampled_softmax_loss: weights of shape {tuple(weights.shape)}; expected one per "
                                 f"position, {tuple(targets.shape)}")  # fmt: skip
            weights = weights.to(dtype)
        half = use_half(matmul, user.device)
        if not _whole_under_compile(negatives, user.shape[0], num_items) and use_chunks(chunk_size, user.shape[0]):
            return _chunked_loss(user.to(dtype), targets, vectors, negatives, sampled, temperature, chunk_size, weights,
                                 half)  # fmt: skip
        if negatives == "shared":  # one chunk: each row's loss and logit gradients from one read of its logits
            return _chunked_loss(user.to(dtype), targets, vectors, negatives, sampled, temperature, 0, weights, half)
        table = None
        if negatives == "per_position" and not exact_distinct and targets.shape[0] * num_negatives > num_items + 1:
            table = item_vectors(None).to(dtype)  # (N+1, d): each row normalised once, not once per draw
            if table.shape[0] != num_items + 1:
                raise ValueError(f"sampled_softmax_loss: item_vectors(None) gave {table.shape[0]} rows; expected the "
                                 f"whole table, num_items + 1 = {num_items + 1} (row 0 the padding item)")  # fmt: skip
            vectors = lambda ids: F.embedding(ids, table)  # noqa: E731
        return _sampled_softmax_loss(user.to(dtype), targets, vectors, negatives, sampled, temperature, weights, table,
                                     half)  # fmt: skip


# torch.compile: a full-catalogue softmax of at most this many logits is computed whole, not in chunks (1 GiB of
# float32 logits; with the saved log-softmax and the logits' gradient the loss's peak is ~3 GiB there, more than
# chunked). The chunk loop's trip count needs a concrete position count, so a chunked loss compiled a new graph for
# every batch size (every CUDA-graph shape bucket); whole, one graph serves every size. Sampled negatives, several
# ranks and larger full softmaxes stay chunked (and compile once per batch size).
COMPILED_WHOLE_LOGITS = 2**28


def _whole_under_compile(negatives: str, positions, num_items: int) -> bool:
    """Whether a compiled step computes this full-softmax loss unchunked (``COMPILED_WHOLE_LOGITS``). Sampled
    negatives keep their chunks: their draws were laid out for them before the step."""
    if negatives != "full" or not torch.compiler.is_compiling():
        return False
    if several_ranks():
        return False  # every rank must issue the same lookups (use_chunks)
    return positions * (num_items + 1) <= COMPILED_WHOLE_LOGITS


def use_chunks(chunk_size: int, positions: int) -> bool:
    """Whether the loss runs in chunks: ``chunk_size`` > 0 and fewer than the batch's positions — or, with
    several ranks, whenever ``chunk_size`` > 0. Which tensors the loss looks up (and so which lookups the
    pipelined step combines and the collectives every rank issues) must not depend on one rank's batch
    size; one chunk gives the unchunked value up to float rounding."""
    if chunk_size <= 0:
        return False
    if positions > chunk_size:
        return True
    return several_ranks()


def _sampled_softmax_loss(user: Tensor, targets: Tensor, item_vectors: Callable[[Tensor | None], Tensor], negatives: str,
                          sampled: SampledNegatives, temperature: float, weights: Tensor | None,
                          table: Tensor | None = None, half: bool = False) -> Tensor:  # fmt: skip
    """The unchunked loss of per-position or whole-catalogue negatives (shared ones take ``_chunked_loss``'s one
    chunk); ``table``: ``item_vectors`` gives its rows, without side effects (a normalised table), so a position's
    target and per-position negatives are scored together, by one gather-dot (fused with float32 on CUDA:
    ``recforge.ops.gather_dot``; else one lookup and one bmm). ``half``: the in-batch and catalogue logits by
    float16-input matmuls (``half_input_logits``)."""
    mm = half_input_logits if half else (lambda a, b: a @ b.T)  # noqa: E731
    if negatives == "full":
        logits = mm(user, item_vectors(None)) / temperature  # (T, N+1)
        logits[:, 0].fill_(float("-inf"))  # padding row is not an item (fill_: __setitem__ would copy a host scalar, a sync)
        if weights is None:
            return F.cross_entropy(logits, targets)
        return _weighted_mean(F.cross_entropy(logits, targets, reduction="none"), weights)
    # per-position negatives, neg_ids (T, K) (shared ones take the one-chunk loss, ``_chunked_loss``); bmm, not
    # einsum: einsum's gradient of the (T, K, d) lookup came out transposed, and was copied whole before the scatter
    neg_ids = sampled.ids
    hits = neg_ids == targets[:, None]
    if table is not None:  # side-effect-free lookups: [target | negatives] rows scored together
        ids = torch.cat([targets[:, None], neg_ids], 1)  # (T, 1+K)
        logits = gather_dot(user, table, ids).to(user.dtype) / temperature  # (T, 1+K)
        parts = [logits.masked_fill(torch.cat([torch.zeros_like(hits[:, :1]), hits], 1), MASKED)]
    else:  # the very tensors a pipelined table staged (recforge.train.pipeline_step): looked up as they are,
        # targets first (a dynamic table admits and evicts rows in lookup order: the positives keep theirs)
        pos = (user * item_vectors(targets)).sum(-1, keepdim=True) / temperature  # (T, 1)
        neg_logits = torch.bmm(item_vectors(neg_ids), user.unsqueeze(2)).squeeze(2) / temperature  # (T, K)
        parts = [pos, neg_logits.masked_fill(hits, MASKED)]
    if sampled.in_batch is not None:
        batch_ids = sampled.in_batch  # (U,)
        batch_logits = mm(user, item_vectors(batch_ids)) / temperature  # (T, U)
        hit = (batch_ids[None, :] == targets[:, None]) | (batch_ids == 0)[None, :]  # 0: batch_distinct's fill
        parts.append(batch_logits.masked_fill(hit, MASKED))
    nll = logsumexp_of_blocks(parts) - parts[0][:, 0]  # -log_softmax(cat(parts))[:, 0], never concatenated
    return nll.mean() if weights is None else _weighted_mean(nll, weights)


def _weighted_mean(nll: Tensor, weights: Tensor) -> Tensor:
    """sum(w * nll) / sum(w), on the device (no host sync)."""
    return (nll * weights).sum() / weights.sum()


def _chunked_loss(user: Tensor, targets: Tensor, item_vectors: Callable[[Tensor | None], Tensor], negatives: str,
                  sampled: SampledNegatives, temperature: float, chunk: int, weights: Tensor | None,
                  half: bool = False) -> Tensor:  # fmt: skip
    """``_sampled_softmax_loss`` in chunks of positions: the same negatives, the positive / shared / per-position
    columns handed to ``chunked_softmax_cross_entropy``; ``chunk`` 0 (shared negatives): all positions as one."""
    if negatives == "full":  # cross-entropy over the catalogue: the target's column is the positive
        return chunked_full_softmax_cross_entropy(user, item_vectors(None), targets, temperature=temperature, chunk=chunk,
                                                  weights=weights, half=half)  # fmt: skip
    if chunk == 0:  # unchunked shared negatives as one chunk (recforge.ops.softmax_nll); the targets looked up first
        shared_ids = sampled.ids if sampled.in_batch is None else torch.cat([sampled.ids, sampled.in_batch])
        positive = item_vectors(targets)
        return chunked_softmax_cross_entropy(user, positive, targets, shared=item_vectors(shared_ids), shared_ids=shared_ids,
                                             temperature=temperature, chunk=0, weights=weights, half=half)  # fmt: skip
    if sampled.distinct is None and sampled.shared is None:
        raise ValueError(f"sampled_softmax_loss: chunk_size={chunk} needs negatives drawn with that chunk_size "
                         "(draw_negatives(..., chunk_size=...))")  # fmt: skip
    shared = item_vectors(sampled.shared) if sampled.shared is not None else None  # (S, d)
    own = item_vectors(sampled.distinct) if sampled.distinct is not None else None  # (M, d): once per distinct item
    own_ids = sampled.ids if negatives == "per_position" else None
    return chunked_softmax_cross_entropy(user, item_vectors(targets), targets, shared=shared, shared_ids=sampled.shared,
                                         own=own, own_rows=sampled.rows, own_ids=own_ids, temperature=temperature,
                                         chunk=chunk, weights=weights, half=half)  # fmt: skip


def batch_distinct(targets: Tensor) -> Tensor:
    """The distinct items of ``targets`` (T,) without a host sync (CUDA-graph safe): (T,) the sorted targets with
    each repeat replaced by the padding id 0, which the loss masks. ``torch.unique(targets)`` is its nonzero
    entries, in order."""
    sorted_ids = targets.sort().values
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    return torch.where(first, sorted_ids, 0)


def _distinct_rows(ids: Tensor, bound: int) -> tuple[Tensor, Tensor]:
    """(distinct, rows) with ``distinct[rows] == ids``: ``torch.unique(ids, return_inverse=True)`` without
    its host synchronisation (a CUDA-graph-safe, fixed size): ``distinct`` has min(ids.numel(), ``bound``)
    entries (``bound`` > max id), the distinct ids in order, then repeats of the smallest one."""
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return flat, ids
    sorted_ids, order = flat.sort()
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot = first.cumsum(0) - 1  # (T*K,) slot of each sorted id
    distinct = sorted_ids[:1].repeat(min(flat.numel(), bound))
    distinct[slot] = sorted_ids  # duplicates write the same value
    rows = torch.empty_like(slot)
    rows[order] = slot
    return distinct, rows.view(ids.shape)


def pointwise_loss(outputs: Tensor, labels: Tensor, kinds: Sequence[str], weights: Sequence[float]) -> tuple[Tensor, Tensor]:
    """Weighted sum over tasks of BCE-with-logits (binary) or MSE (regression), ignoring NaN labels.

    Args:
        outputs: (N, K) logits (binary tasks) or predictions (regression tasks).
        labels: (N, K) labels; NaN = unknown (the row adds nothing to that task).
        kinds: per task, ``binary`` or ``regression``.
        weights: per task, the weight of its mean loss in the total.

    Returns:
        The total loss and each task's unweighted mean loss, (K,) detached, NaN for a task without
        labels in the batch (it adds nothing to the total). Nothing here waits for the device: a
        training step reads its loss once, at the end.
    """
    outputs = outputs.to(torch.promote_types(outputs.dtype, torch.float32))  # bf16/fp16 -> float32
    known = ~torch.isnan(labels)  # (N, K)
    y = torch.nan_to_num(labels.to(outputs.dtype), nan=0.0)
    total = outputs.new_zeros(())
    per_task = []
    for k, (kind, weight) in enumerate(zip(kinds, weights, strict=True)):
        z = torch.where(known[:, k], outputs[:, k], 0.0)  # unlabelled rows: no gradient, even from a non-finite output
        elem = F.binary_cross_entropy_with_logits(z, y[:, k], reduction="none") if kind == "binary" else (z - y[:, k]) ** 2
        count = known[:, k].sum()
        mean = torch.where(known[:, k], elem, 0.0).sum() / count.clamp_min(1)
        total = total + weight * mean
        per_task.append(torch.where(count > 0, mean.detach(), float("nan")))
    return total, torch.stack(per_task) if per_task else outputs.new_zeros(0)


def listwise_loss(outputs: Tensor, labels: Tensor, num_targets: Tensor) -> Tensor:
    """Softmax cross-entropy over each sample's candidates, per binary task column given.

    ``outputs``/``labels`` are (N, K'), the N targets of the batch's samples in order, ``num_targets``
    (B,) per sample. A sample's loss is ``-sum_i y_i log softmax(z)_i / sum_i y_i``, averaged over
    samples with at least one positive (samples without one carry no list signal).
    """
    outputs = outputs.to(torch.promote_types(outputs.dtype, torch.float32))  # bf16/fp16 -> float32
    offsets = torch.cat([num_targets.new_zeros(1), torch.cumsum(num_targets, 0)])
    seq = sequence_ids(offsets, outputs.shape[0])
    batch = num_targets.numel()
    y = torch.nan_to_num(labels.to(outputs.dtype), nan=0.0)
    # log-softmax within each sample: subtract the per-sample max, then log-sum-exp by index_add
    zmax = torch.full((batch, outputs.shape[1]), float("-inf"), device=outputs.device, dtype=outputs.dtype)
    zmax = zmax.scatter_reduce(0, seq.unsqueeze(1).expand_as(outputs), outputs.detach(), "amax")
    shifted = outputs - zmax[seq]
    denom = torch.zeros_like(zmax).index_add_(0, seq, shifted.exp())
    log_p = shifted - denom.clamp_min(1e-30).log()[seq]
    positives = torch.zeros_like(zmax).index_add_(0, seq, y)
    per_sample = -torch.zeros_like(zmax).index_add_(0, seq, y * log_p) / positives.clamp_min(1)
    has_pos = positives > 0
    return torch.where(has_pos, per_sample, 0.0).sum() / has_pos.sum().clamp_min(1)  # 0 without positives; no sync


def token_loss_scale(reference_tokens: float, world_size: int = 1) -> float:
    """Factor that turns a per-token loss *sum* into a fixed-batch-semantics loss.

    With token-budget batches the number of rows varies, so a per-batch *mean* would weight a token
    of a small batch more than one of a large batch. ``loss = per_token_loss.sum() *
    token_loss_scale(...)`` gives every token the same weight ``1 / reference_tokens``. With DDP,
    gradients are averaged over ``world_size`` ranks, so each rank multiplies by ``world_size``:
    the resulting gradient is ``sum over all ranks' tokens / reference_tokens``.

    Args:
        reference_tokens: the denominator: the token budget times world size for a constant
            per-token weight across steps, or the step's global token count (all-reduced) for an
            exact per-step mean.
        world_size: data-parallel ranks whose gradients are averaged.
    """
    if reference_tokens <= 0:
        raise ValueError(f"reference_tokens must be > 0, got {reference_tokens}")
    return world_size / reference_tokens


def token_weighted_ranking_loss(outputs: Tensor, labels: Tensor, num_targets: Tensor, kinds: Sequence[str],
                                weights: Sequence[float], reference: TokenReference,
                                listwise_weight: float = 0.0) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The ranking objective of a token-budget batch: (objective to minimise, the per-batch-mean loss).

    Token-budget batches vary in labels and lists, so each known label of task k weighs a constant
    ``1 / reference.labels[k]`` and each list with a positive ``1 / reference.lists`` (what a batch of
    average content gives) instead of 1/count in this batch: the objectives of two batches add up to
    that of their union. With ``listwise_weight`` > 0 the listwise term is on the first binary task.
    """
    objective = loss = outputs.new_zeros(())
    for k, (kind, weight) in enumerate(zip(kinds, weights, strict=True)):
        mean, _ = pointwise_loss(outputs[:, k : k + 1], labels[:, k : k + 1], [kind], [weight])
        known = (~torch.isnan(labels[:, k])).sum()  # on the device: no host sync per task
        loss = loss + mean
        objective = objective + mean * known * token_loss_scale(float(reference.labels[k]))
    if listwise_weight:
        k = list(kinds).index("binary")
        mean = listwise_weight * listwise_loss(outputs[:, k : k + 1], labels[:, k : k + 1], num_targets)
        sample_of_target = sequence_ids(offsets_from_lengths(num_targets), labels.shape[0])
        positive = (torch.nan_to_num(labels[:, k], nan=0.0) > 0).to(outputs.dtype)
        lists = (outputs.new_zeros(num_targets.numel()).index_add_(0, sample_of_target, positive) > 0).sum()
        loss = loss + mean
        objective = objective + mean * lists * token_loss_scale(reference.lists)
    return objective, loss
