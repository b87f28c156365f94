"""``DenseScorer`` (``generative.dense_scorer``, and the dense_distill teacher): a retrieval run's logits over a SID
catalogue equal the run's own computation rebuilt by hand (from training samples and from retrieve histories alike),
items the run lacks keep logit 0 and are never candidates, bad runs are refused with the fix, and the config accepts
rescore / dense_candidates with a scorer (with or without a dense head) and names the fix without either."""

from __future__ import annotations

import hashlib
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from recforge.checkpoint import find_checkpoint
from recforge.config import ConfigError, load_config, save_config
from recforge.data.dataset import load_dataset
from recforge.data.sequences import UserSequences
from recforge.data.sid_sequences import transition_samples
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.generate.dense_scorer import DenseScorer
from _sid_runs import RUN_TINY, histories_of, retrieval_run, run_args, scorer_logits_by_hand, sid_dataset

TIGER, CPU = "configs/beauty-sid-tiger.yaml", torch.device("cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sid_dataset(tmp_path_factory.mktemp("scorer") / "data", seed=17)


@pytest.fixture(scope="module")
def sasrec(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Path:
    return retrieval_run(tmp_path_factory.mktemp("scorer-sasrec") / "sasrec", data)


def _cfg(tmp_path: Path, data: Path, sasrec: Path, *extra: str, config: str = TIGER):
    return load_config(config, run_args(tmp_path, data, *RUN_TINY, f"generative.dense_scorer={sasrec}",
                                        "generative.rescore=1", *extra))  # fmt: skip


def test_logits_are_the_runs_user_vector_dot_its_items_over_its_temperature(tmp_path: Path, data: Path,
                                                                            sasrec: Path) -> None:  # fmt: skip
    cfg = _cfg(tmp_path, data, sasrec)
    seqs = UserSequences.from_dataset(load_dataset(data))
    scorer = DenseScorer.load(sasrec, cfg, seqs.item_vocab, CPU, "scorer")
    every = transition_samples(seqs, 2)
    samples = every[torch.randperm(every.shape[0])[:24]]
    histories = histories_of(types.SimpleNamespace(seqs=seqs), samples)
    assert max(map(len, histories)) > scorer.max_seq_len == 5  # the run's own window cuts some histories
    want = scorer_logits_by_hand(sasrec, data, histories, seqs.item_vocab[1:].tolist())  # (B, N)
    torch.testing.assert_close(scorer.logits(scorer.batch(seqs, samples)), want, rtol=1e-5, atol=1e-5)
    # a retrieve request's history (dense indices, no target) gives the same user vector in one batched forward
    dense = [_dense(seqs, h) for h in histories]
    user = scorer.history_user_vectors(dense)
    torch.testing.assert_close(scorer.catalogue_logits(user), want, rtol=1e-5, atol=1e-5)
    picked = torch.randint(0, seqs.num_items + 1, (len(histories), 7))  # dense indices, 0: an empty slot
    gathered = torch.where(picked > 0, want.gather(1, (picked - 1).clamp_min(0)), 0.0)
    torch.testing.assert_close(scorer.item_logits(user, picked), gathered, rtol=1e-5, atol=1e-5)
    provenance = scorer.provenance
    ckpt = find_checkpoint(sasrec, "best")
    assert provenance["run_dir"] == str(sasrec.resolve()) and provenance["checkpoint"] == ckpt.name
    assert provenance["weights_sha256"] == hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    assert not scorer.reads_timestamps and not any(p.requires_grad for p in scorer.model.parameters())


def _dense(seqs: UserSequences, raw: list[int]) -> np.ndarray:
    """Dense indices of raw item IDs in ``seqs``'s catalogue (its raw IDs are sorted)."""
    assert np.all(np.diff(seqs.item_vocab[1:]) > 0)
    return np.searchsorted(seqs.item_vocab[1:], raw) + 1


def test_items_the_run_lacks_keep_their_sid_score_and_are_never_candidates(tmp_path: Path, data: Path,
                                                                          sasrec: Path) -> None:  # fmt: skip
    cfg = _cfg(tmp_path, data, sasrec)
    seqs = UserSequences.from_dataset(load_dataset(data))
    new = int(seqs.item_vocab.max()) + 100
    served = np.r_[seqs.item_vocab, new]  # a served catalogue with an item coded after training (`recforge sid add`)
    with pytest.raises(ValueError, match=r"scorer: its item vocabulary differs .*1 of this run's 31 items missing"):
        DenseScorer.load(sasrec, cfg, served, CPU, "scorer")
    scorer = DenseScorer.load(sasrec, cfg, served, CPU, "scorer", exact=False)
    n = len(served) - 1
    a, b = (int(v) for v in torch.randperm(seqs.num_items)[:2] + 1)
    user = scorer.history_user_vectors([np.array([a, n, b]), np.array([a, b]), np.array([n])])
    torch.testing.assert_close(user[0], user[1], rtol=0, atol=0)  # the unknown item is not read
    assert torch.equal(user[2], torch.zeros_like(user[2]))  # nothing the run knows: no dense side for it
    logits = scorer.catalogue_logits(user)
    assert bool(torch.isneginf(logits[:, n - 1]).all()) and bool(torch.isneginf(logits[2]).all())
    assert bool(torch.isfinite(logits[:2, : n - 1]).all())
    item = scorer.item_logits(user, torch.tensor([[n, a, 0]] * 3))
    assert torch.equal(item[:, 0], torch.zeros(3)) and torch.equal(item[:, 2], torch.zeros(3)) and item[0, 1] != 0
    with pytest.raises(ValueError, match=r"scorer: its item vocabulary differs .*1 items there not here"):
        DenseScorer.load(sasrec, cfg, np.r_[seqs.item_vocab[:-1]], CPU, "scorer", exact=False)


def test_bad_scorer_runs_are_refused_with_the_fix(tmp_path: Path, data: Path, sasrec: Path) -> None:
    cfg = _cfg(tmp_path, data, sasrec)
    vocab = UserSequences.from_dataset(load_dataset(data)).item_vocab
    with pytest.raises(ValueError, match="s: not a recforge run directory .*retrieval config"):
        DenseScorer.load(tmp_path / "missing", cfg, vocab, CPU, "s")
    generative_run = tmp_path / "generative-run"
    generative_run.mkdir()
    save_config(cfg, generative_run / "config.yaml")
    with pytest.raises(ValueError, match=r"s: is a generative run; this needs an ID-retrieval run \(recipe: retrieval"):
        DenseScorer.load(generative_run, cfg, vocab, CPU, "s")
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    (untrained / "config.yaml").write_text((sasrec / "config.yaml").read_text())
    with pytest.raises(ValueError, match="s: the run has no best checkpoint; train it first"):
        DenseScorer.load(untrained, cfg, vocab, CPU, "s")
    other = write_synthetic(tmp_path / "other", SyntheticConfig(num_users=20, num_items=30, seed=99, mean_seq_len=6,
                                                                        max_seq_len=12))
    with pytest.raises(ValueError, match=f"s: the run was trained on .*whose interactions differ from {other}"):
        DenseScorer.load(sasrec, load_config(TIGER, run_args(tmp_path, other, *RUN_TINY)), vocab, CPU, "s")
    paper = retrieval_run(tmp_path / "paper", data, "data.protocol=paper")  # trained on the validation targets
    with pytest.raises(ValueError, match="s was trained with data.protocol=paper .*saw the validation target"):
        DenseScorer.load(paper, cfg, vocab, CPU, "s")


def test_the_config_takes_rescore_and_candidates_from_a_scorer_with_or_without_a_dense_head(
    tmp_path: Path, data: Path, sasrec: Path
) -> None:  # fmt: skip
    for config in (TIGER, "configs/beauty-sid-hstu.yaml", "configs/beauty-sid-tiger-dense.yaml"):
        g = _cfg(tmp_path, data, sasrec, "generative.dense_candidates=5", config=config).generative
        assert g.dense_scorer == str(sasrec) and g.rescore == 1 and g.dense_candidates == 5
    fix = "dense_head is off and generative.dense_scorer is empty; set generative.dense_scorer=RETRIEVAL_RUN_DIR"
    with pytest.raises(ConfigError, match=f"rescore=1.0 .*{fix}") as err:
        load_config(TIGER, run_args(tmp_path, data, *RUN_TINY, "generative.rescore=1", "generative.dense_candidates=5"))
    assert f"generative.dense_candidates=5 adds dense top items to the beam's, but generative.{fix}" in str(err.value)
    with pytest.raises(ConfigError, match=f"rescore=2.0 .*{fix}"):
        load_config("configs/beauty-sid-hstu.yaml", run_args(tmp_path, data, *RUN_TINY, "generative.rescore=2"))
