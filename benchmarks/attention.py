"""Attention kernels on jagged bf16 batches: TFLOP/s and share of the measured bf16 matmul peak.

Usage:
    PYTHONPATH=. python benchmarks/attention.py --out benchmarks/results/attention-h100.json \
        [--gr-path /path/to/generative-recommenders] [--head-dims 64 128] [--seq-lens 512 1024 2048 4096 8192] \
        [--baseline DIR] [--precompile 12] [--gr-tiles 0]

For each head dim and maximum sequence length L, one jagged batch of ~``--tokens`` tokens:
the first sequence has L tokens, the others N(0.6 L, 0.25 L) clipped to [1, L] (histories are
rarely all full length). Causal mask, 4 heads, no relative bias. FLOPs are counted as in the
generative-recommenders benchmark: causal = half of n^2 per sequence, forward = 2 matmuls,
forward+backward = 7, i.e. fwd = 2 n^2 D H, fwd+bwd = 7 n^2 D H, summed over sequences.

HSTU variants: recforge Triton, the PyTorch reference (padded), torch.compile of the reference
(dynamic shapes: one compile for all lengths), and the generative-recommenders Triton kernel
(``--gr-path``, run in a child process so that an illegal memory access is reported per case; ``--gr-tiles N``
keeps the N largest tiles of each of its autotuners, 8 by default, 0 every candidate it lists).
Softmax variants: recforge Triton, the PyTorch reference (padded SDPA with a dense mask), and
FlexAttention with a block mask over the packed batch (document + causal).

Each timed row also records host and GPU time per call apart (``host_and_gpu_ms``: at short
lengths ``do_bench``'s time is bounded by host time, not by the kernels).

``--baseline DIR``: DIR holds a package ``base_triton``, a copy of ``recforge/ops/triton`` from
another revision (imports rewritten to ``base_triton.``), timed as "recforge triton (baseline)"
in the same run, so that a kernel change is judged by a ratio from one process on one GPU; each
HSTU case also records how far the two revisions' outputs and gradients differ ("agreement" rows).
``--precompile N``: compile every autotuning candidate of the recforge kernels in N processes
first (Triton's disk cache), so that autotuning in the timed process only loads binaries; also
each generative-recommenders candidate in a process of its own (one that breaks its process,
e.g. by an illegal memory access, is left out of the timed run and named in its rows) and
FlexAttention's graphs (torch.compile's disk caches).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import triton
from _machine import switch_state

from recforge.env import hstu_fused_dq
from recforge.jagged.index import offsets_from_lengths
from recforge.jagged.mask import AttentionMask
from recforge.ops.hstu_attention import hstu_attention, hstu_attention_reference
from recforge.ops.softmax_attention import softmax_attention

HEADS = 4
GR_VARIANT = "generative-recommenders triton"
# every variant name (for --skip); "(baseline)" rows only with --baseline
VARIANTS = ("recforge triton", "pytorch reference", "torch.compile(reference)", "recforge triton (baseline)",
            "recforge triton (softmax)", "pytorch reference (softmax, SDPA)", "FlexAttention (softmax, block mask)",
            "recforge triton (softmax, baseline)", GR_VARIANT)


def make_lengths(max_len: int, tokens: int, seed: int, full_length: bool = False) -> list[int]:
    """One sequence of ``max_len`` tokens, the rest N(0.6 L, 0.25 L) clipped to [1, L], ~``tokens`` in
    all; ``full_length``: ``tokens // max_len`` sequences of ``max_len`` (ANCHORS.md's L x batch)."""
    if full_length:
        return [max_len] * max(1, tokens // max_len)
    gen = torch.Generator().manual_seed(seed + max_len)
    lengths = [max_len]
    while True:
        n = int(torch.normal(0.6 * max_len, 0.25 * max_len, (1,), generator=gen).clamp(1, max_len))
        if sum(lengths) + n > tokens:
            break
        lengths.append(n)
    return lengths


def flops(lengths: list[int], dim: int) -> tuple[float, float]:
    half = sum(n * n / 2 for n in lengths)
    per_matmul = 2 * half * dim * HEADS
    return 2 * per_matmul, 7 * per_matmul


def bench(fn, backward: bool, inputs: list[torch.Tensor]) -> float:
    """Median ms of fn() (and its backward) via triton.testing.do_bench."""
    if backward:
        out = fn()
        grad = torch.randn_like(out)

        def step():
            fn().backward(grad)

        return triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=inputs, return_mode="median")
    with torch.no_grad():
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def host_and_gpu_ms(fn, backward: bool, inputs: list[torch.Tensor], calls: int = 20, repeats: int = 5) -> dict:
    """Host and GPU time of one call, apart: ``calls`` calls queued behind a GPU sleep, so that no
    launch waits for the GPU (host ms: CPU time per call) and the GPU runs them back to back (GPU
    ms: CUDA events around them, per call; no L2 flush between calls); the median of ``repeats``
    such rounds (host time of the same code moved up to 2x between single rounds on the lent
    machines). ``do_bench`` (the table's times) clears a 256 MB buffer before each call, which
    hides only ~0.1 ms of host time."""
    grad = torch.randn_like(fn()) if backward else None

    def step():
        for x in inputs:
            x.grad = None
        if backward:
            fn().backward(grad)
        else:
            with torch.no_grad():
                fn()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host, gpu, hidden = [], [], True
    for _ in range(repeats):
        before, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        before.record()
        torch.cuda._sleep(100_000_000)  # ~60 ms
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        torch.cuda.synchronize()
        hidden &= host_ms < before.elapsed_time(start)  # False: the GPU caught up, gpu_ms counts host gaps
        host.append(host_ms / calls)
        gpu.append(start.elapsed_time(end) / calls)
    return {"host_ms": statistics.median(host), "gpu_ms": statistics.median(gpu), "gpu_ms_hides_host": hidden}


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


def inputs_for(lengths: list[int], dim: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    qkv = [torch.randn(total, HEADS, dim, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.5 for _ in range(3)]
    offsets = offsets_from_lengths(torch.tensor(lengths)).cuda()
    return [x.requires_grad_() for x in qkv], offsets


def hstu_variants(lengths, dim, seed, compiled_ref, baseline):
    (q, k, v), offsets = inputs_for(lengths, dim, seed)
    L, mask, scale = max(lengths), AttentionMask(), 1.0 / max(lengths)
    variants = {
        "recforge triton": lambda: hstu_attention(q, k, v, offsets, L, mask, scale=scale, kernel="triton"),
        "pytorch reference": lambda: hstu_attention_reference(q, k, v, offsets, L, mask, scale),
        "torch.compile(reference)": lambda: compiled_ref(q, k, v, offsets, L, mask, scale),
    }
    if baseline is not None:
        variants["recforge triton (baseline)"] = lambda: baseline.hstu.hstu_attention_triton(
            q, k, v, offsets, L, mask, scale)
    return [q, k, v], variants


def softmax_variants(lengths, dim, seed, tokens, flex, baseline):
    (q, k, v), offsets = inputs_for(lengths, dim, seed)
    L, mask = max(lengths), AttentionMask()
    from torch.nn.attention.flex_attention import create_block_mask

    total = sum(lengths)
    packed = tokens  # fixed packed length: FlexAttention compiles once for every L
    doc = torch.full((packed,), -1, dtype=torch.int64, device="cuda")
    doc[:total] = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))
    pad = packed - total

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    @functools.cache
    def block_mask():  # built on first use: not at all when FlexAttention is skipped
        return create_block_mask(mask_mod, 1, 1, packed, packed, device="cuda")

    def run_flex():
        qp, kp, vp = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = flex(qp, kp, vp, block_mask=block_mask())  # (1, H, packed, D)
        return out[0, :, :total].transpose(0, 1)

    variants = {
        "recforge triton (softmax)": lambda: softmax_attention(q, k, v, offsets, L, mask, kernel="triton"),
        "pytorch reference (softmax, SDPA)": lambda: softmax_attention(q, k, v, offsets, L, mask, kernel="pytorch"),
        "FlexAttention (softmax, block mask)": run_flex,
    }
    if baseline is not None:
        variants["recforge triton (softmax, baseline)"] = lambda: baseline.softmax.softmax_attention_triton(
            q, k, v, offsets, L, mask)
    return [q, k, v], variants


def agreement(fn, base_fn, inputs) -> dict:
    """Largest absolute differences between two variants' outputs and gradients (same inputs, same output
    gradient), relative to the largest magnitude of each: a kernel change timed against ``--baseline`` is also
    checked to compute the same thing (float32 atomics sum dQ in no fixed order, so dQ may differ at rounding)."""
    grad = torch.randn_like(fn())
    results = []
    for f in (fn, base_fn):
        for x in inputs:
            x.grad = None
        out = f()
        out.backward(grad)
        results.append([out.detach(), *(x.grad.detach().clone() for x in inputs)])
    for x in inputs:
        x.grad = None
    return {name: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
            for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True)}


def measure(name, fn, inputs, fl_fwd, fl_bwd, peak) -> dict:
    row = {"variant": name}
    for label, backward, fl in (("fwd", False, fl_fwd), ("fwd_bwd", True, fl_bwd)):
        try:
            ms = bench(fn, backward, inputs)
            row[f"{label}_ms"] = ms
            row[f"{label}_tflops"] = fl / ms / 1e9
            row[f"{label}_share_of_peak"] = fl / ms / 1e9 / peak
            row.update({f"{label}_{k}": v for k, v in host_and_gpu_ms(fn, backward, inputs).items()})
        except torch.cuda.OutOfMemoryError:
            row[f"{label}_error"] = "out of memory"
        except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
            row[f"{label}_error"] = describe_error(e)
        torch.cuda.empty_cache()
    return row


def chosen_tiles(baseline: SimpleNamespace | None, family: str) -> dict:
    """The tile each recforge kernel's autotuner used last (BLOCK_M, BLOCK_N, warps, stages): run-to-run
    differences in a row's speed are often a different tile picked on timing noise."""
    if baseline is not None:
        module = getattr(baseline, family)
    else:
        module = importlib.import_module(f"recforge.ops.triton.{family}")
    tiles = {}
    for name in ("_fwd", "_bwd_dq", "_bwd_dkdv"):
        cfg = getattr(getattr(module, name), "best_config", None)
        if cfg is not None:
            tiles[name.lstrip("_")] = [cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages]
    return tiles


def describe_error(e: BaseException) -> str:
    """The error and its innermost cause: Triton's CompilationError nests the real error
    (e.g. an AttributeError) under one error per inlined function, each naming only a line."""
    first = [line.strip() for line in str(e).splitlines() if line.strip()]
    root = e
    while root.__cause__ is not None or (root.__context__ is not None and not root.__suppress_context__):
        root = root.__cause__ or root.__context__
    text = f"{type(e).__name__}: {(first or [''])[0]}"
    if root is not e:
        root_lines = [line.strip() for line in str(root).splitlines() if line.strip()]
        text += f" ... caused by {type(root).__name__}: {' | '.join(root_lines[-2:])}"
    return text[:400]


def install_gr_compat() -> list[str]:
    """Stubs for Triton builtins that newer Triton removed and the generative-recommenders kernel
    still names, in branches for ENABLE_TMA=True only (the benchmark runs enable_tma=False).
    Without them its kernels fail to compile on Triton >= 3.4 ("module 'triton.language' has no
    attribute '_experimental_descriptor_store'"). A stub that is ever reached raises."""
    import triton.language as tl
    from triton.language import core

    @core.builtin
    def removed(*args, _semantic=None, **kwargs):
        raise RuntimeError("a removed Triton TMA-descriptor builtin was reached (enable_tma=True?)")

    added = []
    for name in ("_experimental_descriptor_load", "_experimental_descriptor_store"):
        if not hasattr(tl, name):
            setattr(tl, name, removed)
            added.append(name)
    return added


def gr_module(gr_path: str, tiles: int):
    """The generative-recommenders attention module from the checkout ``gr_path``, each autotuner cut to its
    ``tiles`` largest tiles (0: every candidate, as that code autotunes them)."""
    sys.path.insert(0, gr_path)
    stubs = install_gr_compat()
    if stubs:
        print(f"generative-recommenders: stubbed removed Triton builtins {stubs}", file=sys.stderr, flush=True)
    from generative_recommenders.ops.triton import triton_hstu_attention as gr
    from triton.runtime.autotuner import Autotuner

    # Their Hopper candidate lists hold ~20-30 configs per kernel; --gr-tiles 8 (the default) keeps the 8 largest
    # tiles of each so that autotuning fits a short lease.
    for obj in vars(gr).values():
        if isinstance(obj, Autotuner) and tiles and len(obj.configs) > tiles:
            obj.configs = sorted(obj.configs, key=lambda c: (-c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], -c.num_warps))[:tiles]
    return gr


def gr_candidate_count(gr_path: str, tiles: int) -> int:
    """How many candidates the largest generative-recommenders autotuner keeps (one precompile child each)."""
    from triton.runtime.autotuner import Autotuner

    gr = gr_module(gr_path, tiles)
    return max(len(obj.configs) for obj in vars(gr).values() if isinstance(obj, Autotuner))


def gr_worker(gr_path: str, cases: list[dict], seed: int, config_slice: list[int] | None = None,
              exclude: dict[str, list[int]] | None = None, tiles: int = 8) -> None:
    """Child process: the generative-recommenders kernel, one JSON line per case; exit on a CUDA error.

    With ``config_slice`` = [i, n]: compile only, i.e. run every case once (forward and backward,
    untimed) with the i-th candidate of each autotuner, so that n such children
    fill Triton's disk cache in parallel and the timed child's autotuning only loads binaries.
    Each finished forward and backward prints a ``GRSTAGE`` line, so that the parent can tell
    which candidate broke the process (see ``precompile``). ``exclude``: autotuner name -> indices
    of candidates (among the ``tiles`` kept) that the timed child drops.
    """
    from triton.runtime.autotuner import Autotuner

    gr = gr_module(gr_path, tiles)
    for name, indices in (exclude or {}).items():
        tuner = getattr(gr, name)
        tuner.configs = [c for i, c in enumerate(tuner.configs) if i not in indices]
    if config_slice is not None:
        index = config_slice[0]
        for obj in vars(gr).values():
            if isinstance(obj, Autotuner):
                obj.configs = obj.configs[index:index + 1] if index < len(obj.configs) else obj.configs[:1]
        for case in cases:
            (q, k, v), offsets = inputs_for(case["lengths"], case["dim"], seed)
            try:
                out = gr.triton_hstu_mha(max(case["lengths"]), 1.0, q, k, v, offsets)
                torch.cuda.synchronize()
                print(f"GRSTAGE {case['dim']} {max(case['lengths'])} fwd", flush=True)
                out.sum().backward()
                torch.cuda.synchronize()
                print(f"GRSTAGE {case['dim']} {max(case['lengths'])} bwd", flush=True)
            except torch.AcceleratorError:
                raise  # the context is broken: the parent reads the stage lines
            except Exception as e:  # noqa: BLE001 - the timed child reports it
                print(f"generative-recommenders precompile: {describe_error(e)}", file=sys.stderr, flush=True)
        return
    peak = cases[0]["peak"]
    for case in cases:
        lengths, dim = case["lengths"], case["dim"]
        (q, k, v), offsets = inputs_for(lengths, dim, seed)
        L = max(lengths)
        fl_fwd, fl_bwd = flops(lengths, dim)
        fn = functools.partial(gr.triton_hstu_mha, L, 1.0, q, k, v, offsets)
        row = measure(GR_VARIANT, fn, [q, k, v], fl_fwd, fl_bwd, peak)
        row.update(dim=dim, max_len=L)
        print("GRROW " + json.dumps(row), flush=True)
        errors = [value for key, value in row.items() if key.endswith("_error")]
        if errors and not all(e.startswith("CompilationError") for e in errors):
            sys.exit(3)  # the CUDA context may be broken: the parent starts a fresh process


def run_gr(gr_path: str, cases: list[dict], seed: int, exclude: dict[str, list[int]] | None = None, tiles: int = 8):
    """Yield the generative-recommenders rows as the child process prints them (a fresh child
    after a case that failed, since a CUDA error can break the context)."""
    todo = list(cases)
    while todo:
        spec = json.dumps({"path": gr_path, "cases": todo, "seed": seed, "exclude": exclude, "tiles": tiles})
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([sys.executable, __file__, "--_gr-worker", spec], stdout=subprocess.PIPE,
                                    stderr=err, text=True, env=dict(os.environ))
            done = 0
            for line in proc.stdout:
                if line.startswith("GRROW "):
                    done += 1
                    yield json.loads(line[6:])
            code = proc.wait()
            if done < len(todo) and code not in (0, 3):
                err.seek(0)
                tail = (err.read().strip().splitlines() or ["no output"])[-1][:200]
                c = todo[done]
                yield {"variant": "generative-recommenders triton", "dim": c["dim"], "max_len": max(c["lengths"]),
                       "fwd_error": f"process died (exit {code}): {tail}", "fwd_bwd_error": "not run"}
                done += 1
            elif done < len(todo) and code == 0:
                raise RuntimeError(f"generative-recommenders worker exited after {done} of {len(todo)} cases")
        todo = todo[done:]


def load_baseline(path: str) -> SimpleNamespace:
    """``base_triton.hstu`` and ``base_triton.softmax`` from DIR (see the module doc)."""
    sys.path.insert(0, os.path.abspath(path))
    return SimpleNamespace(hstu=importlib.import_module("base_triton.hstu"),
                           softmax=importlib.import_module("base_triton.softmax"))


def _triton_calls(dim: int, seed: int, baseline: SimpleNamespace | None, families: list[str]) -> list:
    lengths = [512, 300, 77]  # > 256 tokens: the autotuned path
    (q, k, v), offsets = inputs_for(lengths, dim, seed)
    L, mask = max(lengths), AttentionMask()
    calls = []
    if "hstu" in families:
        calls.append(lambda: hstu_attention(q, k, v, offsets, L, mask, scale=1.0 / L, kernel="triton"))
        if baseline is not None:
            calls.append(lambda: baseline.hstu.hstu_attention_triton(q, k, v, offsets, L, mask, 1.0 / L))
    if "softmax" in families:
        calls.append(lambda: softmax_attention(q, k, v, offsets, L, mask, kernel="triton"))
        if baseline is not None:
            calls.append(lambda: baseline.softmax.softmax_attention_triton(q, k, v, offsets, L, mask))
    return calls


def precompile_worker(index: int, count: int, dims: list[int], baseline_path: str | None, seed: int,
                      families: list[str]) -> None:
    """Child: compile, without running, this worker's share of the autotuning candidates of every
    recforge kernel the timed run will use (same argument specialization, so the same cache entries)."""
    from recforge.ops.triton import hstu as hstu_mod
    from recforge.ops.triton import softmax as softmax_mod
    from recforge.ops.triton import tuning

    modules = [(hstu_mod, tuning), (softmax_mod, tuning)]
    baseline = load_baseline(baseline_path) if baseline_path else None
    if baseline is not None:
        base_tuning = importlib.import_module("base_triton.tuning")
        modules += [(baseline.hstu, base_tuning), (baseline.softmax, base_tuning)]
    jobs = []

    def collector(tuning_mod):
        def collect(kernel, grid_blocks, batch, heads, max_seq_len, args, meta):
            name = kernel.fn.__name__  # revisions before per-kernel tables have no tuning_kind
            kind = getattr(kernel, "tuning_kind", "fwd" if name.endswith("_fwd") else "bwd")
            if "SPLIT_LOOPS" in kernel.fn.arg_names:  # set by launch(), which collect() replaces
                meta = dict(meta, SPLIT_LOOPS=tuning_mod.split_loops(fixed_tile=False))
            if hasattr(tuning_mod, "tile_kind"):  # revisions before the fused dK/dV list have none
                kind = tuning_mod.tile_kind(kind, meta)
            jobs.extend((kernel.fn, args, meta, cfg) for cfg in tuning_mod.candidates(kind, meta["BD_QK"], meta["BD_V"]))

        return collect

    for module, tuning_mod in modules:  # older revisions name their launcher _launch
        setattr(module, "launch" if hasattr(module, "launch") else "_launch", collector(tuning_mod))
    for dim in dims:
        for call in _triton_calls(dim, seed, baseline, families):
            out = call()  # launches nothing: collect() only records
            out.backward(torch.ones_like(out))
    for fn, args, meta, cfg in jobs[index::count]:
        fn.warmup(*args, grid=(1,), **meta, **cfg.all_kwargs())


def flex_warmup(dims: list[int], tokens: int, seed: int) -> None:
    """Child: FlexAttention forward and backward once per head dim, so that the timed process
    finds its compiled graphs in torch.compile's disk caches (one packed length for every L)."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    for dim in dims:
        lengths = make_lengths(1024, tokens, seed)
        _, variants = softmax_variants(lengths, dim, seed, tokens, flex, None)
        variants["FlexAttention (softmax, block mask)"]().sum().backward()
    torch.cuda.synchronize()


def precompile(workers: int, dims: list[int], baseline_path: str | None, seed: int, families: list[str],
               gr_path: str | None, gr_cases: list[dict], flex: bool, tokens: int,
               gr_tiles: int = 8) -> dict[str, list[int]]:
    """Compile ahead, all at once in child processes: the autotuning candidates of the recforge
    kernels of ``families`` ("hstu", "softmax"; ``workers`` processes), of the generative-recommenders
    kernel (``gr_path``; one process per candidate) and FlexAttention's compiled graphs (``flex``;
    torch.compile's disk caches). Returns the generative-recommenders candidates that broke their
    process (an illegal memory access, say), for ``run_gr`` to leave out."""
    start = time.perf_counter()
    procs = []
    if families:
        procs += [subprocess.Popen([sys.executable, __file__, "--_precompile-worker",
                                    json.dumps({"index": i, "count": workers, "dims": dims, "baseline": baseline_path,
                                                "seed": seed, "families": families})])
                  for i in range(workers)]
    gr_procs = []
    if gr_path:  # one child per kept candidate index (see gr_worker) of both its autotuners
        count = gr_candidate_count(gr_path, gr_tiles)
        gr_procs = [subprocess.Popen([sys.executable, __file__, "--_gr-worker",
                                      json.dumps({"path": gr_path, "cases": gr_cases, "seed": seed,
                                                  "slice": [i, count], "tiles": gr_tiles})],
                                     stdout=subprocess.PIPE, text=True)
                    for i in range(count)]
    if flex:
        procs.append(subprocess.Popen([sys.executable, __file__, "--_flex-warmup",
                                       json.dumps({"dims": dims, "seed": seed, "tokens": tokens})]))
    exclude: dict[str, list[int]] = {}
    for i, proc in enumerate(gr_procs):
        stages = [line.split() for line in proc.stdout if line.startswith("GRSTAGE ")]
        if proc.wait() != 0:  # it died in the kernel after its last finished stage
            name = "_hstu_attn_bwd" if stages and stages[-1][-1] == "fwd" else "_hstu_attn_fwd"
            exclude.setdefault(name, []).append(i)
            after = " ".join(stages[-1][1:]) if stages else "start"
            print(f"generative-recommenders: candidate {i} of {name} broke its process after {after}; "
                  "the timed run leaves it out", flush=True)
    codes = [p.wait() for p in procs] + [p.returncode for p in gr_procs]
    print(f"precompiled the autotuning candidates (recforge: {families}, generative-recommenders: {bool(gr_path)}, "
          f"FlexAttention: {flex}) in {len(codes)} processes: {time.perf_counter() - start:.0f} s, exit codes {codes}",
          flush=True)
    return exclude


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per jagged batch")
    parser.add_argument("--full-length", action="store_true",
                        help="every sequence L tokens long (tokens // L of them), as ANCHORS.md measured")
    parser.add_argument("--gr-path", default=None, help="checkout of facebookresearch/generative-recommenders")
    parser.add_argument("--gr-tiles", type=int, default=8,
                        help="candidates kept per generative-recommenders autotuner (its largest tiles; 0: all of them)")
    parser.add_argument("--skip", nargs="*", default=[], choices=VARIANTS, help="variant names to skip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--baseline", default=None, help="folder holding base_triton, another revision's kernels")
    parser.add_argument("--precompile", type=int, default=0, help="compile autotuning candidates in N processes first")
    parser.add_argument("--precompile-only", action="store_true", help="exit after --precompile")
    parser.add_argument("--gr-exclude-file", default=None,
                        help="JSON of generative-recommenders candidates that broke their process: written by "
                             "--precompile, read by a run without it")
    parser.add_argument("--_gr-worker", dest="gr_worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_precompile-worker", dest="precompile_worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_flex-warmup", dest="flex_warmup", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gr_worker:
        spec = json.loads(args.gr_worker)
        gr_worker(spec["path"], spec["cases"], spec["seed"], spec.get("slice"), spec.get("exclude"), spec.get("tiles", 8))
        return
    if args.flex_warmup:
        spec = json.loads(args.flex_warmup)
        flex_warmup(spec["dims"], spec["tokens"], spec["seed"])
        return
    if args.precompile_worker:
        spec = json.loads(args.precompile_worker)
        precompile_worker(spec["index"], spec["count"], spec["dims"], spec["baseline"], spec["seed"], spec["families"])
        return
    gr_cases = [{"lengths": make_lengths(L, args.tokens, args.seed, args.full_length), "dim": dim}
                for dim in args.head_dims for L in args.seq_lens]
    if args.precompile:
        families = [f for f in ("hstu", "softmax") if any(
            name.startswith("recforge triton") and ("softmax" in name) == (f == "softmax") and name not in args.skip
            for name in VARIANTS)]
        gr_exclude = precompile(args.precompile, args.head_dims, args.baseline, args.seed, families,
                                None if GR_VARIANT in args.skip else args.gr_path, gr_cases,
                                "FlexAttention (softmax, block mask)" not in args.skip, args.tokens, args.gr_tiles)
        if args.gr_exclude_file:
            with open(args.gr_exclude_file, "w") as f:
                json.dump(gr_exclude, f)
        if args.precompile_only:
            return
    elif args.gr_exclude_file and os.path.exists(args.gr_exclude_file):
        with open(args.gr_exclude_file) as f:
            gr_exclude = json.load(f)
    else:
        gr_exclude = {}
    baseline = load_baseline(args.baseline) if args.baseline else None

    peak = matmul_peak()
    compiled_ref = torch.compile(hstu_attention_reference, dynamic=True)
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    rows = []
    for dim in args.head_dims:
        for L in args.seq_lens:
            lengths = make_lengths(L, args.tokens, args.seed, args.full_length)
            fl_fwd, fl_bwd = flops(lengths, dim)
            for family in ("hstu", "softmax"):
                if family == "hstu":
                    inputs, variants = hstu_variants(lengths, dim, args.seed, compiled_ref, baseline)
                    if baseline is not None and "recforge triton" not in args.skip:
                        check = agreement(variants["recforge triton"], variants["recforge triton (baseline)"], inputs)
                        print(json.dumps({"dim": dim, "max_len": L, "relative_difference_vs_baseline": check}))
                        rows.append({"variant": "agreement with the baseline", "dim": dim, "max_len": L,
                                     "relative_difference": check})
                else:
                    inputs, variants = softmax_variants(lengths, dim, args.seed, args.tokens, flex, baseline)
                for name, fn in variants.items():
                    if name in args.skip:
                        continue
                    row = measure(name, fn, inputs, fl_fwd, fl_bwd, peak)
                    row.update(dim=dim, max_len=L, batch=len(lengths), tokens=sum(lengths))
                    if name.startswith("recforge triton"):
                        row["tiles"] = chosen_tiles(baseline if "baseline" in name else None,
                                                    "softmax" if "softmax" in name else "hstu")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save(args, rows, peak)  # partial results survive a killed run
                del inputs, variants
    for case in gr_cases:
        case["peak"] = peak
    if args.gr_path and GR_VARIANT not in args.skip:
        for row in run_gr(args.gr_path, gr_cases, args.seed, gr_exclude, args.gr_tiles):
            case = next(c for c in gr_cases if c["dim"] == row["dim"] and max(c["lengths"]) == row["max_len"])
            row.update(batch=len(case["lengths"]), tokens=sum(case["lengths"]))
            if gr_exclude:
                row["left_out_candidates"] = gr_exclude
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(args, rows, peak)
    save(args, rows, peak)
    machine = torch.cuda.get_device_name()
    print(f"\nattention on {machine}, torch {torch.__version__}, triton {triton.__version__}, bf16, {HEADS} heads, "
          f"causal, {'full-length' if args.full_length else 'jagged'} ~{args.tokens} tokens/batch; "
          f"measured bf16 matmul peak {peak:.0f} TFLOP/s")
    print_table(rows)
    print_split(rows)


def save(args, rows: list[dict], peak: float) -> None:
    if args.out:
        machine = torch.cuda.get_device_name()
        payload = {
            "benchmark": "attention",
            "command": "PYTHONPATH=. python benchmarks/attention.py " + " ".join(sys.argv[1:]),
            "machine": machine,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.date.today().isoformat(),
            "matmul_peak_tflops": peak, "hstu_fused_dq": switch_state(hstu_fused_dq()),
            "rows": rows,
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)


def print_table(rows: list[dict]) -> None:
    def cell(row, label):
        if f"{label}_tflops" in row:
            return f"{row[f'{label}_tflops']:6.0f} ({100 * row[f'{label}_share_of_peak']:2.0f}%)"
        return row.get(f"{label}_error", "-")[:28]

    print("| D | L | batch | variant | fwd TFLOP/s (% peak) | fwd+bwd TFLOP/s (% peak) | ours / this, fwd | fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["dim"], r["max_len"], "softmax" in r["variant"], r["variant"])):
        if "relative_difference" in row:  # an agreement row, no timing
            print(f"| {row['dim']} | {row['max_len']} | | {row['variant']}: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in row["relative_difference"].items()) + " | | | | |")
            continue
        ours_name = "recforge triton (softmax)" if ("softmax" in row["variant"] or "Flex" in row["variant"]) else "recforge triton"
        ours = next((r for r in rows if r["variant"] == ours_name and r["dim"] == row["dim"] and r["max_len"] == row["max_len"]), {})
        ratios = []
        for label in ("fwd", "fwd_bwd"):
            a, b = ours.get(f"{label}_ms"), row.get(f"{label}_ms")
            ratios.append(f"{b / a:.2f}x" if a and b and row is not ours else "")
        print(f"| {row['dim']} | {row['max_len']} | {row.get('batch', '')} | {row['variant']} | {cell(row, 'fwd')} | "
              f"{cell(row, 'fwd_bwd')} | {ratios[0]} | {ratios[1]} |")


def print_split(rows: list[dict]) -> None:
    """Each row's do_bench time beside its host and GPU time per call (``host_and_gpu_ms``)."""
    def cell(row, label):
        if f"{label}_ms" not in row:
            return "-"
        return f"{row[f'{label}_ms']:.3f} ({row[f'{label}_host_ms']:.3f}, {row[f'{label}_gpu_ms']:.3f})"

    print("\n| D | L | variant | fwd ms (host, GPU) | fwd+bwd ms (host, GPU) |")
    print("|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["dim"], r["max_len"], r["variant"])):
        if "fwd_host_ms" in row or "fwd_bwd_host_ms" in row:
            print(f"| {row['dim']} | {row['max_len']} | {row['variant']} | {cell(row, 'fwd')} | {cell(row, 'fwd_bwd')} |")


if __name__ == "__main__":
    main()
