"""Tile sizes and launches: autotuned per (sequence-length bucket, head dims, dtype) for
bf16/fp16 on long sequences.

Short sequences (<= 256 tokens, e.g. ML-1M), float32 and the interpreter use one fixed tile,
so a training run or a test never pays for autotuning many kernel variants.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
import triton
from torch import Tensor

from recforge.env import triton_interpret, triton_launch_plans
from recforge.ops.triton._common import max_len_bucket


def is_interpreting() -> bool:
    """Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read when kernels are defined)."""
    return triton_interpret()


def _cfg(bm: int, bn: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


# (BLOCK_M, BLOCK_N, warps, stages) candidates for Hopper, by the larger padded head dim
# (64, 32, 4, 2) forward: for short sequences (a row block's key walk is a few tiles long); autotuning
# picked it at L = 512 (D 64 and 128) in the H100 run of BENCHMARKS.md, where it had picked the
# smallest tile on offer before. The 3-4 stage forward candidates were added after an A/B run: autotuning
# picked (128, 64, 8, 3) at D = 128 from L = 4096 (HSTU forward 1.11x at L = 8192 on an H100,
# `benchmarks/results/attention-h100-fwd-tiles.json`). (128, 32, 4, 3) leads at D = 128: in a sweep of
# every HSTU kernel over ~30 tiles each (`benchmarks/attention_tiles.py`, H200, jagged 64K-token batches,
# `attention_tiles-h200.json`) it was the fastest forward at L 2048 and 8192 (1.09x / 1.04x the previous list's best).
_FWD = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (64, 32, 4, 2),
         (64, 64, 4, 4), (64, 128, 4, 4)],
    128: [(128, 32, 4, 3), (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3),
          (64, 32, 4, 2), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4)],
    256: [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2), (128, 64, 8, 1)],
}
_BWD_256 = [(32, 64, 4, 1), (16, 64, 4, 2), (32, 32, 4, 2), (64, 64, 8, 1)]
# The HSTU backward kernels, each its own list: from the same sweep, the tiles within ~10% of the best at L 2048
# or 8192 (3-4 stages: the earlier lists held 1-2 only; dQ 1.08x, dK/dV 1.05x, fused dK/dV+dQ 1.08x at L 8192,
# D 128, over the previous lists' best), plus the earlier small tiles for short sequences (L 512-1024).
_BWD_DQ = {
    64: [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3)],
    128: [(128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 4), (32, 64, 4, 2)],
    256: _BWD_256,
}
_BWD_DKDV = {
    64: [(64, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 2), (32, 128, 4, 3), (64, 128, 8, 3)],
    128: [(64, 128, 8, 3), (32, 64, 4, 3), (64, 128, 8, 4), (32, 128, 8, 3), (64, 64, 4, 2)],
    256: _BWD_256,
}
# dK/dV with dQ (hstu.fused_dq): one more (BLOCK_M, D) product per tile and its atomics favour 64-query tiles. The
# last two at D 128 are for the bias-gradient specializations, whose larger tiles need more shared memory than an
# H200 has.
_BWD_DKDV_FUSED = {
    64: [(64, 64, 4, 3), (64, 128, 8, 3), (64, 64, 4, 4), (32, 64, 4, 3), (64, 64, 4, 2)],
    128: [(64, 128, 8, 3), (64, 128, 8, 4), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 2), (32, 64, 4, 2)],
    256: _BWD_256,
}


# Softmax backward, per kernel: the dQ kernel (grid over row blocks) does best with 128-row blocks
# at D = 128, the dK/dV kernel with 128-key blocks (as FlexAttention's Hopper defaults). From a
# sweep of 11-12 tiles per kernel, each timed alone on an H100 (bf16, causal, L 2048-8192; the
# table in BENCHMARKS.md), plus a 4-stage variant of the best tiles, which autotuning picked for
# D = 128 at L 2048-8192 in the A/B run. (128, 64, 8, 4) needs too much shared memory for the
# dK/dV kernel, so it stays a dQ candidate only.
_SM_BWD_DQ = {
    64: [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3), (128, 64, 4, 2)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 32, 4, 3), (64, 64, 4, 2), (128, 128, 8, 2)],
    256: _BWD_256,
}
_SM_BWD_DKDV = {
    64: [(32, 128, 4, 3), (32, 128, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 4)],
    128: [(32, 128, 8, 3), (64, 128, 8, 3), (32, 128, 8, 4), (64, 64, 4, 2), (64, 128, 8, 2)],
    256: _BWD_256,
}
_TABLES = {"fwd": _FWD, "bwd_dq": _BWD_DQ, "bwd_dkdv": _BWD_DKDV, "bwd_dkdv_fused": _BWD_DKDV_FUSED,
           "softmax_bwd_dq": _SM_BWD_DQ, "softmax_bwd_dkdv": _SM_BWD_DKDV}


def shorten_hstu_candidates(n: int) -> None:
    """Cut each HSTU kernel's autotuning list (forward, dQ, dK/dV) to its first ``n`` tiles, plus its smallest one,
    for benchmarks whose shapes make every candidate's compile and timing costly (long sequences). The smallest tile
    stays because larger ones may not fit a specialization's shared memory (bias gradients, 3-4 stages): the
    autotuner drops a tile that does not fit when it has others, but launches a lone one untried (the first forward
    tile ran out of shared memory on the H200). Keep ``n`` >= 1."""
    for kind in ("fwd", "bwd_dq", "bwd_dkdv", "bwd_dkdv_fused"):
        _TABLES[kind] = {dims: list(dict.fromkeys([*tiles[:n], _smallest(tiles)]))
                         for dims, tiles in _TABLES[kind].items()}  # fmt: skip


def _smallest(tiles: list[tuple[int, int, int, int]]) -> tuple[int, int, int, int]:
    """The tile needing the least shared memory (BLOCK_M x BLOCK_N x stages), fewer warps first on a tie."""
    return min(tiles, key=lambda t: (t[0] * t[1] * t[3], t[2]))


def _dim_class(bd: int) -> int:
    return 64 if bd <= 64 else (128 if bd <= 128 else 256)


def candidates(kind: str, bd_qk: int, bd_v: int) -> list[triton.Config]:
    """The configs autotuning tries for a kernel at these padded head dims.

    ``kind``: "fwd" (both forwards), "bwd_dq"/"bwd_dkdv"/"bwd_dkdv_fused" (HSTU; see ``tile_kind``) or
    "softmax_bwd_dq"/"softmax_bwd_dkdv".
    """
    return [_cfg(*c) for c in _TABLES[kind][_dim_class(max(bd_qk, bd_v))]]


def tile_kind(kind: str, meta: dict) -> str:
    """The candidate list of a launch of a ``kind`` kernel with constexprs ``meta``: the HSTU dK/dV kernel that also
    computes dQ (``FUSED_DQ``) has its own."""
    return "bwd_dkdv_fused" if kind == "bwd_dkdv" and meta.get("FUSED_DQ") else kind


def _prune(kind: str):
    def prune(configs, named_args, **kwargs):
        bd_qk = named_args.get("BD_QK", kwargs.get("BD_QK", 64))
        bd_v = kwargs.get("BD_V", named_args.get("BD_V", 64))
        wanted = {_key(c) for c in candidates(tile_kind(kind, {**named_args, **kwargs}), bd_qk, bd_v)}
        return [c for c in configs if _key(c) in wanted]

    return prune


def _key(c: triton.Config) -> tuple[int, int, int, int]:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def cache_kwargs(autotune=None) -> dict:
    """``cache_results=True`` where ``triton.autotune`` takes it (Triton >= 3.4), else nothing.

    With it, the timings of an autotuning run go to Triton's cache directory (``~/.triton/cache``,
    ``TRITON_CACHE_DIR``), keyed by Triton's version, the target GPU, the kernel's source, the tuning key
    and the candidate configs, so a later process reuses the picked tile instead of timing every
    candidate again. Older Triton tunes in every process, as before.
    """
    parameters = inspect.signature(autotune or triton.autotune).parameters
    return {"cache_results": True} if "cache_results" in parameters else {}


# What a picked tile is remembered by: the length bucket, head dims and dot precision, and every constexpr that
# changes a kernel's code (mask kinds, biases and their gradients, dQ in the dK/dV kernel): a specialization with
# bias gradients needs more shared memory per stage than one without, so a tile picked for one may not even launch
# for another (names a kernel does not take are left out of its key).
TUNING_KEY = ["len_key", "BD_QK", "BD_V", "DQK", "DV", "DOT_PREC", "SPLIT_LOOPS", "S", "FULL_BITS", "CAUSAL",
              "HAS_TARGETS", "HAS_CONTEXT", "HAS_WINDOW", "HAS_TS", "HAS_POS", "HAS_TIME", "POS_GRAD", "TIME_GRAD",
              "PAIR_ATOMICS", "NB_PAD", "TIME_STEPS", "TIME_LOOP", "REUSE_BUCKET", "FUSED_DQ", "FAST_SIGMOID",
              "SEQ_ORDER"]  # fmt: skip


def tuned(kernel, kind: str, reset_to_zero: list[str] | None = None):
    """The kernel behind a Triton autotuner (``.fn`` is the plain kernel for fixed launches)."""
    if is_interpreting():
        return SimpleNamespace(fn=kernel, tuning_kind=kind)
    kinds = dict.fromkeys([kind, tile_kind(kind, {"FUSED_DQ": True})])  # the dK/dV kernel: with and without dQ
    configs = [_cfg(*c) for k in kinds for cs in _TABLES[k].values() for c in cs]
    configs = list({_key(c): c for c in configs}.values())

    def bench(fn, quantiles):
        # at 25 ms per candidate, identical code and shapes ran up to 2.6x apart between two H100
        # runs (softmax, D 64, L 2048: 95 vs 248 TFLOP/s), most likely a tile picked on noise
        return triton.testing.do_bench(fn, warmup=10, rep=50, quantiles=quantiles)

    autotuner = triton.autotune(
        configs,
        key=TUNING_KEY,
        prune_configs_by={"early_config_prune": _prune(kind)},
        reset_to_zero=reset_to_zero,
        do_bench=bench,
        **cache_kwargs(),
    )(kernel)
    autotuner.tuning_kind = kind  # for tools that compile the candidates ahead (benchmarks/attention.py)
    return autotuner


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: exact ("ieee") for float32, the exactness path; bf16/fp16 use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Warps of the fixed-tile (64 x 64, tensor-core) dK/dV launch when it sums bias gradients (None: the fixed tile's
# own 4). ptxas (sm_90, benchmarks/kernel_spills.py) spills ~1.4 KB per thread at 4 warps and ~0.15 KB at 8 for the
# bf16 64x64 tile with both bias gradients; on an H200 (benchmarks/attention_bias_grad.py, L = 256, 64K tokens) the
# backward took 1.03x (D 64) / 1.08x (D 128) less time at 8 with reused time buckets (BENCHMARKS.md).
bias_grad_fixed_warps: int | None = 8


def fixed_config(bd_qk: int, bd_v: int, dot_prec: str, bias_grads: bool = False) -> triton.Config:
    """The one tile for short sequences, float32 and the interpreter; ``bias_grads``: for a dK/dV launch that sums
    the position/time-bias gradients (the tensor-core tile then takes ``bias_grad_fixed_warps``).

    float32 ("ieee" dots) never takes tensor cores: Triton unrolls each dot into scalar FMAs,
    and at 64x64 tiles ptxas spilled 16-33 KB per thread and took up to 159 s for one kernel
    specialization on an H100. At 32x32 one specialization (forward + both backward kernels)
    compiles in ~10 s. float32 is for tests and CPU parity, not speed, so it is never autotuned.
    """
    if is_interpreting():
        return _cfg(16, 16, 4, 1)
    if dot_prec == "ieee" or max(bd_qk, bd_v) > 128:
        return _cfg(32, 32, 4, 2)
    return _cfg(64, 64, (bias_grad_fixed_warps or 4) if bias_grads else 4, 2)


def split_loops(fixed_tile: bool) -> bool:
    """SPLIT_LOOPS for a launch: walk the tiles that need the mask and the mask-free span in two
    loops (the second without any mask code), or in one loop with the mask math behind a
    run-time branch.

    Two loops are up to ~15% faster at head dim 64 (H100, bf16; equal at 128) but twice the
    code to compile: one float32 'all'-mask HSTU specialization took 135 s for sm_90 with two
    loops at 64x64 tiles and 7 s with one loop at 32x32. So autotuned launches (bf16/fp16, long
    sequences: the speed path) take two loops, and fixed-tile launches (float32, short sequences,
    where a row block has few mask-free tiles) one. The interpreter compiles nothing: two loops,
    the speed path's code.
    """
    return is_interpreting() or not fixed_tile


def launch(kernel, grid_blocks: str, batch: int, heads: int, max_seq_len: int, args: tuple, meta: dict) -> None:
    """Run an attention kernel over its row or key blocks (``grid_blocks``: "m" or "n"), for every
    sequence and head: autotuned for bf16/fp16 on long sequences, the fixed tile otherwise.

    The grid is one-dimensional and block-major: ``cdiv(len_key, BLOCK) * batch * heads`` programs
    (``_common.block_of_program``) in which the blocks of one (sequence, head) are neighbours, so
    they are resident together and read that sequence's keys (or queries) from L2 rather than
    each from memory. On a (batch * heads, blocks) grid neighbours are other sequences' blocks at
    the same position: block-major HSTU took 1.2-1.5x less GPU time at D = 128, L 512-2048 on an
    H100 and the same at L = 8192 (BENCHMARKS.md). The HSTU kernels take the (sequence, head) groups
    longest sequence first on long batches (``_common.sequence_of_rank``).

    The first launch of each specialization goes through Triton (autotuner, argument binding,
    compilation); later ones call the compiled kernel directly (``_LaunchPlans``).
    """
    block_key = "BLOCK_M" if grid_blocks == "m" else "BLOCK_N"
    interpreting = is_interpreting()
    fixed = interpreting or max_seq_len <= 256 or meta["DOT_PREC"] == "ieee"
    meta = dict(meta, SPLIT_LOOPS=split_loops(fixed))
    len_key = max_len_bucket(max_seq_len)  # as the kernel's: it derives its block count from it

    def grid(m):  # three dimensions: CompiledKernel[grid] reads all three
        return (-(-len_key // m[block_key]) * batch * heads, 1, 1)

    bias_grads = bool(meta.get("POS_GRAD") or meta.get("TIME_GRAD"))
    cfg = fixed_config(meta["BD_QK"], meta["BD_V"], meta["DOT_PREC"], bias_grads) if fixed else None
    key = None if interpreting else plans.key(kernel, torch.cuda.current_device(), cfg, args, meta)
    plan = plans.get(key)
    if plan is not None:
        compiled, block_kwargs, params = plan
        compiled[grid(block_kwargs)](*args, *params)
        return
    if fixed:
        compiled = kernel.fn[grid(cfg.kwargs)](
            *args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        compiled = kernel[grid](*args, **meta)
        cfg = kernel.best_config
    if key is not None:
        plans.add(key, kernel, compiled, cfg.kwargs, args, meta)


class _LaunchPlans:
    """Compiled kernels by specialization, so that a repeated launch skips Triton's launch path.

    ``kernel[grid](...)`` re-derives on every call what does not change between training steps:
    the autotuner's cache key, the binding and specialization of ~40 arguments, the compiled
    kernel's cache key. The key here holds everything that Triton specializes a kernel on, and
    more: each tensor argument's dtype and 16-byte alignment, the exact type and value of every
    other argument except floats (which Triton passes unspecialized as fp32; True and 1 differ), the constexprs,
    the fixed tile (or autotuning) and the current device. A launch with a known key calls the compiled kernel
    (``CompiledKernel[grid](*args)``, as ``JITFunction.run`` does after its lookup) on the
    current stream; Triton's pre-run hooks and debug settings changed after a first launch are not
    seen again. Bounded: cleared when it holds ``limit`` plans. ``enabled`` False (or the
    environment variable RECFORGE_TRITON_LAUNCH_PLANS=0 at import) launches every call through
    Triton: for A/B measurements, and a way out should a Triton release change what its
    compiled kernels accept.
    """

    def __init__(self, limit: int = 512, enabled: bool = True):
        self.limit = limit
        self.enabled = enabled
        self.plans: dict[tuple, tuple] = {}
        self.hits = 0

    @staticmethod
    def key(kernel, device: int, tile: triton.Config | None, args: tuple, meta: dict) -> tuple:
        """The specialization of one launch; ``tile``: the fixed tile, None when autotuned."""
        arg_key = tuple([
            (a.dtype, a.data_ptr() & 15) if isinstance(a, Tensor) else (a if type(a) is int else _scalar_key(a))
            for a in args
        ])
        return id(kernel), device, tile and _key(tile), arg_key, tuple(meta.items())

    def get(self, key: tuple | None) -> tuple | None:
        plan = self.plans.get(key) if key is not None and self.enabled else None
        if plan is not None:
            self.hits += 1
        return plan

    def add(self, key: tuple, kernel, compiled, block_kwargs: dict, args: tuple, meta: dict) -> None:
        """Remember ``compiled`` for ``key`` (when Triton returned a launchable compiled kernel)."""
        if not self.enabled or not hasattr(compiled, "__getitem__") or not hasattr(compiled, "function"):
            return  # another Triton's return value: keep launching through Triton
        names = (kernel.fn if hasattr(kernel, "fn") else kernel).arg_names
        given = dict(meta, **block_kwargs)
        if len(self.plans) >= self.limit:
            self.plans.clear()
        self.plans[key] = (compiled, dict(block_kwargs), tuple(given[name] for name in names[len(args):]))


def _scalar_key(a):
    """Key of a non-tensor, non-int argument: floats are not specialized; anything else by type and
    value (True == 1 in Python, but Triton passes a bool as i1)."""
    return float if type(a) is float else (type(a), a)


plans = _LaunchPlans(enabled=triton_launch_plans())
