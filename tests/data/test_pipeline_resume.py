"""Exactly-once resume: state save/restore, re-splitting over ranks, and a SIGKILL test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from recforge.checkpoint import find_checkpoint
from recforge.data.parquet_source import ParquetSource, decode_row_ids
from recforge.data.pipeline import Pipeline
from recforge.data.resume import PipelineState
from tests.data.test_pipeline import write_samples

WORKER = Path(__file__).with_name("pipeline_resume_worker.py")


def dense_rows(row_ids: np.ndarray, rows_per_file: int) -> np.ndarray:
    files, rows = decode_row_ids(row_ids)
    return files * rows_per_file + rows


def test_resume_mid_epoch_consumes_the_rest_exactly_once(tmp_path):
    write_samples(tmp_path, files=2, rows=300)
    pipe = Pipeline.from_parquet(tmp_path, seed=3).shuffle(100).batch(25).prefetch(3)
    it = iter(pipe)
    first = [next(it) for _ in range(5)]  # the prefetch thread has read ahead; those rows are not consumed
    saved = json.loads(json.dumps(pipe.state_dict()))
    assert PipelineState.from_dict(saved).num_consumed == 125
    resumed = Pipeline.from_parquet(tmp_path, seed=3, state=saved).shuffle(100).batch(25)
    rest = list(resumed)
    seen = np.concatenate([dense_rows(b.column("__row_id__").to_numpy(), 300) for b in first + rest])
    assert np.array_equal(np.sort(seen), np.arange(600))
    assert resumed.state.complete
    # the next iteration is a new epoch over all rows
    again = list(resumed)
    assert resumed.state.epoch == 1 and sum(b.num_rows for b in again) == 600


@pytest.mark.parametrize("old_world,new_world", [(1, 3), (3, 2), (2, 5)])
def test_changed_world_size_resplits_evenly(tmp_path, old_world, new_world):
    write_samples(tmp_path, files=3, rows=200, row_group=32)
    source = ParquetSource(tmp_path)
    states = []
    for rank in range(old_world):  # each old rank consumed part of its share, then all crashed
        pipe = Pipeline.from_parquet(tmp_path, rank=rank, world_size=old_world, seed=rank).shuffle(64).batch(10)
        it = iter(pipe)
        for _ in range(3 + 2 * rank):
            next(it)
        states.append(PipelineState.from_dict(pipe.state_dict()))
    merged = PipelineState.merge(states)
    consumed_before = np.concatenate([np.flatnonzero(c) + 200 * f for f, c in enumerate(merged.consumed)])
    shares = []
    for rank in range(new_world):
        _, keep = merged.plan(source, rank, new_world)
        shares.append(sum(int(k.sum()) for k in keep))
        rows = list(Pipeline.from_parquet(tmp_path, rank=rank, world_size=new_world, state=merged.to_dict()).batch(50))
        shares[-1] = (shares[-1], np.concatenate([dense_rows(b.column("__row_id__").to_numpy(), 200) for b in rows]))
    counts = [n for n, _ in shares]
    assert max(counts) - min(counts) <= 1  # even re-split
    everything = np.concatenate([consumed_before] + [r for _, r in shares])
    assert np.array_equal(np.sort(everything), np.arange(600))


def test_state_checks_the_files(tmp_path):
    write_samples(tmp_path, files=2, rows=50)
    saved = Pipeline.from_parquet(tmp_path).state_dict()
    (tmp_path / "part-1.parquet").unlink()
    with pytest.raises(ValueError, match="same files"):
        Pipeline.from_parquet(tmp_path, state=saved)
    with pytest.raises(ValueError, match="version"):
        PipelineState.from_dict({**saved, "version": 99})


def _run_generation(data, run, gen, world, workers, rng, kill: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(world):
        argv = [sys.executable, str(WORKER), str(data), str(run), str(gen), str(rank), str(world), str(workers)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    for p in procs:
        line = p.stdout.readline().strip()  # "ready" once the state is merged and the pipeline built
        assert line in ("ready", "complete"), p.stderr.read()
    if kill:
        time.sleep(rng.uniform(0.0, 0.5))
        for p in procs[: rng.integers(1, world + 1)]:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=120)
        if not kill:
            assert p.returncode == 0, p.stderr.read()


def _audit(run: Path, num_rows: int, rows_per_file: int) -> tuple[np.ndarray, np.ndarray, PipelineState | None]:
    """(times each row was trained per the checkpointed models, per the fsync'd logs up to each checkpoint, merged state)."""
    hits = np.zeros(num_rows, np.int64)
    logged = np.zeros(num_rows, np.int64)
    states = []
    for run_dir in sorted(run.glob("gen*.rank*")):
        ckpt = find_checkpoint(run_dir)
        if ckpt is None:
            continue  # crashed before its first checkpoint: nothing of it counts
        manifest = json.loads((ckpt / "manifest.json").read_text())
        states.append(PipelineState.from_dict(manifest["pipeline_state"]))
        hits += load_file(ckpt / "model.safetensors")["hits"].numpy()
        for line in (run_dir / "consumed.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                continue
            if row["step"] <= manifest["step"]:
                np.add.at(logged, dense_rows(np.array(row["rows"], np.int64), rows_per_file), 1)
    return hits, logged, PipelineState.merge(states) if states else None


@pytest.mark.integration
def test_sigkill_at_random_points_consumes_every_row_exactly_once(tmp_path):
    seed = int(os.environ.get("RECFORGE_KILL_SEED", int.from_bytes(os.urandom(4), "little")))
    rng = np.random.default_rng(seed)  # kill points differ per run; failures print the seed to replay them
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    write_samples(data, files=3, rows=400, row_group=50)
    num_rows = 1200
    # (world size, reader workers, killed?) per generation: kills, then a changed worker count, then changed
    # world sizes; the last generation runs to the end
    plan = [(1, 2, True), (1, 1, True), (2, 3, True), (3, 2, True), (2, 1, False)]
    for gen, (world, workers, kill) in enumerate(plan):
        _run_generation(data, run, gen, world, workers, rng, kill)
        hits, logged, state = _audit(run, num_rows, 400)
        assert hits.max(initial=0) <= 1, f"generation {gen} (RECFORGE_KILL_SEED={seed}): a row was trained on twice"
        assert np.array_equal(hits, logged), f"generation {gen} (RECFORGE_KILL_SEED={seed}): checkpointed model and log disagree"
        if state is not None:
            consumed = np.concatenate(state.consumed).astype(np.int64)
            assert np.array_equal(consumed, hits), f"generation {gen} (RECFORGE_KILL_SEED={seed}): pipeline state and model disagree"
    assert np.array_equal(hits, np.ones(num_rows, np.int64)), f"RECFORGE_KILL_SEED={seed}: rows never trained: {np.flatnonzero(hits == 0)[:10]}"
    assert torch.equal(torch.from_numpy(logged), torch.ones(num_rows, dtype=torch.int64))


def test_several_epochs_on_several_ranks(tmp_path):
    write_samples(tmp_path, files=2, rows=150, row_group=40)
    pipes = [Pipeline.from_parquet(tmp_path, rank=r, world_size=3, seed=5).shuffle(64).batch(16) for r in range(3)]
    for epoch in range(3):
        rows = [np.concatenate([b.column("__row_id__").to_numpy() for b in p]) for p in pipes]
        assert max(map(len, rows)) - min(map(len, rows)) <= 1
        assert np.array_equal(np.sort(dense_rows(np.concatenate(rows), 150)), np.arange(300)), f"epoch {epoch}"
        assert all(p.state.epoch == epoch and p.state.share_done for p in pipes)
    with pytest.raises(ValueError, match="different epochs"):
        PipelineState.merge([pipes[0].state, PipelineState.fresh(pipes[1].source)])
