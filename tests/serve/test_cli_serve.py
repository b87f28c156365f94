"""`recforge serve` / `recforge export` argument handling (the server itself is tested in test_server.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest
from _serve_helpers import build_model, export, random_history

from recforge.cli import build_parser, main


def test_serve_rejects_a_directory_without_a_model(tmp_path, capsys) -> None:
    assert main(["serve", str(tmp_path)]) == 2
    assert "no exported model" in capsys.readouterr().err


def test_serve_with_frontend_processes_checks_its_arguments_first(tmp_path, capsys) -> None:
    assert main(["serve", str(tmp_path), "--http-workers", "2", "--device", "cpu"]) == 2
    assert "no exported model" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--http-workers", "many"]) == 2
    assert "http_workers: expected auto or a number" in capsys.readouterr().err


def test_serve_and_export_parse_their_options() -> None:
    from recforge.serve.config import load_serve_config

    args = build_parser().parse_args(["serve", "runs/x", "--port", "9000", "--dtype", "bfloat16", "--cache-mb", "0"])
    flags = {k: v for k, v in vars(args).items() if k in ("port", "engine.dtype", "cache.device_mb")}
    cfg = load_serve_config(args.config, args.overrides, flags)
    assert (cfg.port, cfg.engine.dtype, cfg.cache.device_mb, cfg.scheduler.token_budget) == (9000, "bfloat16", 0.0, 8192)
    args = build_parser().parse_args(["export", "runs/x", "--out", "runs/x/export", "--formats", "onnx"])
    assert args.formats == "onnx"


def test_serve_refuses_a_bad_config_before_loading_anything(tmp_path, capsys) -> None:
    (tmp_path / "serve.yaml").write_text("scheduler: {token_budget: 0}\n")
    assert main(["serve", "--config", str(tmp_path / "serve.yaml"), str(tmp_path), "engine.dtype=fp8"]) == 2
    err = capsys.readouterr().err
    assert "scheduler.token_budget: must be >= 1" in err and "engine.dtype: 'fp8'" in err


def test_export_rejects_unknown_formats(tmp_path, capsys) -> None:
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o"), "--formats", "tflite"]) == 2
    assert "unknown export formats" in capsys.readouterr().err


@pytest.mark.integration
def test_recforge_serve_answers_over_http(tmp_path) -> None:
    """`recforge serve RUN_DIR` in a subprocess: /health, then a real POST /v1/rank on loopback."""
    run = export(build_model(), tmp_path / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "recforge.cli", "serve", str(run), "--port", str(port),
                               "--device", "cpu", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail(f"server did not come up: {server.stdout.read1().decode()[-2000:]}")
        hist = random_history(20, seed=1)
        body = {"user_id": 5, "history": hist, "candidates": [1001, 1002], "timestamp": hist["timestamps"][-1] + 1}
        response = httpx.post(f"{url}/v1/rank", json=body, timeout=30)
        assert response.status_code == 200, response.text
        assert len(response.json()["scores"]["click"]) == 2
        assert httpx.post(f"{url}/v1/rank", json={**body, "candidates": [5]}, timeout=30).status_code == 422
    finally:
        server.terminate()
        server.wait(timeout=30)
