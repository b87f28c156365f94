"""The README's commands: every `recforge` command parses and its config loads, the configs table is whole,
and the serving example answers 200 against the run the README trains just before it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from recforge.cli import build_parser
from recforge.config import load_config

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def _commands() -> list[list[str]]:
    """Every command line of the README's bash blocks, split into words (comments dropped)."""
    commands = []
    for block in _bash_blocks():
        text = block.replace("\\\n", " ")
        if "curl" in text:  # its JSON body spans lines inside quotes
            text = re.sub(r"curl .*?}'", "curl", text, flags=re.S)
        for line in text.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words:
                    commands.append(words)
    return commands


def _recforge_args(words: list[str]) -> list[str] | None:
    if words[0].endswith("recforge"):
        return words[1:]
    if "recforge.cli" in words:  # torchrun ... -m recforge.cli train ...
        return words[words.index("recforge.cli") + 1 :]
    return None


RECFORGE_COMMANDS = [args for words in _commands() if (args := _recforge_args(words)) is not None]


def test_the_readme_has_the_newcomer_commands_verbatim() -> None:
    blocks = _bash_blocks()
    assert "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/recforge demo\n" in blocks
    assert ".venv/bin/python -m pytest -q\n" in blocks
    assert len(RECFORGE_COMMANDS) >= 20


@pytest.mark.parametrize("args", RECFORGE_COMMANDS, ids=[" ".join(a)[:60] for a in RECFORGE_COMMANDS])
def test_every_readme_recforge_command_parses_and_its_config_loads(args: list[str]) -> None:
    parser = build_parser()
    parsed, extra = parser.parse_known_args(args)  # as cli.main: key=value overrides may follow an option
    assert all("=" in e and not e.startswith("-") for e in extra), extra
    if parsed.command == "train":
        load_config(REPO / parsed.config, [*parsed.overrides, *extra])


def test_configs_table_lists_every_shipped_config_without_a_break() -> None:
    section = README.split("### Configs\n", 1)[1]
    lines = section.lstrip("\n").splitlines()
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append(line)
    named = set(re.findall(r"`(?:configs/)?([\w.-]+\.yaml)`", "\n".join(table)))
    shipped = {p.name for p in (REPO / "configs").glob("*.yaml")}
    assert named == shipped, f"missing from the table: {shipped - named}; not shipped: {named - shipped}"


def test_bare_commands_are_explained() -> None:
    first_bare = README.index("\nrecforge data prepare")
    assert "source .venv/bin/activate" in README[:first_bare]


@pytest.mark.integration
def test_the_serving_example_answers_200(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the README's serving block as written (a shorter training) and post its curl body."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from recforge.cli import main
    from recforge.data.converters import default_data_root
    from recforge.serve.engine import RankEngine
    from recforge.serve.server import ServerConfig, create_app

    sample = default_data_root() / "taobao-sample"
    if not sample.is_dir():
        pytest.skip(f"the Taobao sample is not at {sample} (set RECFORGE_DATA to the shared data directory)")
    block = next(b for b in _bash_blocks() if "recforge serve" in b and "/v1/rank" in b)
    body = json.loads(re.search(r"-d '(\{.*?\})'", block, flags=re.S).group(1))
    monkeypatch.chdir(tmp_path)  # the README's relative paths: data/taobao, runs/ranking-taobao-hstu
    (tmp_path / "configs").symlink_to(REPO / "configs")
    assert main(["data", "prepare", "taobao", "--out", "data/taobao"]) == 0
    fast = ["train.epochs=1", "train.max_steps=2", "train.threads=1", "train.device=cpu", "--no-progress"]
    assert main(["train", "configs/ranking-taobao-hstu.yaml", *fast]) == 0
    with TestClient(create_app(RankEngine.from_run("runs/ranking-taobao-hstu"), ServerConfig())) as client:
        response = client.post("/v1/rank", json=body)
    assert response.status_code == 200, response.text
    scores = response.json()["scores"]
    assert set(scores) == {"cart", "fav", "buy"} and all(len(v) == len(body["candidates"]) for v in scores.values())
