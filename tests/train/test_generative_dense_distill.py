"""``generative.dense_distill``: the dense_init run as a frozen teacher of the dense head. The default leaves the loss
bit-identical (no teacher loaded), a weight w > 0 adds exactly w x KL(teacher || dense head) over the catalogue (checked
against a hand computation that rebuilds each teacher input and matches rows by raw item ID), training and resuming
load the teacher while evaluation never does, and the config errors name the fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recforge.cli import main
from recforge.config import ConfigError, load_config
from recforge.data.sid_sequences import transition_samples
from recforge.jagged.batch import JaggedBatch
from recforge.generate import dense_scorer, retrieval_run
from recforge.train import dense_distill, generative
from recforge.train.losses import sampled_softmax_loss
from _sid_runs import RUN_TINY, run_args, sid_dataset

CONFIG = "configs/beauty-sid-tiger-liger-init.yaml"
# a teacher that reads fewer history items (5) than the SID model (8): its own input length is used
SASREC = ["model.dim=8", "model.ffn_dim=8", "train.threads=1", "train.epochs=1", "eval.batch_size=64",
          "data.max_seq_len=5", "loss.temperature=0.2"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sid_dataset(tmp_path_factory.mktemp("distill") / "data", seed=13)


@pytest.fixture(scope="module")
def sasrec(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Path:
    run = tmp_path_factory.mktemp("sasrec") / "sasrec"
    assert main(["--no-progress", "train", "configs/beauty-sasrec.yaml", f"data.path={data}", f"train.output_dir={run}",
                 *SASREC]) == 0  # fmt: skip
    return run


def _args(tmp_path: Path, data: Path, sasrec: Path, *extra: str) -> list[str]:
    return run_args(tmp_path, data, *RUN_TINY, f"generative.dense_init={sasrec}", "generative.item_dim=8", *extra)


def test_config_errors_name_the_fix(tmp_path: Path, data: Path, sasrec: Path) -> None:
    with pytest.raises(ConfigError, match="dense_distill=1.0 .*dense_init is empty; set generative.dense_init="):
        load_config(
            "configs/beauty-sid-tiger-liger.yaml", run_args(tmp_path, data, *RUN_TINY, "generative.dense_distill=1")
        )
    with pytest.raises(ConfigError, match="dense_distill=0.5 .*dense_head is off; set generative.dense_head=true"):
        load_config(CONFIG, _args(tmp_path, data, sasrec, "generative.dense_head=false", "generative.rescore=0",
                                  "generative.dense_candidates=0", "generative.item_id_embedding=true",
                                  "generative.dense_distill=0.5"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"generative.dense_distill: must be >= 0 \(0: off\)"):
        load_config(CONFIG, _args(tmp_path, data, sasrec, "generative.dense_distill=-1"))


def _batch(s: generative.Setup, seed: int) -> tuple[torch.Tensor, generative.SidBatch]:
    samples = transition_samples(s.seqs, s.holdout)
    picked = samples[torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(seed))[:24]]
    return picked, generative.training_batch(s, picked)


def _without_teacher(s: generative.Setup, batch: generative.SidBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the SID + dense loss by hand, the dense user vectors) of ``batch``."""
    sid_loss, user = s.model.loss_and_user(batch.history, batch.mask, batch.targets, batch.items)
    dense = sampled_softmax_loss(user, batch.target_items, s.model.dense_item_vectors, s.seqs.num_items,
                                 negatives="full", temperature=s.cfg.loss.temperature, chunk_size=s.cfg.loss.chunk_size)  # fmt: skip
    return sid_loss + s.cfg.generative.dense_weight * dense, user


def test_default_zero_leaves_the_loss_bit_identical(tmp_path: Path, data: Path, sasrec: Path, monkeypatch) -> None:
    monkeypatch.setattr(generative, "load_teacher", lambda *a: pytest.fail("a teacher loaded with dense_distill=0"))
    s = generative.setup(load_config(CONFIG, _args(tmp_path, data, sasrec)), fresh=True, teacher=True)
    assert s.teacher is None
    s.model.eval()  # no dropout: both computations see the same network
    _, batch = _batch(s, int(torch.randint(1 << 30, (1,))))
    assert batch.teacher is None
    objective, logged = generative._loss(s, batch)
    want, _ = _without_teacher(s, batch)
    assert torch.equal(objective, want) and torch.equal(logged, want)


def _teacher_logits_by_hand(sasrec: Path, data: Path, s: generative.Setup, samples: torch.Tensor) -> torch.Tensor:
    """(B, N) the SASRec run's logits over ``s``'s items 1..N: each history rebuilt item by item (its last 5 items
    before the target, in the run's own item indices), rows matched through raw item IDs."""
    run, _ = retrieval_run.load_retrieval_run(sasrec, data)
    model = run.model.eval()
    run_row = {int(raw): row for row, raw in enumerate(run.seqs.item_vocab) if row}
    out = []
    for user, end in samples.tolist():
        start = int(s.seqs.offsets[user])
        dense = s.seqs.item_ids[max(start, start + end - 1 - 5) : start + end - 1]
        ids = torch.tensor([run_row[int(s.seqs.item_vocab[i])] for i in dense.tolist()])
        features = {"item_ids": ids}
        if s.seqs.timestamps is not None:
            features["timestamps"] = s.seqs.timestamps[max(start, start + end - 1 - 5) : start + end - 1]
        with torch.no_grad():
            user_vec = model(JaggedBatch(torch.tensor([0, len(ids)]), features, 5))[-1]
            items = F.normalize(model.prefix.item_embedding.weight, dim=-1)
        rows = torch.tensor([run_row[int(raw)] for raw in s.seqs.item_vocab[1:]])
        out.append(user_vec @ items[rows].T / 0.2)  # the run's loss.temperature
    return torch.stack(out)


def test_distill_adds_the_kl_to_the_teacher_over_the_catalogue(tmp_path: Path, data: Path, sasrec: Path) -> None:
    w = float(torch.empty(1).uniform_(0.3, 3.0))
    cfg = load_config(CONFIG, _args(tmp_path, data, sasrec, f"generative.dense_distill={w}"))
    s = generative.setup(cfg, fresh=True, teacher=True)
    assert s.teacher is not None and not s.teacher.model.training
    assert not any(p.requires_grad for p in s.teacher.model.parameters())
    assert all(id(p) not in {id(q) for q in s.model.parameters()} for p in s.teacher.model.parameters())
    s.model.eval()
    samples, batch = _batch(s, int(torch.randint(1 << 30, (1,))))
    objective, logged = generative._loss(s, batch)
    base, user = _without_teacher(s, batch)
    teacher = _teacher_logits_by_hand(sasrec, data, s, samples)
    student = user @ F.normalize(s.model.dense_items.weight[1:], dim=-1).T / cfg.loss.temperature
    p = teacher.double().softmax(-1)
    kl = (p * (p.log() - student.double().log_softmax(-1))).sum(-1).mean()
    assert kl > 1e-3  # the term is not trivially zero
    torch.testing.assert_close(objective.double(), base.double() + w * kl, rtol=1e-5, atol=1e-5)
    assert torch.equal(logged, objective)
    objective.backward()  # the KL trains the user tower, never the teacher
    assert s.model.dense_user.weight.grad is not None
    assert all(p.grad is None for p in s.teacher.model.parameters())


def test_teacher_rows_are_matched_by_raw_item_id(tmp_path: Path, data: Path, sasrec: Path, monkeypatch) -> None:
    """A teacher run whose item indices come in another order (its table permuted with them) gives the same logits."""
    cfg = load_config(CONFIG, _args(tmp_path, data, sasrec, "generative.dense_distill=1"))
    s = generative.setup(cfg, fresh=True, teacher=True)
    samples, batch = _batch(s, 0)
    want = s.teacher.logits(batch.teacher)
    real = retrieval_run.load_retrieval_run
    perm = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(s.seqs.num_items) + 1])  # new row r: old perm[r]

    def permuted(run_dir, data_dir, what=""):
        run, provenance = real(run_dir, data_dir, what)
        run.seqs.item_vocab = run.seqs.item_vocab[perm.numpy()]
        with torch.no_grad():
            run.model.prefix.item_embedding.weight.copy_(run.model.prefix.item_embedding.weight[perm])
        return run, provenance

    monkeypatch.setattr(dense_scorer, "load_retrieval_run", permuted)
    other = dense_distill.load_teacher(cfg, s.seqs, s.device)
    assert not torch.equal(other.to_run, s.teacher.to_run)
    torch.testing.assert_close(other.logits(other.batch(s.seqs, samples)), want, rtol=1e-5, atol=1e-5)
    missing = s.seqs.item_vocab.copy()
    missing[1] = int(np.max(missing)) + 1
    with pytest.raises(ValueError, match="dense_distill: the teacher .*item vocabulary differs"):
        dense_distill.load_teacher(cfg, type(s.seqs)(**{**vars(s.seqs), "item_vocab": missing}), s.device)


def test_training_and_resume_load_the_teacher_evaluation_never(
    tmp_path: Path, data: Path, sasrec: Path, monkeypatch
) -> None:
    real, loads = dense_distill.load_teacher, []
    monkeypatch.setattr(generative, "load_teacher", lambda *a: loads.append(1) or real(*a))
    args = _args(tmp_path, data, sasrec, "generative.dense_distill=1", "train.epochs=2", "train.eval_every=1")
    assert main(["--no-progress", "train", CONFIG, *args, "train.max_steps=2"]) == 0
    assert main(["--no-progress", "train", CONFIG, *args, "--resume"]) == 0
    assert len(loads) == 2  # each training process (new, resumed) loads it; their final evaluations do not
    assert main(["eval", str(tmp_path / "run")]) == 0
    assert len(loads) == 2
