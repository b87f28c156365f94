"""An exported model directory (``RUN_DIR/model``, written by ``save_slices``): finding it, its
version, its vocabulary, and loading it with errors that name the directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from recforge.models.ranking import RankingModel, load_slices


def model_dir_of(run_dir: str | Path) -> Path:
    """``RUN_DIR/model``, or ``run_dir`` itself when it is a model directory; ValueError when neither."""
    run_dir = Path(run_dir)
    model_dir = run_dir / "model" if (run_dir / "model" / "manifest.json").is_file() else run_dir
    if not (model_dir / "manifest.json").is_file():
        raise ValueError(f"{run_dir} holds no exported model (no model/manifest.json); run `recforge eval {run_dir}`")
    return model_dir


def model_version(model_dir: Path) -> str:
    """Identity of an exported model: its manifest's step and the weights files' sizes and mtimes."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    stats = [(p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(model_dir.glob("*/model.safetensors"))]
    return f"step{manifest.get('step', '?')}-{abs(hash(tuple(stats))) % 10**10:010d}"


def read_vocab(model_dir: Path) -> dict | None:
    """``vocab.json`` (raw IDs -> model codes), or None when the model has none."""
    path = model_dir / "vocab.json"
    return json.loads(path.read_text()) if path.is_file() else None


def stage_model(run_dir: str | Path, dtype: torch.dtype) -> tuple[RankingModel, dict, dict | None, str]:
    """Load ``run_dir``'s exported model into host memory: (model in ``dtype``, manifest, vocab, version).

    Any problem with the directory (missing or truncated files, an
    untrusted slice class, bad JSON) raises ``ValueError`` naming it."""
    model_dir = model_dir_of(run_dir)
    try:
        model, manifest = load_slices(model_dir)
        vocab = read_vocab(model_dir)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors/OS errors: the directory is unusable
        raise ValueError(f"cannot load the model in {model_dir}: {type(err).__name__}: {err}") from err
    return model.eval().to(dtype=dtype), manifest, vocab, model_version(model_dir)


__all__ = ["model_dir_of", "model_version", "read_vocab", "stage_model"]
