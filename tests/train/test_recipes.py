"""The recipe registry: every recipe name maps to real train/evaluate functions; unknown names are refused."""

from __future__ import annotations

import inspect

import pytest
import yaml

from recforge.cli import main
from recforge.config import CHOICES
from recforge.train.recipes import RECIPES, get_recipe


def test_the_registry_and_the_config_know_the_same_recipes() -> None:
    assert tuple(RECIPES) == CHOICES["recipe"]


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_recipe_has_train_and_evaluate_functions(name: str) -> None:
    recipe = get_recipe(name)
    module = recipe.module()
    assert list(inspect.signature(module.train).parameters)[:1] == ["cfg"]
    assert {"resume", "progress"} <= set(inspect.signature(module.train).parameters)
    assert {"checkpoint", "split", "command"} <= set(inspect.signature(module.evaluate_run).parameters)
    assert recipe.metrics in ("topk", "ranking")
    assert recipe.serving_model == (name == "ranking") and hasattr(module, "export_model") == recipe.serving_model


def test_an_unknown_recipe_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown recipe 'foo'; known recipes: retrieval \(.*ranking \(.*generative \("):
        get_recipe("foo")


def test_the_cli_refuses_a_config_with_an_unknown_recipe(tmp_path, capsys) -> None:
    config = tmp_path / "foo.yaml"
    config.write_text(yaml.safe_dump({"recipe": "foo", "name": "foo", "data": {"path": str(tmp_path)}}))
    assert main(["--no-progress", "train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "recipe: 'foo' is not one of ('retrieval', 'ranking', 'generative')" in err
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config.read_text())
    assert main(["eval", str(run)]) == 2
    assert "recipe: 'foo' is not one of" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve"], ["export", "--out", "OUT"]])
def test_serve_and_export_say_a_run_of_another_recipe_has_no_serving_model(tmp_path, capsys, command) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"recipe": "retrieval", "data": {"path": "x"}}))
    argv = [command[0], str(run), *[str(tmp_path / a) if a == "OUT" else a for a in command[1:]]]
    assert main(argv) == 2
    assert f"is a retrieval run; `recforge {command[0]}` takes a ranking run" in capsys.readouterr().err
