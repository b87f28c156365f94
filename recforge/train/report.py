"""`recforge report RUN_DIR`: one self-contained HTML page about a training run, to send to a team.

Reads what the run wrote (``train_log.jsonl``, ``evals.jsonl``, ``eval.json``/``eval-valid.json``,
``run.json``, ``config.yaml``) and writes ``RUN_DIR/report/index.html`` with its plots embedded as
base64 PNG (no network, no external file), plus the same PNGs beside it. Works for every recipe:
the metric curves and tables are built from whatever numeric keys the run logged.

Example:
    >>> path = write_report("runs/demo/demo")  # doctest: +SKIP
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from recforge.io import atomic_file
from recforge.train.baselines import RESULTS_FILE, matching_baselines
from recforge.train.report_html import render_html

RUN_MARKERS = ("config.yaml", "run.json", "train_log.jsonl")
# evaluation keys that are bookkeeping, not metrics to plot
_NOT_METRICS = {"step", "epoch", "elapsed_s", "time", "impressions", "eval_seconds", "users", "num_users", "examples"}


@dataclass
class RunRecord:
    """Everything the report shows, read from one run directory."""

    run_dir: Path
    config: dict
    config_text: str
    run: dict
    steps: list[dict]
    evals: list[dict]
    finals: dict[str, dict] = field(default_factory=dict)  # file name -> eval JSON


def _read_jsonl(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a run killed mid-write leaves a partial last line)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); re-create it (`recforge eval RUN_DIR` rewrites eval.json)") from err


def load_run(run_dir: str | Path) -> RunRecord:
    """Read a run directory; ``ValueError`` naming the folder when it is not a recforge run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a directory; pass a run folder written by `recforge train` (e.g. runs/NAME)")
    if not any((run_dir / name).is_file() for name in RUN_MARKERS):
        raise ValueError(f"{run_dir} is not a recforge run: it has none of {', '.join(RUN_MARKERS)}; "
                         "pass the folder `recforge train` wrote (train.output_dir/NAME)")  # fmt: skip
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8") if config_path.is_file() else ""
    config = yaml.safe_load(config_text) or {} if config_text else {}
    run = _read_json(run_dir / "run.json") if (run_dir / "run.json").is_file() else {}
    finals = {p.name: _read_json(p) for p in sorted(run_dir.glob("eval*.json"))}
    return RunRecord(run_dir, config, config_text, run, _read_jsonl(run_dir / "train_log.jsonl"),
                     _read_jsonl(run_dir / "evals.jsonl"), finals)  # fmt: skip


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def metric_groups(rows: list[dict]) -> dict[str, dict[str, str]]:
    """Group the metric keys of evaluation rows into plots: ``click/auc`` -> plot ``auc``, line ``click``;
    ``hr@10`` -> plot ``hr``, line ``@10``; any other numeric key is a plot of its own."""
    groups: dict[str, dict[str, str]] = {}
    for row in rows:
        for key, value in row.items():
            if not _is_number(value) or key in _NOT_METRICS or key.endswith(("_users", "positive_rate")):
                continue
            if "/" in key:
                line, plot = key.rsplit("/", 1)
            elif m := re.fullmatch(r"(.+?)(@\d+)", key):
                plot, line = m.group(1), m.group(2)
            else:
                plot, line = key, key
            groups.setdefault(plot, {})[line] = key
    return groups


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _figures(record: RunRecord) -> dict[str, object]:
    """name -> matplotlib Figure (no pyplot: no global state, no display backend)."""
    from matplotlib.figure import Figure

    figs = {}
    steps = [r for r in record.steps if _is_number(r.get("loss"))]
    if steps:
        fig = Figure(figsize=(7, 3.6), layout="constrained")
        ax = fig.add_subplot()
        x, y = [r["step"] for r in steps], [r["loss"] for r in steps]
        ax.plot(x, y, color="#9bb7d4", linewidth=0.8, label="per step")
        window = max(1, len(y) // 50)
        if window > 1:
            ax.plot(x, _moving_average(y, window), color="#1f4e79", linewidth=1.6, label=f"mean of {window} steps")
        ax.set(xlabel="step", ylabel="training loss", title="Training loss")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
        figs["loss"] = fig
    speed = [r for r in record.steps if _is_number(r.get("tokens_per_s"))]
    if speed:
        fig = Figure(figsize=(7, 3.6), layout="constrained")
        ax = fig.add_subplot()
        ax.plot([r["step"] for r in speed], [r["tokens_per_s"] for r in speed], marker=".", color="#2e7d32")
        ax.set(xlabel="step", ylabel="tokens / s", title="Throughput (per log interval)")
        ax.grid(alpha=0.3)
        mfu = [r for r in speed if _is_number(r.get("mfu"))]
        if mfu:
            ax2 = ax.twinx()
            ax2.plot([r["step"] for r in mfu], [100 * r["mfu"] for r in mfu], color="#c62828", linestyle="--", label="MFU %")
            ax2.set_ylabel("MFU (%)")
            ax2.legend(loc="lower right")
        figs["throughput"] = fig
    evals = [r for r in record.evals if _is_number(r.get("step"))]
    for plot, lines in metric_groups(evals).items():
        fig = Figure(figsize=(5.2, 3.2), layout="constrained")
        ax = fig.add_subplot()
        for line, key in sorted(lines.items(), key=_line_order):
            pts = [(r["step"], r[key]) for r in evals if _is_number(r.get(key))]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=line)
        split = ", ".join(sorted({str(r.get("split", "valid")) for r in evals}))
        ax.set(xlabel="step", ylabel=plot, title=f"{plot} ({split})")
        if len(lines) > 1 or plot not in lines:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        figs[f"metric_{re.sub(r'[^A-Za-z0-9_.-]', '_', plot)}"] = fig
    return figs


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def dataset_name(config: dict) -> str:
    """The dataset folder's name from ``data.path`` (``data/ml-1m`` -> ``ml-1m``)."""
    path = str((config.get("data") or {}).get("path") or "")
    return Path(path.rstrip("/")).name if path else ""


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, results: Path = RESULTS_FILE) -> Path:
    """Write ``index.html`` (plots embedded) and the PNGs to ``out_dir`` (default ``RUN_DIR/report``); its path."""
    record = load_run(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else record.run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    images = {}
    for name, fig in _figures(record).items():
        images[name] = data = _png(fig)
        with atomic_file(out_dir / f"{name}.png") as tmp:
            tmp.write_bytes(data)
    dataset = dataset_name(record.config)
    baselines, baseline_note = matching_baselines(dataset, results) if dataset else ([], "the config names no data.path")
    page = render_html(record, images, baselines, baseline_note)
    index = out_dir / "index.html"
    with atomic_file(index) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return index


def _line_order(item: tuple[str, str]) -> tuple[int, str]:
    """Lines ``@5`` before ``@10`` (numerically), then any other line by name."""
    line = item[0]
    return (int(line[1:]), "") if re.fullmatch(r"@\d+", line) else (1 << 30, line)
