"""Model FLOPs of a training step, counted from each batch's real jagged lengths, and MFU.

Counted: the matmuls of the linear layers, of attention and of the retrieval loss; not the
elementwise work (norms, activations, the optimizer), as MFU conventionally does. Attention
counts the (query, key) pairs a sequence of length n really has: n(n+1)/2 causal (n^2 not
causal); with ``num_targets`` t, the history h = n - t is causal and each target sees the h
history tokens and itself. A window (``max_attn_len``) and contextual tokens are not modelled.

A training step is 3x its forward (backward: one matmul for the input gradient and one for
the weight gradient per forward matmul; attention's dQ, dK, dV and dA are 2x its QK^T and AV).
Recomputation (the attention backward's QK^T, activation checkpointing) is not counted: model
FLOPs, not hardware FLOPs.

MFU = step FLOPs / time / the device's dense peak for the precision the matmuls run in
(``peak_tflops``: a table of known GPUs, ``train.peak_tflops`` to set it, or a peak measured
with ``measure_matmul_peak``).

Example:
    >>> count = step_flops_counter(cfg.model, cfg.loss, num_items=3706)
    >>> flops = count(cpu_batch)                       # one step of this batch, forward + backward
    >>> mfu = flops / step_seconds / (peak_tflops(device, "bfloat16") * 1e12)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from recforge.config import LossConfig, ModelConfig

BACKWARD_FACTOR = 3  # forward + backward of a matmul = 3 forward

# Dense (no 2:4 sparsity) tensor-core peaks per GPU, TFLOP/s, from NVIDIA's data sheets; "float32"
# is the non-tensor-core rate (float32 matmuls with TF32 off, and the float32 Triton attention).
# Matched against torch.cuda.get_device_name() by substring, first match wins.
_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.0, "float32": 67.0}),
    ("H100 NVL", {"bfloat16": 835.0, "float16": 835.0, "tf32": 418.0, "float32": 60.0}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "tf32": 378.0, "float32": 51.0}),
    ("H100", {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.0, "float32": 67.0}),  # SXM (80GB HBM3)
    ("H800", {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.0, "float32": 67.0}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.0, "float16": 362.0, "tf32": 183.0, "float32": 91.6}),
]


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The dense peak (TFLOP/s) of ``device`` for ``precision`` (bfloat16 | float16 | tf32 | float32),
    None for a CPU or a GPU not in the table (set ``train.peak_tflops`` for those)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in _PEAKS:
        if key in name:
            return peaks.get(precision)
    return None


def matmul_precision(train_precision: str) -> str:
    """Which peak a run's matmuls are held to: bfloat16 under autocast, tf32 for float32 runs with
    TF32 matmuls on (``prepare_runtime`` turns it on for CUDA), float32 otherwise."""
    if train_precision in ("bfloat16", "float16"):
        return train_precision
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "float32"


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192,
                        seconds: float = 1.0) -> float:  # fmt: skip
    """The TFLOP/s of a square ``n`` x ``n`` matmul on ``device``, the best of repeated timed runs: a
    peak measured in the same process (clocks and power as the benchmark sees them)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    best, deadline, reps = 0.0, time.perf_counter() + seconds, 10
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12)
    return best


def attention_pairs(lengths: Tensor, num_targets: Tensor | None = None, causal: bool = True) -> int:
    """(query, key) pairs over a batch of sequences of ``lengths`` (B,), per head (see the module doc)."""
    n = lengths.to(torch.int64)
    t = torch.zeros_like(n) if num_targets is None else num_targets.to(torch.int64)
    h = n - t
    history = h * (h + 1) // 2 if causal else h * h
    return int((history + t * (h + 1)).sum())


def hstu_forward_flops(lengths: Tensor, model: ModelConfig, num_targets: Tensor | None = None,
                       causal: bool = True) -> int:  # fmt: skip
    """Forward FLOPs of an HSTU encoder (``model``: dim, num_blocks, num_heads, dqk, dv) on sequences of ``lengths``.

    Per block and token: the uvqk projection 2 d H (2 dv + 2 dqk) and the output projection 2 H dv d;
    per block, head and visible pair: 2 dqk (QK^T) + 2 dv (AV)."""
    tokens = int(lengths.sum())
    d, h, dqk, dv = model.dim, model.num_heads, model.dqk, model.dv
    linear = 2 * d * h * (2 * dv + 2 * dqk) + 2 * h * dv * d
    attention = 2 * h * (dqk + dv) * attention_pairs(lengths, num_targets, causal)
    return model.num_blocks * (tokens * linear + attention)


def sasrec_forward_flops(lengths: Tensor, model: ModelConfig, causal: bool = True) -> int:
    """Forward FLOPs of a SASRec encoder: per token and block qkv 6 d^2, output 2 d^2, feed-forward
    4 d ffn_dim; per visible pair 4 d (QK^T and AV over all heads)."""
    tokens = int(lengths.sum())
    d = model.dim
    linear = 8 * d * d + 4 * d * model.ffn_dim
    return model.num_blocks * (tokens * linear + 4 * d * attention_pairs(lengths, None, causal))


def retrieval_loss_flops(num_targets: int, dim: int, loss: LossConfig, num_items: int, batch_items: int = 0) -> int:
    """Forward FLOPs of ``sampled_softmax_loss`` on ``num_targets`` positions: one d-dot per scored item
    (the positive and ``loss.num_negatives``, or the whole catalogue with ``negatives=full``;
    ``batch_items`` distinct in-batch negatives with ``loss.in_batch_negatives``)."""
    if loss.negatives == "full":
        scored = num_items + 1
    else:
        scored = 1 + loss.num_negatives + (batch_items if loss.in_batch_negatives else 0)
    return 2 * dim * scored * num_targets


def step_flops_counter(model: ModelConfig, loss: LossConfig, num_items: int) -> Callable[[Any], float] | None:
    """``f(cpu_batch) -> FLOPs`` of one training step (forward + backward) of the retrieval recipe on
    that batch, or None for an encoder this module does not count (then no MFU is logged)."""
    if model.kind not in ("hstu", "sasrec"):
        return None

    def count(batch: Any) -> float:
        lengths = batch.seq_offsets[1:] - batch.seq_offsets[:-1]
        mask = batch.mask
        if model.kind == "hstu":
            encoder = hstu_forward_flops(lengths, model, mask.num_targets, mask.causal)
        else:
            encoder = sasrec_forward_flops(lengths, model, mask.causal)
        targets = batch.labels["next_item"]
        distinct = int(torch.unique(targets).numel()) if loss.in_batch_negatives else 0
        head = retrieval_loss_flops(targets.numel(), model.dim, loss, num_items, distinct)
        return float(BACKWARD_FACTOR * (encoder + head))

    return count


__all__ = ["BACKWARD_FACTOR", "attention_pairs", "hstu_forward_flops", "matmul_precision", "measure_matmul_peak",
           "peak_tflops", "retrieval_loss_flops", "sasrec_forward_flops", "step_flops_counter"]
