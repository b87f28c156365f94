"""The semantic-ID directory `recforge sid fit` writes and the generative recipe reads::

    SID_DIR/
      sids.parquet            item_id int64, sid list<int32> (levels [+ collision digit]), one row per item
      tokenizer.safetensors   standardisation, codebooks (and RQ-VAE weights): codes new items
      featurizer.safetensors  text featurizer's IDF weights and SVD components (source=text only)
      sid.json                tokenizer config, source, statistics, featurizer vocabulary

Written atomically as a whole (``recforge.io.atomic_directory``); nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from recforge.data.sequences import PROTOCOL_HOLDOUT
from recforge.io import atomic_directory, check_replaceable

SIDS_FILE, TOKENIZER_FILE, FEATURIZER_FILE, META_FILE = "sids.parquet", "tokenizer.safetensors", "featurizer.safetensors", "sid.json"


@dataclass
class SemanticIds:
    """Every coded item's SID.

    Attributes:
        item_ids: (N,) raw item IDs.
        codes: (N, num_levels) int64 digits, each in [0, vocab_size).
        vocab_size: tokens per level a model over these SIDs has (codebook size, or more when the
            collision level needs more digits).
        meta: the contents of ``sid.json``.
    """

    item_ids: np.ndarray
    codes: Tensor
    vocab_size: int
    meta: dict

    @property
    def num_levels(self) -> int:
        return self.codes.shape[1]

    def codes_for(self, raw_item_ids: np.ndarray) -> Tensor:
        """(len(raw_item_ids), num_levels) SIDs; raises ``ValueError`` naming items without one."""
        order = np.argsort(self.item_ids, kind="stable")
        pos = np.searchsorted(self.item_ids[order], raw_item_ids).clip(0, len(order) - 1)
        rows = order[pos]
        missing = self.item_ids[rows] != raw_item_ids
        if missing.any():
            raise ValueError(
                f"{int(missing.sum())} items have no semantic ID (e.g. {raw_item_ids[missing][:5].tolist()}); "
                "code them with `recforge sid add SID_DIR DATA_DIR` or refit with `recforge sid fit`"
            )
        return self.codes[torch.from_numpy(rows)]


def write_sid_dir(
    out: Path, item_ids: np.ndarray, codes: Tensor, tokenizer: dict[str, Tensor], meta: dict,
    featurizer: dict[str, Tensor] | None = None, *, overwrite: bool = False,
) -> Path:  # fmt: skip
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; pass --overwrite to replace it")
    check_replaceable(out, (SIDS_FILE, TOKENIZER_FILE, FEATURIZER_FILE, META_FILE), "SID directory")
    with atomic_directory(out) as tmp:
        sid = pa.FixedSizeListArray.from_arrays(pa.array(codes.to(torch.int32).flatten().numpy()), codes.shape[1])
        pq.write_table(pa.table({"item_id": pa.array(item_ids, pa.int64()), "sid": sid}), tmp / SIDS_FILE)
        save_file({k: v.detach().cpu().contiguous() for k, v in tokenizer.items()}, tmp / TOKENIZER_FILE)
        if featurizer is not None:
            save_file({k: v.contiguous() for k, v in featurizer.items()}, tmp / FEATURIZER_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_sids(sid_dir: str | Path) -> SemanticIds:
    sid_dir = Path(sid_dir)
    if not (sid_dir / SIDS_FILE).is_file() or not (sid_dir / META_FILE).is_file():
        raise ValueError(f"{sid_dir} holds no semantic IDs (no {SIDS_FILE} / {META_FILE}); run `recforge sid fit` first")
    meta = json.loads((sid_dir / META_FILE).read_text())
    table = pq.read_table(sid_dir / SIDS_FILE)
    sid = table.column("sid").combine_chunks()
    width = sid.type.list_size
    codes = torch.from_numpy(sid.flatten().to_numpy().astype(np.int64).reshape(len(table), width))
    return SemanticIds(table.column("item_id").to_numpy(), codes, int(meta["vocab_size"]), meta)


def read_tensors(sid_dir: str | Path, name: str = TOKENIZER_FILE) -> dict[str, Tensor]:
    path = Path(sid_dir) / name
    if not path.is_file():
        raise ValueError(f"{path} is missing; refit the SIDs with `recforge sid fit`")
    return load_file(path)


def interactions_digest(events: pa.Table) -> str:
    """SHA-256 of the (user_id, item_id) sequence of an events table: equal digests, equal splits."""
    digest = hashlib.sha256()
    for name in ("user_id", "item_id"):
        digest.update(np.ascontiguousarray(events.column(name).to_numpy(), dtype=np.int64).tobytes())
    return digest.hexdigest()


def check_embedding_run(meta: dict, events: pa.Table, protocol: str, data_path: str | Path) -> None:
    """Refuse SIDs whose collaborative embeddings saw what a model trained on them is evaluated on.

    SIDs from ``--source run:RUN_DIR`` carry the run's provenance (``meta["embedding_run"]``). They are
    safe for ``protocol`` on this data only when the run was trained on the same interactions with at
    least as many items held out per user (clean: 2, paper: 1) and its checkpoint was not chosen on an
    evaluation target. SIDs from other sources pass; run-based SIDs fitted before the provenance was
    recorded are refused (their leakage cannot be checked).
    """
    source = str(meta.get("source", ""))
    if not source.startswith("run:"):
        return
    run = meta.get("embedding_run")
    refit = f"refit them: `recforge sid fit {data_path} --out SID_DIR --source {source} --overwrite`"
    if run is None:
        raise ValueError(f"these SIDs come from {source} but do not record which data and protocol that run was "
                         f"trained on, so held-out items may have shaped them; {refit}")  # fmt: skip
    if run["interactions"] != interactions_digest(events):
        raise ValueError(
            f"these SIDs come from {source}, trained on {run['data_path']}, whose interactions differ from "
            f"{data_path}'s: that run may have trained on this dataset's validation/test items. Train the "
            f"retrieval run on {data_path} (data.path={data_path}) and refit the SIDs from it"
        )
    need = PROTOCOL_HOLDOUT[protocol]
    if run["holdout"] < need:
        raise ValueError(
            f"these SIDs come from {source}, trained with data.protocol={run['protocol']} (last {run['holdout']} item(s) "
            f"per user held out), but this run evaluates with data.protocol={protocol}, whose last {need} items per "
            f"user must stay unseen: the embeddings saw the validation target. Retrain the retrieval run with "
            f"data.protocol={protocol} and refit the SIDs from it"
        )
