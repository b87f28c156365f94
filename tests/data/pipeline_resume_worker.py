"""A training-like consumer for the exactly-once SIGKILL test (run as a subprocess).

One process = one rank of one generation (a run between two crashes). On start it merges
the pipeline states of every checkpoint left by earlier generations and ranks, builds this
rank's pipeline over the remaining rows, and for each batch: updates its "model" (a
per-row hit counter, a buffer of an nn.Module), appends the batch's row ids to an fsync'd
log, and every few steps saves the model with the pipeline state in the checkpoint
manifest through ``recforge.checkpoint.save_checkpoint`` (atomic). Each process's
model starts at zero, so the sum of all checkpointed models counts how often each row was
trained on.

Usage: python pipeline_resume_worker.py DATA RUN GEN RANK WORLD WORKERS
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from recforge.checkpoint import find_checkpoint, save_checkpoint
from recforge.data.collate import JaggedCollate
from recforge.data.pipeline import Pipeline
from recforge.data.resume import PipelineState

CHECKPOINT_EVERY = 3


class RowCounter(torch.nn.Module):
    def __init__(self, num_rows: int):
        super().__init__()
        self.register_buffer("hits", torch.zeros(num_rows, dtype=torch.int32))


def saved_states(run: Path, before_gen: int) -> list[dict]:
    """Manifests of the latest checkpoint of every (generation, rank) run directory of earlier
    generations (all ranks of a run restore the same checkpoints, as in DDP: never a sibling's)."""
    out = []
    for run_dir in sorted(run.glob("gen*.rank*")):
        if int(run_dir.name[3:].split(".")[0]) >= before_gen:
            continue
        ckpt = find_checkpoint(run_dir)
        if ckpt is not None:
            out.append(json.loads((ckpt / "manifest.json").read_text()))
    return out


def main(data: str, run: str, gen: int, rank: int, world: int, workers: int) -> None:
    run_path = Path(run)
    states = [PipelineState.from_dict(m["pipeline_state"]) for m in saved_states(run_path, gen)]
    state = PipelineState.merge(states) if states else None
    if state is not None and state.complete:
        print("complete", flush=True)
        return
    pipe = (
        Pipeline.from_parquet(data, num_workers=workers, rank=rank, world_size=world, seed=11, state=state)
        .shuffle(150)
        .batch(16)
        .collate(JaggedCollate({"item_ids": "item_ids"}))
        .prefetch(2)
    )
    run_dir = run_path / f"gen{gen}.rank{rank}"
    run_dir.mkdir(parents=True, exist_ok=True)
    model = RowCounter(pipe.source.num_rows)
    log = open(run_dir / "consumed.jsonl", "a")  # noqa: SIM115 - kept open for the whole run
    print("ready", flush=True)
    step = 0
    file_rows = pipe.source.file_rows
    first_row = torch.from_numpy(file_rows.cumsum() - file_rows)
    for batch in pipe:
        row_ids = batch.dense["row_ids"]
        dense_rows = first_row[row_ids // (1 << 40)] + row_ids % (1 << 40)
        model.hits += torch.bincount(dense_rows, minlength=model.hits.numel()).to(torch.int32)  # the "training step"
        step += 1
        log.write(json.dumps({"step": step, "rows": row_ids.tolist()}) + "\n")
        log.flush()
        os.fsync(log.fileno())
        if step % CHECKPOINT_EVERY == 0:
            save_checkpoint(run_dir, step=step, model=model, optimizer=None, manifest={"pipeline_state": pipe.state_dict()})
        time.sleep(0.002)
    save_checkpoint(run_dir, step=step + 1, model=model, optimizer=None, manifest={"pipeline_state": pipe.state_dict()})
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
