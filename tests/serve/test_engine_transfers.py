"""The eager pass's transfers (``engine.transfers``: uploads, downloads, staging waits) are reported in ``/health``'s
engine report beside the CUDA graphs' counters, and count every pass."""

from __future__ import annotations

import random

from recforge.serve.engine import RankEngine
from recforge.serve.engine_core import engine_report
from recforge.serve.kv_pool import KVCachePool, PoolConfig
from recforge.serve.runner import BatchRunner
from recforge.serve.server import ServerConfig
from _serve_helpers import NUM_ITEMS, build_model, export, random_history


def test_health_reports_the_eager_pass_transfers(tmp_path) -> None:
    engine = RankEngine.from_run(export(build_model(), tmp_path / "run"))
    engine.pool = KVCachePool.for_engine(engine, PoolConfig(device_mb=1, block_size=16))
    runner, rng = BatchRunner(engine), random.Random()
    try:
        before = engine_report(engine, runner, ServerConfig())["transfers"]
        assert before == {"uploads": 0, "downloads": 0, "staging_waits": 0}
        n = rng.randint(2, 5)
        for i in range(n):  # one at a time: each request's prefix pass uploads, its candidates pass downloads
            req = engine.encode(f"u{i}", random_history(rng.randint(3, 20), rng.randrange(10**6)),
                                [rng.randint(1000, 999 + NUM_ITEMS) for _ in range(3)], timestamp=10**9)  # fmt: skip
            runner.submit(req).result(timeout=60)
        report = engine_report(engine, runner, ServerConfig())
    finally:
        runner.close()
    transfers = report["transfers"]
    assert transfers == engine.transfers and transfers is not engine.transfers  # a copy, as the counters are
    passes = report["counters"]["passes"]
    assert transfers["downloads"] == n  # one score read-back per candidates pass, none for prefix-only passes
    assert n < transfers["uploads"] <= passes  # every eager pass uploads its tokens once
    assert transfers["staging_waits"] == 0  # on the CPU nothing is in flight to wait for
