"""`/v1/retrieve` with a dense scorer (``retrieve.dense_scorer`` / the run's ``generative.dense_scorer``): the same
items and scores as evaluation for the same histories (cached users included), allowed items and history exclusion
as the definition says (the scorer's top K among the request's eligible items, computed by hand), the scorer in the
model version, and a scorer that reads timestamps refused at start while evaluation uses it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recforge.data.sid_sequences import eval_samples
from recforge.generate import RetrieveRequest, Retriever
from recforge.serve.retrieve_app import RetrieveSettings, create_retrieve_app, load_retriever
from recforge.train import generative
from _sid_runs import UNSHED, histories_of, retrieval_run, scorer_logits_by_hand, serve_matches, train_tiny_run

TIGER = "configs/beauty-sid-tiger.yaml"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(a tiny tiger run trained without a scorer, its dataset, a SASRec run on that dataset)."""
    root = tmp_path_factory.mktemp("serve-scorer")
    run = train_tiny_run(root, TIGER, 23, "generative.beam=12", "train.epochs=1")
    return run, root / "data", retrieval_run(root / "sasrec", root / "data")


def _settings(sasrec: Path, **extra) -> RetrieveSettings:
    return RetrieveSettings(**{"max_k": 200, "max_batch": 8, "max_history": 50, "max_allowed": 40, "cache_mb": 1,
                               "dense_scorer": str(sasrec), "rescore": 1.5, "dense_candidates": 5, **extra})  # fmt: skip


def test_serving_returns_the_evaluated_lists(runs: tuple[Path, Path, Path]) -> None:
    run, _, sasrec = runs
    assert RetrieveSettings(rescore=-2).problems() == ["rescore: must be >= 0 (-1: the run's generative.rescore), got -2"]
    settings = _settings(sasrec)
    retriever, version = load_retriever(run, settings, device="cpu")
    assert retriever.dense_scorer is not None and retriever.rescore == 1.5 and retriever.dense_candidates == 5
    assert version != load_retriever(run, RetrieveSettings(cache_mb=0), device="cpu")[1]  # the scorer is part of it
    s, _, _ = generative.load_run(run, overrides=[f"generative.dense_scorer={sasrec}", "generative.rescore=1.5",
                                                  "generative.dense_candidates=5"])  # fmt: skip
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1), 1)
    items, scores, targets = generative.generated_items(s, samples, k=10)
    histories = histories_of(s, samples)
    fresh = [row for row, h in enumerate(histories) if s.seqs.item_vocab[int(targets[row])] not in h]
    assert len(fresh) >= 8
    bodies = [{"user_id": f"u{i % 4}", "history": histories[row], "k": 10} for i, row in enumerate(fresh)]
    want = []
    for row in fresh:
        keep = items[row] > 0
        want.append((s.seqs.item_vocab[items[row][keep].numpy()].tolist(), scores[row][keep].tolist()))
    serve_matches(create_retrieve_app(retriever, version, UNSHED, settings), bodies, want, workers=4)
    assert retriever.cache.entries


def _definition(retriever: Retriever, data: Path, sasrec: Path, history: list[int], allowed: list[int] | None,
                exclude: bool, k: int) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    """(items, scores) by the definition: every item of the generation-only beam (allowed, history excluded when
    ``exclude``) and the scorer's top K of the same eligible items by its logits computed by hand, ranked by
    log p(SID) + rescore x logit."""
    generation = Retriever(retriever.model, retriever.item_vocab, retriever.item_codes, retriever.trie,
                           retriever.max_items, retriever.config)  # fmt: skip
    ((items, sid),) = generation.retrieve([history], k=retriever.config.max_k, beam=retriever.config.beam,
                                          allowed_items=[allowed], exclude_history=exclude)  # fmt: skip
    vocab = retriever.item_vocab[1:].tolist()
    logits = scorer_logits_by_hand(sasrec, data, [history], vocab)[0]  # (N,) over dense items 1..N
    eligible = torch.tensor([(allowed is None or v in allowed) and not (exclude and v in history) for v in vocab])
    top = [vocab[i] for i in logits.masked_fill(~eligible, -torch.inf).topk(retriever.dense_candidates).indices.tolist()]
    added = [v for v in top if v not in items]
    with torch.no_grad():
        memory = retriever.model.start(*retriever.history_batch([retriever.encode(RetrieveRequest(history))]))
        dense = torch.from_numpy(retriever.catalogue.dense_ids(added, "added")[0]) if added else torch.zeros(0, dtype=torch.long)
        added_sid = retriever.model.sid_log_probs(memory, retriever.item_codes[dense][None])[0].tolist() if added else []
    candidates = items + added
    index = torch.from_numpy(retriever.catalogue.dense_ids(candidates, "candidates")[0]) - 1
    combined = torch.tensor(sid + added_sid) + retriever.rescore * logits[index]
    order = torch.argsort(combined, descending=True, stable=True)[:k]
    return [candidates[i] for i in order.tolist()], combined[order]


def test_allowed_items_and_history_exclusion_follow_the_definition(runs: tuple[Path, Path, Path]) -> None:
    run, data, sasrec = runs
    settings = _settings(sasrec, rescore=float(torch.empty(1).uniform_(0.5, 3.0)))
    retriever, version = load_retriever(run, settings, device="cpu")
    vocab = [int(v) for v in retriever.item_vocab[1:]]
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    bodies = []
    for i in range(8):
        history = [vocab[j] for j in torch.randperm(len(vocab), generator=g)[: 1 + i % 6]]
        allowed = [vocab[j] for j in torch.randperm(len(vocab), generator=g)[:18]] if i % 2 else None
        body = {"user_id": f"u{i % 3}", "history": history, "k": 8} | ({"allowed_items": allowed} if allowed else {})
        bodies.append(body)
        for exclude in (True, False):
            ((items, scores),) = retriever.retrieve([history], k=8, beam=retriever.config.beam, allowed_items=[allowed],
                                                    exclude_history=exclude)  # fmt: skip
            want_items, want_scores = _definition(retriever, data, sasrec, history, allowed, exclude, k=8)
            assert items == want_items and set(items) <= set(allowed or vocab)
            assert not exclude or not set(items) & set(history)
            torch.testing.assert_close(torch.tensor(scores), want_scores, rtol=1e-4, atol=1e-4)
    want = [retriever.retrieve([b["history"]], k=8, beam=retriever.config.beam,
                               allowed_items=[b.get("allowed_items")])[0] for b in bodies]  # fmt: skip
    serve_matches(create_retrieve_app(retriever, version, UNSHED, settings), bodies, want, workers=4)


def test_a_scorer_that_reads_timestamps_is_refused_for_serving_and_used_by_evaluation(
    runs: tuple[Path, Path, Path], tmp_path: Path
) -> None:  # fmt: skip
    run, data, _ = runs
    hstu = retrieval_run(tmp_path / "hstu", data, "model.num_heads=1", "model.dqk=8", "model.dv=8",
                         config="configs/beauty-hstu.yaml")  # time bias on (model.num_time_buckets) + timestamped data
    with pytest.raises(ValueError, match="reads event timestamps .*model.num_time_buckets=0"):
        load_retriever(run, _settings(hstu), device="cpu")
    s, _, _ = generative.load_run(run, overrides=[f"generative.dense_scorer={hstu}", "generative.rescore=1"])
    assert s.scorer.reads_timestamps
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1)[:16], 1)
    batch = s.scorer.batch(s.seqs, samples)
    assert batch.timestamps is not None  # the retrieval recipe's own input, timestamps included
    without = type(batch)(batch.seq_offsets, {"item_ids": batch.item_ids}, batch.max_seq_len)
    assert not torch.allclose(s.scorer.logits(batch), s.scorer.logits(without))  # and they matter to this run
    items, scores, _ = generative.generated_items(s, samples, k=10)
    assert bool(np.isfinite(scores[items > 0].numpy()).all())


def test_none_serves_a_scorer_trained_run_without_its_scorer(runs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """``retrieve.dense_scorer: none``: a run trained with a scorer serves on its SID scores alone (its scorer's run
    and data need not be there); "" keeps the run's own scorer."""
    _, data, sasrec = runs
    run = train_tiny_run(tmp_path, TIGER, 29, "generative.beam=12", "train.epochs=1", f"data.path={data}",
                         f"generative.sids={data / 'sids'}", f"generative.dense_scorer={sasrec}", "generative.rescore=0",
                         "generative.dense_candidates=3")  # fmt: skip
    own, _ = load_retriever(run, RetrieveSettings(cache_mb=0), device="cpu")
    assert own.dense_scorer is not None and own.dense_candidates == 3
    with pytest.raises(ValueError, match="dense_candidates"):  # no dense side left for the run's candidates
        load_retriever(run, RetrieveSettings(cache_mb=0, dense_scorer="none"), device="cpu")
    plain, _ = load_retriever(run, RetrieveSettings(cache_mb=0, dense_scorer="none", dense_candidates=0), device="cpu")
    assert plain.dense_scorer is None and plain.dense_candidates == 0
