"""An exported model directory (``RUN_DIR/model``, written by ``save_slices``): finding it, its
version, its vocabulary, and reloading a live model's weights from it slice by slice."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from recforge.models.ranking import SLICES, RankingModel, load_slice
from recforge.models.slices import slice_spec


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


def reload_slices(model: RankingModel, model_dir: Path, device: torch.device, dtype: torch.dtype) -> dict:
    """Replace ``model``'s weights with ``model_dir``'s, one slice at a time (never two whole models in
    memory); returns the new manifest. A slice with the same class and config is loaded in place
    (one slice's worth of extra memory); another is freed, then rebuilt."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    for name in SLICES:
        current = getattr(model, name)
        config = json.loads((model_dir / name / "config.json").read_text())
        try:
            same = slice_spec(current) == {"class": config["class"], "kwargs": config["kwargs"]}
        except TypeError:  # a module without slice_config(): rebuild it from the saved config
            same = False
        if same:
            weights = load_file(model_dir / name / "model.safetensors")
            current.load_state_dict(weights)
            del weights
        else:
            setattr(model, name, None)
            del current
            setattr(model, name, load_slice(model_dir / name).eval().to(device, dtype))
    model.eval().to(device, dtype)
    return manifest


__all__ = ["model_dir_of", "model_version", "read_vocab", "reload_slices"]
