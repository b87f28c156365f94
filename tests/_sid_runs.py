"""Shared pieces of the tests that train tiny SID runs and serve them: the small model settings, a synthetic
dataset with its SIDs, a tiny trained run, a tiny ID-retrieval run and its logits rebuilt by hand (dense scorers),
the Retriever checked against the evaluated lists, and the `/v1/retrieve` round trip checked against the
``Retriever``'s answers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient

from recforge.cli import main
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.generate.retrieval_run import load_retrieval_run
from recforge.jagged.batch import JaggedBatch
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig

# the model and loop of a seconds-long CPU run (each test file adds its beam, epochs, ...)
TINY = ["model.dim=16", "model.num_blocks=1", "generative.decoder_blocks=1", "model.num_heads=2", "model.ffn_dim=32",
        "optim.warmup_steps=0", "train.batch_size=64", "train.threads=1", "eval.batch_size=64", "data.max_seq_len=8",
        "eval.ks=[1,5,10]"]  # fmt: skip
RUN_TINY = [*TINY, "generative.beam=10", "optim.schedule=constant"]  # a run whose evaluation the tests re-derive
# a tiny SASRec run that reads fewer history items (5) than the SID models (8) and has its own temperature (0.2)
SASREC = ["model.dim=8", "model.ffn_dim=8", "train.threads=1", "train.epochs=1", "eval.batch_size=64",
          "data.max_seq_len=5", "loss.temperature=0.2"]  # fmt: skip


# a server that sheds nothing: these tests check answers, not admission control, and a loaded 2-core CI machine
# can hold the event loop past the default 250 ms or queue more than the default 500 ms of estimated work
# (shedding is tested in tests/serve/test_server_hardening.py and test_server.py)
UNSHED = ServerConfig(max_loop_lag_ms=60_000, scheduler=SchedulerConfig(max_wait_ms=20.0, max_queue_ms=60_000))


def sid_dataset(path: Path, seed: int, num_users: int = 50) -> Path:
    """A synthetic dataset at ``path`` (30 items) with 2-level SIDs of 8 codes in ``path / 'sids'``."""
    data = write_synthetic(path, SyntheticConfig(num_users=num_users, num_items=30, seed=seed, mean_seq_len=10,
                                                 max_seq_len=20))  # fmt: skip
    assert main(["sid", "fit", str(data), "--out", str(data / "sids"), "--codebook-size", "8", "--levels", "2"]) == 0
    return data


def serve_matches(app, bodies: list[dict], want: list[tuple[list[int], list[float]]], workers: int) -> None:
    """Two rounds of concurrent ``/v1/retrieve`` calls (the second finds every user's last history in the cache;
    padded batches of mixed lengths): each answer is ``want``'s items and scores, none from its history."""
    with TestClient(app) as client:
        for _ in range(2):
            with ThreadPoolExecutor(workers) as pool:
                answers = list(pool.map(lambda b: client.post("/v1/retrieve", json=b), bodies))
            for body, answer, (items_want, scores_want) in zip(bodies, answers, want, strict=True):
                assert answer.status_code == 200, answer.text
                out = answer.json()
                assert out["items"] == items_want and not set(out["items"]) & set(body["history"])
                torch.testing.assert_close(torch.tensor(out["scores"]), torch.tensor(scores_want), rtol=1e-4, atol=1e-4)


def run_args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    """Overrides of a run on ``data`` (its SIDs) written to ``tmp_path / 'run'``, then ``extra``."""
    return [f"data.path={data}", f"generative.sids={data / 'sids'}", f"train.output_dir={tmp_path / 'run'}", *extra]


def train_tiny_run(root: Path, config: str, seed: int, *overrides: str) -> Path:
    """``recforge train config`` on a fresh 40-user dataset (seed ``seed``) under ``root``: the run directory."""
    data = sid_dataset(root / "data", seed=seed, num_users=40)
    run = root / "run"
    assert main(["--no-progress", "train", config, f"data.path={data}", f"generative.sids={data / 'sids'}",
                 f"train.output_dir={run}", *TINY, *overrides]) == 0  # fmt: skip
    return run


def histories_of(s, samples: torch.Tensor) -> list[list[int]]:
    """Raw item IDs of every earlier item of each evaluation sample (user, end) of setup ``s``."""
    out = []
    for user, end in samples.tolist():
        start = int(s.seqs.offsets[user])
        out.append(s.seqs.item_vocab[s.seqs.item_ids[start : start + end - 1].numpy()].tolist())
    return out


def check_retrieves_evaluated(retriever, s, histories: list[list[int]], targets: torch.Tensor, items: torch.Tensor,
                              scores: torch.Tensor, beam: int) -> tuple[list[int], list]:  # fmt: skip
    """For the histories without their target (evaluation never excludes the target; retrieve excludes every
    history item), the Retriever returns exactly the evaluated lists ``items`` / ``scores`` (``generated_items``).
    Returns (those rows, the Retriever's answers for them)."""
    fresh = [row for row, h in enumerate(histories) if s.seqs.item_vocab[int(targets[row])] not in h]
    assert len(fresh) >= 8
    got = retriever.retrieve([histories[row] for row in fresh], k=10, beam=beam)
    for row, (got_items, got_scores) in zip(fresh, got, strict=True):
        keep = items[row] > 0
        assert got_items == s.seqs.item_vocab[items[row][keep].numpy()].tolist()
        torch.testing.assert_close(torch.tensor(got_scores), scores[row][keep], rtol=1e-5, atol=1e-5)
    return fresh, got



def retrieval_run(run: Path, data: Path, *extra: str, config: str = "configs/beauty-sasrec.yaml") -> Path:
    """A tiny ID-retrieval run (``SASREC`` settings, then ``extra``) trained on ``data`` at ``run``."""
    assert main(["--no-progress", "train", config, f"data.path={data}", f"train.output_dir={run}", *SASREC,
                 *extra]) == 0  # fmt: skip
    return run


def scorer_logits_by_hand(run_dir: Path, data: Path, histories: list[list[int]], items: list[int]) -> torch.Tensor:
    """(B, M) a SASRec run's logits of raw ``items`` for raw ``histories``: each history rebuilt item by item (its last
    ``data.max_seq_len`` items the run knows, in the run's item indices) and run alone; 0 for an item the run lacks."""
    run, _ = load_retrieval_run(run_dir, data)
    row = {int(raw): r for r, raw in enumerate(run.seqs.item_vocab) if r}
    n, temperature = run.cfg.data.max_seq_len, run.cfg.loss.temperature
    table = F.normalize(run.model.prefix.item_embedding.weight.detach(), dim=-1)
    known = torch.tensor([i in row for i in items])
    vectors = table[torch.tensor([row.get(i, 0) for i in items])]  # (M, d)
    out = []
    for history in histories:
        ids = torch.tensor([row[i] for i in history if i in row][-n:])
        with torch.no_grad():
            user = run.model(JaggedBatch(torch.tensor([0, len(ids)]), {"item_ids": ids}, n))[-1]
        out.append(torch.where(known, user @ vectors.T / temperature, 0.0))
    return torch.stack(out)
