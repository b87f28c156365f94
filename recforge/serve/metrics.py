"""Prometheus metrics of the server, in two halves that may live in different processes.

- ``HttpMetrics``: what the HTTP layer sees (latency of answered rank requests, every response by path
  and status). With several front-end processes these use prometheus_client's multiprocess mode
  (``PROMETHEUS_MULTIPROC_DIR``, set by ``serve.procs`` before the front ends import it), so any front
  end's ``/metrics`` reports the sum over all of them.
- ``EngineMetrics``: what the batching worker sees (passes, tokens, queue depth, KV cache, drops); they
  live with the engine, whose text a front end appends to its own.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from recforge.serve.runner import BatchRunner

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
KNOWN_PATHS = ("/v1/rank", "/v1/reload", "/health", "/metrics", "/docs", "/openapi.json")


class HttpMetrics:
    """Latency and responses by status (``registry=None`` in multiprocess mode: values go to the shared files)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.latency = Histogram("recforge_rank_latency_seconds", "POST /v1/rank latency (answered requests)",
                                 buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.responses = Counter("recforge_http_responses", "HTTP responses by path and status (every response, "
                                 "the framework's own too)", ["path", "status"], registry=registry)  # fmt: skip
        self.requests = Counter("recforge_rank_requests", "POST /v1/rank responses by HTTP status", ["status"],
                                registry=registry)  # fmt: skip

    def on_status(self, path: str, status: int) -> None:
        self.responses.labels(path if path in KNOWN_PATHS else "other", str(status)).inc()
        if path == "/v1/rank":
            self.requests.labels(str(status)).inc()


class EngineMetrics:
    """Batch sizes, pass times, queue depth, KV-cache use and dropped requests of one ``BatchRunner``."""

    def __init__(self, runner: BatchRunner, registry: CollectorRegistry) -> None:
        self.batch_requests = Histogram("recforge_batch_requests", "requests per engine pass",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)  # fmt: skip
        self.batch_tokens = Histogram("recforge_batch_tokens", "query tokens per engine pass",
                                      buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=registry)  # fmt: skip
        self.pass_seconds = Histogram("recforge_pass_seconds", "engine pass time", buckets=LATENCY_BUCKETS,
                                      registry=registry)  # fmt: skip
        pool_value = lambda key: lambda: float(runner.engine.pool.report()[key]) if runner.engine.pool else 0.0  # noqa: E731
        for key, doc in (("hit_rate", "share of lookups whose cached prefix was reused"),
                         ("token_hit_rate", "share of prefix tokens reused from the cache"),
                         ("device_bytes_used", "KV-cache device tier bytes in use"),
                         ("host_bytes_used", "KV-cache host tier bytes in use"),
                         ("metadata_bytes", "KV-cache per-user metadata in host memory (tokens, keys)"),
                         ("users_device", "users cached on the device tier"),
                         ("users_host", "users cached on the host tier"),
                         ("users_protected", "device-tier users in the protected segment (slru: seen twice)"),
                         ("lookups", "KV-cache lookups since start"),
                         ("device_hits", "lookups found on the device tier since start"),
                         ("host_hits", "lookups found on the host tier (copied back) since start"),
                         ("misses", "lookups with nothing cached since start"),
                         ("stale", "lookups whose entry had nothing reusable since start"),
                         ("evicted_to_host", "entries moved from the device to the host tier since start"),
                         ("dropped", "entries dropped from the cache since start"),
                         ("ghost_admissions", "users cached again as protected after a drop (slru) since start")):  # fmt: skip
            Gauge(f"recforge_kv_cache_{key}", doc, registry=registry).set_function(pool_value(key))
        for key, doc in (("uploads", "host-to-device copies of engine-pass inputs since start"),
                         ("downloads", "device-to-host copies of engine-pass results since start"),
                         ("staging_waits", "waits for a staging buffer still in use by the device since start")):  # fmt: skip
            Gauge(f"recforge_engine_{key}", doc, registry=registry).set_function(
                lambda k=key: float(runner.engine.transfers.get(k, 0)))
        Gauge("recforge_rank_refused", "requests refused by admission control (503) since start",
              registry=registry).set_function(lambda: runner.counters["refused"])  # fmt: skip
        Gauge("recforge_queue_depth", "requests waiting or running", registry=registry).set_function(runner.pending)
        for reason in ("deadline", "cancelled"):
            Gauge(f"recforge_rank_dropped_{reason}", f"requests dropped unanswered ({reason})",
                  registry=registry).set_function(lambda r=reason: runner.dropped[r])  # fmt: skip
        Gauge("recforge_worker_restarts", "unexpected batch-worker errors survived",
              registry=registry).set_function(lambda: runner.restarts)  # fmt: skip
        runner.on_pass = self.on_pass

    def on_pass(self, requests: int, tokens: int, seconds: float) -> None:
        self.batch_requests.observe(requests)
        self.batch_tokens.observe(tokens)
        self.pass_seconds.observe(seconds)


__all__ = ["KNOWN_PATHS", "LATENCY_BUCKETS", "EngineMetrics", "HttpMetrics"]
