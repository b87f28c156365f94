"""KV-cache pool under churn: per-request pool overhead and recomputed tokens, the pool before and after kvburst.

Usage (``--before-src``: a source tree of the pool to compare with, e.g. the commit before the kvburst change):
    mkdir -p /tmp/before && git archive 05e4106 recforge | tar -x -C /tmp/before
    python benchmarks/serve_kv_churn.py --before-src /tmp/before --out benchmarks/results/serve_kv_churn-cpu.json
    python benchmarks/serve_kv_churn.py --device cuda --before-src /tmp/before --out benchmarks/results/serve_kv_churn-h200.json

No model runs: the pool path of a request alone (``CacheManager.acquire`` + ``release``, as the scheduler
calls them), with keys/values shaped like ``serve_overload.py``'s model (2 HSTU blocks x 2 heads of 32,
float32: 1 KiB per token) and its traffic: ``--users`` returning users with ~``--history``-event
histories, each request extends its user's history by 0-2 events, 1 in 10 is a new user (``--new``),
and ``--older`` of the requests are an earlier request of the user arriving late (front ends reorder
same-user requests). The device tier holds about a third of the returning users and the host tier
about as many again, so every new user evicts one to the host and host hits are promoted back.

The same request sequence runs through each variant, side by side:

- before: the pool of ``--before-src`` (at commit 05e4106: a late older request drops its user's
  newer entry and recomputes the whole prefix; each eviction allocates pinned host memory and reads the
  times back with a blocking copy; a host hit waits for its copy); left out without ``--before-src``.
- after: ``recforge.serve.kv_pool``: longest-prefix reuse (the older request reuses its prefix of the
  newer entry, read-only), a reused host page slab, asynchronous copies on the current stream.

Per variant: pool time per request (the acquire + release calls' wall time, p50/p99/mean; on CUDA a
final synchronisation is included in the total), prefix tokens the request must compute (what a
stale lookup costs the engine), and the pool's counters. The "compute" between acquire and release is
a stand-in (keys derived from the tokens, not timed) so that every reused prefix can be checked:
``--check-every`` requests compare their reused keys/values with what was written for those tokens
(any difference fails the run).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch

from _machine import cpu_model, write_result
from recforge.serve.cache_manager import CacheManager
from recforge.serve.kv_pool import KVCachePool, PoolConfig

LAYERS, HEADS, DQK, DV, CTX = 2, 2, 32, 32, 2


class _Before:
    """The old pool behind the current ``CacheManager``: its lookup is the old acquire (whole entry, dropped as
    stale unless it is a prefix of the request)."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def lookup(self, user, identity, num_contextual, capacity):
        state = self._pool.get(user, capacity)
        if state is not None and not state.is_prefix_of(_tokens(identity), num_contextual):
            self._pool.mark_stale(user)
            return None
        return state


def _pool_module(src: Path):
    """``recforge/serve/kv_pool.py`` of the tree ``src``, loaded beside the current package (its imports resolve
    to the current ``recforge``)."""
    path = src / "recforge" / "serve" / "kv_pool.py"
    if not path.is_file():
        raise SystemExit(f"--before-src {src}: no {path}; e.g. `git archive 05e4106 recforge | tar -x -C {src}`")
    spec = importlib.util.spec_from_file_location("kv_pool_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _tokens(identity: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(zip(("item_ids", "actions", "context_ids", "timestamps"), identity.unbind(1)))


def workload(args: argparse.Namespace) -> list[tuple[str, torch.Tensor]]:
    """(user, (n, 4) token identities) per request, as serve_overload's clients send them, plus late older ones."""
    rng = np.random.default_rng(args.seed)
    histories: dict[str, np.ndarray] = {}
    sent: dict[str, list[np.ndarray]] = {}
    out, next_new = [], 0
    for _ in range(args.requests):
        if rng.random() < args.new:
            user, next_new = f"new{next_new}", next_new + 1
        else:
            user = f"u{rng.integers(args.users)}"
        if sent.get(user) and rng.random() < args.older:
            back = sent[user][-int(rng.integers(1, min(4, len(sent[user])) + 1))]
            out.append((user, torch.from_numpy(back)))
            continue
        hist = histories.get(user)
        if hist is None:
            n = args.history - 40
            ctx = np.array([[0, 0, 1 + rng.integers(5), 0], [0, 0, 7, 0]])
            events = np.stack([rng.integers(1, 100_000, n), rng.integers(0, 4, n), np.zeros(n, np.int64),
                               1_700_000_000 + np.cumsum(rng.integers(1, 600, n))], 1)  # fmt: skip
            hist = np.concatenate([ctx, events]).astype(np.int64)
        if hist.shape[0] - CTX < args.history:
            k = int(rng.integers(0, 3))
            extra = np.stack([rng.integers(1, 100_000, k), rng.integers(0, 4, k), np.zeros(k, np.int64),
                              hist[-1, 3] + np.cumsum(rng.integers(1, 600, k))], 1)  # fmt: skip
            hist = np.concatenate([hist, extra.astype(np.int64)])
        histories[user] = hist
        sent.setdefault(user, []).append(hist)
        out.append((user, torch.from_numpy(hist)))
    return out


def stand_in(identity: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values of token i depending on tokens 0..i (a prefix sum of their identities), exact in float32."""
    mix = ((identity[:, 0] * 7 + identity[:, 1] * 3 + identity[:, 3] % 1000).cumsum(0) % 65_521).to(device)
    grid = torch.arange(LAYERS * HEADS * DQK, dtype=torch.float32, device=device).view(LAYERS, 1, HEADS, DQK)
    keys = mix.float().view(1, -1, 1, 1) + grid / 256  # (layers, n, H, Dqk)
    return keys, -keys[..., :DV]


def serve_request(cache: CacheManager, user: str, identity: torch.Tensor, device: torch.device, check: bool,
                  label: str) -> tuple[int, int, float]:
    """One request through the pool as the scheduler makes it: acquire the user's prefix, (optionally check
    that the reused keys/values/timestamps are this user's), write the rest, release. (tokens reused, tokens
    in all, seconds spent in the pool: acquire + release)."""
    t0 = time.perf_counter()
    state = cache.acquire(user, _tokens(identity), CTX)
    t1 = time.perf_counter()
    k, n = state.length, identity.shape[0]
    keys, values = stand_in(identity, device)
    if check and k:
        if device.type == "cuda":
            torch.cuda.synchronize()
        if not (torch.equal(state.keys[:, :k], keys[:, :k]) and torch.equal(state.values[:, :k], values[:, :k])
                and torch.equal(state.timestamps[:k].cpu(), identity[:k, 3])):  # fmt: skip
            raise SystemExit(f"{label} ({user}) reused {k} tokens whose keys/values are not theirs")
    state.keys[:, k:n], state.values[:, k:n] = keys[:, k:], values[:, k:]
    state.timestamps[k:n] = identity[k:, 3].to(device)
    state.tokens[k:n], state.length = identity[k:], n
    t2 = time.perf_counter()
    cache.release(user, state, k)
    return k, n, t1 - t0 + time.perf_counter() - t2


def run_variant(name: str, pool, requests: list, args: argparse.Namespace, device: torch.device) -> dict:
    cache = CacheManager(LAYERS, HEADS, DQK, DV, torch.float32, device, pool.version, pool)
    pool_s, computed, checked = [], 0, 0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t_start = time.perf_counter()
    for i, (user, identity) in enumerate(requests):
        check = bool(args.check_every) and i % args.check_every == 0
        k, n, pool_time = serve_request(cache, user, identity, device, check, label=f"{name}: request {i}")
        checked += check and k > 0
        computed += n - k
        pool_s.append(pool_time)
    sync()
    wall = time.perf_counter() - t_start
    ms = np.array(pool_s) * 1e3
    report = pool.report()
    return {"variant": name, "requests": len(requests), "pool_ms_mean": float(ms.mean()),
            "pool_ms_p50": float(np.percentile(ms, 50)), "pool_ms_p99": float(np.percentile(ms, 99)),
            "pool_s_total": float(ms.sum() / 1e3), "wall_s": wall, "computed_tokens_per_request": computed / len(requests),
            "checked": checked, "kv_cache": report}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--users", type=int, default=400)
    parser.add_argument("--history", type=int, default=500)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--new", type=float, default=0.1, help="share of requests from a new user")
    parser.add_argument("--older", type=float, default=0.1, help="share of requests that are an earlier one, late")
    parser.add_argument("--device-mb", type=float, default=64.0)
    parser.add_argument("--host-mb", type=float, default=64.0)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--check-every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the server's default is 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--before-src", type=Path, default=None,
                        help="a source tree (holding recforge/serve/kv_pool.py) whose pool runs as 'before'")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    requests = workload(args)
    config = PoolConfig(device_mb=args.device_mb, host_mb=args.host_mb, block_size=args.block_size)
    variants = {"after": lambda: KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, device, config)}
    if args.before_src is not None:
        before = _pool_module(args.before_src)
        variants = {"before": lambda: _Before(before.KVCachePool(LAYERS, HEADS, DQK, DV, torch.float32, device, config)),
                    **variants}  # fmt: skip
    results = []
    for name, make in variants.items():
        run_variant(name, make(), requests[: min(200, len(requests))], args, device)  # warm-up: allocator, kernels
        results.append(run_variant(name, make(), requests, args, device))
    print(f"{len(requests)} requests, {args.users} users (+{args.new:.0%} new, {args.older:.0%} late older ones), "
          f"~{args.history} events; device tier {args.device_mb} MB, host tier {args.host_mb} MB, on {device}")  # fmt: skip
    print(f"{'variant':8} {'pool ms mean':>12} {'p50':>7} {'p99':>7} {'wall s':>7} {'computed tok/req':>16} "
          f"{'dev hits':>8} {'host hits':>9} {'stale':>6} {'older':>6} {'dropped':>7}")  # fmt: skip
    for r in results:
        kv = r["kv_cache"]
        print(f"{r['variant']:8} {r['pool_ms_mean']:12.3f} {r['pool_ms_p50']:7.3f} {r['pool_ms_p99']:7.3f} {r['wall_s']:7.2f} "
              f"{r['computed_tokens_per_request']:16.1f} {kv['device_hits']:8} {kv['host_hits']:9} {kv['stale']:6} "
              f"{kv.get('older', 0):6} {kv['dropped']:7}")  # fmt: skip
    if args.out:
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
        doc = {"benchmark": "serve_kv_churn", "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine,
               "torch": torch.__version__, "date": datetime.date.today().isoformat(), "args": {k: str(v) for k, v in vars(args).items()},
               "variants": results}  # fmt: skip
        write_result(args.out, doc)


if __name__ == "__main__":
    main()
