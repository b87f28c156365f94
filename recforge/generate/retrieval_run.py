"""A trained ID-retrieval run (``recipe: retrieval``, e.g. SASRec or HSTU), loaded for a SID model to use.

Three features read such a run: collaborative SIDs (`recforge sid fit --source run:RUN_DIR`), the dense item tables'
initialisation and its teacher (``generative.dense_init`` / ``dense_distill``), and the dense scorer of evaluation and
``/v1/retrieve`` (``generative.dense_scorer``, ``dense_scorer.py``). They load it here, with the same checks:

- **the same interactions**: the run must be trained on the SID model's dataset (``interactions_digest``), so it never
  trained on that dataset's held-out items; ``checked_run`` also refuses a run that held out fewer items per user
  than the SID model's protocol evaluates on;
- **the same catalogue by raw item ID**: the run's rows are matched through both vocabularies (``run_rows``), never
  by position.

It lives in ``generate`` because serving loads the dense scorer, and serving never imports training code.

Example:
    >>> run, provenance = load_retrieval_run("runs/beauty-sasrec-collab", "data/beauty")
    >>> run.model.item_vectors().shape, run.seqs.item_vocab.shape, provenance["checkpoint"]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from recforge.checkpoint import find_checkpoint, load_checkpoint
from recforge.config import RunConfig, load_config
from recforge.data.dataset import load_dataset
from recforge.data.sequences import PROTOCOL_HOLDOUT, UserSequences
from recforge.data.sids import interactions_digest
from recforge.models.builders import build_retrieval_model
from recforge.models.retrieval import RetrievalModel

Loaded = TypeVar("Loaded", bound=tuple)


@dataclass
class RetrievalRun:
    """A trained retrieval run on the CPU, its checkpoint loaded (eval mode)."""

    cfg: RunConfig  # the run's own config (train.device=cpu)
    model: RetrievalModel
    seqs: UserSequences  # the run's dataset as its recipe reads it; ``seqs.item_vocab[r]``: raw item ID of row r
    checkpoint: Path  # the loaded checkpoint directory


def load_retrieval_run(run_dir: str | Path, data_dir: str | Path, what: str = "") -> tuple[RetrievalRun, dict]:
    """(the run, its provenance) of the retrieval run ``run_dir``, which must have been trained on ``data_dir``'s
    interactions. The checkpoint is ``best`` for a clean run (chosen on the validation target) and ``latest`` for a
    paper run (its ``best`` was chosen on the test target). ``what`` names the run in errors (default
    ``--source run:RUN``). The calling process keeps its RNG stream (building the run's model reseeds).

    The provenance (``run_dir``, ``data_path``, ``interactions`` digest, ``protocol``, ``holdout``, ``checkpoint``,
    ``step``) goes into ``sid.json`` and ``eval.json``; ``checked_run`` compares it with a SID run's protocol."""
    with torch.random.fork_rng(devices=[]):
        return _load(Path(run_dir), data_dir, what or f"--source run:{run_dir}")


def _load(run_dir: Path, data_dir: str | Path, what: str) -> tuple[RetrievalRun, dict]:
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{what}: not a recforge run directory (no config.yaml); "
                         "give the output directory of `recforge train` on a retrieval config")  # fmt: skip
    cfg = load_config(run_dir / "config.yaml", ["train.device=cpu"])
    if cfg.recipe != "retrieval":
        raise ValueError(f"{what}: is a {cfg.recipe} run; this needs an ID-retrieval run (recipe: retrieval, e.g. "
                         "configs/beauty-sasrec.yaml or configs/beauty-hstu.yaml) trained on the same dataset")  # fmt: skip
    which = "best" if cfg.data.protocol == "clean" else "latest"
    ckpt = find_checkpoint(run_dir, which)
    if ckpt is None:
        raise ValueError(f"{what}: the run has no {which} checkpoint; train it first")
    digest = interactions_digest(load_dataset(data_dir).events)
    if interactions_digest(load_dataset(cfg.data.path).events) != digest:
        raise ValueError(
            f"{what}: the run was trained on {cfg.data.path}, whose interactions differ from "
            f"{data_dir}'s, so it may have trained on {data_dir}'s held-out items. Train the retrieval run "
            f"on {data_dir} (data.path={data_dir}, data.protocol=clean) and use that run"
        )
    seqs = UserSequences.from_dataset(load_dataset(cfg.data.path))
    torch.manual_seed(cfg.train.seed)  # the recipe's own init; every trained weight is then overwritten
    model = build_retrieval_model(cfg.model, seqs.num_items, cfg.data.max_seq_len, cfg.sparse)
    manifest = load_checkpoint(ckpt, model)
    provenance = {
        "run_dir": str(run_dir.resolve()), "data_path": str(cfg.data.path), "interactions": digest,
        "protocol": cfg.data.protocol, "holdout": PROTOCOL_HOLDOUT[cfg.data.protocol], "checkpoint": ckpt.name,
        "step": manifest.get("step"),
    }  # fmt: skip
    return RetrievalRun(cfg, model.eval(), seqs, ckpt), provenance


def checked_run(load: Callable[[], Loaded], cfg: RunConfig, what: str) -> Loaded:
    """``load()`` (a loader of the retrieval run whose last value is its provenance, e.g. ``load_retrieval_run``),
    refused when that run saw the evaluation targets of the SID run configured by ``cfg`` (``data.protocol``)."""
    loaded = load()
    provenance = loaded[-1]
    need = PROTOCOL_HOLDOUT[cfg.data.protocol]
    if provenance["holdout"] < need:
        raise ValueError(
            f"{what} was trained with data.protocol={provenance['protocol']} (last {provenance['holdout']} item(s) per "
            f"user held out), but this run evaluates with data.protocol={cfg.data.protocol}, whose last {need} items "
            "must stay unseen: its embeddings saw the validation target. Use a retrieval run trained with "
            f"data.protocol={cfg.data.protocol}"
        )
    return loaded


def run_rows(run_ids: np.ndarray, item_vocab: np.ndarray, what: str, *, exact: bool = True) -> np.ndarray:
    """(N,) int64: the index in ``run_ids`` of each raw item ``item_vocab[1:]`` (``item_vocab[0]`` is padding).

    ``exact``: both catalogues must hold exactly the same items, else ``ValueError``. Not ``exact`` (a served
    catalogue, which may hold items coded after training, `recforge sid add`): every item of the run must be in
    ``item_vocab``, whose other items get -1 (no row)."""
    run_ids, wanted = np.asarray(run_ids, dtype=np.int64), np.asarray(item_vocab[1:], dtype=np.int64)
    if len(np.unique(run_ids)) != len(run_ids):
        raise ValueError(f"{what}: its item vocabulary repeats raw item IDs; it is not a recforge run's catalogue")
    missing, extra = np.setdiff1d(wanted, run_ids), np.setdiff1d(run_ids, wanted)
    if extra.size or (exact and missing.size):
        raise ValueError(
            f"{what}: its item vocabulary differs from this run's ({missing.size} of this run's {wanted.size} items "
            f"missing there, e.g. {missing[:5].tolist()}; {extra.size} items there not here, e.g. "
            f"{extra[:5].tolist()}); train the retrieval run on the same prepared dataset (data.path) as this one"
        )
    rows = np.full(len(wanted), -1, dtype=np.int64)
    if len(run_ids):
        order = np.argsort(run_ids)
        found = order[np.searchsorted(run_ids[order], wanted).clip(0, len(run_ids) - 1)]
        rows = np.where(run_ids[found] == wanted, found, -1)  # the run's row of each item
    return rows
