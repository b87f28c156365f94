"""`recforge report`: a self-contained HTML page (plots, tables, config) for retrieval and ranking runs."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from recforge.cli import main
from recforge.config import config_from_dict, load_config
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train import ranking, retrieval
from recforge.train.baselines import matching_baselines, names_dataset, parse_tables
from recforge.train.report import write_report

REPO = Path(__file__).resolve().parents[2]


class Page(HTMLParser):
    """The parts of the report the tests look at: headings, images, table cells, <pre> texts, every URL."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.headings, self.images, self.cells, self.pres, self.urls = [], {}, [], [], []
        self._tag, self._text = None, []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.urls += [v for k, v in attrs.items() if k in ("src", "href", "action", "data") and v]
        if tag == "img":
            self.images[attrs["id"]] = attrs["src"]
        if tag in ("h2", "h3", "td", "th", "pre"):
            self._tag, self._text = tag, []

    def handle_data(self, data):
        if self._tag:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == self._tag:
            text = "".join(self._text).strip()
            {"pre": self.pres, "td": self.cells, "th": self.cells}.get(tag, self.headings).append(text)
            self._tag = None


def _check_self_contained(text: str, page: Page) -> None:
    assert page.urls and all(u.startswith("data:image/png;base64,") for u in page.urls), page.urls
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/|url\(", text, re.IGNORECASE)
    assert "<script" not in text.lower() and "<link" not in text.lower()


def _check_pngs(report: Path, page: Page) -> None:
    for img_id, src in page.images.items():
        png = base64.b64decode(src.split(",", 1)[1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert (report.parent / f"{img_id.removeprefix('plot-')}.png").read_bytes() == png


@pytest.fixture(scope="module")
def retrieval_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny retrieval run whose data folder is named like RESULTS.md's MovieLens-1M (ml-1m)."""
    root = tmp_path_factory.mktemp("report")
    data = write_synthetic(root / "ml-1m", SyntheticConfig(num_users=40, num_items=50, num_clusters=5, mean_seq_len=10,
                                                           min_seq_len=3, max_seq_len=30, seed=7))  # fmt: skip
    raw = {
        "name": "tiny", "data": {"path": str(data), "protocol": "paper", "max_seq_len": 20},
        "model": {"kind": "hstu", "dim": 16, "num_blocks": 1, "num_heads": 1, "dqk": 8, "dv": 8},
        "loss": {"negatives": "per_position", "num_negatives": 16},
        "train": {"epochs": 2, "batch_size": 12, "eval_every": 1, "log_every": 2, "output_dir": str(root / "{name}"),
                  "device": "cpu", "threads": 1},
        "eval": {"ks": [1, 10], "batch_size": 16},
    }  # fmt: skip
    retrieval.train(config_from_dict(raw, []), progress=False)
    return root / "tiny"


def test_retrieval_report(retrieval_run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(retrieval_run)]) == 0
    report = retrieval_run / "report" / "index.html"
    assert capsys.readouterr().out.strip() == f"report: {report}"
    text = report.read_text()
    page = Page(text)
    _check_self_contained(text, page)
    _check_pngs(report, page)
    assert {"plot-loss", "plot-throughput", "plot-metric_hr", "plot-metric_ndcg"} <= set(page.images)
    assert {"Why training stopped", "Training loss", "Final evaluation", "eval.json", "Config", "Commands"} <= set(page.headings)
    result = json.loads((retrieval_run / "eval.json").read_text())
    assert "hr@10" in page.cells and f"{result['hr@10']:.4f}" in page.cells
    assert "Paper protocol" in page.headings and "`configs/ml1m-hstu.yaml`" in page.cells  # RESULTS.md's ML-1M rows
    assert 'id="stop-reason">epochs: all 2 epoch(s) done' in text
    assert "num_blocks: 1" in page.pres[-1]  # the config


@pytest.mark.integration
def test_ranking_report(tmp_path: Path) -> None:
    data = write_synthetic(tmp_path / "tinyrank", SyntheticConfig(num_users=40, num_items=80, num_clusters=4,
                           mean_seq_len=15, max_seq_len=40, seed=3), impressions=True)  # fmt: skip
    overrides = [f"data.path={data}", f"train.output_dir={tmp_path}/{{name}}", "train.epochs=2", "model.dim=16",
                 "model.dqk=8", "model.dv=8", "model.head_hidden=16", "data.max_seq_len=64", "ranking.max_targets=16",
                 "train.batch_size=16", "eval.batch_size=64", "train.threads=1"]  # fmt: skip
    cfg = load_config(REPO / "configs" / "ranking-synthetic-hstu.yaml", overrides)
    ranking.train(cfg, progress=False)
    assert main(["--no-progress", "eval", str(cfg.run_dir), "--split", "valid"]) == 0
    report = write_report(cfg.run_dir, tmp_path / "out")
    text = report.read_text()
    page = Page(text)
    _check_self_contained(text, page)
    _check_pngs(report, page)
    assert {"plot-loss", "plot-metric_auc", "plot-metric_gauc", "plot-metric_logloss"} <= set(page.images)
    assert {"eval.json", "eval-valid.json"} <= set(page.headings)
    for task in ("click", "like", "purchase"):  # a row per task, AUC/GAUC columns
        assert page.cells.count(task) == 2
    assert {"auc", "gauc"} <= set(page.cells)
    assert "RESULTS.md has no baseline for the dataset &#x27;tinyrank&#x27;" in text
    assert any(p == f"recforge --no-progress eval {cfg.run_dir} --split valid" for p in page.pres)


def test_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a recforge run" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_baseline_matching(tmp_path: Path) -> None:
    assert names_dataset("`configs/ml1m-hstu.yaml`", "ml-1m") and names_dataset("results/ml-1m-x.json", "ml-1m")
    assert not names_dataset("results/ml-100k-x.json", "ml-1m") and not names_dataset("ml 1", "ml-1m")
    md = tmp_path / "RESULTS.md"
    md.write_text("# R\n## Beauty\n| model | hr |\n| --- | --- |\n| a | 0.1 |\n\n## Other\n| model | hr |\n|---|---|\n"
                  "| *paper* | *0.2* |\n| x `configs/ml1m.yaml` | 0.3 |\n| y `configs/beauty.yaml` | 0.4 |\n")  # fmt: skip
    assert [(t.heading, len(t.rows)) for t in parse_tables(md.read_text())] == [("Beauty", 1), ("Other", 3)]
    tables, note = matching_baselines("ml1m", md)
    assert [t.rows for t in tables] == [[["*paper*", "*0.2*"], ["x `configs/ml1m.yaml`", "0.3"]]] and "1 table" in note
    tables, _ = matching_baselines("beauty", md)
    assert [t.heading for t in tables] == ["Beauty", "Other"]
    assert matching_baselines("taobao", md)[0] == [] and "no baseline" in matching_baselines("taobao", md)[1]
    assert "no RESULTS.md" in matching_baselines("x", tmp_path / "nope.md")[1]


def test_report_renders_in_a_headless_browser(retrieval_run: Path, tmp_path: Path) -> None:
    """The page opens in a real browser (Chromium, headless) and paints: a screenshot of it is written.
    Skips where no Chromium is installed (``apt-get install chromium``)."""
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium) to render the report in")
    assert main(["report", str(retrieval_run), "--out", str(tmp_path / "report")]) == 0
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1024,1400",
                    f"--screenshot={shot}", (tmp_path / "report" / "index.html").as_uri()],
                   check=True, timeout=120, capture_output=True)  # fmt: skip
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a painted page, not a blank one
