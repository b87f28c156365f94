"""``generative.dense_init``: a SID model's item tables initialised from a trained ID-retrieval run.

The run whose item embeddings gave the collaborative SIDs (e.g. SASRec) already holds a good dense item table.
With ``generative.dense_init: RUN_DIR`` the generative recipe copies it into the model's item tables (the
dense head's ``dense_items`` and, with ``generative.item_id_embedding``, the input ``item_embedding``) before
the first step; ``generative.dense_freeze`` then keeps them fixed, so only the user tower (the encoder and
``dense_user``) learns to score against the retrieval run's item space.

- **Rows** are matched by raw item ID through both runs' vocabularies (``item_table_from_run``,
  ``generate.retrieval_run.run_rows``); the run's catalogue must be the SID model's exactly (both come from one
  prepared dataset), else ``ValueError``.
- **Leakage**: the run must be trained on the same interactions (``run_item_embeddings`` checks the digest)
  with at least this run's held-out items per user (a clean run serves both protocols; ``checked_run``), as for
  run-based SIDs.
- **Width**: the loaded table keeps its width; the SID model's item tables take it through
  ``generative.item_dim`` (a clear error names the value to set). The dense user tower (``dense_user``, a
  learned linear map from the encoder's width) then projects into the loaded space, and the item-ID input goes
  through a learned ``item_id_projection`` to ``model.dim``: the loaded geometry is never distorted by a random
  projection on the item side.
- **Scale**: the run's rows are L2-normalised (its scoring geometry: cosine) and scaled to ``sqrt(item_dim)``, the
  expected norm of a default ``nn.Embedding`` row, so the item-ID input has the magnitude of the table it
  replaces. The dense head normalises rows before scoring, so its scores do not depend on this scale.

Only a new run loads the table: a resumed run reads every weight from its checkpoint.

Example:
    >>> table = item_table_from_run("runs/beauty-sasrec-collab", cfg, seqs.item_vocab)  # (N + 1, d_run)
    >>> init_item_tables(model, table)
    >>> freeze_item_tables(model)  # generative.dense_freeze
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from recforge.config import RunConfig
from recforge.generate.retrieval_run import checked_run, run_rows
from recforge.models.sid_seq2seq import SIDSeq2Seq
from recforge.train.sid_fit import run_item_embeddings

log = logging.getLogger("recforge.train")


def rows_by_item_id(run_ids: np.ndarray, run_vectors: np.ndarray, item_vocab: np.ndarray, what: str) -> torch.Tensor:
    """(N + 1, d) float32: row r holds the run's vector of raw item ``item_vocab[r]`` (row 0, padding: zeros).

    Args:
        run_ids: (M,) raw item IDs of the run's rows; run_vectors: (M, d) their vectors.
        item_vocab: (N + 1,) raw item ID of each row of the model's tables ([0]: the padding row).
        what: names the source in errors.

    Raises ``ValueError`` unless both catalogues hold exactly the same items.
    """
    source = run_rows(run_ids, item_vocab, what)
    table = torch.zeros(len(source) + 1, run_vectors.shape[1])
    table[1:] = torch.from_numpy(np.ascontiguousarray(run_vectors[source], dtype=np.float32))
    return table


def item_table_from_run(run_dir: str | Path, cfg: RunConfig, item_vocab: np.ndarray) -> torch.Tensor:
    """(N + 1, d_run) float32 item table for a model whose table rows are raw items ``item_vocab`` (``[0]`` padding),
    read from the retrieval run ``run_dir`` (its best checkpoint on a clean run) and checked for leakage against
    ``cfg`` (``data.path``, ``data.protocol``): unit rows scaled to ``sqrt(d_run)`` (see the module docstring)."""
    what = f"generative.dense_init={run_dir}"
    ids, vectors, provenance = checked_run(lambda: run_item_embeddings(run_dir, cfg.data.path, what=what), cfg, what)
    table = rows_by_item_id(ids, vectors, item_vocab, what)
    table[1:] = torch.nn.functional.normalize(table[1:], dim=-1) * table.shape[1] ** 0.5
    log.info("%s: item tables initialised from %s (step %s), %d items x %d", what, provenance["checkpoint"],
             provenance["step"], table.shape[0] - 1, table.shape[1])  # fmt: skip
    return table


def _item_tables(model: SIDSeq2Seq) -> list[torch.nn.Parameter]:
    return [getattr(model, name).weight for name in ("dense_items", "item_embedding") if hasattr(model, name)]


@torch.no_grad()
def init_item_tables(model: SIDSeq2Seq, table: torch.Tensor) -> None:
    """Copy ``table`` (N + 1, d) into the model's item tables (row 0 stays: the item-ID embedding's padding zeros,
    the dense head's never-scored row)."""
    width = model.cfg.item_width
    if table.shape[1] != width:
        key = "generative.item_dim" + ("" if model.cfg.item_dim else f"=0, i.e. model.dim={model.cfg.dim}")
        raise ValueError(f"generative.dense_init: the run's item table is {table.shape[1]} wide but this model's item "
                         f"tables are {width} ({key}); set generative.item_dim={table.shape[1]} (the dense user tower "
                         "then projects the encoder's output to that width)")  # fmt: skip
    for weight in _item_tables(model):
        if weight.shape[0] != table.shape[0]:
            raise ValueError(f"generative.dense_init: {table.shape[0] - 1} loaded rows for an item table of "
                             f"{weight.shape[0] - 1}")  # fmt: skip
        weight[1:].copy_(table[1:].to(weight.device, weight.dtype))


def freeze_item_tables(model: SIDSeq2Seq) -> None:
    """``generative.dense_freeze``: the item tables take no gradient, so the optimizer never changes them
    (``make_optimizer`` steps only parameters that require one)."""
    for weight in _item_tables(model):
        weight.requires_grad_(False)
