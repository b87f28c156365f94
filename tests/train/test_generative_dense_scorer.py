"""``generative.dense_scorer`` through the recipe: evaluation's lists against their definition (every beam item and the
scorer's top K allowed, unseen items, ranked by log p(SID) + rescore x the scorer's logit computed by hand), for tiger
without a dense head and for sid_hstu; rescore 0 with K 0 is the plain beam; `recforge eval RUN
generative.dense_scorer=...` end to end (eval-valid.json records the scorer); a run trained with a scorer records it
and the Retriever returns its evaluated lists."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from recforge.checkpoint import find_checkpoint
from recforge.cli import main
from recforge.config import load_config
from recforge.data.sid_sequences import eval_samples, seen_mask
from recforge.generate import Retriever
from recforge.train import generative
from _sid_runs import (RUN_TINY, TINY, check_retrieves_evaluated, histories_of, retrieval_run, run_args,
                       scorer_logits_by_hand, sid_dataset)  # fmt: skip

TIGER, SID_HSTU = "configs/beauty-sid-tiger.yaml", "configs/beauty-sid-hstu.yaml"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sid_dataset(tmp_path_factory.mktemp("hybrid") / "data", seed=19)


@pytest.fixture(scope="module")
def sasrec(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Path:
    return retrieval_run(tmp_path_factory.mktemp("hybrid-sasrec") / "sasrec", data)


def _setup(tmp_path: Path, data: Path, config: str, *extra: str) -> generative.Setup:
    s = generative.setup(load_config(config, run_args(tmp_path, data, *RUN_TINY, *extra)))
    s.model.eval()
    return s


def _definition(s: generative.Setup, samples: torch.Tensor, logits: torch.Tensor, rescore: float, count: int,
                k: int) -> tuple[list[list[int]], list[torch.Tensor]]:  # fmt: skip
    """Per sample: the top ``k`` dense items and their scores by the definition. Candidates: every item of the plain
    beam's SIDs (their beam scores) and the ``count`` best unseen items by the scorer's ``logits`` (B, N) (their SIDs
    scored teacher-forced); each scored log p(SID) + rescore x logit, ties in that order."""
    g = s.cfg.generative
    rescore_was, count_was, scorer = g.rescore, g.dense_candidates, s.scorer
    g.rescore, g.dense_candidates, s.scorer = 0.0, 0, None  # the plain beam: every item of its SIDs
    beam_items, beam_scores, targets = generative.generated_items(s, samples, k=g.beam * s.trie.max_items_per_leaf)
    g.rescore, g.dense_candidates, s.scorer = rescore_was, count_was, scorer
    seen = seen_mask(s.seqs, samples)
    seen[torch.arange(targets.numel()), targets] = False
    with torch.no_grad():
        history, mask, rows, _ = generative._inputs(s, samples)
        memory = s.model.start(history, mask, rows)
        top = logits.masked_fill(seen[:, 1:], -torch.inf).topk(count, dim=1).indices + 1 if count else None
        added = s.model.sid_log_probs(memory, s.item_codes[top]) if count else None  # (B, count)
    out_items, out_scores = [], []
    for row in range(samples.shape[0]):
        keep = beam_items[row] > 0
        items, sid = beam_items[row][keep].tolist(), beam_scores[row][keep].tolist()
        if count:
            new = [(i, sc) for i, sc in zip(top[row].tolist(), added[row].tolist(), strict=True) if i not in items]
            items, sid = items + [i for i, _ in new], sid + [sc for _, sc in new]
        combined = torch.tensor(sid) + rescore * logits[row, torch.tensor(items) - 1]
        order = torch.argsort(combined, descending=True, stable=True)[:k]
        out_items.append([items[i] for i in order.tolist()])
        out_scores.append(combined[order])
    return out_items, out_scores


@pytest.mark.parametrize("config", [TIGER, SID_HSTU])
def test_evaluated_lists_are_the_sid_score_plus_rescore_times_the_scorers_logit(
    tmp_path: Path, data: Path, sasrec: Path, config: str
) -> None:  # fmt: skip
    rescore = float(torch.empty(1).uniform_(0.3, 3.0))
    s = _setup(tmp_path, data, config, f"generative.dense_scorer={sasrec}", f"generative.rescore={rescore}")
    assert not getattr(s.model, "has_dense_head", False) and s.scorer is not None
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1)[torch.randperm(40)[:24]], 1)
    logits = scorer_logits_by_hand(sasrec, data, histories_of(s, samples), s.seqs.item_vocab[1:].tolist())
    changed = 0
    for count in (0, 6):  # the beam's items re-scored; then the scorer's top 6 join them
        s.cfg.generative.dense_candidates = count
        items, scores, _ = generative.generated_items(s, samples, k=10)
        want_items, want_scores = _definition(s, samples, logits, rescore, count, k=10)
        for row in range(samples.shape[0]):
            got = items[row][items[row] > 0]
            assert got.tolist() == want_items[row]
            torch.testing.assert_close(scores[row][: got.numel()], want_scores[row], rtol=1e-4, atol=1e-4)
        changed += sum(i != j for i, j in zip(want_items, _definition(s, samples, logits, 0.0, 0, k=10)[0], strict=True))
    assert changed  # the scorer reorders lists and adds items


def test_rescore_zero_and_no_candidates_is_the_plain_beam(tmp_path: Path, data: Path, sasrec: Path) -> None:
    with_scorer = _setup(tmp_path, data, TIGER, f"generative.dense_scorer={sasrec}")
    plain = _setup(tmp_path, data, TIGER)
    assert with_scorer.cfg.generative.rescore == 0 and with_scorer.cfg.generative.dense_candidates == 0
    samples = eval_samples(plain.seqs, plain.seqs.evaluable_users(1), 1)
    for got, want in zip(generative.generated_items(with_scorer, samples, 10), generative.generated_items(plain, samples, 10),
                         strict=True):  # fmt: skip
        assert torch.equal(got, want)


def test_eval_override_end_to_end_and_a_run_trained_with_a_scorer(
    tmp_path: Path, data: Path, sasrec: Path, capsys: pytest.CaptureFixture
) -> None:  # fmt: skip
    args = run_args(tmp_path, data, *TINY, "generative.beam=10", "train.epochs=1")
    assert main(["--no-progress", "train", TIGER, *args]) == 0
    run = tmp_path / "run"
    overrides = [f"generative.dense_scorer={sasrec}", "generative.rescore=1", "generative.dense_candidates=5"]
    assert main(["eval", str(run), *overrides, "--split", "valid"]) == 0
    valid = json.loads((run / "eval-valid.json").read_text())
    ckpt = find_checkpoint(sasrec, "best")
    assert valid["rescore"] == 1.0 and valid["dense_candidates"] == 5 and all(o in valid["command"] for o in overrides)
    scorer = valid["dense_scorer"]
    assert scorer["run_dir"] == str(sasrec.resolve()) and scorer["checkpoint"] == ckpt.name
    assert scorer["step"] is not None and scorer["protocol"] == "clean"
    assert scorer["weights_sha256"] == hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert 0.0 <= valid["ndcg@10"] <= valid["hr@10"] <= 1.0
    assert main(["eval", str(run), "--split", "valid"]) == 0
    assert json.loads((run / "eval-valid.json").read_text())["dense_scorer"] is None  # the run's own settings
    capsys.readouterr()
    assert main(["eval", str(run), "generative.rescore=1", "--split", "valid"]) == 2
    assert "set generative.dense_scorer=RETRIEVAL_RUN_DIR" in capsys.readouterr().err
    assert main(["eval", str(run), f"generative.dense_scorer={tmp_path / 'nowhere'}", "generative.rescore=1"]) == 2
    assert "not a recforge run directory" in capsys.readouterr().err

    # set at training time: recorded in the run's config and eval.json; the Retriever returns the evaluated lists
    trained = tmp_path / "trained"
    assert main(["--no-progress", "train", TIGER, *args, f"train.output_dir={trained}", *overrides]) == 0
    assert load_config(trained / "config.yaml").generative.dense_scorer == str(sasrec)
    assert json.loads((trained / "eval.json").read_text())["dense_scorer"]["run_dir"] == str(sasrec.resolve())
    s, _, _ = generative.load_run(trained)
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1), 1)
    items, scores, targets = generative.generated_items(s, samples, k=10)
    retriever = Retriever.from_run(trained, device="cpu")
    assert retriever.dense_scorer is not None and retriever.rescore == 1.0 and retriever.dense_candidates == 5
    check_retrieves_evaluated(retriever, s, histories_of(s, samples), targets, items, scores, beam=10)
