"""Item content vectors for semantic IDs, from what ``items.parquet`` already holds.

- ``embedding_column``: an ``embedding`` list<float> column the user wrote (any encoder of theirs).
- ``TextFeaturizer``: a built-in featurizer needing no model download: every other column
  becomes tokens (``brand=nike``, one per list element, lower-cased words of strings), then
  TF-IDF + truncated SVD (scikit-learn) + L2 normalisation. Its fitted state (vocabulary,
  IDF weights, SVD components) is plain arrays, saved without pickle, so items added later are
  featurized exactly as the fitted ones were.

Example:
    >>> feat = TextFeaturizer.fit(item_documents(items, item_ids), dim=64, seed=0)
    >>> vectors = feat.transform(item_documents(new_items, new_ids))   # (N, 64) float32
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

SKIP_COLUMNS = ("item_id", "embedding")
_WORD = re.compile(r"[a-z0-9]+")


def _row_lookup(items: pa.Table, item_ids: np.ndarray) -> np.ndarray:
    """Row of ``items`` for each of ``item_ids`` (-1 when the item has no row)."""
    table_ids = items.column("item_id").to_numpy()
    order = np.argsort(table_ids, kind="stable")
    pos = np.searchsorted(table_ids[order], item_ids).clip(0, max(len(order) - 1, 0))
    found = len(order) > 0
    rows = order[pos] if found else np.zeros(len(item_ids), np.int64)
    hit = found & (table_ids[rows] == item_ids) if found else np.zeros(len(item_ids), bool)
    return np.where(hit, rows, -1)


def embedding_column(items: pa.Table | None, item_ids: np.ndarray, column: str = "embedding") -> np.ndarray:
    """(N, D) float32 vectors of ``item_ids`` from a list<float> column of ``items`` (one per item, equal D)."""
    if items is None:
        raise ValueError(f"the dataset has no items.parquet, so no {column!r} column; write one (item_id int64, "
                         f"{column} list<float32>, one row per item) or use --source text / --source run:RUN_DIR")  # fmt: skip
    if column not in items.column_names:
        raise ValueError(f"items.parquet has no {column!r} column (it has {items.column_names}); add one (list<float>, "
                         "one row per item) or use --source text / --source run:RUN_DIR")  # fmt: skip
    kind = items.schema.field(column).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) or not (
        pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type)
    ):  # fmt: skip
        raise ValueError(f"items.parquet column {column!r} is {kind}; it must be a list of floats (one vector per item)")
    rows = _row_lookup(items, item_ids)
    if (rows < 0).any():
        missing = item_ids[rows < 0][:5].tolist()
        raise ValueError(f"{int((rows < 0).sum())} of {len(item_ids)} items have no row in items.parquet (e.g. item_id "
                         f"{missing}); every item in events.parquet needs an {column!r} vector")  # fmt: skip
    values = items.column(column).combine_chunks().take(pa.array(rows))
    nulls = np.asarray(values.is_null().to_numpy(zero_copy_only=False))
    if nulls.any():
        raise ValueError(f"{int(nulls.sum())} items have a null {column!r} (e.g. item_id {item_ids[nulls][:5].tolist()}); "
                         "give every item a vector")  # fmt: skip
    lengths = values.value_lengths().to_numpy(zero_copy_only=False)
    dim = int(np.bincount(lengths).argmax())  # the most common length
    if (lengths != dim).any() or dim == 0:
        bad = lengths != dim if dim else np.ones(len(lengths), bool)
        raise ValueError(f"every {column!r} vector must have the same length; most have {dim}, but "
                         f"{int(bad.sum())} items differ (e.g. item_id {item_ids[bad][:5].tolist()} with lengths "
                         f"{lengths[bad][:5].tolist()}); re-encode them with the same model")  # fmt: skip
    vectors = values.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(rows), dim)
    return check_vectors(vectors, item_ids, f"items.parquet column {column!r}")


def check_vectors(vectors: np.ndarray, item_ids: np.ndarray, what: str, dim: int | None = None) -> np.ndarray:
    """``vectors`` (N, D) if finite (and D == ``dim`` when given); else ``ValueError`` naming the items."""
    if vectors.ndim != 2 or vectors.shape[0] != len(item_ids):
        raise ValueError(f"{what}: expected one vector per item ({len(item_ids)}, D); got shape {vectors.shape}")
    if dim is not None and vectors.shape[1] != dim:
        raise ValueError(f"{what}: vectors have {vectors.shape[1]} dimensions but the SIDs were fitted on {dim}; "
                         f"encode the new items with the same model, or refit with `recforge sid fit`")  # fmt: skip
    bad = ~np.isfinite(vectors).all(1)
    if bad.any():
        raise ValueError(f"{what}: {int(bad.sum())} items have NaN or infinite values (e.g. item_id "
                         f"{item_ids[bad][:5].tolist()}); fix or re-encode them (a run whose training diverged "
                         "has NaN embeddings: retrain it)")  # fmt: skip
    return vectors


def item_documents(items: pa.Table | None, item_ids: np.ndarray) -> list[list[str]]:
    """One token list per item from every column but ``item_id``/``embedding`` (empty without a row)."""
    docs: list[list[str]] = [[] for _ in item_ids]
    if items is None:
        return docs
    rows = _row_lookup(items, item_ids)
    for name in items.column_names:
        if name in SKIP_COLUMNS:
            continue
        values = items.column(name).to_pylist()
        for i, row in enumerate(rows):
            if row < 0 or values[row] is None:
                continue
            value = values[row]
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, str):
                    docs[i].extend(f"{name}:{w}" for w in _WORD.findall(v.lower()))
                elif v is not None:
                    docs[i].append(f"{name}={v}")
    return docs


@dataclass
class TextFeaturizer:
    """Fitted TF-IDF + SVD state: token vocabulary, IDF weights (V,), SVD components (dim, V)."""

    vocabulary: list[str]
    idf: np.ndarray
    components: np.ndarray

    @staticmethod
    def fit(docs: list[list[str]], dim: int, seed: int) -> TextFeaturizer:
        from sklearn.decomposition import TruncatedSVD
        from sklearn.feature_extraction.text import TfidfVectorizer

        if not any(docs):
            raise ValueError("--source text: no item has text or attribute values to featurize (items.parquet is "
                             "missing, empty, or holds only item_id/embedding); add attribute columns to items.parquet, "
                             "or use --source embedding / --source run:RUN_DIR")  # fmt: skip
        tfidf = TfidfVectorizer(analyzer=lambda tokens: tokens)  # docs are already token lists
        matrix = tfidf.fit_transform(docs)
        dim = min(dim, matrix.shape[1] - 1)
        if dim < 1:
            raise ValueError(f"--source text: the items have only {matrix.shape[1]} distinct attribute tokens, too few "
                             "to tell them apart; use --source embedding or --source run:RUN_DIR")  # fmt: skip
        svd = TruncatedSVD(n_components=dim, random_state=seed).fit(matrix)
        vocab = [""] * len(tfidf.vocabulary_)
        for token, index in tfidf.vocabulary_.items():
            vocab[index] = token
        return TextFeaturizer(vocab, tfidf.idf_.astype(np.float64), svd.components_.astype(np.float64))

    def transform(self, docs: list[list[str]]) -> np.ndarray:
        """(N, dim) float32 L2-normalised vectors (all zero for an item without known tokens)."""
        from scipy.sparse import csr_matrix

        index = {t: i for i, t in enumerate(self.vocabulary)}
        rows, cols = [], []
        for r, doc in enumerate(docs):
            for token in doc:
                if (c := index.get(token)) is not None:
                    rows.append(r)
                    cols.append(c)
        counts = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(docs), len(self.vocabulary)))
        counts.sum_duplicates()
        tfidf = counts.multiply(self.idf[None]).tocsr()
        norms = np.sqrt(np.asarray(tfidf.multiply(tfidf).sum(1))).clip(1e-12)
        vectors = np.asarray((tfidf.multiply(1 / norms)).tocsr() @ self.components.T)
        return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True).clip(1e-12)).astype(np.float32)
