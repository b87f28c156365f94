"""Checkpoints: safetensors tensors + a JSON manifest, written atomically.

Layout inside a run directory::

    checkpoints/
      step_00000480/            one directory per checkpoint, renamed into place when complete
        model.safetensors
        optimizer.safetensors   AdamW moments and step counts, flattened by parameter index
        sparse/                 the model's dynamic tables, if any (recforge.sparse.checkpoint)
        sparse_sharded/         torchrun with dynamic tables: every rank's shards (recforge.sparse.sharded_checkpoint),
                                restored on any number of ranks, and merged when one process loads them (eval)
        manifest.json           step, epoch, config, optimizer param_groups, metrics, files
      latest.json               {"step_dir": "step_00000480"}   replaced atomically
      best.json                 same, for the best validation checkpoint (clean protocol)

Nothing is unpickled on load: safetensors and JSON only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from recforge.io import atomic_directory, atomic_write_json
from recforge.sparse.checkpoint import load_sparse_checkpoint, module_tables, write_sparse
from recforge.sparse.sharded import sharded_tables
from recforge.sparse.sharded_checkpoint import load_merged, load_sharded_checkpoint

FORMAT_VERSION = 1


class CorruptCheckpointError(ValueError):
    """A checkpoint file cannot be read (truncated, overwritten, not JSON): the message names it."""


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors do not fit the model built from the current config."""


def _optimizer_tensors(state: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    tensors = {}
    for index, param_state in state["state"].items():
        for key, value in param_state.items():
            tensors[f"state.{index}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, state["param_groups"]


def save_checkpoint(
    run_dir: Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    manifest: dict,
    keep: int = 2,
    best: bool = False,
    sharded_sparse: Path | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict | None = None,
) -> Path:
    """Write ``checkpoints/step_<8-digit step>`` atomically, move the ``latest`` pointer, prune old ones.

    Args:
        run_dir: the run directory.
        step: global step, names the checkpoint.
        model: module whose ``state_dict`` is saved.
        optimizer: optimizer to save alongside (None for weights only).
        manifest: JSON-serialisable training state (epoch, config, metrics...).
        keep: how many most recent checkpoints to keep (the best one is always kept).
        best: also point ``best.json`` at this checkpoint.
        sharded_sparse: a sharded sparse checkpoint all ranks just wrote (``save_sharded_checkpoint``):
            moved into this checkpoint as ``sparse_sharded/`` (no whole-table export: a single process
            loading it merges the shards, ``load_merged``).
        weights, optimizer_state: the full (unsharded) ``state_dict``s to save instead of the
            model's and optimizer's own (FSDP2: see ``distributed.full_dense_state``).
    """
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    with atomic_directory(ckpt_root / name) as tmp:
        weights = {k: v.detach().cpu().contiguous() for k, v in (weights or model.state_dict()).items()}
        save_file(weights, tmp / "model.safetensors")
        full_manifest = {"format_version": FORMAT_VERSION, "step": step, "files": {"model": "model.safetensors"}, **manifest}
        if optimizer is not None:
            tensors, groups = _optimizer_tensors(optimizer_state or optimizer.state_dict())
            save_file(tensors, tmp / "optimizer.safetensors")
            full_manifest["files"]["optimizer"] = "optimizer.safetensors"
            full_manifest["optimizer_param_groups"] = groups
        if sharded_sparse is not None:
            os.replace(sharded_sparse, tmp / "sparse_sharded")
            full_manifest["files"]["sparse_sharded"] = "sparse_sharded"
        elif tables := module_tables(model):  # rows, their optimizer state, policy counters, hash keys
            (tmp / "sparse").mkdir()
            write_sparse(tmp / "sparse", tables)
            full_manifest["files"]["sparse"] = "sparse"
        # a plain write: the directory is renamed into place whole, its files fsynced first (atomic_directory)
        (tmp / "manifest.json").write_text(json.dumps(full_manifest, indent=2) + "\n")
    atomic_write_json(ckpt_root / "latest.json", {"step_dir": name})
    if best:
        atomic_write_json(ckpt_root / "best.json", {"step_dir": name})
    _prune(ckpt_root, keep)
    return ckpt_root / name


def _read_json(path: Path, what: str) -> dict:
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"{path}: cannot read the {what} ({err}); it was damaged after it was written "
                                     "(recforge replaces it atomically)") from err  # fmt: skip
    if not isinstance(payload, dict):
        raise CorruptCheckpointError(f"{path}: the {what} is not a JSON object")
    return payload


def _pointer(ckpt_root: Path, which: str) -> str | None:
    path = ckpt_root / f"{which}.json"
    if not path.is_file():
        return None
    name = _read_json(path, f"{which}-checkpoint pointer").get("step_dir")
    if not isinstance(name, str) or not re.fullmatch(r"step_\d+", name):
        raise CorruptCheckpointError(f"{path}: expected {{\"step_dir\": \"step_NNNNNNNN\"}}, got step_dir={name!r}")
    return name


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's complete checkpoint directories, newest step first."""
    ckpt_root = Path(run_dir) / "checkpoints"
    return sorted((p for p in ckpt_root.glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d+", p.name)), reverse=True)


def resume_candidates(run_dir: Path) -> tuple[list[Path], list[str]]:
    """Checkpoints to resume from, in order of preference: the ``latest`` one, then older ones.

    Returns (candidates, warnings): a damaged or dangling ``latest.json`` is a warning, and the
    newest checkpoint directory is used instead.
    """
    ckpt_root, warnings = Path(run_dir) / "checkpoints", []
    found = checkpoint_dirs(run_dir)
    try:
        latest = _pointer(ckpt_root, "latest")
    except CorruptCheckpointError as err:
        warnings.append(f"{err}; using the newest checkpoint directory instead")
        latest = None
    if latest is not None and not (ckpt_root / latest).is_dir():
        warnings.append(f"{ckpt_root / 'latest.json'} points at {latest}, which does not exist; using the newest "
                        "checkpoint directory instead")  # fmt: skip
        latest = None
    first = [ckpt_root / latest] if latest else []
    return first + [p for p in found if p.name != latest], warnings


def _prune(ckpt_root: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (never best/latest) and what crashed saves left behind:
    sharded-sparse staging (``.sparse-<step>``) and temporary directories (``.<name>.tmp-*``, ``.<name>.old-*``).
    Runs on rank 0 after a save completed, while no rank is writing."""
    for leftover in [*ckpt_root.glob(".sparse-*"), *ckpt_root.glob(".*.tmp-*"), *ckpt_root.glob(".*.old-*")]:
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    protected = set()
    for which in ("best", "latest"):
        try:
            protected.add(_pointer(ckpt_root, which))
        except CorruptCheckpointError:  # prune nothing on a damaged pointer: it may have named any of them
            return
    steps = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        if old.name not in protected:
            shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(run_dir: Path, which: str = "latest") -> Path | None:
    """Path of the ``latest`` or ``best`` checkpoint of a run, or None when there is none."""
    ckpt_root = Path(run_dir) / "checkpoints"
    name = _pointer(ckpt_root, which)
    return ckpt_root / name if name else None


def read_manifest(path: Path) -> dict:
    """A checkpoint directory's manifest alone (e.g. what size of model to build before loading its weights)."""
    manifest_path = Path(path) / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{path} is not a recforge checkpoint (no manifest.json)")
    return _read_json(manifest_path, "checkpoint manifest")


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, device: str | torch.device = "cpu"
) -> dict:
    """Load weights (and optimizer state) from a checkpoint directory; return its manifest."""
    path = Path(path)
    try:
        return _load(path, model, optimizer, device)
    except CorruptCheckpointError as err:
        others = [p.name for p in checkpoint_dirs(path.parent.parent) if p != path]
        hint = (f"; this run has other checkpoints ({', '.join(others)}): `recforge eval --checkpoint "
                f"{path.parent / others[0]}` reads one, and `recforge train ... --resume` falls back to them"
                if others else "; the run has no other checkpoint to fall back to")  # fmt: skip
        raise CorruptCheckpointError(f"{err}{hint}") from err


def _load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: str | torch.device) -> dict:
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{path} is not a recforge checkpoint (no manifest.json)")
    manifest = _read_json(manifest_path, "checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {manifest.get('format_version')} is not supported")
    weights = _load_tensors(path / manifest["files"]["model"], device)
    current = model.state_dict()
    _check_shapes(path, weights, current)
    model.load_state_dict({k: _like(v, current.get(k)) for k, v in weights.items()})
    files = manifest["files"]
    sharded, tables = sharded_tables(model), module_tables(model)
    if (sharded or tables) and not ({"sparse", "sparse_sharded"} & set(files)):
        raise ValueError(f"{path} holds no dynamic-table state; it was saved by a model without one (model.embedding)")
    if sharded:  # torchrun: this rank's shards, from a sharded checkpoint of any world size or a single-process one
        load_sharded_checkpoint(path / files.get("sparse_sharded", files.get("sparse")), sharded)
    elif tables and "sparse" in files:
        load_sparse_checkpoint(path / files["sparse"], tables)
    elif tables:  # one process reading a torchrun checkpoint: every shard's rows merged
        load_merged(path / files["sparse_sharded"], tables)
    if optimizer is not None:
        if "optimizer" not in manifest["files"]:
            raise ValueError(f"{path} holds no optimizer state; cannot resume training from it")
        flat = _load_tensors(path / manifest["files"]["optimizer"], device)
        state: dict[int, dict] = {}
        for key, value in flat.items():
            _, index, name = key.split(".", 2)
            if name == "step":
                value = value.cpu()  # AdamW keeps non-capturable step counts on the CPU
            state.setdefault(int(index), {})[name] = value
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved_count = sum(len(g["params"]) for g in manifest["optimizer_param_groups"])  # a state_dict's groups
        if saved_count != len(params):
            raise CheckpointMismatchError(
                f"{path}: its optimizer state covers {saved_count} parameters, this run trains {len(params)}: the trainable "
                "parameters changed (e.g. generative.dense_freeze or the model's shape); resume with the run's settings")
        state = {i: {k: v if k == "step" else _like(v, params[i]) for k, v in s.items()} for i, s in state.items()}
        # the saved hyperparameters (lr, betas, ...), but this run's implementation (fused on one device kind,
        # foreach, capturable): a checkpoint written without fusing (older CPU runs, FSDP2) must not turn the fused
        # kernel off, and torch places ``step`` by these flags (on the device when fused)
        groups = [{**saved, **{k: live[k] for k in IMPLEMENTATION_KEYS if k in live}}
                  for saved, live in zip(manifest["optimizer_param_groups"], optimizer.param_groups, strict=False)]  # fmt: skip
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return manifest


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def _load_tensors(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    try:
        return load_file(path, device=str(device))
    except (SafetensorError, OSError) as err:
        raise CorruptCheckpointError(f"{path}: cannot read the checkpoint's tensors ({err}); the file is truncated "
                                     "or damaged") from err  # fmt: skip


def _check_shapes(path: Path, saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    """Raise ``CheckpointMismatchError`` naming the tensors that do not fit (instead of PyTorch's traceback)."""
    problems = [f"{k}: saved {tuple(v.shape)}, model {tuple(current[k].shape)}"
                for k, v in saved.items() if k in current and tuple(v.shape) != tuple(current[k].shape)]  # fmt: skip
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    problems += [f"{k}: not in the checkpoint" for k in missing[:5]] + [f"{k}: not in the model" for k in unexpected[:5]]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointMismatchError(f"{path} does not fit the model built from the current config ({shown})"
                                      f"{_switch_hint(missing, unexpected)}")  # fmt: skip


def _switch_hint(missing: list[str], unexpected: list[str]) -> str:
    """The config switch that explains a mismatch made only of HSTU relative-bias weights, if that is all it is."""
    if not (missing or unexpected) or not all(k.rsplit(".", 1)[-1] == "pos_weights" for k in missing + unexpected):
        return ""
    saved = "with" if unexpected else "without"
    return (f"; the checkpoint was trained {saved} the relative position bias: set model.relative_bias="
            f"{'true' if unexpected else 'false'} to match it")


def _like(full: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
    """``full`` sharded as ``reference`` when that is a DTensor (FSDP2 weights and moments), else as is."""
    tensors = sys.modules.get("torch.distributed.tensor")  # not imported here (0.5 s+): FSDP2 has loaded it
    if tensors is None or not isinstance(reference, tensors.DTensor):
        return full
    return tensors.distribute_tensor(full.to(reference.device), reference.device_mesh, reference.placements)
