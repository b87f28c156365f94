"""`/v1/retrieve` on a run trained with ``generative.dense_head`` and ``generative.rescore``: the beam's items in the
re-scored order (checked against its definition), cached users' histories included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recforge.generate import RetrieveRequest, Retriever
from recforge.serve.retrieve_app import RetrieveSettings, create_retrieve_app, load_retriever
from _sid_runs import UNSHED, serve_matches, train_tiny_run

TINY = ["generative.beam=12", "train.epochs=1", "generative.rescore=2.0"]  # after _sid_runs.TINY


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tmp_path_factory.mktemp("retrieve-dense"), "configs/beauty-sid-tiger-dense.yaml", 7, *TINY)


def _rescored(retriever: Retriever, history: list[int], k: int) -> tuple[list[int], list[int]]:
    """(the definition: every item of the generation-only beam, sorted by SID score + rescore x dense logit; the
    generation-only list), top ``k`` each."""
    generation = Retriever(retriever.model, retriever.item_vocab, retriever.item_codes, retriever.trie,
                           retriever.max_items, retriever.config)  # fmt: skip
    ((items, scores),) = generation.retrieve([history], k=retriever.config.max_k, beam=retriever.config.beam)
    with torch.no_grad():
        user = retriever.model.start(*retriever.history_batch([retriever.encode(RetrieveRequest(history))])).user
        dense_index = torch.from_numpy(retriever.catalogue.dense_ids(items, "allowed")[0])
        dense = retriever.model.dense_logits(user, retriever.item_rows[dense_index][None])[0]
    combined = torch.tensor(scores) + retriever.rescore * dense
    return [items[i] for i in torch.argsort(combined, descending=True, stable=True)[:k].tolist()], items[:k]


def test_retrieve_returns_the_rescored_order_cached_or_not(run_dir: Path) -> None:
    settings = RetrieveSettings(max_k=40, max_batch=8, max_history=50, max_allowed=40, cache_mb=1)
    retriever, version = load_retriever(run_dir, settings, device="cpu")
    assert retriever.rescore == 2.0 and retriever.cache is not None
    items = [int(v) for v in retriever.item_vocab[1:]]
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    bodies = []
    for i in range(10):
        history = [items[j] for j in torch.randint(len(items), (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)]
        bodies.append({"user_id": f"u{i % 4}", "history": history, "k": 8})
    want = [retriever.retrieve([b["history"]], k=8, beam=retriever.config.beam)[0] for b in bodies]
    changed = 0
    for body, (items_want, _) in zip(bodies, want, strict=True):
        rescored, generated = _rescored(retriever, body["history"], 8)
        assert items_want == rescored
        changed += rescored != generated
    assert changed  # the dense head reorders some lists
    serve_matches(create_retrieve_app(retriever, version, UNSHED, settings), bodies, want, workers=5)
    assert retriever.cache.entries


def test_the_serve_config_sets_dense_candidates_and_serving_returns_the_retrievers_lists(run_dir: Path) -> None:
    assert RetrieveSettings(dense_candidates=-2).problems() == [
        "dense_candidates: must be >= -1 (-1: the run's generative.dense_candidates), got -2"]  # fmt: skip
    plain, _ = load_retriever(run_dir, RetrieveSettings(max_k=40, cache_mb=0), device="cpu")
    assert plain.dense_candidates == 0  # -1: the run's own setting
    settings = RetrieveSettings(max_k=40, max_batch=8, max_history=50, max_allowed=40, cache_mb=1, dense_candidates=6)
    retriever, version = load_retriever(run_dir, settings, device="cpu")
    assert retriever.dense_candidates == 6 and retriever.rescore == 2.0
    items = [int(v) for v in retriever.item_vocab[1:]]
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    bodies = [{"user_id": f"u{i % 3}", "history": [items[j] for j in torch.randint(len(items), (1 + i % 5,), generator=g)],
               "k": 20} for i in range(8)]  # fmt: skip
    want = [retriever.retrieve([b["history"]], k=20, beam=retriever.config.beam)[0] for b in bodies]
    beam_only = [plain.retrieve([b["history"]], k=20, beam=plain.config.beam)[0] for b in bodies]
    assert all(set(b) <= set(w) for (w, _), (b, _) in zip(want, beam_only, strict=True))  # the beam's items stay
    assert sum(len(w) > len(b) for (w, _), (b, _) in zip(want, beam_only, strict=True))  # and the dense head's join
    serve_matches(create_retrieve_app(retriever, version, UNSHED, settings), bodies, want, workers=4)
