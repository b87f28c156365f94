"""``recforge serve --http-workers N``: one engine process and N HTTP front-end processes, vLLM-style.

    clients ──► host:port ──► front end 1 … N    HTTP, JSON, validation, encoding, shedding (frontend.py)
                                   │ ZeroMQ ipc, msgpack (transport.py): encoded requests, cancels, heartbeats
                                   ▼
                              engine process      model, KV pool, BatchRunner (engine_core.py)

On Linux every front end listens on its own SO_REUSEPORT socket bound to host:port, and the
kernel spreads new connections evenly over them; elsewhere they share one listening socket.

Why: in one process the HTTP event loop and the batching worker share one GIL, so past saturation
the loop cannot even read (and refuse) requests while the worker launches passes. Here the front
ends parse, validate, encode and refuse on their own cores; the engine process only batches.

This process (the supervisor) starts the engine, waits until its model is loaded, binds the port,
starts the front ends and then only watches them:

- SIGTERM / SIGINT: the front ends stop accepting and finish their requests in flight (uvicorn's
  graceful shutdown, ``drain_timeout_s`` + 1 s), then the engine drains and exits; whatever is
  still alive after ``drain_timeout_s`` + 5 s per stage is killed. Exit status 0.
- The engine process dies: the front ends answer 503 at once (they see its connection close) and
  the supervisor shuts the front ends down and exits with status 1 (no automatic restart: the KV
  cache and CUDA graphs are gone with it; let systemd / Kubernetes restart the server).
- A front end dies: everything is shut down the same way, exit status 1.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from multiprocessing.connection import wait
from pathlib import Path

from recforge.serve.transport import Endpoints

log = logging.getLogger(__name__)
SPAWN = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads


def default_http_workers(device: str, cpus: int | None = None) -> int:
    """``--http-workers auto``: on CUDA ``min(4, cores // 4)`` front ends, so parsing never shares the batching
    worker's GIL (0, in-process, with fewer than 4 cores: no core to spare for them); on CPU 0 (in-process: the
    model's own threads need the cores)."""
    if cpus is None:  # the cores this process may run on (taskset, cgroups), not the machine's
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(4, cpus // 4) if device.startswith("cuda") else 0


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening). ``reuse_port``: SO_REUSEPORT, so that each front
    end can bind its own socket to the same port and the kernel spreads new connections evenly over them (a
    shared accept socket hands most connections to whichever process happens to wake first)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {err}; pick another --port or stop what uses it") from None
    sock.set_inheritable(True)
    return sock


def reuse_port_supported() -> bool:
    """SO_REUSEPORT with load balancing over the listening sockets: Linux."""
    return sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


def serve_processes(run_dir: str, engine_config, config, http_workers: int, host: str = "127.0.0.1",
                    port: int = 8000, log_level: str = "warning", threads: int = 0, on_ready=None) -> int:  # fmt: skip
    """Run the server as processes (see the module docstring) until a signal or a death; the exit status.

    ``on_ready(port, engine_version)`` is called once the front ends are starting (``port`` is the bound one)."""
    if http_workers < 1:
        raise ValueError(f"http_workers must be >= 1 for the multi-process server, got {http_workers}")
    config.validate()
    workdir = tempfile.mkdtemp(prefix="recforge-serve-")
    endpoints, metrics_dir = Endpoints(workdir), Path(workdir) / "metrics"
    metrics_dir.mkdir()
    stop = _StopOnSignal()
    engine, frontends, sock = None, [], None
    try:
        ready, child_end = SPAWN.Pipe(duplex=False)
        engine = SPAWN.Process(target=_engine_main, name="recforge-engine", daemon=False,
                               args=(str(run_dir), engine_config, config, endpoints, child_end, threads, log_level))  # fmt: skip
        engine.start()
        child_end.close()
        version = _wait_ready(engine, ready, stop)
        if version is None:
            return 0 if stop.signum else 1
        # Linux: each front end listens on its own SO_REUSEPORT socket (this one only holds the port, never
        # listens, so it gets no connections); elsewhere they share this socket
        reuse = reuse_port_supported()
        sock = bind_socket(host, port, reuse_port=reuse)
        listen = (host, sock.getsockname()[1]) if reuse else sock
        frontends = [SPAWN.Process(target=_frontend_main, name=f"recforge-http-{i}", daemon=False,
                                   args=(listen, endpoints, config, str(metrics_dir), log_level))
                     for i in range(http_workers)]  # fmt: skip
        with _environ(PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)):  # before the child imports prometheus_client
            for proc in frontends:
                proc.start()
        if on_ready is not None:
            on_ready(sock.getsockname()[1], version)
        status = 0
        while not stop.signum:
            dead = [p for p in (engine, *frontends) if not p.is_alive()]
            if dead:
                for p in dead:
                    log.error("%s (pid %s) exited with status %s; shutting the server down", p.name, p.pid, p.exitcode)
                status = 1
                break
            wait([p.sentinel for p in (engine, *frontends)], timeout=0.5)
        return status
    finally:
        _shutdown(frontends, engine, config.scheduler.drain_timeout_s)
        stop.restore()
        if sock is not None:
            sock.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(engine, ready, stop: _StopOnSignal) -> str | None:
    """The engine's model version once it has loaded; None when it failed (logged) or a signal came first."""
    while not stop.signum:
        if ready.poll(0.2):
            try:
                message = ready.recv()
            except EOFError:
                message = ("error", "the engine process exited while loading")
            if message[0] == "ready":
                return message[1]
            log.error("engine process failed to start: %s", message[1])
            print(f"recforge serve: the engine process failed to start: {message[1]}", flush=True)
            return None
        if not engine.is_alive():
            print(f"recforge serve: the engine process exited with status {engine.exitcode} while loading", flush=True)
            return None
    return None


def _shutdown(frontends: list, engine, drain_s: float) -> None:
    """Front ends first (they finish their requests on the live engine), then the engine; each stage bounded."""
    for stage in (frontends, [engine] if engine is not None else []):
        live = [p for p in stage if p.is_alive()]
        for p in live:
            p.terminate()  # SIGTERM: graceful
        t0 = time.monotonic()
        deadline = time.monotonic() + drain_s + 5
        for p in live:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.error("%s (pid %s) did not stop within %.0f s; killing it", p.name, p.pid, drain_s + 5)
                p.kill()
                p.join(5)
        log.info("stopped %s in %.2f s", [p.name for p in live], time.monotonic() - t0)


class _StopOnSignal:
    """Records SIGTERM/SIGINT (the main loop then shuts down in order) instead of dying mid-way."""

    def __init__(self) -> None:
        self.signum = 0
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def _engine_main(run_dir, engine_config, config, endpoints, ready, threads: int, log_level: str) -> None:
    import threading

    logging.basicConfig(level=log_level.upper())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front ends drain first
    try:
        import torch

        from recforge.serve.engine import RankEngine
        from recforge.serve.engine_core import EngineCore

        if threads:
            torch.set_num_threads(threads)
        # the I/O thread must get the GIL between the worker's torch calls without waiting the default 5 ms
        sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)
        engine = RankEngine.from_run(run_dir, engine_config)
        core = EngineCore(engine, config, endpoints)
    except Exception as err:  # noqa: BLE001 - reported to the supervisor, which exits non-zero
        ready.send(("error", f"{type(err).__name__}: {err}"))
        raise SystemExit(1) from None
    ready.send(("ready", engine.version))
    ready.close()
    parent = os.getppid()
    threading.Thread(target=_stop_when_orphaned, args=(parent, stop), daemon=True).start()
    # what start-up made (the model, modules, imports) leaves the collector's generations: a full collection
    # no longer walks it while holding the GIL the batching worker needs (a reload unfreezes: the old model
    # must stay collectable)
    gc.freeze()
    core.froze_at_start = True
    core.serve(stop)


def _stop_when_orphaned(parent: int, stop) -> None:
    while not stop.wait(0.5):
        if os.getppid() != parent:
            stop.set()


@contextmanager
def _environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _frontend_main(listen, endpoints, config, metrics_dir: str, log_level: str) -> None:
    # prometheus_client picks its multiprocess mode when first imported, which unpickling ``config`` already did:
    # the variable came with the spawned interpreter's environment (``_environ``); check it did
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") == metrics_dir
    logging.basicConfig(level=log_level.upper())
    from recforge.serve.frontend import run_frontend

    sock = bind_socket(*listen, reuse_port=True) if isinstance(listen, tuple) else listen
    run_frontend(sock, endpoints, config, log_level)


__all__ = ["bind_socket", "default_http_workers", "reuse_port_supported", "serve_processes"]
