"""The import layers of ARCHITECTURE.md, checked on every module of recforge (parsed with ast, nothing imported).

Each component (a subpackage such as ``recforge.data``, or a top-level module such as ``recforge.io``)
may import recforge only from the components ``ALLOWED`` lists for it; a few components also must not
import some outside modules (``FORBIDDEN_EXTERNAL``). Function-local and ``TYPE_CHECKING`` imports
count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BASE = {"env", "io"}  # utilities that import nothing of recforge
ALLOWED: dict[str, set[str]] = {
    "jagged": set(),  # the bottom layer: batch type, mask description, jagged index helpers
    "env": set(),
    "io": set(),
    "ops": {"jagged", "env"},
    "data": {"jagged", *BASE},
    "config": {"data", *BASE},  # validation parses data specs (ranking tasks); data never reads configs
    "sparse": {"jagged", "ops", *BASE},
    "models": {"jagged", "ops", "sparse", "config", *BASE},
    "checkpoint": {"sparse", *BASE},
    "generate": {"jagged", "ops", "data", "models", "checkpoint", "config", *BASE},
    "train": {"jagged", "ops", "data", "sparse", "models", "checkpoint", "generate", "config", *BASE},
    "serve": {"jagged", "ops", "data", "sparse", "models", "checkpoint", "generate", "config", *BASE},
    "cli": {"jagged", "ops", "data", "sparse", "models", "checkpoint", "generate", "train", "serve", "config", *BASE},
    "recforge": set(),  # recforge/__init__.py: importing the package must stay cheap
}
FORBIDDEN_EXTERNAL: dict[str, tuple[str, ...]] = {
    "jagged": ("torch.distributed",),
    "ops": ("torch.distributed",),
    "data": ("torch.distributed",),
}
# Inside ops: the kernels never import their dispatchers (the dispatchers import the kernels).
KERNEL_PACKAGE, DISPATCHERS = "recforge.ops.triton", ("recforge.ops.hstu_attention", "recforge.ops.softmax_attention",
                                                      "recforge.ops.cached_attention", "recforge.ops.gather_dot",
                                                      "recforge.ops")  # fmt: skip


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def component(module: str) -> str:
    """``recforge.data.sequences`` -> ``data``; ``recforge`` (the package itself) -> ``recforge``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "recforge"


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            # `from recforge import checkpoint` imports the component `checkpoint`
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if base == "recforge"]
    return found


def violations(root: Path = ROOT) -> list[str]:
    """Every import of ``root/recforge`` that breaks the layer rules, as ``path:line: what``."""
    problems = []
    for path in sorted((root / "recforge").rglob("*.py")):
        module = module_name(path, root)
        own = component(module)
        if own not in ALLOWED:
            problems.append(f"{path.relative_to(root)}: component {own!r} is not in ARCHITECTURE.md's layers")
            continue
        for line, target in imported_modules(path, module):
            where = f"{path.relative_to(root)}:{line}"
            if target == "recforge" or target.startswith("recforge."):
                other = component(target)
                if target != "recforge" and other != own and other not in ALLOWED[own]:
                    problems.append(f"{where}: {own} imports {target} ({other} is not below {own})")
                if module.startswith(KERNEL_PACKAGE) and target in DISPATCHERS:
                    problems.append(f"{where}: the kernel module {module} imports the dispatcher {target}")
            for banned in FORBIDDEN_EXTERNAL.get(own, ()):
                if target == banned or target.startswith(banned + "."):
                    problems.append(f"{where}: {own} imports {target}")
    return problems


def test_layers_form_a_dag() -> None:
    graph = {name: allowed - {name} for name, allowed in ALLOWED.items()}
    assert all(dep in ALLOWED for deps in graph.values() for dep in deps)
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a cycle


def test_every_import_follows_the_layers() -> None:
    problems = violations()
    assert not problems, "imports that break ARCHITECTURE.md's layers:\n" + "\n".join(problems)


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    """The checker itself: a data module importing models, and a kernel importing its dispatcher, are found."""
    (tmp_path / "recforge" / "data").mkdir(parents=True)
    (tmp_path / "recforge" / "ops" / "triton").mkdir(parents=True)
    (tmp_path / "recforge" / "data" / "bad.py").write_text("def f():\n    from recforge.models.hstu import HSTUEncoder\n")
    (tmp_path / "recforge" / "ops" / "triton" / "k.py").write_text("from ..hstu_attention import time_buckets\n")
    (tmp_path / "recforge" / "jagged.py").write_text("import torch.distributed as dist\n")
    found = violations(tmp_path)
    assert any("data/bad.py:2: data imports recforge.models.hstu" in p for p in found), found
    assert any("imports the dispatcher recforge.ops.hstu_attention" in p for p in found), found
    assert any("jagged imports torch.distributed" in p for p in found), found


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_component_exists(name: str) -> None:
    """Every component of the table is a real package or module (a renamed one must update the table)."""
    assert name == "recforge" or (ROOT / "recforge" / name).is_dir() or (ROOT / "recforge" / f"{name}.py").is_file()
