"""Distributed training on CPU with gloo: real ``torchrun`` jobs on 127.0.0.1, tiny configs.

Each job starts fresh Python processes (a few seconds each on a busy 2-core machine), hence
``integration``. The worker (``_worker.py``) is ``recforge.cli`` with a step that records the rows
each rank trained on and can kill one rank mid-epoch.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from recforge.checkpoint import find_checkpoint
from recforge.config import config_from_dict
from recforge.data.dataset import load_dataset
from recforge.data.sequences import UserSequences
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train import retrieval

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 users, 50 items: 4 steps per epoch at a global batch of 12."""
    config = SyntheticConfig(num_users=40, num_items=50, num_clusters=5, mean_seq_len=10, min_seq_len=3, max_seq_len=30, seed=11)
    return write_synthetic(tmp_path_factory.mktemp("dist") / "synth", config)


def _raw(data: Path, out: Path, **train: object) -> dict:
    """Deterministic steps: full-softmax loss (no sampled negatives), no dropout."""
    return {
        "name": "run",
        "data": {"path": str(data), "protocol": "paper", "max_seq_len": 20},
        "model": {"kind": "hstu", "dim": 16, "num_blocks": 1, "num_heads": 1, "dqk": 8, "dv": 8, "dropout": 0.0},
        "loss": {"negatives": "full", "temperature": 0.1},
        "optim": {"lr": 0.01, "grad_clip": 1.0},
        "train": {"epochs": 6, "batch_size": 12, "eval_every": 0, "output_dir": str(out / "{name}"), "device": "cpu",
                  "threads": 1, "seed": 5, "keep_checkpoints": 5, **train},
        "eval": {"ks": [1, 10], "batch_size": 7},
    }  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CRASH_AT")}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def _launcher(nproc: int, rdzv: list[str], worker: bool = True) -> list[str]:
    """torchrun running the recording worker, or (``worker=False``) the documented ``-m recforge.cli``."""
    program = [str(WORKER)] if worker else ["-m", "recforge.cli"]
    return [sys.executable, "-m", "torch.distributed.run", *rdzv, f"--nproc-per-node={nproc}", *program, "--no-progress"]


def torchrun(nproc: int, args: list[str], check: bool = True, worker: bool = True, **env: str) -> subprocess.CompletedProcess:
    """One single-node torchrun job of ``nproc`` ranks running ``recforge <args>``."""
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--nnodes=1"]
    done = subprocess.run(_launcher(nproc, rdzv, worker) + args, env=_env(**env), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    if check and done.returncode != 0:
        raise AssertionError(f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done


def _config_file(tmp_path: Path, raw: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dense", ["ddp", "fsdp2"])
def test_two_ranks_with_grad_accum_follow_one_process(tmp_path: Path, data_dir: Path, dense: str) -> None:
    """2 ranks x 2 micro-batches on the same global batches (DDP or FSDP2): the loss curve and the
    (sharded, gathered) metrics of one process, for 24 steps with gradient clipping. The FSDP2 run
    stops at step 10 and resumes (its gathered weights and AdamW moments restored as shards)."""
    single = config_from_dict(_raw(data_dir, tmp_path / "one"))
    retrieval.train(single, progress=False)
    config = _config_file(tmp_path, _raw(data_dir, tmp_path / "two"))
    args = ["train", config, "dist.grad_accum=2", f"dist.dense={dense}"]
    if dense == "fsdp2":
        torchrun(2, [*args, "train.max_steps=10"])
        args.append("--resume")
    torchrun(2, args)
    run_two = tmp_path / "two" / "run"
    one, two = _losses(single.run_dir), _losses(run_two)
    assert len(one) == len(two) == 24
    for name in ("model", "optimizer"):  # the final dense weights and AdamW state (FSDP2: gathered from the shards)
        ref, got = (load_file(find_checkpoint(d) / f"{name}.safetensors") for d in (single.run_dir, run_two))
        assert ref.keys() == got.keys()
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=1e-3, atol=1e-5, msg=key)
    np.testing.assert_allclose(two, one, rtol=2e-4, atol=1e-5)
    assert one[-1] < 0.8 * one[0]  # it trained
    ref, got = (json.loads((d / "eval.json").read_text()) for d in (single.run_dir, run_two))
    for key in ("hr@10", "ndcg@10", "mrr"):
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key
    sharded_eval = json.loads((run_two / "evals.jsonl").read_text().splitlines()[-1])  # computed on 2 ranks
    for key in ("hr@10", "ndcg@10", "mrr"):  # the same checkpoint evaluated by one process (recforge eval)
        assert sharded_eval[key] == pytest.approx(got[key], abs=1e-12), key


def _rows_per_step(record_dir: Path, keep_until: int | None = None) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    for path in sorted(record_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if keep_until is None or entry["step"] <= keep_until:
                rows.setdefault(entry["step"], []).extend(entry["rows"])
    return rows


@pytest.mark.parametrize(("resume_ranks", "crash_step"), [(2, 7), (3, 6)])
def test_kill_one_rank_then_resume_trains_each_sample_once_per_epoch(tmp_path: Path, data_dir: Path, resume_ranks: int,
                                                                     crash_step: int) -> None:  # fmt: skip
    """Rank 1 of 2 dies mid-epoch (after a mid-epoch checkpoint); ``--resume`` on the same or a
    different number of ranks finishes the run, and every sample is trained exactly once in every epoch."""
    raw = _raw(data_dir, tmp_path, epochs=3, loader="pipeline", checkpoint_every=2, batch_size=6 * resume_ranks)
    config = _config_file(tmp_path, raw)
    first, second = tmp_path / "rec1", tmp_path / "rec2"
    first.mkdir(), second.mkdir()
    crashed = torchrun(2, ["train", config], check=False, RECORD_DIR=str(first), CRASH_AT=f"1:{crash_step}")
    assert crashed.returncode != 0
    run_dir = tmp_path / "run"
    saved = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step_dir"]
    step = int(saved.split("_")[1])
    assert 0 < step < crash_step  # the crash lost steps after the last checkpoint
    torchrun(resume_ranks, ["train", config, "--resume"], RECORD_DIR=str(second), START_STEP=str(step))
    rows = {**_rows_per_step(first, keep_until=step), **_rows_per_step(second)}
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert sorted(rows) == list(range(1, len(epochs) + 1))
    num_samples = UserSequences.from_dataset(load_dataset(data_dir)).training_samples(1, 20, "last").shape[0]
    for epoch in range(3):
        seen = np.sort(np.concatenate([rows[s + 1] for s, e in enumerate(epochs) if e == epoch]))
        assert np.array_equal(seen, np.arange(num_samples)), f"epoch {epoch}: {seen.tolist()}"


def test_ranking_on_two_ranks_metrics_equal_one_process_eval(tmp_path: Path) -> None:
    """The ranking recipe trains on 2 ranks (pipeline loader); AUC/GAUC computed on 2 ranks during
    training equal ``recforge eval`` of the same checkpoint in one process."""
    data = write_synthetic(tmp_path / "impressions", SyntheticConfig(num_users=40, num_items=60, num_clusters=4,
                                                                     mean_seq_len=16, max_seq_len=40, seed=5),
                           impressions=True)  # fmt: skip
    overrides = [f"data.path={data}", f"train.output_dir={tmp_path}/{{name}}", "train.epochs=2", "train.eval_every=1",
                 "model.dim=16", "model.dqk=8", "model.dv=8", "model.head_hidden=16", "data.max_seq_len=64",
                 "ranking.max_targets=16", "train.batch_size=16", "eval.batch_size=16", "train.threads=1",
                 "train.loader=pipeline", "train.device=cpu"]  # fmt: skip
    torchrun(2, ["train", str(REPO / "configs" / "ranking-synthetic-hstu.yaml"), *overrides], worker=False)
    run_dir = next(p for p in tmp_path.iterdir() if (p / "evals.jsonl").is_file())
    assert (run_dir / "model" / "vocab.json").is_file()  # slices for recforge serve / export, written by rank 0
    last = json.loads((run_dir / "evals.jsonl").read_text().splitlines()[-1])
    done = subprocess.run([sys.executable, "-m", "recforge.cli", "eval", str(run_dir), "--checkpoint", "latest",
                           "--split", "valid"], env=_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    single = json.loads((run_dir / "eval-valid.json").read_text())
    keys = [k for k in last if k.endswith(("/auc", "/gauc"))]
    assert keys
    for key in keys:
        assert last[key] == pytest.approx(single[key], abs=1e-9), key
    assert torch.isfinite(torch.tensor([last[k] for k in keys])).all()


def test_two_nodes_on_loopback(tmp_path: Path, data_dir: Path) -> None:
    """``--nnodes 2`` with c10d rendezvous: two launchers (one rank each) form one job and train
    the same loss curve as one process."""
    raw = _raw(data_dir, tmp_path, epochs=2)
    config = _config_file(tmp_path, raw)
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--nnodes=2", "--rdzv-id=loopback"]
    nodes = [subprocess.Popen(_launcher(1, rdzv) + ["train", config], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-4000:]
    assert sum("hr@10" in out for out, _ in outputs) == 1  # only global rank 0 prints the result
    single = config_from_dict(_raw(data_dir, tmp_path / "one", epochs=2))
    retrieval.train(single, progress=False)
    np.testing.assert_allclose(_losses(tmp_path / "run"), _losses(single.run_dir), rtol=2e-4, atol=1e-5)


def _assert_gathered_metrics_equal_single_process(run_dir: Path, world_size: int, step: int) -> None:
    ckpt = run_dir / "checkpoints" / json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step_dir"]
    assert json.loads((ckpt / "sparse_sharded" / "manifest.json").read_text())["world_size"] == world_size
    gathered = json.loads((run_dir / "evals.jsonl").read_text().splitlines()[-1])  # on world_size ranks
    single = json.loads((run_dir / "eval.json").read_text())  # train's final evaluation: one process, the export
    assert single["step"] == gathered["step"] == step
    for key in ("hr@10", "ndcg@10", "mrr"):
        assert gathered[key] == pytest.approx(single[key], abs=1e-12), key


def test_dynamic_tables_reshard_4_2_1(tmp_path: Path, data_dir: Path) -> None:
    """``model.embedding=dynamic`` on 4 ranks, resumed on 2, then on 1: the planner's plan is saved,
    each checkpoint holds the shards (resharded at every resume) and their single-process export,
    and the metrics gathered from the ranks equal ``recforge eval``'s (one process, the export)."""
    config = _config_file(tmp_path, _raw(data_dir, tmp_path, epochs=1, eval_every=1))
    dynamic = ["model.embedding=dynamic", "sparse.optimizer=adam", "sparse.lr=0.01"]
    run_dir = tmp_path / "run"
    for epochs, ranks in enumerate((4, 2, 1), start=1):
        torchrun(ranks, ["train", config, *dynamic, f"train.epochs={epochs}", *(["--resume"] if epochs > 1 else [])])
        assert json.loads((run_dir / "sharding_plan.json").read_text())["world_size"] == ranks
        _assert_gathered_metrics_equal_single_process(run_dir, ranks, step=4 * epochs)
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in log] == [0] * 4 + [1] * 4 + [2] * 4
    assert log[-1]["loss"] < log[0]["loss"]


def test_token_budget_batches_on_two_ranks_train_each_sample_once(tmp_path: Path, data_dir: Path) -> None:
    """Token-budget batches give the ranks different batch counts: the ranks agree on each epoch's
    end (a rank out of data steps with weight 0) and every sample is trained once per epoch."""
    raw = _raw(data_dir, tmp_path, epochs=2, loader="pipeline", token_budget=150)  # ranks get 2 and 3 batches
    record = tmp_path / "rec"
    record.mkdir()
    torchrun(2, ["train", _config_file(tmp_path, raw)], RECORD_DIR=str(record))
    rows = _rows_per_step(record)
    epochs = [json.loads(line)["epoch"] for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    num_samples = UserSequences.from_dataset(load_dataset(data_dir)).training_samples(1, 20, "last").shape[0]
    per_rank = [[json.loads(line)["rows"] for line in (record / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert any(not r for ranks in per_rank for r in ranks), "expected a step where one rank had no batch"
    for epoch in range(2):
        seen = np.sort(np.concatenate([rows[s + 1] for s, e in enumerate(epochs) if e == epoch]))
        assert np.array_equal(seen, np.arange(num_samples)), f"epoch {epoch}: {seen.tolist()}"


def test_sparse_input_one_step_ahead_changes_no_result(tmp_path: Path, data_dir: Path) -> None:
    """``dist.pipeline=true`` distributes and stages the next step's history lookups during this step's backward
    (the full-softmax loss looks up the whole catalogue, which is not the batch's); the loss curve equals
    ``dist.pipeline=false`` on 2 ranks, bit for bit."""
    dynamic = ["model.embedding=dynamic", "sparse.optimizer=adam", "sparse.lr=0.01", "train.epochs=3"]
    runs = {}
    for pipeline in ("true", "false"):
        config = _config_file(tmp_path, _raw(data_dir, tmp_path / pipeline))
        runs[pipeline] = torchrun(2, ["train", config, *dynamic, f"dist.pipeline={pipeline}"])
    staged = "sparse input staged one step ahead: {'prefix.item_embedding': ['features.item_ids']}"
    assert staged in runs["true"].stderr
    assert "one step ahead" not in runs["false"].stderr
    used = re.findall(r"lookups staged a step ahead, so far: \{'prefix.item_embedding': (\d+)\}", runs["true"].stderr)
    assert len(used) == 3 and int(used[-1]) >= 3 * (4 - 1)  # each epoch: every step but the first
    np.testing.assert_array_equal(_losses(tmp_path / "true" / "run"), _losses(tmp_path / "false" / "run"))


def test_single_process_run_resumes_on_two_ranks(tmp_path: Path, data_dir: Path) -> None:
    """A plain ``recforge train`` run with dynamic tables continues under torchrun on 2 ranks (its
    single-process sparse state re-routed to the owners), and ``recforge eval`` reads the result."""
    config = _config_file(tmp_path, _raw(data_dir, tmp_path, epochs=1, eval_every=1))
    dynamic = ["model.embedding=dynamic", "sparse.optimizer=adam", "sparse.lr=0.01"]
    single = subprocess.run([sys.executable, "-m", "recforge.cli", "--no-progress", "train", config, *dynamic], env=_env(),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    torchrun(2, ["train", config, *dynamic, "train.epochs=2", "--resume"], worker=False)
    _assert_gathered_metrics_equal_single_process(tmp_path / "run", 2, step=8)
