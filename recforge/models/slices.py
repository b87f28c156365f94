"""Slices: a module saved as ``{"class": "module:QualName", "kwargs": {...}}`` and rebuilt from it.

A slice is any ``nn.Module`` with ``slice_config()`` (its constructor arguments as JSON), or an
``HSTUEncoder`` (its config). ``recforge.models.ranking.save_slices`` writes a model's prefix,
encoder and postfix this way; wrapper slices (``CandidateTower``, ``ContextCross``,
``TargetHistoryPool``) name the modules inside them with ``slice_spec``.

Loading imports the class a config.json names, so a model directory from elsewhere could make
the loader import any installed module. Only trusted classes are built: recforge's own, classes
registered with ``register_slice`` (a decorator on your prefix/postfix), and classes of the
modules listed in the ``RECFORGE_TRUSTED_SLICE_MODULES`` environment variable (comma-separated
module names, for a process such as ``recforge serve`` that did not import your code). A
config naming anything else is refused before any import.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from torch import nn

from recforge.env import TRUSTED_SLICE_MODULES, trusted_slice_modules
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
    return {"class": slice_path(type(module)), "kwargs": slice_config(module)}


_registered: dict[str, type] = {}


def register_slice(cls: type) -> type:
    """Let ``load_slices`` build this class from a saved config (use as a class decorator).

    Example:
        >>> @register_slice
        ... class MyPrefix(nn.Module):
        ...     def slice_config(self): return {...}
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_slice takes an nn.Module subclass, got {cls!r}")
    _registered[slice_path(cls)] = cls
    return cls


def slice_path(cls: type) -> str:
    """``"module:QualName"`` of a class, as a slice's config.json names it."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _trusted(module_name: str) -> bool:
    if module_name == "recforge" or module_name.startswith("recforge."):
        return True
    listed = trusted_slice_modules()
    return any(module_name == m or module_name.startswith(m + ".") for m in listed)


def build_slice(class_path: str, kwargs: dict) -> nn.Module:
    """A new module of ``class_path`` (``"package.module:QualName"``) built from ``kwargs``; the class
    must be trusted (see the module doc), which is checked before anything is imported."""
    module_name, _, qualname = class_path.partition(":")
    cls: Any = _registered.get(class_path)
    if cls is None:
        if not _trusted(module_name):
            raise ValueError(
                f"slice class {class_path!r} is not trusted: a saved model may only name recforge's classes, "
                f"classes registered with recforge.models.register_slice, or classes of modules listed in "
                f"{TRUSTED_SLICE_MODULES} (e.g. {TRUSTED_SLICE_MODULES}={module_name.split('.')[0] or 'mypackage'}). "
                "Register or list yours if you wrote this model; otherwise do not load it"
            )
        try:
            cls = importlib.import_module(module_name)
            for part in qualname.split("."):  # through classes only: never into a module the trusted one imported
                cls = getattr(cls, part) if part.isidentifier() else None
                if not isinstance(cls, type):
                    break
        except (ImportError, AttributeError) as err:
            raise ValueError(
                f"slice class {class_path!r} cannot be imported ({err}); install the package that defines it"
            ) from err
        if isinstance(cls, type) and not _trusted(cls.__module__) and _registered.get(slice_path(cls)) is not cls:
            raise ValueError(f"slice class {class_path!r} is {slice_path(cls)}, which is not trusted")  # a re-export
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"slice class {class_path!r} is not an nn.Module")
    if cls is HSTUEncoder:
        return HSTUEncoder(HSTUConfig(**kwargs))
    return cls(**kwargs)


__all__ = ["build_slice", "register_slice", "slice_config", "slice_path", "slice_spec"]
