"""`recforge serve` past saturation: goodput, hung requests, memory and recovery under 2x the saturating rate.

Usage (the client needs aiohttp: pip install -e '.[bench]'):
    python benchmarks/serve_overload.py --out benchmarks/results/serve_overload-cpu.json
    python benchmarks/serve_overload.py --device cuda --client-procs 8 --out benchmarks/results/serve_overload-h200.json
    python benchmarks/serve_overload.py --device cuda --server-cpus 0-7 --client-procs 8 --concurrency 64 --users 400 \
        --http-workers 0,4 --out benchmarks/results/serve_overload-h200-frontends.json

``--http-workers 0,4`` runs every phase once per value, each against a fresh server, and prints them side by
side: 0 is one process (HTTP and the batching worker share the GIL), N >= 1 is N front-end processes and
one engine process (``recforge serve --http-workers N``). The server's RSS is that of all its processes.

Exports the randomly initialised ranking model of ``serve_load.py`` (d=64, 2 HSTU blocks, 100,000
items), starts `recforge serve` on loopback in a subprocess and drives POST /v1/rank from
``--client-procs`` client processes. Users return: each request extends its user's history by
0-2 events (so the KV cache serves most of the prefix, as in production), 1 request in 10 is a
new user. Phases, one after the other against the same server:

1. saturation: a closed loop of ``--concurrency`` clients for ``--saturation-seconds``; the
   saturating rate R = answered (200) requests per second.
2. baseline: open loop at 0.5 R; its p99 is the "normal" p99.
3. burst: open loop at ``--overload`` x R (default 2) for ``--burst-seconds`` (default 60).
   Goodput = requests answered 200 within their deadline, per second; its ratio to R is the
   figure of merit (goal >= 0.9). A request with no answer ``--grace-s`` after its deadline is
   *hung* (goal: 0). The server's RSS is sampled every 0.5 s throughout.
4. recovery: open loop at 0.5 R; the time from the burst's end until a 1-second window's p99
   is back within 1.5x the baseline p99 (goal <= 5 s).
5. saturation after: the closed loop of phase 1 again, on the cache state the burst left (the
   recovery phase adds few users). The goodput ratio is also reported against this rate R'. R
   stays the headline: phase 1 runs on a filling cache (the first visit of every returning user is
   a miss, but the device tier is not yet full), while the burst runs on a full one (every new
   user evicts one to the host tier, and host hits are copied back); R' says how much of the gap
   is the cache state rather than overload itself. ``--warm-users`` first sends one request per
   returning user (before the warm-up), so phase 1 no longer pays their first visits; it still
   does not fill the cache with the burst's one-time users.

After each phase the engine's cumulative counters (``/health`` ``counters`` and ``kv_cache``) are
read and differenced, and a table says where the engine's time went: the batching worker's CPU,
engine-pass and idle shares of wall time, the I/O thread's busy and CPU shares and its decode time
per rank message (front-end processes only), requests and tokens per engine pass, 503s sent by the
front ends (shed before reading the body) and by the engine, and KV-cache lookups by outcome.
``--py-spy PREFIX`` also records the engine process's stacks during phases 1 and 3 (py-spy must
be installed; it reads the process from outside). ``--server-src DIR`` runs the server from
another source tree (``git worktree add /tmp/old COMMIT``) with this client, for before/after
comparisons; a server without the counters prints none.

Every request carries the server's default deadline (``--deadline-ms``). Latency counts from the
moment the client sends a request; the client's lag behind its schedule is reported apart
("lag ms", p99), and "sent/s" says whether the clients kept up with the offered rate.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp  # the load generator (httpx's pool fell behind a 1,500 requests/s schedule: client-side "hangs")
import httpx
import numpy as np
import torch

from _machine import cpu_model
from serve_load import NUM_ITEMS, export_model, free_port, returning_history, wait_until_up
from recforge.io import atomic_write_json


def rss_mb(pid: int) -> float:
    """RSS of ``pid`` and all its descendants (the multi-process server's engine and front ends)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier and child not in tree]
        tree.update(frontier)
    total = 0.0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total if total else float("nan")


class Users:
    """Returning users whose histories grow by a few events per request (one client process's share)."""

    def __init__(self, first: int, count: int, history: int, candidates: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.first, self.count, self.history, self.candidates = first, count, history, candidates
        self.items: dict[int, list] = {}
        self.next_new = first + count

    def body(self, user: int | None = None) -> bytes:
        """The next request: of ``user``, else of a new user (1 in 10) or a random returning one."""
        rng = self.rng
        if user is not None:
            pass
        elif rng.random() < 0.1:
            user = self.next_new
            self.next_new += 1
        else:
            user = self.first + int(rng.integers(self.count))
        events = self.items[user] = returning_history(rng, self.items.get(user), self.history)
        body = {"user_id": f"user{user}", "history": {"items": events[0], "timestamps": events[1], "actions": events[2]},
                "candidates": rng.integers(1, NUM_ITEMS + 1, self.candidates).tolist(),
                "user_features": {"user_id": str(user % 1000), "gender": "f"}, "timestamp": events[1][-1] + 60}  # fmt: skip
        return json.dumps(body).encode()


async def _send(client: aiohttp.ClientSession, body: bytes, scheduled: float, timeout: float, out: list) -> int:
    sent = time.perf_counter()  # latency counts from here: a client that falls behind its schedule is not the server's
    try:
        async with client.post("/v1/rank", data=body, headers={"content-type": "application/json"},
                               timeout=aiohttp.ClientTimeout(total=timeout)) as response:  # fmt: skip
            await response.read()
            status = response.status
    except TimeoutError:
        status = -1  # no answer by deadline + grace: hung
    except aiohttp.ClientError:
        status = -2
    out.append((sent, time.perf_counter() - sent, status, sent - scheduled))
    return status


async def _open_loop(url: str, bodies: list[bytes], rate: float, timeout: float) -> list:
    """Send ``bodies`` (made beforehand, so the client's own work is small) at ``rate`` per second."""
    out: list = []
    async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=4096)) as client:
        tasks, t0 = [], time.perf_counter()
        for i, body in enumerate(bodies):
            scheduled = t0 + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(client, body, scheduled, timeout, out)))
        await asyncio.gather(*tasks)
    return out


async def _closed_loop(url: str, users: Users, concurrency: int, seconds: float, timeout: float,
                       every_user: bool = False) -> list:  # fmt: skip
    """``concurrency`` clients back to back for ``seconds``; ``every_user``: instead, one request per returning
    user (the cache pre-fill of ``--warm-users``)."""
    out: list = []
    end = time.perf_counter() + seconds
    todo = list(range(users.first, users.first + users.count)) if every_user else None
    async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=concurrency)) as client:

        async def worker() -> None:
            while (todo if every_user else time.perf_counter() < end):
                body = users.body(todo.pop()) if every_user else users.body()
                if await _send(client, body, time.perf_counter(), timeout, out) == 503:
                    await asyncio.sleep(CLOSED_LOOP_BACKOFF_S)  # a refused client backs off instead of spinning

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


# A closed-loop client refused with 503 waits this long before its next request. Without it a refused client
# resends at once: a one-process server then spends its event loop (and the GIL its batching worker needs)
# refusing thousands of requests per second, and the "saturating rate" measured that way is a fraction of
# what the server sustains (2-core CPU: 25 answered/s beside 1,000 refusals/s).
CLOSED_LOOP_BACKOFF_S = 0.05

_USERS: dict[int, Users] = {}  # per client process: users keep their histories from phase to phase


def _client(args: tuple) -> list:
    """One client process: its own users, one phase (open or closed loop); returns (sent, latency, status) rows."""
    url, proc, kind, rate_or_conc, seconds, timeout, start_at, opts = args
    if proc not in _USERS:
        _USERS[proc] = Users(proc * 10**7, opts["users"], opts["history"], opts["candidates"], seed=proc)
    if kind in ("closed", "prefill"):
        time.sleep(max(0.0, start_at - time.time()))
        return asyncio.run(_closed_loop(url, _USERS[proc], int(rate_or_conc), seconds, timeout, kind == "prefill"))
    bodies = [_USERS[proc].body() for _ in range(int(rate_or_conc * seconds))]
    time.sleep(max(0.0, start_at - time.time()))
    return asyncio.run(_open_loop(url, bodies, rate_or_conc, timeout))


def run_phase(pool, url: str, procs: int, kind: str, value: float, seconds: float, timeout: float, opts: dict) -> list:
    start_at = time.time() + 0.5 + (value * seconds / procs) * 3e-4 * (kind == "open")  # after the bodies are made
    per = value / procs if kind == "open" else max(1, int(value // procs))
    parts = pool.map(_client, [(url, p, kind, per, seconds, timeout, start_at, opts) for p in range(procs)], chunksize=1)
    return [row for part in parts for row in part]


def engine_counters(url: str) -> dict | None:
    """The engine's cumulative counters and KV-cache statistics from /health (None from a server without them)."""
    report = httpx.get(f"{url}/health", timeout=30).json()
    counters = report.get("counters")
    return None if counters is None else {**counters, **{f"kv_{k}": v for k, v in (report.get("kv_cache") or {}).items()}}


def engine_phase(before: dict | None, after: dict | None, statuses: dict) -> dict | None:
    """Where the engine's time went during one phase (differences of two ``engine_counters`` readings): busy
    shares of the batching worker and of the I/O thread, engine passes, refusals, KV-cache lookups."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float)) and k in before}
    span, passes = max(d["t"], 1e-9), max(d["passes"], 1)
    lookups = max(d.get("kv_lookups", 0), 1)
    refused_engine = d["refused"]
    out = {"seconds": span, "worker_cpu_share": d["worker_cpu_s"] / span, "worker_pass_share": d["pass_s"] / span,
           "worker_idle_share": d["idle_s"] / span, "worker_batch_wait_share": d["batch_wait_s"] / span,
           "passes_per_s": d["passes"] / span, "requests_per_pass": d["pass_requests"] / passes,
           "tokens_per_pass": d["pass_tokens"] / passes, "ms_per_pass": d["pass_s"] / passes * 1e3,
           "admitted": d["admitted"], "refused_engine": refused_engine,
           "refused_frontend": max(statuses.get("503", 0) - refused_engine, 0),
           "kv_lookups": d.get("kv_lookups", 0)}  # fmt: skip
    for key in ("device_hits", "host_hits", "misses", "stale", "evicted_to_host", "dropped"):
        out[f"kv_{key}_per_lookup"] = d.get(f"kv_{key}", 0) / lookups
    if "io_busy_s" in d:  # front-end processes: the engine's I/O thread
        out.update({"io_busy_share": d["io_busy_s"] / span, "io_cpu_share": d["io_cpu_s"] / span,
                    "io_rank_messages": d["io_rank_messages"], "io_refused_before_decode": d["io_refused_before_decode"],
                    "io_refused_at_submit": d["io_refused_at_submit"],
                    "io_decode_us_per_message": d["io_decode_s"] / max(d["io_rank_messages"], 1) * 1e6})  # fmt: skip
    return out


def print_engine(name: str, e: dict | None) -> None:
    if e is None:
        print(f"{name:<15}(the server reports no engine counters)")
        return
    io = (f"{e['io_busy_share']:>6.2f}{e['io_cpu_share']:>6.2f}{e['io_decode_us_per_message']:>7.0f}"
          if "io_busy_share" in e else f"{'-':>6}{'-':>6}{'-':>7}")  # fmt: skip
    print(f"{name:<15}{e['worker_cpu_share']:>6.2f}{e['worker_pass_share']:>6.2f}{e['worker_idle_share']:>6.2f}{io}"
          f"{e['requests_per_pass']:>7.1f}{e['tokens_per_pass']:>8.0f}{e['ms_per_pass']:>7.1f}{e['refused_frontend']:>8}"
          f"{e['refused_engine']:>8}{e['kv_device_hits_per_lookup']:>6.2f}{e['kv_host_hits_per_lookup']:>6.2f}"
          f"{e['kv_misses_per_lookup']:>6.2f}{e['kv_stale_per_lookup']:>6.2f}{e['kv_evicted_to_host_per_lookup']:>6.2f}")  # fmt: skip


def py_spy(args: argparse.Namespace, url: str, server_pid: int, http_workers: int, phase: str, seconds: float):
    """Start py-spy on the engine process (the server itself when it is one process) for ``seconds``, or None."""
    if not args.py_spy:
        return None
    pid = httpx.get(f"{url}/health", timeout=30).json().get("frontend", {}).get("engine_pid") or server_pid
    out = f"{args.py_spy}-{http_workers}-{phase}.txt"
    cmd = ["py-spy", "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "250", "--format",
           "raw", "--threads", "--nonblocking", "--output", out]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize(rows: list, seconds: float, deadline_s: float) -> dict:
    lat = np.array([r[1] for r in rows]) if rows else np.zeros(0)
    status = np.array([r[2] for r in rows]) if rows else np.zeros(0, dtype=int)
    ok = status == 200
    good = ok & (lat <= deadline_s)
    counts = {str(s): int((status == s).sum()) for s in sorted(set(status.tolist()))}
    return {"sent": len(rows), "statuses": counts, "answered_rps": ok.sum() / seconds, "goodput_rps": good.sum() / seconds,
            "hung": int((status == -1).sum()), "transport_errors": int((status == -2).sum()),
            "sent_rps": len(rows) / seconds, "client_lag_p99_ms": float(np.percentile([r[3] for r in rows], 99) * 1e3) if rows else 0.0,
            "p50_ms": float(np.percentile(lat[ok], 50) * 1e3) if ok.any() else float("nan"),
            "p99_ms": float(np.percentile(lat[ok], 99) * 1e3) if ok.any() else float("nan")}  # fmt: skip


def server_latency(url: str) -> dict[float, float]:
    """The server's own POST /v1/rank latency histogram (cumulative counts by upper bound, seconds)."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("recforge_rank_latency_seconds_bucket"):
            bound = line.split('le="')[1].split('"')[0]
            out[float("inf") if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile(before: dict, after: dict, q: float) -> float:
    """Upper bound (ms) of the bucket holding quantile ``q`` of the observations between two scrapes."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    for bound, count in zip(bounds, counts):
        if total and count >= q * total:
            return bound * 1e3
    return float("nan")


def window_p99(rows: list, t0: float, seconds: float) -> list[float]:
    """p99 (ms) of answered requests per 1-second window of send time after ``t0``."""
    out = []
    for w in range(int(seconds)):
        lat = [r[1] for r in rows if r[2] == 200 and t0 + w <= r[0] < t0 + w + 1]
        out.append(float(np.percentile(lat, 99) * 1e3) if lat else float("nan"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--server-cpus", default=None, help="taskset CPU list for the server (e.g. 0-3): clients keep the rest")
    parser.add_argument("--history", type=int, default=500)
    parser.add_argument("--candidates", type=int, default=200)
    parser.add_argument("--users", type=int, default=200, help="returning users per client process")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop clients for the saturation phase")
    parser.add_argument("--saturation-seconds", type=float, default=15)
    parser.add_argument("--baseline-seconds", type=float, default=10)
    parser.add_argument("--burst-seconds", type=float, default=60)
    parser.add_argument("--recovery-seconds", type=float, default=10)
    parser.add_argument("--overload", type=float, default=2.0, help="burst rate as a multiple of the saturating rate")
    parser.add_argument("--deadline-ms", type=float, default=2000.0)
    parser.add_argument("--max-queue-ms", type=float, default=500.0)
    parser.add_argument("--grace-s", type=float, default=1.0)
    parser.add_argument("--gil-switch-ms", type=float, default=0.5, help="recforge serve --gil-switch-ms")
    parser.add_argument("--http-workers", default="0",
                        help="comma-separated recforge serve --http-workers values, one full run each (0: one process)")
    parser.add_argument("--warm-users", action="store_true",
                        help="before the warm-up, one request per returning user, so saturation is not measured on "
                             "their first (uncached) visits")  # fmt: skip
    parser.add_argument("--server-src", default=None,
                        help="run the server from this source tree (e.g. a `git worktree` of an older commit), for a "
                             "before/after comparison with the same client")  # fmt: skip
    parser.add_argument("--py-spy", default=None, metavar="PREFIX",
                        help="record the engine process with py-spy (installed separately) during the saturation and "
                             "burst phases: collapsed stacks in PREFIX-<workers>-<phase>.txt")  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    variants = [int(v) for v in args.http_workers.split(",")]
    results = [run_variant(args, workers) for workers in variants]
    if len(results) > 1:
        print(f"\n{'http workers':<14}{'saturation/s':>13}{'burst goodput/s':>16}{'ratio':>7}{'sat after/s':>12}"
              f"{'ratio':>7}{'hung':>6}{'burst p99 ms':>13}{'recovered s':>12}{'max RSS MB':>11}")  # fmt: skip
        for r in results:
            print(f"{r['http_workers']:<14}{r['saturation']['answered_rps']:>13.1f}{r['burst']['goodput_rps']:>16.1f}"
                  f"{r['goodput_ratio']:>7.2f}{r['saturation_after']['answered_rps']:>12.1f}{r['goodput_ratio_after']:>7.2f}"
                  f"{r['burst']['hung'] + r['recovery']['hung']:>6}{r['burst']['p99_ms']:>13.0f}"
                  f"{str(r['recovered_after_s']):>12}{r['rss_mb_max_burst'] or float('nan'):>11.0f}")  # fmt: skip
    if args.out:
        payload = {"benchmark": "serve_overload", "command": "python " + " ".join(sys.argv), "machine": results[0]["machine"],
                   "torch": torch.__version__, "date": datetime.date.today().isoformat(), "args": vars(args),
                   **(results[0] if len(results) == 1 else {"variants": results})}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), payload)


def run_variant(args: argparse.Namespace, http_workers: int) -> dict:
    """Every phase against a fresh server with ``http_workers`` front-end processes; prints and returns the results."""
    deadline_s, timeout = args.deadline_ms / 1e3, args.deadline_ms / 1e3 + args.grace_s
    opts = {"users": args.users, "history": args.history, "candidates": args.candidates}
    with tempfile.TemporaryDirectory() as tmp:
        run = export_model(Path(tmp) / "run", max_len=max(512, args.history + 8))
        port = free_port()
        cmd = [sys.executable, "-m", "recforge.cli", "serve", str(run), "--port", str(port), "--device", args.device,
               "--dtype", args.dtype, "--threads", str(args.server_threads), "--max-history", str(args.history + 10),
               "--cache-mb", "1024", "--request-timeout-ms", str(args.deadline_ms),
               "--max-queue-ms", str(args.max_queue_ms), "--gil-switch-ms", str(args.gil_switch_ms),
               "--http-workers", str(http_workers)]  # fmt: skip
        log_path = Path(tmp) / "server.log"
        server_log = log_path.open("w")
        if args.server_cpus:
            cmd = ["taskset", "-c", args.server_cpus, *cmd]
        env = dict(os.environ)
        if args.server_src:
            env["PYTHONPATH"] = os.pathsep.join([str(Path(args.server_src).resolve()), env.get("PYTHONPATH", "")])
        server = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        samples: list[tuple[float, float]] = []
        stop = threading.Event()
        try:
            wait_until_up(url, log_path)

            def sample() -> None:
                while not stop.is_set():
                    samples.append((time.time(), rss_mb(server.pid)))
                    stop.wait(0.5)

            threading.Thread(target=sample, daemon=True).start()
            ctx = mp.get_context("spawn")
            engine: dict[str, dict | None] = {}
            with ctx.Pool(args.client_procs) as pool:
                if args.warm_users:
                    run_phase(pool, url, args.client_procs, "prefill", args.concurrency, 0, timeout, opts)
                run_phase(pool, url, args.client_procs, "closed", args.concurrency, 3, timeout, opts)  # warm-up
                counters = engine_counters(url)
                spy = py_spy(args, url, server.pid, http_workers, "saturation", args.saturation_seconds - 2)
                sat_rows = run_phase(pool, url, args.client_procs, "closed", args.concurrency, args.saturation_seconds,
                                     timeout, opts)  # fmt: skip
                saturation = summarize(sat_rows, args.saturation_seconds, deadline_s)
                engine["saturation"], counters = engine_phase(counters, c := engine_counters(url), saturation["statuses"]), c
                rate = saturation["answered_rps"]
                print(f"saturation: {rate:.1f} answered/s (closed loop, {args.concurrency} clients), p99 "
                      f"{saturation['p99_ms']:.0f} ms, statuses {saturation['statuses']}", flush=True)  # fmt: skip
                base_rows = run_phase(pool, url, args.client_procs, "open", 0.5 * rate, args.baseline_seconds, timeout, opts)
                baseline = summarize(base_rows, args.baseline_seconds, deadline_s)
                engine["baseline"], counters = engine_phase(counters, c := engine_counters(url), baseline["statuses"]), c
                print(f"baseline 0.5x: p50 {baseline['p50_ms']:.0f} ms p99 {baseline['p99_ms']:.0f} ms {baseline['statuses']}",
                      flush=True)  # fmt: skip
                rss_before = samples[-1][1]
                hist_before = server_latency(url)
                burst_start = time.time()
                spy = py_spy(args, url, server.pid, http_workers, "burst", args.burst_seconds - 5) or spy
                burst_rows = run_phase(pool, url, args.client_procs, "open", args.overload * rate, args.burst_seconds,
                                       timeout, opts)  # fmt: skip
                burst = summarize(burst_rows, args.burst_seconds, deadline_s)
                burst_end = time.time()
                hist_after = server_latency(url)
                engine["burst"], counters = engine_phase(counters, c := engine_counters(url), burst["statuses"]), c
                burst["server_p50_ms_bucket"] = histogram_quantile(hist_before, hist_after, 0.5)
                burst["server_p99_ms_bucket"] = histogram_quantile(hist_before, hist_after, 0.99)
                print(f"burst {args.overload:g}x for {args.burst_seconds:g}s: goodput {burst['goodput_rps']:.1f}/s = "
                      f"{burst['goodput_rps'] / rate:.2f} of saturation, hung {burst['hung']}, {burst['statuses']}",
                      flush=True)  # fmt: skip
                rec_rows = run_phase(pool, url, args.client_procs, "open", 0.5 * rate, args.recovery_seconds, timeout, opts)
                recovery = summarize(rec_rows, args.recovery_seconds, deadline_s)
                engine["recovery"], counters = engine_phase(counters, c := engine_counters(url), recovery["statuses"]), c
                # saturation again, on the cache the burst left (the recovery phase adds few users): what the
                # engine can answer per second in the burst's cache state
                after_rows = run_phase(pool, url, args.client_procs, "closed", args.concurrency, args.saturation_seconds,
                                       timeout, opts)  # fmt: skip
                saturation_after = summarize(after_rows, args.saturation_seconds, deadline_s)
                engine["sat. after"] = engine_phase(counters, engine_counters(url), saturation_after["statuses"])
            rec_t0 = min(r[0] for r in rec_rows) if rec_rows else time.perf_counter()
            windows = window_p99(rec_rows, rec_t0, args.recovery_seconds)
            normal = 1.5 * baseline["p99_ms"]
            back = next((w for w, p in enumerate(windows) if p <= normal), None)
            health = httpx.get(f"{url}/health").json()
            if spy is not None:
                spy.wait(timeout=60)
        except Exception:
            print(f"server output (last 3000 characters):\n{log_path.read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            stop.set()
            server.terminate()
            server.wait(timeout=30)
            server_log.close()
    burst_rss = [m for t, m in samples if burst_start <= t <= burst_end]
    recovered_s = None if back is None else back + 1  # the first window at normal p99 ends this many seconds in
    machine = (f"{cpu_model()}, {os.cpu_count()} cores, server {args.server_threads} torch thread(s), "
               f"{args.client_procs} client process(es)" if args.device == "cpu" else torch.cuda.get_device_name())  # fmt: skip
    layout = "one process" if http_workers == 0 else f"{http_workers} HTTP front-end processes + one engine process"
    print(f"\nrecforge serve past saturation ({layout}), {machine}, {args.dtype}, torch {torch.__version__}")
    print(f"request: ~{args.history}-event returning histories (+0-2 events each), {args.candidates} candidates, deadline "
          f"{args.deadline_ms:g} ms, max_queue_ms {args.max_queue_ms:g}")  # fmt: skip
    print(f"{'phase':<12}{'offered/s':>10}{'sent/s':>8}{'answered/s':>11}{'goodput/s':>10}{'p50 ms':>8}{'p99 ms':>8}"
          f"{'hung':>6}{'lag ms':>8}  statuses")  # fmt: skip
    for name, offered, s in (("saturation", float("nan"), saturation), ("baseline", 0.5 * rate, baseline),
                             (f"burst {args.overload:g}x", args.overload * rate, burst), ("recovery", 0.5 * rate, recovery),
                             ("sat. after", float("nan"), saturation_after)):  # fmt: skip
        print(f"{name:<12}{offered:>10.1f}{s['sent_rps']:>8.1f}{s['answered_rps']:>11.1f}{s['goodput_rps']:>10.1f}"
              f"{s['p50_ms']:>8.0f}{s['p99_ms']:>8.0f}{s['hung']:>6}{s['client_lag_p99_ms']:>8.0f}  {s['statuses']}")  # fmt: skip
    print(f"burst, the server's own latency (arrival to answer, histogram bucket bounds): p50 <= "
          f"{burst['server_p50_ms_bucket']:.0f} ms, p99 <= {burst['server_p99_ms_bucket']:.0f} ms")  # fmt: skip
    rate_after = saturation_after["answered_rps"]
    print(f"goodput during the burst: {burst['goodput_rps'] / rate:.2f} x the saturating rate (goal >= 0.90), "
          f"{burst['goodput_rps'] / rate_after:.2f} x the saturating rate measured after the burst ({rate_after:.1f}/s); "
          f"hung {burst['hung'] + recovery['hung']} (goal 0)")  # fmt: skip
    print("\nengine, per phase: shares of wall time (worker CPU, worker in engine passes, worker idle; I/O thread busy, "
          "I/O thread CPU, its decode us per rank message), requests and tokens per pass, ms per pass, 503s from the "
          "front ends / the engine, KV-cache lookups that were device hits, host hits, misses, stale, evictions to host")
    print(f"{'phase':<15}{'wCPU':>6}{'wPass':>6}{'wIdle':>6}{'ioBsy':>6}{'ioCPU':>6}{'dec us':>7}{'req/p':>7}{'tok/p':>8}"
          f"{'ms/p':>7}{'503 fe':>8}{'503 en':>8}{'devH':>6}{'hostH':>6}{'miss':>6}{'stale':>6}{'evict':>6}")  # fmt: skip
    for name, e in engine.items():
        print_engine(name, e)
    print(f"server RSS: {rss_before:.0f} MB before the burst, max {max(burst_rss, default=float('nan')):.0f} MB during it, "
          f"{samples[-1][1]:.0f} MB at the end")  # fmt: skip
    print(f"recovery: 1-s window p99 after the burst {[None if p != p else round(p) for p in windows]} ms; back within 1.5x the baseline p99 "
          f"({normal:.0f} ms) after {recovered_s} s (goal <= 5)")  # fmt: skip
    return {"http_workers": http_workers, "machine": machine, "saturation": saturation, "baseline": baseline,
            "burst": burst, "recovery": recovery, "saturation_after": saturation_after,
            "goodput_ratio": burst["goodput_rps"] / rate, "goodput_ratio_after": burst["goodput_rps"] / rate_after,
            "engine": engine,
            "recovery_window_p99_ms": windows, "recovered_after_s": recovered_s, "rss_mb_before": rss_before,
            "rss_mb_max_burst": max(burst_rss, default=None), "rss_mb_end": samples[-1][1],
            "worker": health["worker"], "kv_cache": health["kv_cache"]}  # fmt: skip


if __name__ == "__main__":
    main()
