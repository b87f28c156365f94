"""KV-cache pool eviction policy: lru vs slru on request traces of returning and one-time users, side by side.

Usage:
    python benchmarks/serve_kv_policy.py --out benchmarks/results/serve_kv_policy-cpu-2core.json
    python benchmarks/serve_kv_policy.py --device cuda --out benchmarks/results/serve_kv_policy-h200.json

No model runs: the pool path of a request alone (``CacheManager.acquire`` + ``release``, as the scheduler
calls them) with ``serve_kv_churn.py``'s keys/values (2 HSTU blocks x 2 heads of 32, float32: 1 KiB per
token) and stand-in compute, checked: ``--check-every`` requests compare their reused keys/values with
what was written for those tokens (any difference fails the run).

Traces (``MIXES``): returning users drawn with Zipf-like popularity (p(rank k) ~ k^-s; s=0 is
serve_overload's uniform draw), each request extending its user's history by 0-2 events, and a stream
of one-time users (a new user, never seen again), at a base share and, in burst mixes, at a higher share
for the middle third of the trace (a burst of new users). Every mix's request sequence runs through
each variant (``lru``, and ``slru`` at each ``--shares``) on a fresh pool. The first ``--warmup`` share
of each trace fills the cache and is not counted.

Per variant: device-hit and host-hit rate (lookups that reused a prefix from that tier), prefix tokens
computed per request (all requests, and returning users' alone; in burst mixes also during and after the
burst), pool time per request (acquire + release wall time: mean, p99; on CUDA a final synchronisation
is included in the total) and the pool's counters.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch

from _machine import cpu_model, write_result
from recforge.serve.cache_manager import CacheManager
from recforge.serve.kv_pool import KVCachePool, PoolConfig
from serve_kv_churn import DQK, DV, HEADS, LAYERS, serve_request

# name: (Zipf exponent of returning users, share of one-time users, share of one-time users during the burst or None)
MIXES = {
    "overload-uniform": (0.0, 0.1, None),  # serve_overload's clients
    "overload-uniform-burst": (0.0, 0.1, 0.5),
    "zipf0.8-10%new": (0.8, 0.1, None),
    "zipf0.8-30%new": (0.8, 0.3, None),
    "zipf0.8-burst": (0.8, 0.1, 0.6),
    "zipf1.1-burst": (1.1, 0.1, 0.6),
    "zipf0.8-returning-only": (0.8, 0.0, None),
}


def trace(mix: str, args: argparse.Namespace) -> list[tuple[str, torch.Tensor, bool, str]]:
    """(user, (n, 4) token identities, returning?, phase) per request."""
    s, new_share, burst_share = MIXES[mix]
    rng = np.random.default_rng(args.seed)
    popularity = 1.0 / np.arange(1, args.users + 1) ** s
    popularity /= popularity.sum()
    histories: dict[str, np.ndarray] = {}
    out, next_new = [], 0
    third = args.requests // 3
    for i in range(args.requests):
        phase = "before" if i < third else "burst" if i < 2 * third else "after"
        share = burst_share if burst_share is not None and phase == "burst" else new_share
        returning = rng.random() >= share
        if returning:
            user = f"u{rng.choice(args.users, p=popularity)}"
        else:
            user, next_new = f"once{next_new}", next_new + 1
        hist = histories.get(user)
        if hist is None:
            n = int(rng.integers(args.history // 2, args.history))
            ctx = np.array([[0, 0, 1 + rng.integers(5), 0], [0, 0, 7, 0]])
            events = np.stack([rng.integers(1, 100_000, n), rng.integers(0, 4, n), np.zeros(n, np.int64),
                               1_700_000_000 + np.cumsum(rng.integers(1, 600, n))], 1)  # fmt: skip
            hist = np.concatenate([ctx, events]).astype(np.int64)
        else:
            k = int(rng.integers(0, 3))
            extra = np.stack([rng.integers(1, 100_000, k), rng.integers(0, 4, k), np.zeros(k, np.int64),
                              hist[-1, 3] + np.cumsum(rng.integers(1, 600, k))], 1)  # fmt: skip
            hist = np.concatenate([hist, extra.astype(np.int64)])
        if returning:
            histories[user] = hist
        out.append((user, torch.from_numpy(hist), returning, phase if burst_share is not None else "all"))
    return out


def run(pool: KVCachePool, requests: list, args: argparse.Namespace, device: torch.device) -> dict:
    cache = CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, device, pool.version, pool)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warmup = int(args.warmup * len(requests))
    rows, stats = [], pool.stats
    sync()
    t_start = time.perf_counter()
    for i, (user, identity, returning, phase) in enumerate(requests):
        device_hits, host_hits = stats.device_hits, stats.host_hits
        k, n, pool_time = serve_request(cache, user, identity, device,
                                        check=bool(args.check_every and i % args.check_every == 0), label=f"request {i}")  # fmt: skip
        tier = "device" if stats.device_hits > device_hits else "host" if stats.host_hits > host_hits else "miss"
        if i >= warmup:
            rows.append((tier if k else "miss", n - k, returning, phase, pool_time))
    sync()
    wall = time.perf_counter() - t_start
    tiers = np.array([r[0] for r in rows])
    computed = np.array([r[1] for r in rows], dtype=np.float64)
    returning = np.array([r[2] for r in rows])
    phases = np.array([r[3] for r in rows])
    ms = np.array([r[4] for r in rows]) * 1e3
    out = {"requests": len(rows), "device_hit_rate": float((tiers == "device").mean()),
           "host_hit_rate": float((tiers == "host").mean()), "miss_rate": float((tiers == "miss").mean()),
           "returning_device_hit_rate": float((tiers[returning] == "device").mean()) if returning.any() else None,
           "computed_tokens_per_request": float(computed.mean()),
           "returning_computed_tokens_per_request": float(computed[returning].mean()) if returning.any() else None,
           "pool_ms_mean": float(ms.mean()), "pool_ms_p99": float(np.percentile(ms, 99)), "wall_s": wall}  # fmt: skip
    for phase in ("burst", "after"):
        if (phases == phase).any():
            mask = phases == phase
            out[f"{phase}_computed_tokens_per_request"] = float(computed[mask].mean())
            out[f"{phase}_returning_computed_tokens_per_request"] = float(computed[mask & returning].mean())
    out["kv_cache"] = pool.report()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, of {list(MIXES)}")
    parser.add_argument("--users", type=int, default=400, help="returning users")
    parser.add_argument("--history", type=int, default=300, help="most events of a history (new ones: half to all)")
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--warmup", type=float, default=0.2, help="share of each trace not counted")
    parser.add_argument("--device-mb", type=float, default=32.0, help="about 140 users of ~225 events")
    parser.add_argument("--host-mb", type=float, default=64.0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--shares", default="0.5,0.8", help="slru protected shares to run")
    parser.add_argument("--check-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the server's default is 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    variants = {"lru": ("lru", 0.8), **{f"slru-{s}": ("slru", float(s)) for s in args.shares.split(",")}}
    results = []
    print(f"{args.users} returning users, ~{args.history * 3 // 4} events; device tier {args.device_mb} MB, "
          f"host tier {args.host_mb} MB, on {device}; {args.requests} requests per mix, first {args.warmup:.0%} uncounted")  # fmt: skip
    print(f"{'mix':24} {'variant':9} {'dev hit':>8} {'host hit':>8} {'miss':>6} {'computed/req':>12} {'returning':>9} "
          f"{'burst':>7} {'after':>7} {'pool ms':>8} {'p99':>6}")  # fmt: skip
    for mix in args.mixes.split(","):
        requests = trace(mix, args)
        for name, (policy, share) in variants.items():
            config = PoolConfig(device_mb=args.device_mb, host_mb=args.host_mb, block_size=args.block_size,
                                policy=policy, protected_share=share)  # fmt: skip
            pool = KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, device, config)
            r = {"mix": mix, "variant": name, **run(pool, requests, args, device)}
            results.append(r)
            burst = r.get("burst_computed_tokens_per_request", float("nan"))
            after = r.get("after_computed_tokens_per_request", float("nan"))
            print(f"{mix:24} {name:9} {r['device_hit_rate']:8.3f} {r['host_hit_rate']:8.3f} {r['miss_rate']:6.3f} "
                  f"{r['computed_tokens_per_request']:12.1f} {r['returning_computed_tokens_per_request'] or 0:9.1f} "
                  f"{burst:7.1f} {after:7.1f} {r['pool_ms_mean']:8.3f} {r['pool_ms_p99']:6.2f}", flush=True)  # fmt: skip
    if args.out:
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
        doc = {"benchmark": "serve_kv_policy", "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine,
               "torch": torch.__version__, "date": datetime.date.today().isoformat(), "args": {k: str(v) for k, v in vars(args).items()},
               "mixes": {m: dict(zip(("zipf_s", "new_share", "burst_new_share"), MIXES[m])) for m in args.mixes.split(",")},
               "variants": results}  # fmt: skip
        write_result(args.out, doc)


if __name__ == "__main__":
    main()
