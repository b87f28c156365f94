"""`recforge serve` / `recforge export` argument handling (the server itself is tested in test_server.py)."""

from __future__ import annotations

from recforge.cli import build_parser, main


def test_serve_rejects_a_directory_without_a_model(tmp_path, capsys) -> None:
    assert main(["serve", str(tmp_path)]) == 2
    assert "no exported model" in capsys.readouterr().err


def test_serve_and_export_parse_their_options() -> None:
    args = build_parser().parse_args(["serve", "runs/x", "--port", "9000", "--dtype", "bfloat16", "--cache-mb", "0"])
    assert (args.port, args.dtype, args.cache_mb, args.token_budget) == (9000, "bfloat16", 0.0, 8192)
    args = build_parser().parse_args(["export", "runs/x", "--out", "runs/x/export", "--formats", "onnx"])
    assert args.formats == "onnx"


def test_export_rejects_unknown_formats(tmp_path, capsys) -> None:
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o"), "--formats", "tflite"]) == 2
    assert "unknown export formats" in capsys.readouterr().err
