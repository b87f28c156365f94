"""``serve_processes`` on a free port with a ServerConfig given as JSON; prints ``READY port version`` (test_procs.py).

Usage: python _procs_server.py RUN_DIR HTTP_WORKERS '{"engine_timeout_s": 5, "scheduler": {...}, "pool": {...}}'
"""

if __name__ == "__main__":  # spawned children import this file as __mp_main__: nothing may run then
    import json
    import sys

    from recforge.serve.engine import EngineConfig
    from recforge.serve.kv_pool import PoolConfig
    from recforge.serve.procs import serve_processes
    from recforge.serve.scheduler import SchedulerConfig
    from recforge.serve.server import ServerConfig

    run_dir, workers, fields = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    config = ServerConfig(scheduler=SchedulerConfig(**fields.pop("scheduler", {})),
                          pool=PoolConfig(**fields.pop("pool", {})), **fields)  # fmt: skip
    engine = EngineConfig(device="cpu", max_candidates=50, max_history_events=500)
    sys.exit(serve_processes(run_dir, engine, config, workers, port=0,
                             on_ready=lambda port, version: print(f"READY {port} {version}", flush=True)))  # fmt: skip
