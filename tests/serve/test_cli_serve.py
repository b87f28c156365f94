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
    assert "--http-workers 'many'" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "runs/x"]).http_workers == "auto"


def test_serve_and_export_parse_their_options() -> None:
    args = build_parser().parse_args(["serve", "runs/x", "--port", "9000", "--dtype", "bfloat16", "--cache-mb", "0"])
    assert (args.port, args.dtype, args.cache_mb, args.token_budget) == (9000, "bfloat16", 0.0, 8192)
    args = build_parser().parse_args(["export", "runs/x", "--out", "runs/x/export", "--formats", "onnx"])
    assert args.formats == "onnx"


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
