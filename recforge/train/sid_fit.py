"""Workflow behind `recforge sid fit` / `recforge sid add`: item vectors -> tokenizer -> SID directory.

Item vectors come from one of three sources:

- ``embedding``: the ``embedding`` column of ``items.parquet``;
- ``text``: the built-in TF-IDF + SVD featurizer over the other ``items.parquet`` columns;
- ``run:RUN_DIR``: the item table of a trained recforge retrieval run (collaborative embeddings).
  Safe only when the run never saw what the SID model is evaluated on: the run must be trained
  on the same dataset (checked here) with at least the SID model's held-out items per user
  (``data.protocol: clean`` serves both protocols; checked by the generative recipe).

Example:
    >>> report = fit_sids("data/beauty", "data/beauty/sid-rk", source="text",
    ...                   config=TokenizerConfig(method="rkmeans", balanced=True))
    >>> report["stats"]["collision_rate"]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from recforge.data.dataset import load_dataset
from recforge.data.sid_features import TextFeaturizer, check_vectors, embedding_column, item_documents
from recforge.data.sids import FEATURIZER_FILE, read_sids, read_tensors, write_sid_dir
from recforge.generate.retrieval_run import load_retrieval_run
from recforge.models.sid_tokenizer import SIDTokenizer, TokenizerConfig, add_collision_level, config_dict, sid_stats


def _catalogue(data_dir: str | Path) -> tuple[np.ndarray, object]:
    dataset = load_dataset(data_dir)
    ids = np.unique(dataset.events.column("item_id").to_numpy())
    if dataset.items is not None and "item_id" not in dataset.items.column_names:
        raise ValueError(f"{Path(data_dir) / 'items.parquet'} has no item_id column (it has {dataset.items.column_names}); "
                         "rewrite it with an int64 item_id per row")  # fmt: skip
    if dataset.items is not None:
        ids = np.union1d(ids, dataset.items.column("item_id").to_numpy())
    return ids.astype(np.int64), dataset.items


def run_item_embeddings(
    run_dir: str | Path, data_dir: str | Path, what: str = ""
) -> tuple[np.ndarray, np.ndarray, dict]:  # fmt: skip
    """(raw item IDs, (N, d) item vectors, provenance) of a trained retrieval run.

    The run must have been trained on ``data_dir``'s interactions. The checkpoint is ``best`` for a
    clean run (chosen on the validation target) and ``latest`` for a paper run (its ``best`` was chosen
    on the test target). The provenance (data digest, protocol, held-out items per user) goes into
    ``sid.json``; the generative recipe refuses the SIDs where the run saw its evaluation targets
    (``recforge.data.sids.check_embedding_run``). ``what`` names the run in errors (default ``--source run:RUN``).
    """
    what = what or f"--source run:{run_dir}"
    run, provenance = load_retrieval_run(run_dir, data_dir, what)
    with torch.no_grad():
        vectors = run.model.item_vectors().float()[1:]  # row 0 is padding
    ids = run.seqs.item_vocab[1:]
    return ids, check_vectors(vectors.numpy(), ids, f"{what} item embeddings"), provenance


def item_vectors(data_dir: str | Path, source: str, *, text_dim: int = 64, seed: int = 0):
    """(item IDs, (N, D) float32 vectors, featurizer or None, provenance or None) for ``source``
    (see the module docstring)."""
    if source.startswith("run:"):
        ids, vectors, provenance = run_item_embeddings(source[4:], data_dir)
        return ids, vectors, None, provenance
    ids, items = _catalogue(data_dir)
    if source == "embedding":
        return ids, embedding_column(items, ids), None, None
    if source == "text":
        docs = item_documents(items, ids)
        featurizer = TextFeaturizer.fit(docs, text_dim, seed)
        return ids, featurizer.transform(docs), featurizer, None
    raise ValueError(f"--source {source!r}: expected embedding, text or run:RUN_DIR")


def fit_sids(
    data_dir: str | Path, out: str | Path, *, source: str, config: TokenizerConfig, text_dim: int = 64,
    overwrite: bool = False,
) -> dict:  # fmt: skip
    """Fit a tokenizer on the catalogue's item vectors and write the SID directory; return its report."""
    config.validate()
    if text_dim < 1:
        raise ValueError(f"--text-dim {text_dim}: the text featurizer needs at least 1 dimension (default 64)")
    if Path(out).exists() and not overwrite:  # checked before the fit (minutes), not only when writing
        raise ValueError(f"{out} already exists; pass --overwrite to replace it")
    ids, vectors, featurizer, provenance = item_vectors(data_dir, source, text_dim=text_dim, seed=config.seed)
    if len(ids) < 2:
        raise ValueError(f"{data_dir} has {len(ids)} item(s); semantic IDs need a catalogue of at least 2 items")
    if config.codebook_size > len(ids):
        raise ValueError(f"--codebook-size {config.codebook_size} for {len(ids)} items: a level cannot use more codes "
                         f"than there are items; use --codebook-size {len(ids)} or less")  # fmt: skip
    tok, codes = SIDTokenizer.fit_encode(torch.from_numpy(vectors), config)
    stats = sid_stats(codes, config.codebook_size)
    sids = add_collision_level(codes) if config.collision_level else codes
    vocab_size = max(config.codebook_size, int(sids.max()) + 1)  # tokens per level: the collision digit may need more
    meta = {
        "source": source, "data_dir": str(data_dir), "tokenizer": config_dict(config),
        "vocab_size": vocab_size, "num_levels": int(sids.shape[1]), "embedding_dim": int(vectors.shape[1]),
        "stats": stats,
    }  # fmt: skip
    if provenance is not None:
        meta["embedding_run"] = provenance  # checked by the generative recipe (no held-out item may shape the SIDs)
    feat_tensors = None
    if featurizer is not None:
        meta["featurizer"] = {"kind": "tfidf_svd", "vocabulary": featurizer.vocabulary}
        feat_tensors = {"idf": torch.from_numpy(featurizer.idf), "components": torch.from_numpy(featurizer.components)}
    write_sid_dir(Path(out), ids, sids, tok.state_dict(), meta, feat_tensors, overwrite=overwrite)
    return meta


def load_tokenizer(sid_dir: str | Path) -> SIDTokenizer:
    meta = read_sids(sid_dir).meta
    tok = SIDTokenizer(TokenizerConfig(**meta["tokenizer"]), meta["embedding_dim"])
    tok.load_state_dict(read_tensors(sid_dir))
    return tok.eval()


def add_items(sid_dir: str | Path, data_dir: str | Path) -> dict:
    """Code the items of ``data_dir`` that ``sid_dir`` lacks, leaving every existing SID unchanged.

    The new items are featurized with the saved featurizer and quantized with the saved
    codebooks; the collision digit continues after the digits already taken.
    """
    sids = read_sids(sid_dir)
    meta = sids.meta
    ids, items = _catalogue(data_dir)
    new_ids = np.setdiff1d(ids, sids.item_ids)
    if new_ids.size == 0:
        return {"added": 0, "num_items": int(sids.item_ids.size)}
    if meta["source"] == "embedding":
        vectors = check_vectors(embedding_column(items, new_ids), new_ids, "items.parquet column 'embedding'",
                                dim=meta["embedding_dim"])  # fmt: skip
    elif meta["source"] == "text":
        f = read_tensors(sid_dir, FEATURIZER_FILE)
        featurizer = TextFeaturizer(meta["featurizer"]["vocabulary"], f["idf"].numpy(), f["components"].numpy())
        vectors = featurizer.transform(item_documents(items, new_ids))
    else:
        raise ValueError(f"{sid_dir} was fitted on collaborative embeddings ({meta['source']}), which new items do "
                         "not have; refit with `recforge sid fit` after training on them")  # fmt: skip
    levels = meta["tokenizer"]["levels"]
    codes = load_tokenizer(sid_dir).encode(torch.from_numpy(vectors))
    if sids.num_levels > levels:  # collision level
        codes = add_collision_level(codes, sids.vocab_size, existing=sids.codes)
    all_ids = np.concatenate([sids.item_ids, new_ids])
    all_codes = torch.cat([sids.codes, codes])
    meta["stats"] = sid_stats(all_codes[:, :levels], meta["tokenizer"]["codebook_size"])
    write_sid_dir(Path(sid_dir), all_ids, all_codes, read_tensors(sid_dir), meta,
                  read_tensors(sid_dir, FEATURIZER_FILE) if meta["source"] == "text" else None, overwrite=True)  # fmt: skip
    return {"added": int(new_ids.size), "num_items": int(all_ids.size)}
