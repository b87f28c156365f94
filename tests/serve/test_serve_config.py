"""`recforge serve` configuration: YAML, overrides and flags in that order, every key checked by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from recforge.cli import SERVE_FLAGS, build_parser
from recforge.config import ConfigError
from recforge.serve.config import ServeConfig, load_serve_config, valid_keys

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "configs").glob("serve-*.yaml"))


def test_defaults_are_the_documented_serve_defaults() -> None:
    cfg = load_serve_config()
    assert cfg.engine.device == "auto" and cfg.port == 8000 and cfg.scheduler.token_budget == 8192
    engine, server = cfg.engine_config(), cfg.server_config("runs/x")
    assert engine.prefill_chunk == cfg.scheduler.prefill_chunk
    assert server.scheduler is cfg.scheduler and server.pool is cfg.cache and server.run_dir == "runs/x"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_serve_config_loads_and_names_every_key(path: Path) -> None:
    import yaml

    cfg = load_serve_config(path)
    raw = yaml.safe_load(path.read_text())
    written = {f"{k}.{n}" if isinstance(v, dict) else k for k, v in raw.items() for n in (v if isinstance(v, dict) else [k])}
    assert written == set(valid_keys())  # the example documents every key, and only keys
    assert isinstance(cfg, ServeConfig)


def test_examples_exist() -> None:
    assert EXAMPLES, "ship at least one configs/serve-*.yaml"


def test_yaml_then_overrides_then_flags(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9001\nscheduler: {token_budget: 1000, max_wait_ms: 5}\ncache: {device_mb: 0}\n"
                    "engine: {dtype: bfloat16}\n")  # fmt: skip
    cfg = load_serve_config(path, ["scheduler.token_budget=2000", "engine.cuda_graphs=0"], {"port": 9002})
    assert (cfg.port, cfg.scheduler.token_budget, cfg.scheduler.max_wait_ms) == (9002, 2000, 5.0)
    assert (cfg.engine.dtype, cfg.engine.cuda_graphs) == ("bfloat16", 0)
    assert cfg.server_config().pool is None  # device_mb 0: no cache
    with pytest.raises(ConfigError, match=r"scheduler.token_budget: given both as a flag"):
        load_serve_config(path, ["scheduler.token_budget=2000"], {"scheduler.token_budget": 3000})


def test_unknown_keys_are_refused_with_the_valid_ones(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("prot: 1\nscheduler: {token_budgt: 5}\nengine: {prefill_chunk: 8}\nserver: {pool: {}}\n")
    with pytest.raises(ConfigError) as err:
        load_serve_config(path)
    message = str(err.value)
    assert "4 problem(s)" in message
    assert "prot: unknown key (valid keys: host, port," in message and "scheduler.token_budget" in message
    assert "scheduler.token_budgt: unknown key" in message
    assert "engine.prefill_chunk: not a serve config key; set scheduler.prefill_chunk" in message
    assert "server.pool: not a serve config key; use the cache: section" in message


def test_values_are_checked_and_each_problem_names_its_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_serve_config(None, ["port=eighty", "engine.dtype=fp8", "scheduler.token_budget=0", "cache.device_mb=-1",
                                 "cache.block_size=0", "server.request_timeout_ms=0", "log_level=loud", "threads=-2"])  # fmt: skip
    message = str(err.value)
    for expected in ("port: expected int, got str 'eighty'", "engine.dtype: 'fp8' is not one of",
                     "scheduler.token_budget: must be >= 1, got 0", "cache.device_mb: must be >= 0",
                     "cache.block_size: must be >= 1, got 0", "server.request_timeout_ms must be > 0, got 0",
                     "log_level: 'loud' is not one of", "threads: must be >= 0"):  # fmt: skip
        assert expected in message, (expected, message)
    assert "8 problem(s)" in message


def test_a_missing_or_malformed_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_serve_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_serve_config(tmp_path / "list.yaml")


def test_every_serve_flag_sets_a_config_key() -> None:
    keys = set(valid_keys())
    assert all(key in keys for _, key, _, _ in SERVE_FLAGS)
    # the flags of the old command line are all still there
    assert {flag for flag, *_ in SERVE_FLAGS} >= {"--host", "--port", "--device", "--dtype", "--threads", "--token-budget",
        "--max-wait-ms", "--prefill-chunk", "--max-queue", "--max-queue-ms", "--request-timeout-ms", "--max-candidates",
        "--max-history", "--unknown-ids", "--unknown-feature-values", "--cache-mb", "--host-cache-mb", "--cuda-graphs",
        "--gil-switch-ms", "--allow-reload", "--log-level"}  # fmt: skip


def test_the_command_line_resolves_config_overrides_and_flags(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9001\nengine: {dtype: float16}\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "runs/x", "scheduler.max_queue=7",
                                      "--dtype", "bfloat16", "--cache-mb", "0", "--allow-reload"])  # fmt: skip
    assert args.run_dir == "runs/x" and args.overrides == ["scheduler.max_queue=7"]
    flags = {k: v for k, v in vars(args).items() if "." in k or k in ("host", "port", "threads", "log_level")}
    assert flags == {"engine.dtype": "bfloat16", "cache.device_mb": 0.0, "server.allow_reload": True}  # only given flags
    cfg = load_serve_config(args.config, args.overrides, flags)
    assert (cfg.port, cfg.engine.dtype, cfg.scheduler.max_queue, cfg.server.allow_reload) == (9001, "bfloat16", 7, True)
    assert cfg.server_config().pool is None
