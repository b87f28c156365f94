"""HTTP load test of `recforge serve`: p50/p99 latency and requests/s at several request rates, cold vs warm caches.

Usage:
    python benchmarks/serve_load.py --out benchmarks/results/serve_load-cpu-2core.json
    python benchmarks/serve_load.py --device cuda --rates 50,100,200,400 --out benchmarks/results/serve_load-h100.json

Exports a randomly initialised ranking model (d=64, 2 HSTU blocks x 2 heads, MLP heads, 2
user features) with a 100,000-item vocabulary, starts `recforge serve` on loopback in a
subprocess (`--server-threads` torch threads), and drives POST /v1/rank with an open-loop
client: requests are sent at a fixed rate, at most `--max-in-flight` at once (a bounded
httpx.AsyncClient), for `--seconds` per rate. Each request: one user, a `--history`-event
history, `--candidates` candidates.

- cold: every request is a new user (a KV-cache miss: the whole history is computed).
- warm: the same users again with the same history and request time (the cached prefix is
  reused; only the candidates are computed).

Latency is measured from each request's scheduled send time to its response (so client-side
waiting for a free slot counts). Before the server starts, the same model is timed in-process
(``RankEngine.rank_encoded`` with a KV-cache pool, one thread, `--engine-requests` users, cold
then warm, medians) to separate the engine's time from HTTP and JSON overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from recforge.models import HSTUConfig, HSTUEncoder
from recforge.models.ranking import MultiTaskMLP, RankingModel, RankingPrefix, save_slices
from recforge.io import atomic_write_json
from _machine import cpu_model

NUM_ITEMS, DIM = 100_000, 64
ACTIONS = ["view", "click", "cart", "buy"]
VOCAB = {"item_ids": list(range(1, NUM_ITEMS + 1)), "action_column": "action", "actions": ACTIONS,
         "user_features": {"user_id": {"offset": 0, "values": [str(i) for i in range(1000)]},
                           "gender": {"offset": 1000, "values": ["f", "m"]}}}  # fmt: skip


def returning_history(rng: np.random.Generator, events: list | None, history: int) -> list:
    """A returning user's [items, timestamps, actions] for their next request: ``events`` (None: a new user
    with ``history`` - 40 events) grown by 0-2 events, up to ``history``. Extends ``events`` in place."""
    if events is None:
        n = history - 40
        events = [rng.integers(1, NUM_ITEMS + 1, n).tolist(), (1_700_000_000 + np.cumsum(rng.integers(1, 600, n))).tolist(),
                  [ACTIONS[a] for a in rng.integers(0, len(ACTIONS), n)]]  # fmt: skip
    if len(events[0]) < history:
        for _ in range(int(rng.integers(0, 3))):
            events[0].append(int(rng.integers(1, NUM_ITEMS + 1)))
            events[1].append(events[1][-1] + int(rng.integers(1, 600)))
            events[2].append(ACTIONS[int(rng.integers(len(ACTIONS)))])
    return events


def export_model(out: Path, max_len: int, kernel: str = "auto") -> Path:
    torch.manual_seed(0)
    model = RankingModel(
        RankingPrefix(NUM_ITEMS, len(ACTIONS), 1010, DIM),
        HSTUEncoder(HSTUConfig(dim=DIM, num_blocks=2, num_heads=2, dqk=32, dv=32, dropout=0.0, max_seq_len=max_len,
                               kernel=kernel)),
        MultiTaskMLP(DIM, 2, hidden=128),
    )
    vocab = VOCAB
    extra = {"step": 0, "action_encoding": "sum", "max_seq_len": max_len, "num_contextual": 2,
             "user_features": ["user_id", "gender"]}  # fmt: skip
    tasks = [{"name": "click", "kind": "binary"}, {"name": "buy", "kind": "binary"}]
    save_slices(model, out / "model", tasks=tasks, extra=extra, json_files={"vocab.json": vocab})
    return out


def make_body(user: int, events: int, candidates: int, rng: np.random.Generator) -> dict:
    ts = (1_700_000_000 + np.cumsum(rng.integers(1, 3600, events))).tolist()
    return {
        "user_id": f"user{user}",
        "history": {"items": rng.integers(1, NUM_ITEMS + 1, events).tolist(), "timestamps": ts,
                    "actions": [ACTIONS[a] for a in rng.integers(0, len(ACTIONS), events)]},
        "candidates": rng.integers(1, NUM_ITEMS + 1, candidates).tolist(),
        "user_features": {"user_id": str(user % 1000), "gender": "f"},
        "timestamp": (ts[-1] if ts else 1_700_000_000) + 60,
    }  # fmt: skip


async def drive(url: str, bodies: list[dict], rate: float, max_in_flight: int) -> dict:
    """Send ``bodies`` at ``rate`` per second (open loop, bounded in-flight); latency percentiles."""
    latencies, errors, cached = [], 0, 0
    slots = asyncio.Semaphore(max_in_flight)
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:

        async def one(body: dict, scheduled: float) -> None:
            nonlocal errors, cached
            async with slots:
                try:
                    response = await client.post("/v1/rank", json=body)
                except httpx.TransportError:  # a dropped connection is a failed request, not a crash
                    errors += 1
                    return
            if response.status_code != 200:
                errors += 1
                return
            cached += response.json()["cached_tokens"] > 0
            latencies.append(time.perf_counter() - scheduled)

        start = time.perf_counter()
        tasks = []
        for i, body in enumerate(bodies):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(body, scheduled)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    lat = np.array(latencies) * 1e3
    return {
        "offered_rps": rate, "requests": len(bodies), "errors": errors, "achieved_rps": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else float("nan"),
        "mean_ms": float(lat.mean()) if lat.size else float("nan"), "cache_hits": cached,
    }  # fmt: skip


def engine_latency(run: Path, bodies: list[dict], config) -> dict:
    """Median in-process latency (ms) of cold (first) and warm (repeated) requests."""
    import statistics

    from recforge.serve.engine import RankEngine
    from recforge.serve.kv_pool import KVCachePool, PoolConfig

    engine = RankEngine.from_run(run, config)
    engine.pool = KVCachePool.for_engine(engine, PoolConfig(device_mb=1024))
    reqs = [engine.encode(b["user_id"], b["history"], b["candidates"], user_features=b["user_features"],
                          timestamp=b["timestamp"]) for b in bodies]  # fmt: skip
    out = {}
    for phase in ("cold", "warm"):
        times = []
        for req in reqs:
            t0 = time.perf_counter()
            engine.rank_encoded(req)
            times.append(time.perf_counter() - t0)
        out[f"engine_{phase}_ms"] = statistics.median(times) * 1e3
    return out


def wait_until_up(url: str, log_path: Path, tries: int = 600) -> None:
    """Poll ``url``/health until it answers 200 (~60 s); exit with the server log's tail if it never does."""
    for _ in range(tries):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    sys.exit(f"server did not start: {log_path.read_text()[-2000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="5,10,20,40", help="offered request rates (requests/s)")
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each rate")
    parser.add_argument("--history", type=int, default=500, help="events per request")
    parser.add_argument("--candidates", type=int, default=200)
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kernel", default="auto", choices=("auto", "triton", "pytorch"),
                        help="the served model's attention kernel (auto: Triton on CUDA)")
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    parser.add_argument("--engine-requests", type=int, default=50, help="users timed in-process (0: skip)")
    parser.add_argument("--cuda-graphs", type=int, default=32, help="recforge serve --cuda-graphs (0: eager)")
    parser.add_argument("--http-workers", type=int, default=0,
                        help="recforge serve --http-workers: front-end processes before one engine process (0: one process)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        run = export_model(Path(tmp) / "run", max_len=max(512, args.history + 8), kernel=args.kernel)
        in_process = {}
        if args.engine_requests:
            from recforge.serve.engine import EngineConfig

            torch.set_num_threads(args.server_threads)
            rng = np.random.default_rng(1)
            config = EngineConfig(device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs)
            in_process = engine_latency(run, [make_body(2 * 10**6 + i, args.history, args.candidates, rng)
                                              for i in range(args.engine_requests)], config)  # fmt: skip
            print(f"in-process engine: cold {in_process['engine_cold_ms']:.1f} ms, warm {in_process['engine_warm_ms']:.1f} ms "
                  f"(median of {args.engine_requests} users)", flush=True)  # fmt: skip
        port = free_port()
        cmd = [sys.executable, "-m", "recforge.cli", "serve", str(run), "--port", str(port), "--device", args.device,
               "--dtype", args.dtype, "--threads", str(args.server_threads), "--token-budget", str(args.token_budget),
               "--max-wait-ms", str(args.max_wait_ms), "--max-history", str(args.history), "--cache-mb", "1024",
               "--cuda-graphs", str(args.cuda_graphs), "--http-workers", str(args.http_workers)]  # fmt: skip
        # the server's output goes to a file: an unread pipe would fill and stall the server
        log_path = Path(tmp) / "server.log"
        server_log = log_path.open("w")
        server = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_up(url, log_path)
            rng = np.random.default_rng(0)
            asyncio.run(drive(url, [make_body(10**6 + i, args.history, args.candidates, rng) for i in range(20)], 20, 8))
            rows, next_user = [], 0
            for rate in rates:
                count = max(1, int(rate * args.seconds))
                bodies = [make_body(next_user + i, args.history, args.candidates, rng) for i in range(count)]
                next_user += count
                for phase in ("cold", "warm"):  # warm: the same users, histories and request times again
                    row = {"cache": phase, **asyncio.run(drive(url, bodies, rate, args.max_in_flight))}
                    rows.append(row)
                    print(f"{phase:<5} offered {rate:>6.1f}/s  achieved {row['achieved_rps']:>7.1f}/s  "
                          f"p50 {row['p50_ms']:>8.1f} ms  p99 {row['p99_ms']:>8.1f} ms  errors {row['errors']}  "
                          f"cache hits {row['cache_hits']}/{row['requests']}", flush=True)  # fmt: skip
            metrics = httpx.get(f"{url}/metrics").text
            health = httpx.get(f"{url}/health").json()
        except Exception:
            print(f"server output (last 3000 characters):\n{log_path.read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            server.terminate()
            server.wait(timeout=30)
            server_log.close()
    machine = (f"{cpu_model()}, {os.cpu_count()} cores, server {args.server_threads} torch thread(s)"
               if args.device == "cpu" else torch.cuda.get_device_name())  # fmt: skip
    graphs = f", CUDA graphs {health['cuda_graphs']}" if health.get("cuda_graphs") else ""
    print(f"\nrecforge serve under an open-loop client on loopback, {machine}, {args.dtype}, torch {torch.__version__}{graphs}")
    print(f"request: {args.history}-event history, {args.candidates} candidates; token budget {args.token_budget}, "
          f"max wait {args.max_wait_ms} ms; at most {args.max_in_flight} requests in flight; "
          f"{args.http_workers or 'no'} HTTP front-end processes")  # fmt: skip
    print(f"{'cache':<6}{'offered/s':>10}{'achieved/s':>12}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}{'hits':>8}")
    for r in rows:
        print(f"{r['cache']:<6}{r['offered_rps']:>10.1f}{r['achieved_rps']:>12.1f}{r['p50_ms']:>10.1f}{r['p99_ms']:>10.1f}"
              f"{r['errors']:>8}{r['cache_hits']:>8}")  # fmt: skip
    if in_process:
        print(f"in-process engine (no HTTP): cold {in_process['engine_cold_ms']:.1f} ms, warm "
              f"{in_process['engine_warm_ms']:.1f} ms median per request")  # fmt: skip
    print(f"server cache report: hit rate {health['kv_cache']['hit_rate']:.3f}, token hit rate "
          f"{health['kv_cache']['token_hit_rate']:.3f}; 1-min load average at start {load_at_start:.2f}")  # fmt: skip
    if args.out:
        batch_lines = [line for line in metrics.splitlines() if line.startswith("recforge_batch_requests_")]
        payload = {"benchmark": "serve_load", "command": "python " + " ".join(sys.argv), "machine": machine,
                   "dtype": args.dtype, "http_workers": args.http_workers, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                   "load_average_1m_at_start": load_at_start, "in_process": in_process, "rows": rows,
                   "kv_cache": health["kv_cache"], "cuda_graphs": health.get("cuda_graphs"),
                   "batch_requests_histogram": batch_lines}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), payload)


if __name__ == "__main__":
    main()
