"""The multi-process server (``recforge serve --http-workers N``) for real: a supervisor, one engine process and
N front-end processes on loopback. Same scores as the in-process server, same-user concurrency across front
ends, /metrics summed over them, an engine that dies -> 503 at once and a non-zero exit, SIGTERM bounded."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.kv_pool import PoolConfig
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig, create_app
from _serve_helpers import build_model, export, random_history

pytestmark = pytest.mark.integration
HELPER = Path(__file__).with_name("_procs_server.py")
ENGINE = dict(max_candidates=50, max_history_events=500)
DRAIN_S = 2.0


class _Served:
    """``_procs_server.py`` in a subprocess (its own supervisor, engine and front ends)."""

    def __init__(self, run: Path, workers: int, log: Path, **fields) -> None:
        fields = {"max_loop_lag_ms": 60_000, "pool": {"device_mb": 1, "block_size": 16},
                  "scheduler": {"max_wait_ms": 1, "max_queue_ms": 60_000, "drain_timeout_s": DRAIN_S}, **fields}  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen([sys.executable, str(HELPER), str(run), str(workers), json.dumps(fields)],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready = [line for line in log.read_text().splitlines() if line.startswith("READY")]
            if ready:
                self.url = f"http://127.0.0.1:{ready[0].split()[1]}"
                break
            time.sleep(0.2)
        else:
            self.proc.kill()
            raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")
        for _ in range(300):  # the front ends start after the READY line
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the front ends did not come up:\n{log.read_text()[-3000:]}")

    def pids(self) -> tuple[int, int]:
        """(front end pid, engine pid); a front end knows the engine's pid from its first status message, which can
        come after /health first answers, so wait for it."""
        for _ in range(100):
            front = httpx.get(self.url + "/health", timeout=5).json()["frontend"]
            if front["engine_pid"] is not None:
                return front["pid"], front["engine_pid"]
            time.sleep(0.1)
        raise AssertionError(f"no engine pid in /health after 10 s: {front}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _body(user: str, hist: dict, rng: random.Random) -> dict:
    return {"user_id": user, "history": hist, "candidates": [1000 + rng.randrange(50) for _ in range(rng.randint(1, 6))],
            "user_features": {"gender": "f"}, "timestamp": (hist["timestamps"] or [0])[-1] + 7}  # fmt: skip


def _grow(hist: dict, rng: random.Random, n: int) -> dict:
    more = random_history(n, seed=rng.randrange(10_000), start=(hist["timestamps"] or [1_000_000])[-1])
    return {k: hist[k] + more[k] for k in hist}


@pytest.fixture
def run(tmp_path):
    return export(build_model(), tmp_path / "run")


def test_frontend_processes_answer_like_one_process_and_stop_on_sigterm(run, tmp_path) -> None:
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    served = _Served(run, 2, tmp_path / "log")
    try:
        local = RankEngine.from_run(run, EngineConfig(**ENGINE))
        config = ServerConfig(max_loop_lag_ms=60_000, pool=PoolConfig(device_mb=1, block_size=16),
                              scheduler=SchedulerConfig(max_wait_ms=1, max_queue_ms=60_000))  # fmt: skip
        hist = {u: random_history(rng.randint(0, 10), rng.randrange(1000)) for u in ("a", "b")}
        with TestClient(create_app(local, config)) as inproc:
            for _ in range(8):
                user = rng.choice(list(hist))
                hist[user] = _grow(hist[user], rng, rng.randint(0, 5))
                body = _body(user, hist[user], rng)
                a, b = httpx.post(served.url + "/v1/rank", json=body, timeout=30), inproc.post("/v1/rank", json=body)
                assert a.status_code == b.status_code == 200, (a.text, b.text)
                assert a.json()["cached_tokens"] == b.json()["cached_tokens"]
                for task, scores in b.json()["scores"].items():
                    torch.testing.assert_close(torch.tensor(a.json()["scores"][task]), torch.tensor(scores), rtol=0, atol=1e-6)
        cold = RankEngine.from_run(run, EngineConfig(**ENGINE))
        lock, answers, failures = threading.Lock(), [], []
        histories = {"x": random_history(4, 1), "y": random_history(4, 2)}

        def caller(k: int) -> None:  # one connection per request: spread over the front ends by the kernel
            local_rng = random.Random(seed + k)
            for _ in range(6):
                user = local_rng.choice(list(histories))
                with lock:
                    histories[user] = _grow(histories[user], local_rng, local_rng.randint(0, 3))
                    body = _body(user, {k2: list(v) for k2, v in histories[user].items()}, local_rng)
                response = httpx.post(served.url + "/v1/rank", json=body, timeout=30)
                (answers if response.status_code == 200 else failures).append((body, response))

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, (seed, [(r.status_code, r.text) for _, r in failures[:3]])
        for body, response in answers:
            expected = cold.rank(body["user_id"], body["history"], body["candidates"], user_features=body["user_features"],
                                 timestamp=body["timestamp"]).task_scores()  # fmt: skip
            for task, scores in expected.items():
                torch.testing.assert_close(torch.tensor(response.json()["scores"][task]), torch.tensor(scores),
                                           rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")  # fmt: skip
        metrics = httpx.get(served.url + "/metrics", timeout=10).text  # any front end: the sum over all of them
        assert f'recforge_rank_requests_total{{status="200"}} {8 + len(answers)}.0' in metrics, metrics
        pids = {served.pids()[0] for _ in range(24)}  # a new connection each: SO_REUSEPORT spreads them
        assert len(pids) == 2, "every connection went to one front end"
        engine_pid = served.pids()[1]
        t0 = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(2 * (DRAIN_S + 5)) == 0
        print(f"SIGTERM -> exit in {time.monotonic() - t0:.1f} s; front ends seen: {len(pids)}")
        time.sleep(0.5)
        assert not any(_alive(p) for p in (*pids, engine_pid))
    finally:
        served.stop()


def test_a_dead_engine_gives_503_at_once_and_a_nonzero_exit(run, tmp_path) -> None:
    served = _Served(run, 2, tmp_path / "log", engine_timeout_s=10.0)
    try:
        front_pid, engine_pid = served.pids()
        os.kill(engine_pid, signal.SIGSTOP)  # wedged: a request waits ...
        waiting: list = []
        body = _body("a", random_history(3, 1), random.Random(0))
        thread = threading.Thread(target=lambda: waiting.append(httpx.post(
            served.url + "/v1/rank", json=body, headers={"X-Request-Timeout-Ms": "30000"}, timeout=60)))  # fmt: skip
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive()
        t0 = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)  # ... and the engine dies: 503 at once, long before the 10 s heartbeat limit
        thread.join(8)
        assert waiting and waiting[0].status_code == 503, waiting and waiting[0].text
        assert time.monotonic() - t0 < 5
        assert served.proc.wait(DRAIN_S + 15) == 1  # the supervisor notices and exits non-zero
        time.sleep(0.5)
        assert not _alive(front_pid)
    finally:
        served.stop()
