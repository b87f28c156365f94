"""`/v1/retrieve` on a run trained with ``generative.item_id_embedding``: the same items as ``Retriever``, cached
users' histories, mixed padded batches, and an item coded after training (no table row) in a history."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch

from recforge.data.dataset import load_dataset, write_dataset
from recforge.generate import RetrieveRequest
from recforge.serve.retrieve_app import RetrieveSettings, create_retrieve_app, load_retriever
from _sid_runs import UNSHED, serve_matches, train_tiny_run
from recforge.train.sid_fit import add_items

TINY = ["generative.beam=12", "train.epochs=1"]  # after _sid_runs.TINY
NEW_ITEM = 7000


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = train_tiny_run(tmp_path_factory.mktemp("retrieve-ids"), "configs/beauty-sid-tiger-ids.yaml", 6, *TINY)
    data = run.parent / "data"
    dataset = load_dataset(data)  # an item coded after training: in the catalogue, not in the ID table
    extra = dataset.items.slice(0, 1).set_column(0, "item_id", pa.array([NEW_ITEM], pa.int64()))
    grown = write_dataset(run.parent / "grown", dataset.events, pa.concat_tables([dataset.items, extra]), name="g", source="t")
    assert add_items(run / "sids", grown)["added"] == 1
    return run


def test_retrieve_with_item_ids_equals_the_retriever_cached_or_not(run_dir: Path) -> None:
    settings = RetrieveSettings(max_k=20, max_batch=8, max_history=50, max_allowed=40, cache_mb=1)
    retriever, version = load_retriever(run_dir, settings, device="cpu")
    assert retriever.item_rows is not None and retriever.cache is not None
    assert int(retriever.item_rows[int(retriever.catalogue.dense_ids([NEW_ITEM], "history")[0][0])]) == 0
    items = [int(v) for v in retriever.item_vocab[1:]]
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    bodies = []
    for i in range(12):
        history = [items[j] for j in torch.randint(len(items), (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)]
        if i % 3 == 0:
            history.append(NEW_ITEM)
        bodies.append({"user_id": f"u{i % 4}", "history": history, "k": 8})
    want = [retriever.retrieve([b["history"]], k=8, beam=retriever.config.beam)[0] for b in bodies]
    serve_matches(create_retrieve_app(retriever, version, UNSHED, settings), bodies, want, workers=6)
    assert retriever.cache.entries
    # the table row changes the answer: the same history without the IDs' contribution scores differently
    codes, mask, rows = retriever.history_batch([retriever.encode(RetrieveRequest(bodies[1]["history"]))])
    with torch.no_grad():
        with_ids, _ = retriever.model.encode(codes, mask, rows)
        without, _ = retriever.model.encode(codes, mask, torch.zeros_like(rows))
    assert (with_ids - without).abs().amax() > 1e-3
