"""Sampled softmax's gather-dot, ``logits[n, r] = q[n] . table[idx[n, r]]``, fused so that the (N, R, D) gathered
rows are never materialised, forward or backward.

    q (N, D), table (rows, D), idx (N, R) -> logits (N, R) float32

Per-position negatives (the HSTU paper's sampled softmax: R = 1 + 128 rows of D = 1024 per position, N = 16K
positions) gather N * R * D elements: PyTorch's ``bmm(F.embedding(idx, table), q)`` writes and reads them as an
(N, R, D) tensor, then its backward writes their gradient as another and scatters it (~43 GB per step at that
shape in float32). The Triton kernels (``recforge.ops.triton.gather_dot``) read each gathered row once per pass
and write only (N, R) logits, (N, D) and (rows, D) gradients. Float32 sums whatever the inputs' dtype.

On by default for float32 inputs on CUDA (what the loss runs; H200, 16K x 129 x 1024: forward + backward 2.8x
PyTorch's, 0.5 instead of 17 GB; BENCHMARKS.md); bfloat16/float16 inputs keep the PyTorch path (1.05x at that
shape, 0.83x at 4K x 129 x 512). ``RECFORGE_FUSED_GATHER_DOT=1`` (read at import) takes the kernels for every
supported dtype, ``=0`` never. CPU tensors always take the PyTorch path, unless a test sets
``default_kernel = "triton"`` (Triton's interpreter, ``TRITON_INTERPRET=1``). The three primitives are public for losses that compute their
gradients by hand (``recforge.train.chunked_softmax``): ``gather_dot_logits``, ``gather_rows_sum`` (dq) and
``scatter_rows_sum`` (dtable).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from recforge.env import fused_gather_dot
from recforge.ops.custom_ops import gather_dot_op, gather_rows_sum_op, scatter_rows_sum_op
from recforge.ops.dispatch import TRITON_DTYPES, resolve_kernel

# the kernel every call without an explicit one uses: "auto" (Triton on CUDA; "pytorch" with RECFORGE_FUSED_GATHER_DOT=0),
# "triton" in tests (the interpreter on CPU); read at each call. float32_only: "auto" leaves other dtypes to PyTorch
# (the switch unset; =1 clears it)
_SWITCH = fused_gather_dot()
default_kernel = "pytorch" if _SWITCH is False else "auto"
float32_only = _SWITCH is None


def gather_dot_reference(q: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """PyTorch: the (N, R, D) gathered rows times ``q`` by one bmm (what the loss ran before); float32 out (float64
    for float64 inputs)."""
    logits = torch.bmm(F.embedding(idx, table), q.unsqueeze(2)).squeeze(2)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def gather_rows_sum_reference(g: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """PyTorch: ``sum_r g[n, r] * table[idx[n, r]]`` (N, D), through the (N, R, D) gathered rows."""
    return torch.bmm(g.to(table.dtype).unsqueeze(1), table[idx]).squeeze(1)


def scatter_rows_sum_reference(g: Tensor, q: Tensor, idx: Tensor, num_rows: int) -> Tensor:
    """PyTorch: ``dtable[e] = sum_{idx[n, r] = e} g[n, r] * q[n]`` (num_rows, D), through an (N, R, D) product."""
    out = q.new_zeros(num_rows, q.shape[1])
    return out.index_add_(0, idx.reshape(-1), (g.to(q.dtype).unsqueeze(2) * q.unsqueeze(1)).reshape(-1, q.shape[1]))


def unsupported(q: Tensor, table: Tensor, idx: Tensor) -> str | None:
    """Why the Triton kernels cannot take these inputs, or None when they can."""
    if q.dim() != 2 or table.dim() != 2 or idx.dim() != 2:
        return f"shapes q {tuple(q.shape)}, table {tuple(table.shape)}, idx {tuple(idx.shape)} (expected 2-D each)"
    if q.shape[0] != idx.shape[0] or q.shape[1] != table.shape[1]:
        return (f"q {tuple(q.shape)} against table {tuple(table.shape)} and idx {tuple(idx.shape)} "
                "(expected (N, D), (rows, D), (N, R))")  # fmt: skip
    return _unsupported_types(q.dtype, table.dtype, idx)


def _unsupported_types(dtype: torch.dtype, other: torch.dtype, idx: Tensor) -> str | None:
    if dtype != other or dtype not in TRITON_DTYPES:
        return f"dtypes {dtype} and {other} (expected the same one of float16, bfloat16, float32)"
    if idx.dtype not in (torch.int32, torch.int64):
        return f"index dtype {idx.dtype} (expected int32 or int64)"
    return None


def _unsupported_sum(g: Tensor, rows: Tensor, idx: Tensor) -> str | None:
    """``gather_rows_sum`` / ``scatter_rows_sum``: g (N, R) as idx, rows (*, D) the gathered rows' tensor."""
    if g.shape != idx.shape or idx.dim() != 2 or rows.dim() != 2:
        return f"g {tuple(g.shape)}, idx {tuple(idx.shape)}, rows {tuple(rows.shape)} (expected (N, R), (N, R), (*, D))"
    return _unsupported_types(rows.dtype, rows.dtype, idx)


def _rows_match(q: Tensor, idx: Tensor) -> str | None:
    return (
        None
        if q.shape[0] == idx.shape[0]
        else f"q {tuple(q.shape)} for idx {tuple(idx.shape)} (expected (N, D), (N, R))"
    )


def _backend(device: torch.device, why: str | None, requested: str | None, dtype: torch.dtype) -> str:
    kernel = default_kernel if requested is None else requested
    if requested is None and kernel == "auto" and float32_only and dtype != torch.float32 and why is None:
        # the default: the kernels only where they were measured faster (logged as an "auto" choice, not a request)
        why = f"{dtype} inputs under the float32-only default (RECFORGE_FUSED_GATHER_DOT=1 takes them)"
    return resolve_kernel("gather_dot", kernel, device, why)


def use_triton(q: Tensor, table: Tensor, idx: Tensor, *, kernel: str | None = None) -> bool:
    """Whether ``gather_dot(q, table, idx, kernel=kernel)`` runs the Triton kernels (raises as it would)."""
    return _backend(q.device, unsupported(q, table, idx), kernel, q.dtype) == "triton"


def gather_dot(q: Tensor, table: Tensor, idx: Tensor, *, kernel: str | None = None) -> Tensor:
    """``logits[n, r] = q[n] . table[idx[n, r]]`` with gradients to ``q`` and ``table``, never materialising (N, R, D).

    Args:
        q: (N, D) query vectors (one per position).
        table: (rows, D) item vectors (unit column stride; e.g. the whole normalised item table).
        idx: (N, R) int32/int64 rows of ``table`` each position scores, in [0, rows). Not checked on the device
            (no host sync): an index outside reads out of bounds in the Triton forward and adds nothing to ``table``'s
            gradient, where PyTorch's path fails a device assert; callers check their IDs (the losses do).
        kernel: "auto" | "pytorch" | "triton"; None: the module's ``default_kernel`` (the ``RECFORGE_FUSED_GATHER_DOT``
            switch; unset: Triton for float32 CUDA inputs only). "auto" runs Triton on CUDA inputs it supports (one float dtype for both, int32/int64 indices).

    Returns:
        (N, R) float32 logits; ``table``'s gradient is dense (rows, D), zeros where no index points.

    Example:
        >>> logits = gather_dot(user, table, torch.cat([targets[:, None], negatives], 1)) / temperature
    """
    return _run(q.device, unsupported(q, table, idx), kernel, q.dtype, (q, table, idx), gather_dot_reference,
                gather_dot_op, lambda kernels: kernels.GatherDot.apply)


def gather_dot_logits(q: Tensor, table: Tensor, idx: Tensor, *, kernel: str | None = None) -> Tensor:
    """``gather_dot``'s forward without autograd (losses that compute their gradients by hand)."""
    return _run(q.device, unsupported(q, table, idx), kernel, q.dtype, (q, table, idx), gather_dot_reference,
                gather_dot_op, lambda kernels: kernels.gather_dot_forward)


def gather_rows_sum(g: Tensor, table: Tensor, idx: Tensor, *, kernel: str | None = None) -> Tensor:
    """(N, D) ``sum_r g[n, r] * table[idx[n, r]]`` in ``table``'s dtype: ``gather_dot``'s gradient of ``q``."""
    return _run(table.device, _unsupported_sum(g, table, idx), kernel, table.dtype, (g, table, idx),
                gather_rows_sum_reference, gather_rows_sum_op, lambda kernels: kernels.gather_rows_sum)


def scatter_rows_sum(g: Tensor, q: Tensor, idx: Tensor, num_rows: int, *, kernel: str | None = None) -> Tensor:
    """(num_rows, D) ``sum_{idx[n, r] = e} g[n, r] * q[n]`` in ``q``'s dtype: ``gather_dot``'s gradient of the table."""
    return _run(q.device, _unsupported_sum(g, q, idx) or _rows_match(q, idx), kernel, q.dtype, (g, q, idx, num_rows),
                scatter_rows_sum_reference, scatter_rows_sum_op, lambda kernels: kernels.scatter_rows_sum)


def _run(device: torch.device, why: str | None, kernel: str | None, dtype: torch.dtype, args: tuple,
         reference: Callable, op: Callable, launch: Callable) -> Tensor:  # fmt: skip
    """The one dispatch of every entry point: PyTorch's ``reference``, the custom ``op`` while compiling (one opaque
    node, not a trace of the launch code), else the Triton launcher ``launch(recforge.ops.triton.gather_dot)``."""
    if _backend(device, why, kernel, dtype) == "pytorch":
        return reference(*args)
    if torch.compiler.is_compiling():
        return op(*args)
    from recforge.ops.triton import gather_dot as kernels  # defined on first use: see recforge.ops.triton

    return launch(kernels)(*args)


__all__ = ["gather_dot", "gather_dot_logits", "gather_dot_reference", "gather_rows_sum", "gather_rows_sum_reference",
           "scatter_rows_sum", "scatter_rows_sum_reference", "unsupported", "use_triton"]  # fmt: skip
