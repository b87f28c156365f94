"""`recforge serve` configuration: one YAML file, ``key=value`` overrides and flags, like `recforge train`.

The file has five sections, each the config of the component it sets, and four top-level keys::

    host: 127.0.0.1          # top level: where to listen, torch threads, the server's log level
    engine:    {...}         # EngineConfig (device, dtype, request limits, CUDA graphs)
    scheduler: {...}         # SchedulerConfig (token budget, prefill chunk, queue and admission limits)
    cache:     {...}         # PoolConfig (KV-cache device and host tiers; device_mb: 0 turns the cache off)
    server:    {...}         # ServerConfig's HTTP settings (body limits, deadlines, reload)
    retrieve:  {...}         # RetrieveSettings (beam, k and list limits of a generative run's /v1/retrieve)

Precedence: defaults < the YAML file < ``key=value`` overrides and flags (one key given both ways is
refused). Unknown keys are refused with the list of valid ones; every problem is reported at once,
each naming its key. The YAML and override mechanics are ``recforge.config``'s (one config system).

Example:
    >>> cfg = load_serve_config("configs/serve-default.yaml", ["scheduler.token_budget=4096"], {"port": 9000})
    >>> engine = RankEngine.from_run(run_dir, cfg.engine_config())
    >>> app = create_app(engine, cfg.server_config(run_dir))
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from recforge.config import _INVALID, ConfigError, _check_type, _merge, parse_overrides
from recforge.serve.engine import EngineConfig
from recforge.serve.kv_pool import PoolConfig
from recforge.serve.retrieve_app import RetrieveSettings
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
SECTIONS: dict[str, type] = {"engine": EngineConfig, "scheduler": SchedulerConfig, "cache": PoolConfig,
                             "server": ServerConfig, "retrieve": RetrieveSettings}  # fmt: skip
# fields of the section configs that ServeConfig sets from elsewhere: key -> where it is set instead
NOT_KEYS = {
    "engine.prefill_chunk": "set scheduler.prefill_chunk (the engine's chunk follows it)",
    "server.scheduler": "use the scheduler: section",
    "server.pool": "use the cache: section",
    "server.run_dir": "the reload source is RUN_DIR on the command line",
}


@dataclass
class ServeConfig:
    """Everything `recforge serve` takes (see the module docstring)."""

    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 0  # torch intra-op threads (0: torch's default)
    log_level: str = "warning"  # uvicorn's: critical | error | warning | info | debug | trace
    # HTTP front-end processes before one engine process (serve/procs.py); "0": one process; "auto": a few on CUDA
    http_workers: str | int = "auto"
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(device="auto"))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: PoolConfig = field(default_factory=PoolConfig)  # device_mb: 0 serves without a KV cache
    server: ServerConfig = field(default_factory=ServerConfig)
    retrieve: RetrieveSettings = field(default_factory=RetrieveSettings)  # generative runs' /v1/retrieve only

    def engine_config(self) -> EngineConfig:
        return replace(self.engine, prefill_chunk=self.scheduler.prefill_chunk)

    def server_config(self, run_dir: str | None = None) -> ServerConfig:
        """The server's config: its HTTP settings, the scheduler, the cache (None when off), the reload source."""
        pool = self.cache if self.cache.device_mb > 0 else None
        return replace(self.server, scheduler=self.scheduler, pool=pool, run_dir=run_dir)

    def problems(self) -> list[str]:
        """Every invalid value, each message naming its key (``section.field``)."""
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"port: must be in [0, 65535], got {self.port}")
        if self.threads < 0:
            problems.append(f"threads: must be >= 0 (0: torch's default), got {self.threads}")
        if not (self.http_workers == "auto" or str(self.http_workers).isdigit()):
            problems.append(f"http_workers: expected auto or a number of processes (0: one process), got {self.http_workers!r}")
        if self.log_level not in LOG_LEVELS:
            problems.append(f"log_level: {self.log_level!r} is not one of {LOG_LEVELS}")
        problems += [f"engine.{p}" for p in replace(self.engine, prefill_chunk=1).problems()]
        problems += [f"scheduler.{p}" for p in self.scheduler.problems()]
        if self.cache.device_mb < 0:
            problems.append(f"cache.device_mb: must be >= 0 (0 turns the cache off), got {self.cache.device_mb}")
        problems += [f"cache.{p}" for p in self.cache.problems() if not p.startswith("device_mb")]
        try:
            replace(self.server, scheduler=SchedulerConfig()).validate()
        except ValueError as err:  # "ServerConfig: a must be > 0, got 0; b must ..."
            problems += [f"server.{p}" for p in str(err).removeprefix("ServerConfig: ").split("; ")]
        problems += [f"retrieve.{p}" for p in self.retrieve.problems()]
        return problems


def valid_keys() -> list[str]:
    """Every key of a serve config, dotted (``scheduler.token_budget``)."""
    keys = [f.name for f in dataclasses.fields(ServeConfig) if f.name not in SECTIONS]
    for section, cls in SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls) if f"{section}.{f.name}" not in NOT_KEYS]
    return keys


def load_serve_config(path: str | Path | None = None, overrides: list[str] | None = None,
                      flags: dict[str, Any] | None = None) -> ServeConfig:  # fmt: skip
    """Read ``path`` (None: defaults only), apply ``key=value`` ``overrides`` and ``flags`` ({dotted key: value},
    from the command line's flags), validate; ``ConfigError`` listing every problem."""
    problems: list[str] = []
    raw = _read_yaml(Path(path)) if path is not None else {}
    from_overrides = parse_overrides(overrides or [], problems)
    flags = flags or {}
    given_twice = sorted(set(flags) & set(_flatten(from_overrides)))
    problems += [f"{key}: given both as a flag and as {key}=...; give it once" for key in given_twice]
    merged = _merge(_merge(raw, from_overrides), _nest(flags))
    cfg = _build(merged, problems)
    problems += cfg.problems()
    if problems:
        source = str(path) if path is not None else "serve config"
        raise ConfigError(f"{source}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return cfg


def _build(raw: dict, problems: list[str]) -> ServeConfig:
    """A ``ServeConfig`` from a nested dict; wrong keys and types go to ``problems`` (the field keeps its default)."""
    top_hints, sections = typing.get_type_hints(ServeConfig), {}
    cfg = ServeConfig()
    for key, value in raw.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                problems.append(f"{key}: expected a mapping of {SECTIONS[key].__name__} keys, got {value!r}")
            else:
                sections[key] = value
        elif key in top_hints:
            checked = _check_type(value, top_hints[key], key, problems)
            if checked is not _INVALID:
                setattr(cfg, key, checked)
        else:
            problems.append(_unknown(key))
    for section, values in sections.items():
        hints, target = typing.get_type_hints(SECTIONS[section]), getattr(cfg, section)
        for name, value in values.items():
            key = f"{section}.{name}"
            if key in NOT_KEYS:
                problems.append(f"{key}: not a serve config key; {NOT_KEYS[key]}")
            elif name not in hints:
                problems.append(_unknown(key))
            elif (checked := _check_type(value, hints[name], key, problems)) is not _INVALID:
                setattr(target, name, checked)
    return cfg


def _unknown(key: str) -> str:
    return f"{key}: unknown key (valid keys: {', '.join(valid_keys())})"


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"serve config {path} does not exist (see configs/serve-default.yaml)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping (host:, engine:, scheduler:, cache:, server:)")
    return raw


def _nest(flat: dict[str, Any]) -> dict:
    nested: dict = {}
    for key, value in flat.items():
        *sections, name = key.split(".")
        node = nested
        for part in sections:
            node = node.setdefault(part, {})
        node[name] = value
    return nested


def _flatten(nested: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


__all__ = ["ServeConfig", "load_serve_config", "valid_keys"]
