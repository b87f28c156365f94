"""Run ``recforge.cli`` with the start-up's phases timed: ``python _startup_phases.py OUT.jsonl CLI_ARGS...``.

Used by ``train_startup.py --phases``. Each timed call appends a JSON row to OUT.jsonl as it returns
(the benchmark stops the run at its checkpoint): the phase, its start (seconds since this script
started; Python start-up itself is not included) and its host seconds. Every phase is looked up where
the retrieval recipe calls it; one a tree lacks is skipped, so older trees run too.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import functools  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

# (module, attribute looked up there, phase name)
PHASES = (
    ("recforge.train.retrieval", "load_config", "load_config"),
    ("recforge.train.retrieval", "prepare_runtime", "prepare_runtime (device)"),
    ("recforge.train.retrieval", "init_distributed", "init_distributed"),
    ("recforge.train.retrieval", "prepare_run_dir", "prepare_run_dir"),
    ("recforge.train.retrieval", "load_dataset", "load_dataset"),
    ("recforge.data.sequences", "UserSequences.from_dataset", "UserSequences.from_dataset"),
    ("recforge.train.retrieval", "build_retrieval_model", "build_retrieval_model"),
    ("recforge.train.retrieval", "StepRunner", "StepRunner (step, optimizer)"),
    ("recforge.data.sequences", "UserSequences.training_samples", "training_samples"),
    ("recforge.train.retrieval", "run_loop", "run_loop"),
    ("recforge.train.retrieval", "_step", "step"),
    ("recforge.train.retrieval", "_eval_during_training", "evaluation"),
    ("recforge.train.loop", "host_snapshot", "checkpoint snapshot"),
    ("recforge.train.loop", "save_checkpoint", "checkpoint write"),
)
MAX_CALLS = 3  # rows per phase (the first steps, evaluations, checkpoints)


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    lock = threading.Lock()
    counts: dict[str, int] = {}

    def record(phase: str, start: float, seconds: float) -> None:
        with lock:
            counts[phase] = counts.get(phase, 0) + 1
            if counts[phase] <= MAX_CALLS:
                with open(out, "a") as f:
                    f.write(json.dumps({"phase": phase, "call": counts[phase], "start_s": start - STARTED,
                                        "seconds": seconds}) + "\n")  # fmt: skip

    def timed(fn, phase):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record(phase, start, time.perf_counter() - start)

        return call

    start = time.perf_counter()
    import recforge.cli as cli

    for module_name, attribute, phase in PHASES:
        try:
            module = importlib.import_module(module_name)
            owner, name = module, attribute
            if "." in attribute:
                owner_name, name = attribute.split(".")
                owner = getattr(module, owner_name)
            raw = owner.__dict__[name]
        except (ImportError, AttributeError, KeyError):
            continue  # this tree has no such phase
        if isinstance(raw, staticmethod):
            setattr(owner, name, staticmethod(timed(raw.__func__, phase)))
        else:
            setattr(owner, name, timed(raw, phase))
    record("imports (recforge.cli + recipe)", start, time.perf_counter() - start)
    sys.argv = ["recforge", *argv]
    sys.exit(cli.main(argv))


if __name__ == "__main__":
    main()
