"""Embedding lookup + update step (forward, backward, Adam) of recforge.sparse against plain PyTorch.

Usage:
    python benchmarks/sparse_embedding.py --device cpu --scale 0.02 --out benchmarks/results/sparse_embedding-cpu-2core.json
    python benchmarks/sparse_embedding.py --device cuda --out benchmarks/results/sparse_embedding-h100.json

Seed 000 Table 1 configurations (bs / L / d): 32/4000/128, 128/4000/128, 256/4000/256,
65536/10/128; ``--scale`` shrinks the ID count (L, or bs where L is short) and the tables.

(a) whole table on the device, IDs with ~70% duplicates over a ``--rows``-row table:
    dynamic     DynamicEmbedding, raw int64 IDs hashed to rows, lazy Adam (recforge.sparse)
    nn.sparse   nn.Embedding(sparse=True) + torch.optim.SparseAdam on pre-mapped row IDs
    lazy-adam   unique + index_select + hand-written lazy Adam + index_copy_ on pre-mapped IDs
(b) host table 10x the device cache, power-law (Zipf) IDs reused across steps:
    tiered      DynamicEmbedding(cache_rows=rows/10); each step: lookup (pins its rows), prefetch the next
                batch (its misses evict only unpinned rows), backward, update
    naive-host  rows and Adam state in (pinned) host memory: gather, H2D, update, D2H, scatter per step
    floor       bytes the naive path must move / measured copy bandwidth; the tiered floor counts the rows
                the cache really loaded and wrote back over the timed steps (same bandwidth)
(hash) at table size n: insert n/100 new keys and look up n keys, IdHashTable against SortedIdIndex
    (searchsorted; an insert merges). ``--index`` picks the tables' index (default: auto, by device).
(uva, CUDA) GB/s of the tiered store's row-swap kernel between a pinned host table and a device cache
    (missed-row loads, dirty write-backs, both), per warps/tile setting.
``--profile DIR`` writes torch.profiler tables of the dynamic and tiered steps (and Chrome traces of
those ``--trace`` names) to DIR.

Times are medians, synchronising the device around each step. The methods of one mode are timed
interleaved: each round runs every method's step once (the order rotating), ``--warmup`` rounds
untimed, then ``--rounds`` (mode a; ``--repeats`` for mode b, of which the naive path, 100-1000x
slower, runs the first ``--naive-repeats``), so a drift of the host's or GPU's speed hits all methods
alike. Launch-bound configurations (32/4000/128) vary by up to 2x between runs on a lent machine: the
claim is each method's ratio to the same run's "unique + lazy Adam (pre-mapped)" median
(``vs_lazy_adam``), printed beside the absolute time and the issue's limit (at ``--scale 1``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recforge.sparse import DynamicEmbedding, SparseOptimConfig, TableConfig, kernels, warm_start
from recforge.sparse.hash_table import IdHashTable
from recforge.sparse.sorted_index import SortedIdIndex
from recforge.io import atomic_write_json

sys.path.insert(0, str(Path(__file__).parent))
from _machine import cpu_model

CONFIGS = [(32, 4000, 128), (128, 4000, 128), (256, 4000, 256), (65536, 10, 128)]
LR = 1e-3
DYNAMIC, NN_SPARSE, LAZY = "dynamic (raw IDs, hashed)", "nn.Embedding(sparse)+SparseAdam", "unique + lazy Adam (pre-mapped)"
TIERED = "tiered (cache + prefetch)"
# issue 5's targets at full size (H100): (a) dynamic within RATIO_LIMIT x plain PyTorch lazy Adam on
# pre-mapped IDs (ANCHORS.md's medians, and here the same run's); (b) tiered step at most the seed's ms
ANCHOR_LAZY_ADAM_MS = {(32, 4000, 128): 0.82, (128, 4000, 128): 2.18, (256, 4000, 256): 6.73, (65536, 10, 128): 2.70}
TIERED_TARGET_MS = {(32, 4000, 128): 5.0, (128, 4000, 128): 14.0, (256, 4000, 256): 32.0, (65536, 10, 128): 24.0}
RATIO_LIMIT = 1.5


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(step: Callable[[int], None], device: torch.device, warmup: int, repeats: int) -> float:
    times = []
    for i in range(warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        step(i)
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def interleaved_ms(steps: dict[str, Callable[[int], None]], device: torch.device, warmup: int, rounds: int,
                   timed: dict[str, int] | None = None) -> dict[str, float]:
    """Median ms of each step, timed round-robin: round ``r`` runs every step once as ``step(r)``, starting at a
    rotating one; ``timed[name]`` caps how many timed rounds that step runs (the first ones)."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if timed is not None and r >= warmup + timed.get(name, rounds):
                continue
            sync(device)
            t0 = time.perf_counter()
            steps[name](r)
            sync(device)
            if r >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def profile(name: str, step: Callable[[int], None], steps: list[int], device: torch.device, args) -> None:
    """torch.profiler table (and, for ``trace``-named steps, a Chrome trace) of ``steps`` into ``args.profile``."""
    if not args.profile:
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with torch_profile(activities=activities) as prof:
        for i in steps:
            step(i)
        sync(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with open(out / "profile.txt", "a") as f:
        f.write(f"\n### {name} ({len(steps)} steps)\n")
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60) + "\n")
    if args.trace and any(name.startswith(prefix) for prefix in args.trace.split(",")):
        prof.export_chrome_trace(str(out / f"trace-{name.split()[0]}.json"))
    if device.type == "cuda":  # which calls of one step synchronise the host with the GPU
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step(steps[0])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with open(out / "profile.txt", "a") as f:
            f.write(f"synchronising calls in one step: {len(caught)}\n")
            f.writelines(f"  {w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}\n" for w in caught)


def scaled(bs: int, length: int, scale: float) -> tuple[int, int]:
    if length >= 100:
        return bs, max(1, round(length * scale))
    return max(1, round(bs * scale)), length


def uniform_dup_batches(n: int, rows: int, count: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``count`` batches of ``n`` row indices, ~70% duplicates: 0.3n distinct candidates drawn with replacement."""
    out = []
    for _ in range(count):
        pool = torch.randint(0, rows, (max(1, int(0.3 * n)),), generator=gen)
        out.append(pool[torch.randint(0, pool.numel(), (n,), generator=gen)])
    return out


def lazy_adam_(weight, m, v, step_count: int, rows, grad) -> None:
    """Hand-written lazy Adam (global step bias correction, as SparseAdam) on ``rows``."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    mr = m.index_select(0, rows).lerp_(grad, 1 - b1)
    vr = v.index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1 - b2)
    m.index_copy_(0, rows, mr)
    v.index_copy_(0, rows, vr)
    denom = vr.sqrt_().div_((1 - b2**step_count) ** 0.5).add_(eps)
    weight.index_copy_(0, rows, weight.index_select(0, rows).addcdiv_(mr, denom, value=-LR / (1 - b1**step_count)))


def mode_a(bs: int, length: int, dim: int, rows: int, device: torch.device, args) -> list[dict]:
    n = bs * length
    gen = torch.Generator().manual_seed(0)
    batches = uniform_dup_batches(n, rows, 4, gen)
    grad_out = torch.randn(n, dim, device=device)
    raw_keys = torch.randint(0, 2**62, (rows,), generator=gen)  # raw IDs: row r is ID raw_keys[r]

    table = DynamicEmbedding(TableConfig(name="bench", dim=dim, capacity=rows, index=args.index, optimizer=SparseOptimConfig(kind="adam", lr=LR)), device)
    warm_start(table, torch.randn(rows, dim, device=device) * 0.01, raw_keys)  # drawn on the device: quicker
    raw_batches = [raw_keys[b].to(device) for b in batches]

    def dynamic_step(i: int) -> None:
        table(raw_batches[i % 4]).backward(grad_out)
        table.apply_gradients()

    row_batches = [b.to(device) for b in batches]
    emb = nn.Embedding(rows, dim, sparse=True, device=device)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=LR)

    def torch_sparse_step(i: int) -> None:
        emb(row_batches[i % 4]).backward(grad_out)
        opt.step()
        opt.zero_grad(set_to_none=True)

    weight = torch.randn(rows, dim, device=device) * 0.01
    m, v = torch.zeros_like(weight), torch.zeros_like(weight)
    lazy_calls = [0]

    def lazy_step(i: int) -> None:
        uniq, inverse = torch.unique(row_batches[i % 4], return_inverse=True)
        leaf = weight.index_select(0, uniq).requires_grad_()
        F.embedding(inverse, leaf).backward(grad_out)
        lazy_calls[0] += 1
        lazy_adam_(weight, m, v, lazy_calls[0], uniq, leaf.grad)

    steps = {DYNAMIC: dynamic_step, NN_SPARSE: torch_sparse_step, LAZY: lazy_step}
    ms = interleaved_ms(steps, device, args.warmup, args.rounds)
    profile(f"a-{bs}-{length}-{dim} dynamic", dynamic_step, [0, 1, 2], device, args)
    base, sparse = ms[LAZY], ms[NN_SPARSE]
    anchor = ANCHOR_LAZY_ADAM_MS.get((bs, length, dim)) if args.scale == 1.0 else None
    out = []
    for name, t in ms.items():
        row = {"mode": "a", "bs": bs, "L": length, "d": dim, "rows": rows, "method": name, "ms": t, "vs_lazy_adam": t / base,
               "vs_nn_sparse": t / sparse, "rounds": args.rounds}  # fmt: skip
        if name == DYNAMIC and device.type == "cuda":  # the GPU target (CPU: the ratio to nn.sparse)
            row.update(ratio_limit=RATIO_LIMIT, pass_ratio=t / base <= RATIO_LIMIT)
            if anchor:
                row.update(anchor_limit_ms=RATIO_LIMIT * anchor, pass_anchor=t <= RATIO_LIMIT * anchor)
        out.append(row)
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes/s of one host->device plus device->host copy pair (pinned host memory on CUDA)."""
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device.type == "cuda")
    dev = torch.empty_like(host, device=device)

    def copy(_: int) -> None:
        dev.copy_(host, non_blocking=True)
        host.copy_(dev, non_blocking=True)

    ms = median_ms(copy, device, 1, 5)
    return 2 * nbytes / (ms / 1e3)


def zipf_batches(n: int, rows: int, count: int, gen: torch.Generator, exponent: float = 1.05) -> list[torch.Tensor]:
    """Power-law row indices: rank r has weight r**-exponent; a fixed random rank->row permutation."""
    perm = torch.randperm(rows, generator=gen)
    u = torch.rand(count, n, generator=gen, dtype=torch.float64)
    ranks = ((rows ** (1 - exponent) - 1) * u + 1) ** (1 / (1 - exponent))  # inverse CDF of the continuous law
    return [perm[(r.long() - 1).clamp(0, rows - 1)] for r in ranks]


def mode_b(bs: int, length: int, dim: int, rows: int, device: torch.device, args, bandwidth: float, lazy_ms: float | None) -> list[dict]:
    """``lazy_ms``: mode (a)'s unique + lazy Adam median of this configuration in this run (None: not run)."""
    n = bs * length
    steps = args.warmup + args.repeats + 1
    gen = torch.Generator().manual_seed(1)
    batches = zipf_batches(n, rows, steps, gen)
    distinct = [b.unique().numel() for b in batches]
    unique_per_step = statistics.median(distinct)
    cache = max(rows // 10, int(1.5 * max(distinct)))
    grad_out = torch.randn(n, dim, device=device)
    raw_keys = torch.randint(0, 2**62, (rows,), generator=gen)
    raw_batches = [raw_keys[b].to(device) for b in batches]
    table = DynamicEmbedding(
        TableConfig(name="bench", dim=dim, capacity=rows, cache_rows=cache, index=args.index, optimizer=SparseOptimConfig(kind="adam", lr=LR)), device
    )
    warm_start(table, torch.randn(rows, dim, device=device) * 0.01, raw_keys)

    before: dict[str, int] = {}

    def tiered_step(i: int) -> None:
        out = table(raw_batches[i])  # pins this batch's cache rows
        table.prefetch([raw_batches[i + 1]])  # next batch's misses, evicting unpinned rows only
        out.backward(grad_out)
        table.apply_gradients()
        if i == args.warmup - 1:  # untimed: cache traffic before the timed steps
            before.update(table.store.stats())

    pin = device.type == "cuda"
    host_w = torch.empty(rows, dim, pin_memory=pin).copy_(torch.randn(rows, dim, device=device) * 0.01)  # stays pinned
    host_m, host_v = torch.zeros(rows, dim, pin_memory=pin), torch.zeros(rows, dim, pin_memory=pin)
    dev_batches = [b.to(device) for b in batches]

    def naive_step(i: int) -> None:
        uniq, inverse = torch.unique(dev_batches[i], return_inverse=True)
        rows_cpu = uniq.cpu()
        w, m, v = (t.index_select(0, rows_cpu).to(device, non_blocking=True) for t in (host_w, host_m, host_v))
        leaf = w.clone().requires_grad_()
        F.embedding(inverse, leaf).backward(grad_out)
        local = torch.arange(uniq.numel(), device=device)
        lazy_adam_(w, m, v, i + 1, local, leaf.grad)
        for host, t in ((host_w, w), (host_m, m), (host_v, v)):
            host.index_copy_(0, rows_cpu, t.cpu())

    naive_name = "naive host (gather/H2D/D2H)"
    ms = interleaved_ms({TIERED: tiered_step, naive_name: naive_step}, device, args.warmup, args.repeats,
                        timed={naive_name: min(args.repeats, args.naive_repeats)})  # fmt: skip
    stats = table.store.stats()
    moved = sum(stats[k] - before.get(k, 0) for k in ("rows_loaded", "rows_written_back")) / args.repeats
    tiered_floor_ms = moved * (3 * dim * 4 + 8) / bandwidth * 1e3  # weight, Adam moments, step count per row
    profile(f"b-{bs}-{length}-{dim} tiered", tiered_step, [steps - 4, steps - 3, steps - 2], device, args)
    floor_ms = unique_per_step * dim * 4 * 3 * 2 / bandwidth * 1e3  # w, m, v rows in and out
    common = {"mode": "b", "bs": bs, "L": length, "d": dim, "rows": rows, "cache_rows": cache, "unique_ids_per_step": unique_per_step}
    tiered = {**common, "method": TIERED, "ms": ms[TIERED], "rounds": args.repeats, "cache": stats}
    target = TIERED_TARGET_MS.get((bs, length, dim)) if args.scale == 1.0 else None
    if target:
        tiered.update(target_ms=target, pass_target=ms[TIERED] <= target)
    if lazy_ms:
        tiered["vs_lazy_adam"] = ms[TIERED] / lazy_ms
    return [
        tiered,
        {**common, "method": naive_name, "ms": ms[naive_name], "rounds": min(args.repeats, args.naive_repeats)},
        {**common, "method": "floor: naive bytes / copy bandwidth", "ms": floor_ms},
        {**common, "method": "floor: tiered misses / copy bandwidth", "ms": tiered_floor_ms, "rows_moved_per_step": moved},
    ]


def hash_rates(n: int, device: torch.device, args) -> list[dict]:
    """Per-step costs at table size ``n``: insert a batch of n/100 new keys, look up n keys (all present)."""
    gen = torch.Generator().manual_seed(2)
    batch = max(1, n // 100)
    reps = 1 + args.repeats
    pool = torch.randint(0, 2**62, (n + reps * batch + 1000,), generator=gen).unique()
    pool = pool[torch.randperm(pool.numel(), generator=gen)].to(device)
    keys, new = pool[:n], pool[n : n + reps * batch].view(reps, batch)
    probe = keys[torch.randint(0, n, (n,), generator=gen).to(device)]
    zeros = torch.zeros(n, dtype=torch.int64, device=device)
    out = []
    for name, table in (("hash table", IdHashTable(n + reps * batch, device)), ("sorted index", SortedIdIndex(n, device))):
        table.insert(keys, None, zeros)
        # each timed insert adds a fresh batch (the table grows by n/100 per repeat); a sorted index merges it in
        out.append((name, "insert", batch, median_ms(lambda i, t=table: t.insert(new[i], None, zeros[:batch]), device, 1, args.repeats)))
        out.append((name, "lookup", n, median_ms(lambda _, t=table: t.lookup(probe, None), device, 1, args.repeats)))
    return [{"mode": "hash", "structure": st, "op": op, "table_keys": n, "keys": k, "ms": ms, "mkeys_per_s": k / ms / 1e3}
            for st, op, k, ms in out]  # fmt: skip


def uva_rates(device: torch.device, args) -> list[dict]:
    """GB/s of ``kernels.swap_rows`` moving rows of 3 x 256 floats (a d=256 row and its Adam moments) between
    a pinned host table and a device cache: loads only, write-backs only, both at once."""
    if device.type != "cuda" or not kernels.available(device):
        return []
    gen = torch.Generator().manual_seed(3)
    rows, cache, width = max(20_000, int(2_000_000 * args.scale)), max(4000, int(400_000 * args.scale)), 768
    n = cache * 7 // 20  # ~140K of 400K slots, as a 256/4000/256 tiered step
    host = torch.empty(rows, width, pin_memory=True).copy_(torch.randn(rows, width, device=device))
    dev = torch.randn(cache, width, device=device)
    slots = torch.randperm(cache, generator=gen)[:n].to(device)
    load = torch.randperm(rows, generator=gen)[:n].to(device)
    wb = torch.randperm(rows, generator=gen)[:n].to(device)
    out = []
    for warps, tile in ((4, 4096), (8, 4096), (8, 8192), (16, 16384)):
        for what, w, ld in (("load", None, load), ("write-back", wb, None), ("both", wb, load)):
            ms = median_ms(lambda _: kernels.swap_rows(dev, host, slots, w, ld, num_warps=warps, tile=tile), device, 2, args.repeats)
            nbytes = n * width * 4 * (2 if what == "both" else 1)
            out.append({"mode": "uva", "what": what, "num_warps": warps, "tile": tile, "rows": n, "row_bytes": width * 4,
                        "ms": ms, "gb_per_s": nbytes / ms / 1e6})  # fmt: skip
    return out


def _line(r: dict) -> str:
    if r["mode"] == "uva":
        what = f"swap {r['what']} (warps {r['num_warps']}, tile {r['tile']})"
        return f"{'uva':<5} {r['rows']:<16,} {what:<40} {r['ms']:>10.2f} {r['gb_per_s']:>9.1f} GB/s"
    if r["mode"] == "hash":
        what = f"{r['structure']} {r['op']} ({r['keys']:,} keys)"
        size = f"n={r['table_keys']:,}"
        return f"{'hash':<5} {size:<16} {what:<40} {r['ms']:>10.2f} {r['mkeys_per_s']:>9.1f} Mkey/s"
    ratio = f"{r['vs_lazy_adam']:.2f}x" if "vs_lazy_adam" in r else ""
    ratio_sparse = f"{r['vs_nn_sparse']:.2f}x" if "vs_nn_sparse" in r else ""
    if "ratio_limit" in r:
        limit = f"<= {r['ratio_limit']:.1f}x: {'pass' if r['pass_ratio'] else 'MISS'}"
        if "anchor_limit_ms" in r:
            limit += f"; <= {r['anchor_limit_ms']:.2f} ms: {'pass' if r['pass_anchor'] else 'MISS'}"
    elif "target_ms" in r:
        limit = f"<= {r['target_ms']:.0f} ms: {'pass' if r['pass_target'] else 'MISS'}"
    else:
        limit = ""
    shape = f"{r['bs']}/{r['L']}/{r['d']}"
    return f"{r['mode']:<5} {shape:<16} {r['method']:<40} {r['ms']:>10.2f} {ratio:>13} {ratio_sparse:>13}  {limit}".rstrip()


def _progress(rows: list[dict]) -> list[dict]:
    for r in rows:  # as they come (the table is printed again at the end)
        print("..", _line(r), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of each config's IDs and of --rows (CPU: 0.02)")
    p.add_argument("--rows", type=int, default=4_000_000, help="table rows in mode (a), host rows in mode (b), before --scale")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds (steps) before the timed ones")
    p.add_argument("--rounds", type=int, default=40, help="timed interleaved rounds of mode (a)")
    p.add_argument("--repeats", type=int, default=15, help="timed steps of mode (b) (interleaved), hash and uva")
    p.add_argument("--naive-repeats", type=int, default=3, help="timed steps of mode (b)'s naive path (the first rounds)")
    p.add_argument("--modes", default="a,b,hash,uva", help="a,b,hash,uva (uva: CUDA only)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--index", default="auto", help="tables' ID index: auto (by device) | sorted | hash")
    p.add_argument("--out", default="")
    p.add_argument("--profile", default="", help="directory for torch.profiler tables of the dynamic and tiered steps")
    p.add_argument("--trace", default="", help="comma-separated name prefixes (e.g. a-32,b-256) of profiled steps to trace too")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = max(1000, int(args.rows * args.scale))
    modes = set(args.modes.split(","))
    results: list[dict] = []
    bandwidth = copy_bandwidth(device) if "b" in modes else 0.0
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_model()}, {os.cpu_count()} cores"

    def save() -> None:  # after each part: a run cut short keeps what it measured
        if args.out:
            payload = {"benchmark": "sparse_embedding", "command": "python " + " ".join(sys.argv), "machine": machine,
                       "torch": torch.__version__, "date": datetime.date.today().isoformat(), "args": vars(args),
                       "copy_bandwidth_bytes_per_s": bandwidth, "rows": results}  # fmt: skip
            atomic_write_json(Path(args.out), payload)

    for bs0, l0, dim in CONFIGS:
        bs, length = scaled(bs0, l0, args.scale)
        lazy_ms = None
        if "a" in modes:
            results += _progress(mode_a(bs, length, dim, rows, device, args))
            lazy_ms = results[-1]["ms"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "b" in modes:
            results += _progress(mode_b(bs, length, dim, rows, device, args, bandwidth, lazy_ms))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    if "hash" in modes:
        results += _progress(hash_rates(max(10_000, int(4_000_000 * args.scale)), device, args))
        save()
    if "uva" in modes:
        results += _progress(uva_rates(device, args))
    print(f"# {machine}; torch {torch.__version__}; rows {rows:,}; copy bandwidth {bandwidth / 1e9:.2f} GB/s (H2D+D2H)")
    print(f"{'mode':<5} {'bs/L/d':<16} {'method':<40} {'ms':>10} {'vs lazy Adam':>13} {'vs nn.sparse':>13}  limit (issue 5)")
    for r in results:
        print(_line(r))
    save()


if __name__ == "__main__":
    main()
