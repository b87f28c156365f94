"""MFU, tokens/s and a profiler step-time breakdown of the HSTU training step, variants side by side.

Usage (one H200, about 3 minutes; every case and variant in one process):
    python benchmarks/train_mfu.py --out benchmarks/results/train_mfu-h200.json
    python benchmarks/train_mfu.py --cases ml1m medium --variants fp32-eager bf16-eager bf16-compile fp32-graphs \
        bf16-graphs bf16-compile-graphs --out benchmarks/results/train_mfu-graphs-h200.json   # eager vs compile vs graphs
    python benchmarks/train_mfu.py --cases large large-norab large-shared large-shared-norab --variants bf16-compile \
        --out benchmarks/results/train_mfu-norab-h200.json   # the relative position bias on vs off
    python benchmarks/train_mfu.py --cases large-shared-norab long-shared-norab --variants bf16-compile-graphs --top 40 \
        --out benchmarks/results/train_mfu-top-h200.json   # 16K vs 64K-token batches, the 40 largest kernels
    python benchmarks/train_mfu.py --device cpu --cases tiny --variants fp32-eager   # smoke run

Cases (``--cases``; jagged batches of random user lengths in [max_len / 4, max_len] up to a token budget,
sampled softmax with 128 negatives per position over 100K items, attention in Triton):
    large     8 blocks, d 1024, 4 heads of 128, users up to 4096 tokens, 16K-token batches
    large-shared  the same model and batches, 8,192 negatives shared by the batch's positions
              (``loss.negatives=shared``: the loss is one matmul instead of 128 gathered rows per position)
    large-norab, large-shared-norab  large / large-shared without the relative position bias
              (``model.relative_bias=false``, as NVIDIA's recsys-examples HSTU; FLOPs counted alike: the bias is
              elementwise work, which MFU does not count)
    long-shared-norab  large-shared-norab's model on users up to 8,192 tokens, 64K-token batches
    large-64k-shared-norab  users up to 4,096 tokens (NVIDIA recsys-examples' MFU shape), 64K-token batches
    xlong-32k-shared-norab, xlong-100k-shared-norab  users up to 32,768 / 100,000 tokens, 128K-token batches
    medium    8 blocks, d 512, 4 heads of 128, users up to 1024 tokens, 4K-token batches
    ml1m      configs/ml1m-hstu-plus-d128.yaml's shape: 8 blocks, d 128, 2 heads of 64, users up to 200 tokens,
              256 users per batch (about 38K tokens), full softmax over 3,706 items
    small     2 blocks, d 128, 2 heads of 64, users up to 512 tokens, 2K-token batches, 20K items (CPU-feasible)
    tiny      2 blocks, d 32 (CPU smoke run)
Variants (``--variants``): fp32-eager, bf16-eager, bf16-compile (train.compile=default),
bf16-compile-max-autotune (train.compile=max-autotune-no-cudagraphs; long compile, not run by default),
and with ``train.cuda_graphs`` (the whole step, AdamW included, replayed as one CUDA graph per shape bucket):
fp32-graphs, bf16-graphs, bf16-compile-graphs (Inductor's kernels captured).

Each variant runs the training step itself (``recforge.train.step.StepRunner``: autocast, the
compiled objective, AdamW) from the same initial weights on the same batches. Its first steps
(also the warm-up and compilation) must give the fp32-eager losses within a tolerance (1% bf16,
0.2% fp32 compiled) before it is timed; a variant that fails or disagrees is reported and skipped.
The loss's per-position gather-dot runs the fused Triton kernels for float32 (``recforge.ops.gather_dot``, the
default; its kernels profiled as ``gather-dot``), or PyTorch's gather + bmm with ``RECFORGE_FUSED_GATHER_DOT=0`` in
the environment (recorded in the JSON as ``fused_gather_dot``: null unset, true/false set): run the script once
each way to A/B them.
Sampled negatives are drawn before each step (``StepRunner(draw=...)``, seeded alike in every variant), so
every variant scores the same ones. A graphs variant's first step of each shape bucket runs eagerly and
is captured; ``--check-steps`` > ``--batches`` makes the checked steps include replays (each batch is its
own bucket or shares one), and the timed steps are replays. MFU: model FLOPs (``recforge.train.flops``, from the real jagged lengths; forward +
backward = 3x forward) / step time / the dense bf16 peak, from the GPU table and measured here (an
8192^3 bf16 matmul). The breakdown: GPU kernel time per category from ``torch.profiler`` over a few
steps, and the host gap (step time not covered by any kernel).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import traceback
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config
from _machine import switch_state

from recforge.config import config_from_dict
from recforge.env import fused_gather_dot, hstu_fused_dq
from recforge.io import atomic_write_json
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import offsets_from_lengths
from recforge.models.builders import build_retrieval_model
from recforge.train.distributed import DistContext
from recforge.train.flops import matmul_precision, measure_matmul_peak, peak_tflops, step_flops_counter
from recforge.train.losses import draw_negatives, sampled_softmax_loss
from recforge.train.step import StepRunner
from recforge.train.step_padding import RetrievalPadding, loss_weights

_LARGE = dict(dim=1024, num_blocks=8, num_heads=4, dqk=128, dv=128)
_NORAB = dict(_LARGE, relative_bias=False)  # model.relative_bias=false: no pos_weights (the batches have no timestamps)
CASES = {  # name: (model, max_len, tokens per batch (0: users), users per batch, loss, negatives, items)
    "large": (_LARGE, 4096, 16384, 0, "per_position", 128, 100_000),
    "large-shared": (_LARGE, 4096, 16384, 0, "shared", 8192, 100_000),
    "large-norab": (_NORAB, 4096, 16384, 0, "per_position", 128, 100_000),
    "large-shared-norab": (_NORAB, 4096, 16384, 0, "shared", 8192, 100_000),
    "long-shared-norab": (_NORAB, 8192, 65536, 0, "shared", 8192, 100_000),
    # the residual stream in float32 (model.residual_dtype=float32, the default before the 20th session; bf16 variants
    # of the other cases carry it in bf16, the default auto: the "-res16" cases of earlier results)
    "long-shared-norab-res32": (dict(_NORAB, residual_dtype="float32"), 8192, 65536, 0, "shared", 8192, 100_000),
    # NVIDIA recsys-examples' MFU shape (8 x 1024, users up to 4K tokens) in 64K-token batches (large-shared-norab: 16K)
    "large-64k-shared-norab": (_NORAB, 4096, 65536, 0, "shared", 8192, 100_000),
    # long histories (issue 18's title regime, seed 000's "10万级" sequences): users of 8K-32K / 25K-100K tokens in
    # 128K-token batches, the same model; attention is most of the FLOPs there
    "xlong-32k-shared-norab": (_NORAB, 32768, 131072, 0, "shared", 8192, 100_000),
    "xlong-100k-shared-norab": (_NORAB, 100_000, 131072, 0, "shared", 8192, 100_000),
    # the same at head dim 64 (8 heads of 64): the Gluon kernels from max_seq_len 4,096 there (28th session)
    "long-d64-shared-norab": (dict(_NORAB, num_heads=8, dqk=64, dv=64), 8192, 65536, 0, "shared", 8192, 100_000),
    "medium": (dict(dim=512, num_blocks=8, num_heads=4, dqk=128, dv=128), 1024, 4096, 0, "per_position", 128, 100_000),
    "ml1m": (dict(dim=128, num_blocks=8, num_heads=2, dqk=64, dv=64), 200, 0, 256, "full", 0, 3706),
    "small": (dict(dim=128, num_blocks=2, num_heads=2, dqk=64, dv=64), 512, 2048, 0, "per_position", 128, 20_000),
    "tiny": (dict(dim=32, num_blocks=2, num_heads=2, dqk=16, dv=16), 64, 512, 0, "per_position", 128, 1000),
}
VARIANTS = {  # name: (train.precision, train.compile, train.cuda_graphs, loss tolerance against fp32-eager)
    "fp32-eager": ("float32", "none", False, 0.0),
    "bf16-eager": ("bfloat16", "none", False, 1e-2),
    "bf16-compile": ("bfloat16", "default", False, 1e-2),
    "bf16-compile-max-autotune": ("bfloat16", "max-autotune-no-cudagraphs", False, 1e-2),
    "fp32-compile": ("float32", "default", False, 2e-3),
    "fp32-graphs": ("float32", "none", True, 5e-3),  # padded to buckets: TF32 GEMMs of other shapes
    "bf16-graphs": ("bfloat16", "none", True, 1e-2),
    "bf16-compile-graphs": ("bfloat16", "default", True, 1e-2),
    "bf16-compile-max-autotune-graphs": ("bfloat16", "max-autotune-no-cudagraphs", True, 1e-2),
}
CATEGORIES = [  # (category, substrings of kernel names), first match wins
    ("attention", ("_hstu_", "hstu_attention")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "_mm_", "triton_tem", "matmul", "splitk")),
    ("memcpy/memset", ("memcpy", "memset", "copy_")),
    ("gather-dot", ("_gather_dot_fwd", "_gather_rows_sum")),  # recforge.ops.gather_dot (float32, the default)
    ("elementwise/norm", ("elementwise", "layer_norm", "triton_poi", "triton_red", "triton_per", "reduce", "softmax",
                          "index", "embedding", "cat", "fill", "silu", "norm", "where", "scatter", "gather")),
]  # fmt: skip


def _gather_dot_state() -> str:
    """The gather-dot kernels the loss takes under the environment's switch (float32 is what the loss runs)."""
    return {None: "fused for float32 (the default)", True: "fused for every dtype", False: "off"}[fused_gather_dot()]


def make_batches(case: str, count: int, seed: int) -> list[JaggedBatch]:
    """``count`` CPU batches of ``case`` (random lengths; next-item labels at every position)."""
    _, max_len, tokens, users, _, _, items = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths: list[int] = []
        while (sum(lengths) < tokens) if tokens else (len(lengths) < users):
            lengths.append(int(torch.randint(max_len // 4, max_len + 1, (), generator=gen)))
        if tokens:
            lengths[-1] -= sum(lengths) - tokens
        total = sum(lengths)
        batches.append(JaggedBatch(offsets_from_lengths(torch.tensor(lengths)),
                                   {"item_ids": torch.randint(1, items + 1, (total,), generator=gen)}, max_len,
                                   labels={"next_item": torch.randint(1, items + 1, (total,), generator=gen)}))  # fmt: skip
    return batches


def make_runner(case: str, variant: str, device: torch.device, args, loss=None) -> tuple[StepRunner, object]:
    """The variant's ``StepRunner`` and config; ``loss``: in place of ``sampled_softmax_loss`` (same arguments)."""
    model_kw, max_len, _, _, negatives, num_negatives, items = CASES[case]
    precision, compile_mode, graphs, _ = VARIANTS[variant]
    cfg = config_from_dict({
        "data": {"path": "-", "max_seq_len": max_len},
        "model": {"kind": "hstu", "dropout": 0.0, "kernel": "triton" if device.type == "cuda" else "pytorch", **model_kw},
        "loss": {"negatives": negatives, "num_negatives": num_negatives or 128, "temperature": 0.05, "chunk_size": args.chunk_size,
                 "matmul": args.loss_matmul},
        "train": {"device": str(device), "precision": precision, "compile": compile_mode, "cuda_graphs": graphs,
                  "graph_bucket_ratio": args.bucket_ratio},
    })  # fmt: skip
    score = loss or sampled_softmax_loss
    torch.manual_seed(0)
    model = build_retrieval_model(cfg.model, items, max_len).to(device)
    lc = cfg.loss

    def loss_fn(batch, draws=None):  # as recforge.train.retrieval._loss
        user = model(batch)  # padded for train.cuda_graphs: padding positions weigh 0 (loss_weights)
        value = score(user, batch.labels["next_item"], model.item_vectors, items, negatives=lc.negatives,
                      num_negatives=lc.num_negatives, temperature=lc.temperature, chunk_size=lc.chunk_size,
                      sampled=draws, weights=loss_weights(batch), matmul=lc.matmul)  # fmt: skip
        return value, value

    def draw(batch, seed):
        return draw_negatives(batch.labels["next_item"], items, negatives=lc.negatives, num_negatives=lc.num_negatives,
                              chunk_size=lc.chunk_size, generator=torch.Generator(device).manual_seed(seed))  # fmt: skip

    pad = RetrievalPadding(lc, items, cfg.train.graph_bucket_ratio, summed=False)
    runner = StepRunner(cfg, model, device, DistContext(), loss_fn=loss_fn, units_fn=lambda b: b.labels["next_item"].numel(),
                        draw=None if lc.negatives == "full" else draw, pad=pad)  # fmt: skip
    if graphs and runner.graphed is None:
        raise RuntimeError("train.cuda_graphs is off for this variant (see the warning above)")
    return runner, cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


COPY_OPS = ("aten::copy_", "aten::fill_", "aten::cat", "aten::_index_put_impl_", "aten::embedding_dense_backward")


def categorize(name: str) -> str:
    low = name.lower()
    if low.startswith(("triton_poi", "triton_red", "triton_per")):  # Inductor's fused kernels, named after their ops:
        return "elementwise/norm"  # "..._to_copy_..." (a fused dtype cast) is no memcpy
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def is_annotation(name: str) -> bool:
    """A profiler range recorded on the GPU timeline, not a kernel: Inductor's ``## Call CompiledFxGraph ... ##``
    and the optimizer's ``Optimizer.step#AdamW.step`` span the kernels they launch."""
    return name.startswith("## ") or name.startswith("Optimizer.")


def copy_ops(prof, steps: int, top: int) -> list[dict]:
    """The aten copies / fills / scatters of the profiled steps (``--copies``): per op, input shape, dtypes and
    calling op chain, the calls and MB (first input's size) per step, largest first."""
    rows: dict[tuple, list[float]] = {}
    for e in prof.events():
        if e.name not in COPY_OPS or not e.input_shapes or not e.input_shapes[0]:
            continue
        chain, parent = [], e.cpu_parent
        while parent is not None and len(chain) < 3:
            chain.append(parent.name)
            parent = parent.cpu_parent
        dtypes = [str(d) for d in (getattr(e, "input_dtypes", None) or [])[:2]]
        size = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4, "bool": 1}
        numel = torch.Size(e.input_shapes[0]).numel() if isinstance(e.input_shapes[0], list) else 0
        row = rows.setdefault((e.name, str(e.input_shapes[0]), " ".join(dtypes), " < ".join(chain)), [0, 0.0])
        row[0] += 1
        row[1] += numel * size.get(dtypes[0] if dtypes else "float", 4) / 1e6
    out = [{"op": k[0], "shape": k[1], "dtypes": k[2], "called_from": k[3], "calls": v[0] / steps, "mb": v[1] / steps}
           for k, v in rows.items()]  # fmt: skip
    return sorted(out, key=lambda r: -r["mb"])[:top]


def profile_steps(runner: StepRunner, batches: list, device: torch.device, steps: int, copies: int = 0,
                  top_n: int = 12) -> dict:
    """GPU time per kernel category (ms per step) and the host gap, from ``torch.profiler``; ``copies`` > 0: also
    the top copy ops (``copy_ops``) and memcpy/memset kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=copies > 0) as prof:
        for i in range(steps):
            runner([batches[i % len(batches)]])
        _sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kernels: dict[str, float] = {}
    top: dict[str, float] = {}
    copying: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if device.type != "cuda" or not device_us or event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if is_annotation(event.key):  # a range over kernels counted on their own: summing it would count them twice
            continue
        cat = categorize(event.key)
        kernels[cat] = kernels.get(cat, 0.0) + device_us / 1e3 / steps
        top[event.key[:200]] = top.get(event.key[:200], 0.0) + device_us / 1e3 / steps
        if cat == "memcpy/memset":
            copying[event.key[:160]] = copying.get(event.key[:160], 0.0) + device_us / 1e3 / steps
    busy = sum(kernels.values())
    extra = {}
    if copies:
        extra = {"copy_ops": copy_ops(prof, steps, copies),
                 "memcpy_kernels_ms": dict(sorted(copying.items(), key=lambda kv: -kv[1])[:copies])}  # fmt: skip
    return {**extra, "profiled_step_ms": wall_ms, "gpu_ms_by_category": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
            "host_gap_ms": max(0.0, wall_ms - busy), "gpu_busy_fraction": busy / wall_ms if wall_ms else 0.0,
            "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:top_n])}  # fmt: skip


def run_variant(case: str, variant: str, device: torch.device, cpu_batches: list, reference: list[float] | None,
                args, peaks: dict) -> dict:  # fmt: skip
    runner, cfg = make_runner(case, variant, device, args)
    batches = [b.to(device) for b in cpu_batches]
    count = step_flops_counter(cfg.model, cfg.loss, CASES[case][6])
    flops = [count(b) for b in cpu_batches]
    t0 = time.perf_counter()
    losses = [float(runner([batches[i % len(batches)]]).loss) for i in range(args.check_steps)]  # compiles here
    row: dict = {"case": case, "variant": variant, "first_steps_s": time.perf_counter() - t0, "losses": losses}
    if reference is not None:
        tol = VARIANTS[variant][3]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        row["max_rel_loss_diff"] = worst
        if worst > tol:
            row["error"] = f"losses disagree with fp32-eager: max relative difference {worst:.3g} > {tol:g}"
            return row
    for i in range(args.warmup):
        runner([batches[i % len(batches)]])
    _sync(device)
    t0 = time.perf_counter()
    for i in range(args.steps):
        runner([batches[i % len(batches)]])
    _sync(device)
    seconds = (time.perf_counter() - t0) / args.steps
    step_flops = sum(flops[i % len(flops)] for i in range(args.steps)) / args.steps
    tokens = sum(cpu_batches[i % len(cpu_batches)].num_tokens for i in range(args.steps)) / args.steps
    row.update({"step_ms": seconds * 1e3, "tokens_per_step": tokens, "tokens_per_s": tokens / seconds,
                "tflops": step_flops / seconds / 1e12})  # fmt: skip
    for name, peak in peaks.items():
        if peak:
            row[f"mfu_{name}"] = row["tflops"] / peak
    if args.profile_steps:
        row["profile"] = profile_steps(runner, batches, device, args.profile_steps, args.copies, args.top)
    if runner.graphed is not None:
        row["graphs"] = {"captured": len(runner.graphed.graphs), "replays": runner.graphed.replays,
                         "eager_steps": runner.graphed.eager_steps, "failed": runner.graphed.failed}  # fmt: skip
    elif VARIANTS[variant][2]:
        row["error"] = "train.cuda_graphs: the capture failed; the steps ran eagerly (see the warning above)"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", nargs="*", default=["large", "medium", "ml1m"], choices=list(CASES))
    parser.add_argument("--variants", nargs="*", default=["fp32-eager", "bf16-eager", "bf16-compile"], choices=list(VARIANTS))
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, cycled (each its own token count)")
    parser.add_argument("--check-steps", type=int, default=6,
                        help="first steps whose losses must agree (more than --batches: graphs variants replay some)")
    parser.add_argument("--chunk-size", type=int, default=0, help="loss.chunk_size (0: unchunked loss, as before; "
                        "the ml1m configs' default is 8192)")
    parser.add_argument("--loss-matmul", default="float32", choices=["float32", "float16"],
                        help="loss.matmul: the loss's logit matmuls from float16 inputs (float32 sums) or float32 (TF32)")
    parser.add_argument("--bucket-ratio", type=float, default=1.125, help="train.graph_bucket_ratio of graphs variants")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler (0: none)")
    parser.add_argument("--copies", type=int, default=0, help="list this many top copy ops and memcpy/memset kernels "
                        "of the profiled steps (their shapes, MB and callers; 0: none)")  # fmt: skip
    parser.add_argument("--top", type=int, default=12, help="the profile's kernels listed, by GPU time per step")
    parser.add_argument("--budget-s", type=float, default=220.0, help="skip variants not started within this time")
    parser.add_argument("--out", default=None, help="JSON output path (e.g. benchmarks/results/train_mfu-h200.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as recforge.train.runtime.prepare_runtime
    torch._inductor.config.fallback_random = True  # compiled random ops as eager's (the negatives are drawn outside)
    for name in ("cache_size_limit", "recompile_limit"):  # one compile per case and variant, same code objects
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    peaks = {"table": peak_tflops(device, "bfloat16"), "measured": None}
    if device.type == "cuda":
        peaks["measured"] = measure_matmul_peak(device, torch.bfloat16)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}; "
          f"bf16 peak TFLOP/s: table {peaks['table']}, measured {peaks['measured'] and round(peaks['measured'])}; "
          f"fused per-position gather-dot: {_gather_dot_state()} (RECFORGE_FUSED_GATHER_DOT)")  # fmt: skip
    rows = []
    begun = time.perf_counter()
    for case in args.cases:
        cpu_batches = make_batches(case, args.batches, seed=1)
        reference = None
        for variant in args.variants:
            started = time.perf_counter()
            if started - begun > args.budget_s:
                rows.append({"case": case, "variant": variant, "error": f"skipped: over --budget-s {args.budget_s:g}",
                             "wall_s": 0.0})  # fmt: skip
                _print_row(rows[-1])
                continue
            try:
                row = run_variant(case, variant, device, cpu_batches, reference, args, peaks)
                if variant == "fp32-eager" and "error" not in row:
                    reference = row["losses"]
            except Exception as err:  # noqa: BLE001 - reported, and the other variants still run
                row = {"case": case, "variant": variant, "error": f"{type(err).__name__}: {err}",
                       "traceback": traceback.format_exc(limit=6)}  # fmt: skip
            row["wall_s"] = time.perf_counter() - started
            rows.append(row)
            _print_row(row)
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        atomic_write_json(Path(args.out), {
            "benchmark": "train_mfu", "command": "python benchmarks/train_mfu.py " + " ".join(sys.argv[1:]),
            "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "matmul_precision_fp32": matmul_precision("float32"), "peaks_tflops_bf16": peaks,
            "date": datetime.date.today().isoformat(), "fused_gather_dot": fused_gather_dot(), "hstu_fused_dq": switch_state(hstu_fused_dq()), "loss_matmul": args.loss_matmul, "gather_dot_kernels": _gather_dot_state(), "cases": {c: {k: v for k, v in zip(
                ("model", "max_len", "tokens", "users", "negatives", "num_negatives", "items"), CASES[c], strict=True)} for c in args.cases},
            "rows": rows,
        })  # fmt: skip


def _print_row(row: dict) -> None:
    head = f"{row['case']:<19}{row['variant']:<28}"
    if "error" in row:
        print(head + f"FAILED ({row['wall_s']:.0f} s): {row['error']}", flush=True)
        return
    mfu = " ".join(f"mfu({k[4:]}) {100 * v:5.1f}%" for k, v in row.items() if k.startswith("mfu_"))
    print(head + f"{row['step_ms']:8.2f} ms {row['tokens_per_s']:>12,.0f} tok/s {row['tflops']:7.1f} TFLOP/s {mfu}"
          f"  (loss diff {row.get('max_rel_loss_diff', 0):.1e}, {row['wall_s']:.0f} s)", flush=True)  # fmt: skip
    prof = row.get("profile")
    if prof and prof["gpu_ms_by_category"]:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in prof["gpu_ms_by_category"].items())
        print(f"{'':<47}GPU ms/step: {parts}; host gap {prof['host_gap_ms']:.2f} ms "
              f"(GPU busy {100 * prof['gpu_busy_fraction']:.0f}%)", flush=True)  # fmt: skip
    for name, ms in (prof or {}).get("memcpy_kernels_ms", {}).items():
        print(f"{'':<47}{ms:7.2f} ms  {name}", flush=True)
    for op in (prof or {}).get("copy_ops", []):
        print(f"{'':<47}{op['mb']:9.1f} MB {op['calls']:5.1f}x {op['op']:<32}{op['shape']:<24}{op['dtypes']:<28}"
              f"{op['called_from'][:100]}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
