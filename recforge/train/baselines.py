"""The baseline rows of RESULTS.md that match a run's dataset, for the run report.

RESULTS.md is read loosely: every Markdown table (a header row, a ``| --- |`` rule, then rows)
under the nearest ``#`` heading. A table matches a dataset when its heading or one of its rows
names the dataset: the words of the dataset folder's name (``data/ml-1m`` -> ``ml 1m``) appear in
that order, or its letters and digits form one word (``ml1m`` in ``configs/ml1m-hstu.yaml``). Of a
table matched by its rows, the matching rows are kept and the published ones (in italics).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_FILE = Path(__file__).resolve().parents[2] / "RESULTS.md"  # a source checkout; absent from a wheel
_WORD = re.compile(r"[a-z0-9]+")


@dataclass
class BaselineTable:
    """One matching table: the heading it sits under, its header cells and the kept rows."""

    heading: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def names_dataset(text: str, dataset: str) -> bool:
    """True when ``text`` names ``dataset`` (a folder name such as ``ml-1m``), word by word or joined."""
    want = _words(dataset)
    if not want:
        return False
    have = _words(text)
    joined = "".join(want)
    if joined in have:
        return True
    n = len(want)
    return any(have[i : i + n] == want for i in range(len(have) - n + 1))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _is_rule(line: str) -> bool:
    return bool(re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?", line.strip()))


def parse_tables(text: str) -> list[BaselineTable]:
    """Every Markdown table of ``text`` with all its rows, under its nearest heading."""
    lines = text.splitlines()
    tables, heading, i = [], "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.lstrip().startswith("|") and i + 1 < len(lines) and _is_rule(lines[i + 1]):
            table = BaselineTable(heading, _cells(line))
            i += 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                table.rows.append(_cells(lines[i]))
                i += 1
            tables.append(table)
            continue
        i += 1
    return tables


def matching_baselines(dataset: str, results: Path = RESULTS_FILE) -> tuple[list[BaselineTable], str]:
    """The tables (and rows) of ``results`` that name ``dataset``, and a sentence saying what was found."""
    if not results.is_file():
        return [], f"no RESULTS.md at {results} (it ships with a source checkout), so no baselines to compare with"
    kept = []
    for table in parse_tables(results.read_text(encoding="utf-8")):
        if names_dataset(table.heading, dataset):
            kept.append(table)
            continue
        rows = [r for r in table.rows if names_dataset(" ".join(r), dataset)]
        if rows:
            published = [r for r in table.rows if r and r[0].startswith("*") and not r[0].startswith("**")]
            kept.append(BaselineTable(table.heading, table.header, published + [r for r in rows if r not in published]))
    if not kept:
        return [], f"RESULTS.md has no baseline for the dataset '{dataset}' (matched by the folder name of data.path)"
    rows = sum(len(t.rows) for t in kept)
    return kept, f"{rows} baseline row(s) of RESULTS.md in {len(kept)} table(s) name the dataset '{dataset}'"
