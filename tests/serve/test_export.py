"""Export: torch.export and ONNX (run by onnxruntime) programs reproduce the engine's scores on new shapes."""

from __future__ import annotations

import json

import pytest
import torch

from recforge.serve.engine import RankEngine
from recforge.serve.export import export_run, run_onnx
from recforge.serve.layout import candidate_tokens, prefix_tokens
from _serve_helpers import build_model, export, random_history

FEATURES = ("item_ids", "actions", "context_ids", "timestamps")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    run = export(build_model(seed=3), root / "run")
    return run, export_run(run, root / "out")


def _request(engine: RankEngine):
    hist = random_history(37, seed=8)
    return engine.encode("u1", hist, [1003, 1004, 1020, 1021, 1044, 1049, 1001], user_features={"gender": "m"},
                         timestamp=hist["timestamps"][-4] + 1)  # three events after the request time  # fmt: skip


def _pipeline(run_program, req, engine: RankEngine, tower: bool = False) -> torch.Tensor:
    prefix = prefix_tokens(req, engine.action_encoding)
    cands = candidate_tokens(req)
    x = run_program("prefix", tuple(prefix[k] for k in FEATURES))
    ctx = torch.tensor(req.context_ids.numel())
    keys, values = run_program("encoder_prefill", (x, prefix["timestamps"], ctx))
    y = run_program("prefix", tuple(cands[k] for k in FEATURES))
    states = run_program("encoder_score", (y, cands["timestamps"], keys, values, prefix["timestamps"], ctx))
    return run_program("postfix", (torch.cat([states, y], 1) if tower else states,))


def test_config_json_describes_the_programs(exported) -> None:
    _, out = exported
    config = json.loads((out / "export.json").read_text())
    assert set(config["programs"]) == {"prefix", "encoder_prefill", "encoder_score", "postfix"}
    for entry in config["programs"].values():
        assert (out / entry["files"]["torch"]).is_file() and (out / entry["files"]["onnx"]).is_file()
    assert config["layout"]["num_contextual"] == 2 and config["tasks"][0]["name"] == "click"
    assert max(config["check_max_abs_diff"].values()) < 1e-5


@pytest.mark.parametrize("fmt", ["torch", "onnx"])
def test_exported_programs_match_the_engine(exported, fmt) -> None:
    run, out = exported
    engine = RankEngine.from_run(run)
    req = _request(engine)
    if fmt == "torch":
        programs = {name: torch.export.load(out / f"{name}.pt2").module() for name in
                    ("prefix", "encoder_prefill", "encoder_score", "postfix")}  # fmt: skip
        run_program = lambda name, args: programs[name](*args)  # noqa: E731
    else:
        run_program = lambda name, args: run_onnx(out / f"{name}.onnx", args)  # noqa: E731
    got = _pipeline(run_program, req, engine)
    torch.testing.assert_close(got, engine.rank_encoded(req).scores, rtol=1e-4, atol=1e-5)


def test_candidate_tower_postfix_exports(tmp_path) -> None:
    """With model.item_tower the postfix program reads [states, candidate embeddings] (C, 2d); ONNX
    reproduces the engine, and export.json says so."""
    run = export(build_model(seed=4, tower=True), tmp_path / "run")
    out = export_run(run, tmp_path / "out", formats=("onnx",))
    assert "concatenated" in json.loads((out / "export.json").read_text())["flow"][1]
    engine = RankEngine.from_run(run)
    req = _request(engine)
    got = _pipeline(lambda name, args: run_onnx(out / f"{name}.onnx", args), req, engine, tower=True)
    torch.testing.assert_close(got, engine.rank_encoded(req).scores, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # an export of its own (~13 s on 2 cores); the cached path is checked by test_engine.py by default
def test_a_model_without_relative_bias_exports(tmp_path) -> None:
    """model.relative_bias=false: no pos_weights in the programs; ONNX reproduces the engine."""
    pytest.importorskip("onnxruntime")
    run = export(build_model(seed=5, relative_bias=False), tmp_path / "run")
    out = export_run(run, tmp_path / "out", formats=("onnx",))
    engine = RankEngine.from_run(run)
    assert all(block.pos_weights is None for block in engine.model.encoder.blocks)
    req = _request(engine)
    got = _pipeline(lambda name, args: run_onnx(out / f"{name}.onnx", args), req, engine)
    torch.testing.assert_close(got, engine.rank_encoded(req).scores, rtol=1e-4, atol=1e-5)
