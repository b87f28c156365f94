"""``torchrun`` entry point of the distributed tests: ``recforge.cli`` with the recipes' step wrapped.

Each rank appends, per global step, the sample rows it trained on to ``$RECORD_DIR/rank<R>.jsonl``
(the first step is ``$START_STEP + 1``), and ``$CRASH_AT=RANK:STEP`` kills that rank with
``os._exit`` at that step, before the step's results can be checkpointed (a simulated crash).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from recforge import cli
from recforge.data.parquet_source import decode_row_ids
from recforge.train import ranking, retrieval

RANK = int(os.environ["RANK"])
RECORD_DIR = os.environ.get("RECORD_DIR")
CRASH = tuple(int(x) for x in os.environ["CRASH_AT"].split(":")) if os.environ.get("CRASH_AT") else None
calls = int(os.environ.get("START_STEP", "0"))


def _wrap(module) -> None:
    real = module._step

    def step(s, micro, lr_scale):
        global calls
        result = real(s, micro, lr_scale)
        if result is None:  # the epoch-end call that finds no data on any rank
            return None
        calls += 1
        if CRASH is not None and CRASH == (RANK, calls):
            os._exit(3)
        if RECORD_DIR:
            rows = [decode_row_ids(b.dense["row_ids"].cpu().numpy())[1] for b in micro if b is not None and "row_ids" in b.dense]
            with open(os.path.join(RECORD_DIR, f"rank{RANK}.jsonl"), "a") as f:
                f.write(json.dumps({"step": calls, "rows": np.concatenate(rows).tolist() if rows else []}) + "\n")
        return result

    module._step = step


_wrap(retrieval)
_wrap(ranking)
sys.exit(cli.main(sys.argv[1:]))
