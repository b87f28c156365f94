"""The recipe registry: the one place that maps a config's ``recipe:`` to its functions.

Each recipe is a module of ``recforge.train`` with ``train(cfg, resume=, progress=)`` and
``evaluate_run(run_dir, checkpoint=, split=, command=)``; a ranking run also exports its serving
model (``RUN_DIR/model``: prefix/encoder/postfix slices) when it trains and evaluates, which
`recforge serve` and `recforge export` read. An unknown name is refused with the known ones;
``recforge.config`` checks ``recipe:`` against the same names (a test keeps the two equal).

Example:
    >>> recipe = get_recipe(cfg.recipe)
    >>> summary = recipe.train(cfg)
    >>> metrics = recipe.evaluate(cfg.run_dir, split="test")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


def _retrieval() -> ModuleType:
    from recforge.train import retrieval

    return retrieval


def _ranking() -> ModuleType:
    from recforge.train import ranking

    return ranking


def _generative() -> ModuleType:
    from recforge.train import generative

    return generative


@dataclass(frozen=True)
class Recipe:
    """One training workflow: what it does, its module (imported on first use), what it reports and exports."""

    name: str
    description: str
    module: Callable[[], ModuleType]
    metrics: str  # what its summaries hold: "topk" (hr@K, ndcg@K, mrr) | "ranking" (per task: auc, gauc, logloss, rmse)
    serving_model: bool  # writes RUN_DIR/model, the slices `recforge serve` and `recforge export` read

    def train(self, cfg: Any, *, resume: bool = False, progress: bool = True) -> dict:
        return self.module().train(cfg, resume=resume, progress=progress)

    def evaluate(self, run_dir: str | Path, **kwargs: Any) -> dict:
        """``evaluate_run``: metrics of a trained run, written to ``RUN_DIR/eval.json``."""
        return self.module().evaluate_run(run_dir, **kwargs)


RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe("retrieval", "next-item retrieval (HSTU, SASRec) with sampled softmax", _retrieval, "topk", False),
        Recipe("ranking", "multi-task ranking of impressions (HSTU, DLRM, item baseline)", _ranking, "ranking", True),
        Recipe("generative", "generative retrieval over semantic IDs (TIGER, SID-HSTU)", _generative, "topk", False),
    )
}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; ``ValueError`` listing the known ones otherwise."""
    recipe = RECIPES.get(name)
    if recipe is None:
        known = ", ".join(f"{r.name} ({r.description})" for r in RECIPES.values())
        raise ValueError(f"unknown recipe {name!r}; known recipes: {known}")
    return recipe


__all__ = ["RECIPES", "Recipe", "get_recipe"]
