"""Slices: a module saved as ``{"class": "module:QualName", "kwargs": {...}}`` and rebuilt from it.

A slice is any ``nn.Module`` with ``slice_config()`` (its constructor arguments as JSON), or an
``HSTUEncoder`` (its config). ``recforge.models.ranking.save_slices`` writes a model's prefix,
encoder and postfix this way; wrapper slices (``CandidateTower``, ``ContextCross``,
``TargetHistoryPool``) name the modules inside them with ``slice_spec``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from torch import nn

from recforge.models.hstu import HSTUConfig, HSTUEncoder


def slice_config(module: nn.Module) -> dict:
    """A slice's constructor arguments (JSON): ``slice_config()``, or the config of an ``HSTUEncoder``."""
    if isinstance(module, HSTUEncoder):
        return dataclasses.asdict(module.cfg)
    if not hasattr(module, "slice_config"):
        raise TypeError(
            f"{type(module).__name__} cannot be saved as a slice: give it a slice_config() method returning its "
            "constructor arguments as a JSON-serialisable dict"
        )
    return module.slice_config()


def slice_spec(module: nn.Module) -> dict:
    """``{"class", "kwargs"}`` of a module: what a slice's config.json holds, and how a wrapper
    slice (TargetHistoryPool, ContextCross, CandidateTower) names the modules inside it."""
    cls = type(module)
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "kwargs": slice_config(module)}


def build_slice(class_path: str, kwargs: dict) -> nn.Module:
    """A new module of ``class_path`` (``"package.module:QualName"``) built from ``kwargs``."""
    module_name, _, qualname = class_path.partition(":")
    try:
        cls: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"slice class {class_path!r} cannot be imported ({err}); install the package that defines it") from err
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"slice class {class_path!r} is not an nn.Module")
    if cls is HSTUEncoder:
        return HSTUEncoder(HSTUConfig(**kwargs))
    return cls(**kwargs)


__all__ = ["build_slice", "slice_config", "slice_spec"]
