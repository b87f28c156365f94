"""Tests for typed run configuration: YAML, overrides, validation, the shipped configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from recforge.config import (
    ConfigError,
    DataConfig,
    RunConfig,
    config_from_dict,
    load_config,
    parse_overrides,
    save_config,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"


def _write(tmp_path: Path, payload, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(payload if isinstance(payload, str) else yaml.safe_dump(payload))
    return path


def _problems(err: pytest.ExceptionInfo) -> list[str]:
    return [line[4:] for line in str(err.value).splitlines() if line.startswith("  - ")]


# --------------------------------------------------------------------------- loading


def test_load_yaml_with_defaults(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        name: tiny
        data: {path: data/x, protocol: clean, max_seq_len: 30}
        model: {kind: sasrec, dim: 32, num_heads: 2}
        optim: {lr: 0.01, betas: [0.8, 0.9]}
        train: {epochs: 3, max_minutes: 1}
        eval: {ks: [1, 10]}
        """.replace("\n        ", "\n"),
    )
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.name == "tiny" and cfg.recipe == "retrieval"
    assert cfg.data == DataConfig(path="data/x", protocol="clean", max_seq_len=30, train_windows="last")
    assert (cfg.model.kind, cfg.model.dim, cfg.model.num_heads, cfg.model.num_blocks) == ("sasrec", 32, 2, 2)
    assert cfg.optim.lr == 0.01 and cfg.optim.betas == [0.8, 0.9]
    assert cfg.train.epochs == 3 and cfg.train.batch_size == 128
    assert cfg.train.max_minutes == 1.0 and isinstance(cfg.train.max_minutes, float)  # int promoted to float
    assert cfg.eval.ks == [1, 10] and cfg.eval.select_metric == "ndcg@10"
    assert cfg.loss.negatives == "per_position"
    assert cfg.run_dir == Path("runs/tiny")


def test_save_config_round_trip(tmp_path: Path) -> None:
    cfg = config_from_dict({"name": "rt", "data": {"path": "d"}}, ["model.dim=24", "eval.ks=[3, 7]", "train.output_dir=out/{name}-x"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert again.run_dir == Path("out/rt-x")


def test_overrides_nested_and_typed(tmp_path: Path) -> None:
    path = _write(tmp_path, {"name": "base", "data": {"path": "d", "max_seq_len": 50}, "model": {"dim": 16}})
    cfg = load_config(
        path,
        [
            "train.epochs=7",
            "model.kind=sasrec",
            "loss.in_batch_negatives=true",
            "loss.temperature=0.1",
            "optim.betas=[0.5, 0.6]",
            "eval.ks=[5]",
            "train.max_minutes=2",
            "data.max_seq_len=25",  # overrides the file
            "name=changed",
            "train.output_dir=",  # empty value -> empty string
        ],
    )
    assert cfg.train.epochs == 7 and isinstance(cfg.train.epochs, int)
    assert cfg.model.kind == "sasrec"
    assert cfg.model.dim == 16  # file value kept next to an override in the same section
    assert cfg.loss.in_batch_negatives is True
    assert cfg.loss.temperature == pytest.approx(0.1, abs=0)
    assert cfg.optim.betas == [0.5, 0.6]
    assert cfg.eval.ks == [5]
    assert cfg.train.max_minutes == 2.0
    assert cfg.data.max_seq_len == 25 and cfg.data.path == "d"
    assert cfg.name == "changed"
    assert cfg.train.output_dir == ""


def test_parse_overrides() -> None:
    problems: list[str] = []
    nested = parse_overrides(["a.b.c=1", "a.b.d=x", "a.e=[1, 2]", "f=true", "g=k=v", "broken"], problems)
    assert nested == {"a": {"b": {"c": 1, "d": "x"}, "e": [1, 2]}, "f": True, "g": "k=v"}
    assert len(problems) == 1 and "'broken'" in problems[0] and "key=value" in problems[0]


# --------------------------------------------------------------------------- errors


def test_all_structural_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(
            {"data": {"path": "d", "colour": "red"}, "model": {"dim": "wide"}, "bogus": 1},
            ["train.epochs=2.5", "train.device=3", "eval.ks=5", "optim.betas=[0.9, fast]", "nonsense"],
            source="my.yaml",
        )
    msg = str(err.value)
    assert msg.startswith("my.yaml: 8 problem(s):")
    problems = _problems(err)
    assert len(problems) == 8
    expected = [
        "data.colour: unknown key",
        "model.dim: expected int, got str 'wide'",
        "bogus: unknown key",
        "train.epochs: expected int, got float 2.5",
        "train.device: expected str, got int 3",
        "eval.ks: expected a list, got 5",
        "optim.betas[1]: expected float, got str 'fast'",
        "override 'nonsense'",
    ]
    for part in expected:
        assert any(part in p for p in problems), part


def test_all_value_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(
            {"model": {"kind": "transformer", "dim": 0, "dropout": 1.0}, "loss": {"negatives": "some", "temperature": 0}},
            ["train.batch_size=-4", "data.protocol=strict", "optim.betas=[0.9]", "data.train_windows=every"],
        )
    problems = _problems(err)
    expected = [
        "model.kind: 'transformer' is not one of",
        "loss.negatives: 'some' is not one of",
        "data.protocol: 'strict' is not one of",
        "data.train_windows: 'every' is not one of",
        "model.dim: must be > 0, got 0",
        "train.batch_size: must be > 0, got -4",
        "loss.temperature: must be > 0",
        "optim.betas: expected two numbers",
        "model.dropout: must be in [0, 1)",
        "data.path: required",
    ]
    for part in expected:
        assert any(part in p for p in problems), part
    assert len(problems) == len(expected)


def test_wrong_types_are_rejected() -> None:
    for override, message in [
        ("train.epochs=true", "expected int, got bool"),  # bools are not ints
        ("loss.in_batch_negatives=1", "expected bool, got int"),
        ("model.dropout=high", "expected float, got str"),
        ("data=[1]", "data: expected a mapping"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
            config_from_dict({"data": {"path": "d"}}, [override])


def test_num_negatives_and_sasrec_heads() -> None:
    with pytest.raises(ConfigError, match="loss.num_negatives: must be > 0 unless loss.negatives=full"):
        config_from_dict({"data": {"path": "d"}}, ["loss.num_negatives=0"])
    config_from_dict({"data": {"path": "d"}}, ["loss.num_negatives=0", "loss.negatives=full"])
    with pytest.raises(ConfigError, match="must be divisible by model.num_heads 3 for SASRec"):
        config_from_dict({"data": {"path": "d"}}, ["model.kind=sasrec", "model.dim=16", "model.num_heads=3"])
    config_from_dict({"data": {"path": "d"}}, ["model.kind=hstu", "model.dim=16", "model.num_heads=3"])


def test_relative_bias_is_a_bool_of_the_hstu_encoder() -> None:
    assert config_from_dict({"data": {"path": "d"}}).model.relative_bias is True
    assert config_from_dict({"data": {"path": "d"}}, ["model.relative_bias=false"]).model.relative_bias is False
    with pytest.raises(ConfigError, match="model.relative_bias: expected bool, got str"):
        config_from_dict({"data": {"path": "d"}}, ["model.relative_bias=no-rab"])
    with pytest.raises(ConfigError, match="the switch of the HSTU blocks .* not of model.kind=sasrec"):
        config_from_dict({"data": {"path": "d"}}, ["model.kind=sasrec", "model.relative_bias=false"])


def test_a_ranking_hstu_keeps_one_source_of_order() -> None:
    """Ranking's HSTU has no absolute positions: with neither bias it would see an unordered history."""
    ranking = {"data": {"path": "d"}, "recipe": "ranking", "ranking": {"tasks": ["like:rating>=4"]},
               "eval": {"select_metric": "like/auc"}}  # fmt: skip
    config_from_dict(ranking, ["model.relative_bias=false"])  # the time bias remains
    config_from_dict(ranking, ["model.num_time_buckets=0"])  # the position bias remains
    with pytest.raises(ConfigError, match="unordered set; keep one of the two biases"):
        config_from_dict(ranking, ["model.relative_bias=false", "model.num_time_buckets=0"])


def test_sid_hstu_is_built_without_the_relative_bias_when_switched_off() -> None:
    from recforge.generate.sid_run import build_sid_model

    cfg = config_from_dict({"recipe": "generative", "data": {"path": "d"}},
                           ["model.kind=sid_hstu", "model.dim=16", "model.num_blocks=2", "model.num_heads=2", "eval.ks=[10]"])  # fmt: skip
    assert all(b.pos_weights is not None for b in build_sid_model(cfg, 3, 8).encoder.blocks)
    cfg = config_from_dict({"recipe": "generative", "data": {"path": "d"}},
                           ["model.kind=sid_hstu", "model.dim=16", "model.num_blocks=2", "model.num_heads=2",
                            "model.relative_bias=false", "eval.ks=[10]"])  # fmt: skip
    assert all(b.pos_weights is None for b in build_sid_model(cfg, 3, 8).encoder.blocks)


def test_missing_data_path() -> None:
    with pytest.raises(ConfigError, match="data.path: required"):
        config_from_dict({})


def test_load_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(_write(tmp_path, "data: {path: [unclosed\n", "bad.yaml"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n", "list.yaml"))
    with pytest.raises(ConfigError, match="data.path: required"):
        load_config(_write(tmp_path, "", "empty.yaml"))
    assert issubclass(ConfigError, ValueError)  # the CLI reports ValueErrors as exit code 2


def test_structural_and_value_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"data": {"path": "d"}, "modle": {"dim": 8}}, ["model.kind=transformer", "train.epochs=0"])
    problems = _problems(err)
    assert any("modle: unknown key" in p for p in problems)
    assert any("model.kind: 'transformer' is not one of" in p for p in problems)
    assert any("train.epochs: must be > 0" in p for p in problems)


def test_scientific_notation_override() -> None:
    cfg = config_from_dict({"data": {"path": "d"}}, ["optim.lr=1e-3", "loss.temperature=5e-2"])
    assert cfg.optim.lr == pytest.approx(1e-3, abs=0)
    assert cfg.loss.temperature == pytest.approx(0.05, abs=0)


def test_conflicting_overrides_give_config_error() -> None:
    with pytest.raises(ConfigError):
        config_from_dict({"data": {"path": "d"}}, ["train.epochs=5", "train.epochs.extra=1"])


# --------------------------------------------------------------------------- shipped configs


def _shipped_configs() -> list[Path]:
    """The run configs (serve-*.yaml are `recforge serve` configs, checked in tests/serve/test_serve_config.py)."""
    paths = sorted(CONFIG_DIR.glob("*.yaml")) + sorted(CONFIG_DIR.glob("*.yml"))
    return [p for p in paths if not p.name.startswith("serve-")]


def test_every_shipped_config_loads() -> None:
    paths = _shipped_configs()
    on_disk = [n for n in os.listdir(CONFIG_DIR) if n.endswith((".yaml", ".yml")) and not n.startswith("serve-")]
    assert len(paths) == len(on_disk) > 0
    loaded = []
    for path in paths:
        cfg = load_config(path)
        assert cfg.name == path.stem, f"{path.name}: name {cfg.name!r} should match the file name"
        assert cfg.data.path, path
        loaded.append(cfg)
    assert len(loaded) == len(on_disk)
    assert len({c.name for c in loaded}) == len(loaded)  # distinct run directories


@pytest.mark.parametrize("path", _shipped_configs(), ids=lambda p: p.name)
def test_shipped_config_accepts_overrides(path: Path) -> None:
    cfg = load_config(path, ["train.epochs=1", "data.path=elsewhere"])
    assert cfg.train.epochs == 1 and cfg.data.path == "elsewhere"


# --------------------------------------------------------------------------- ranges of every numeric key

# One nonsensical value per numeric key of the training sections, and the words the refusal must contain.
BAD_VALUES = {
    "data.max_seq_len": (0, "> 0"), "model.dim": (-8, "> 0"), "model.num_blocks": (0, "> 0"),
    "model.num_heads": (0, "> 0"), "model.dqk": (0, "> 0"), "model.dv": (0, "> 0"), "model.ffn_dim": (0, "> 0"),
    "model.dropout": (1.5, "[0, 1)"), "model.num_time_buckets": (-1, ">= 0"), "model.head_hidden": (0, "> 0"),
    "model.num_experts": (0, "> 0"), "model.item_tower": (-0.5, "[0, 1)"),
    "ranking.period_seconds": (0, "> 0"), "ranking.max_targets": (0, "> 0"), "ranking.valid_fraction": (-0.1, "valid"),
    "ranking.test_fraction": (0.0, "test"), "ranking.listwise_weight": (-1.0, ">= 0"),
    "sparse.lr": (0.0, "> 0"), "sparse.capacity": (-1, ">= 0"), "sparse.max_rows": (-1, ">= 0"),
    "sparse.cache_rows": (-5, ">= 0"), "sparse.admission_threshold": (0.5, ">= 1"), "sparse.eviction_every": (-1, ">= 0"),
    "sparse.ttl_steps": (-1, ">= 0"),
    "loss.num_negatives": (0, "> 0"), "loss.chunk_size": (-1, ">= 0"), "loss.temperature": (0.0, "> 0"),
    "optim.lr": (0.0, "> 0"), "optim.weight_decay": (-0.1, ">= 0"), "optim.grad_clip": (-5.0, "clipping off"),
    "optim.warmup_steps": (-1, ">= 0"), "optim.min_lr_fraction": (1.5, "[0, 1]"),
    "train.epochs": (0, "> 0"), "train.batch_size": (0, "> 0"), "train.seed": (-1, ">= 0"),
    "train.eval_every": (-1, ">= 0"), "train.checkpoint_every": (-1, ">= 0"), "train.keep_checkpoints": (0, "> 0"),
    "train.max_steps": (-1, ">= 0"), "train.max_minutes": (-1.0, "no limit"), "train.log_every": (0, "> 0"),
    "train.log_seconds": (0.0, "> 0"), "train.threads": (-2, ">= 0"), "train.loader_workers": (0, ">= 1"),
    "train.token_budget": (-1, ">= 0"), "train.peak_tflops": (-1.0, ">= 0"), "train.graph_bucket_ratio": (0.9, "[1, 4]"), "dist.grad_accum": (0, "> 0"),
    "dist.timeout_minutes": (0.0, "> 0"),
    "eval.batch_size": (0, "> 0"), "generative.decoder_blocks": (0, "> 0"), "generative.beam": (0, "> 0"),
    "generative.dense_weight": (0, "> 0"), "generative.rescore": (-0.5, ">= 0"),
    "generative.dense_candidates": (-1, ">= 0"), "generative.item_dim": (-1, ">= 0"),
    "generative.dense_distill": (-0.5, ">= 0"),
}  # fmt: skip
TRAINING_SECTIONS = ("data", "ranking", "model", "sparse", "loss", "optim", "train", "dist", "eval", "generative")


def test_every_numeric_training_key_has_a_range_check() -> None:
    from recforge.config import _numeric_fields

    keys = {k for k, _ in _numeric_fields(RunConfig()) if k.split(".")[0] in TRAINING_SECTIONS}
    assert keys == set(BAD_VALUES), f"give these keys a range in config.py and a bad value here: {keys ^ set(BAD_VALUES)}"


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_nonsensical_values_are_refused_naming_the_key_and_range(key: str) -> None:
    value, words = BAD_VALUES[key]
    extra = {"recipe": "ranking", "ranking": {"tasks": ["like:rating>=4"]}, "eval": {"select_metric": "like/auc"}} \
        if key.startswith("ranking.") else {}  # fmt: skip
    if key == "sparse.admission_threshold":
        extra = {"sparse": {"admission": "count"}}
    with pytest.raises(ConfigError) as err:
        config_from_dict({"data": {"path": "d"}, **extra}, [f"{key}={value}"])
    problems = [p for p in _problems(err) if key in p]
    assert problems and words in problems[0], _problems(err)


@pytest.mark.parametrize("override", ["optim.lr=.nan", "optim.grad_clip=.inf", "train.max_minutes=-.inf", "optim.betas=[0.9, .nan]"])
def test_non_finite_numbers_are_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0] + ": must be"):
        config_from_dict({"data": {"path": "d"}}, [override])


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"data": {"path": "d"}}, ["sparse.capacity=100", "sparse.max_rows=10", "optim.betas=[0.9, 1.2]",
                                                   "optim.schedule=cosine", "optim.warmup_steps=50", "train.max_steps=20"])
    text = str(err.value)
    assert "sparse.max_rows (10) must be >= sparse.capacity (100)" in text
    assert "optim.betas: each must be in [0, 1)" in text and "optim.warmup_steps (50) must be < train.max_steps (20)" in text
