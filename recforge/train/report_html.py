"""The run report's HTML: one page, inline CSS, plots as base64 PNG, no script and no external URL."""

from __future__ import annotations

import base64
import html
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recforge.train.baselines import BaselineTable
    from recforge.train.report import RunRecord

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; color: #1b1b1b; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d0d7de; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; } th { background: #f3f5f7; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; border-radius: 4px; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; } .plots img { max-width: 100%; border: 1px solid #eee; }
.note { color: #555; } .stop { padding: 0.5em 0.8em; background: #eef6ee; border-left: 4px solid #2e7d32; }
.stop.bad { background: #fdecea; border-color: #c62828; }
"""
_META_KEYS = ("split", "dataset", "model", "checkpoint", "step", "epoch", "command")


def _e(value) -> str:
    return html.escape(str(value))


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _table(header: list[str], rows: list[list], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _img(name: str, png: bytes) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<figure><img alt="{_e(name)}" id="plot-{_e(name)}" src="data:image/png;base64,{data}"></figure>'


def eval_tables(result: dict) -> str:
    """An eval JSON as tables: ``task/metric`` keys pivoted (a row per task), other numbers as name/value."""
    numeric = {k: v for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    per_task: dict[str, dict[str, float]] = {}
    flat = []
    for key, value in numeric.items():
        if "/" in key:
            task, metric = key.rsplit("/", 1)
            per_task.setdefault(task, {})[metric] = value
        elif key not in ("step", "epoch"):
            flat.append([key, value])
    parts = []
    if per_task:
        metrics = list(dict.fromkeys(m for d in per_task.values() for m in d))
        rows = [[task, *(d.get(m, "-") for m in metrics)] for task, d in per_task.items()]
        parts.append(_table(["task", *metrics], rows, "eval-tasks"))
    if flat:
        parts.append(_table(["metric", "value"], flat, "eval-metrics"))
    meta = [[k, result[k]] for k in _META_KEYS if k in result and k != "command"]
    if meta:
        parts.append(_table(["", ""], meta, "eval-meta"))
    return "".join(parts)


def _stop(run: dict) -> str:
    if not run:
        return '<p class="note">No run.json: this run predates stop reasons, or was killed before its first step.</p>'
    reason = run.get("stop_reason", "unknown")
    bad = reason in ("error", "running", "killed")
    text = f"{_e(reason)}: {_e(run.get('stop_message', ''))}"
    facts = [f"{k.replace('_', ' ')}: {_e(_fmt(run[k]))}" for k in ("epochs_completed", "global_step", "train_minutes", "finished_at")
             if k in run]  # fmt: skip
    return f'<p class="stop{" bad" if bad else ""}" id="stop-reason">{text}</p><p class="note">{"; ".join(facts)}</p>'


def _baselines(tables: list[BaselineTable], note: str) -> str:
    parts = [f'<p class="note" id="baseline-note">{_e(note)}</p>']
    for t in tables:
        width = len(t.header)
        rows = [(r + [""] * width)[:width] for r in t.rows]
        parts.append(f"<h3>{_e(t.heading)}</h3>" + _table(t.header, rows, "baselines"))
    return "".join(parts)


def _commands(record: RunRecord) -> str:
    cmds = []
    if record.run.get("command"):
        cmds.append(("train", record.run["command"]))
    for name, result in record.finals.items():
        if result.get("command"):
            cmds.append((name, result["command"]))
    if not cmds:
        return '<p class="note">No command recorded.</p>'
    return "".join(f"<p>{_e(what)}</p><pre>{_e(cmd)}</pre>" for what, cmd in cmds)


def render_html(record: RunRecord, images: dict[str, bytes], baselines: list[BaselineTable], baseline_note: str) -> str:
    """The whole page as one string."""
    name = record.config.get("name") or record.run_dir.name
    recipe = record.config.get("recipe", "retrieval")
    model = (record.config.get("model") or {}).get("kind", "")
    data_path = (record.config.get("data") or {}).get("path", "")
    curves = [n for n in images if n.startswith("metric_")]
    body = [
        f"<h1>Run report: {_e(name)}</h1>",
        f'<p class="note">recipe {_e(recipe)}, model {_e(model)}, data {_e(data_path)}; run folder {_e(record.run_dir)}</p>',
        "<h2>Why training stopped</h2>", _stop(record.run),
        "<h2>Training loss</h2>",
        _img("loss", images["loss"]) if "loss" in images else '<p class="note">train_log.jsonl has no loss rows.</p>',
        "<h2>Throughput</h2>",
        _img("throughput", images["throughput"]) if "throughput" in images
        else '<p class="note">No throughput rows yet (logged once per train.log_every steps).</p>',
        "<h2>Evaluation during training</h2>",
        '<div class="plots">' + "".join(_img(n, images[n]) for n in curves) + "</div>" if curves
        else '<p class="note">evals.jsonl has no evaluations (train.eval_every=0, or none finished).</p>',
        "<h2>Final evaluation</h2>",
    ]  # fmt: skip
    if record.finals:
        body += [f"<h3>{_e(fname)}</h3>" + eval_tables(result) for fname, result in record.finals.items()]
    else:
        body.append('<p class="note">No eval.json: run `recforge eval RUN_DIR` to write one.</p>')
    body += ["<h2>Baselines (RESULTS.md)</h2>", _baselines(baselines, baseline_note),
             "<h2>Commands</h2>", _commands(record),
             "<h2>Config</h2>", f'<pre id="config">{_e(record.config_text or "(no config.yaml)")}</pre>']  # fmt: skip
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>recforge run report: {_e(name)}</title><style>{_CSS}</style></head>\n"
            f"<body>{''.join(body)}</body></html>\n")  # fmt: skip
