"""One engine pass's host work and host <-> device transfers, before and after the pass staging change.

Usage (``--before-src``: a source tree to compare with, the commit before the change):
    mkdir -p /tmp/before && git archive 58e233e recforge | tar -x -C /tmp/before
    python benchmarks/serve_engine_pass.py --before-src /tmp/before --out benchmarks/results/serve_engine_pass-cpu-2core.json
    python benchmarks/serve_engine_pass.py --device cuda --before-src /tmp/before --out benchmarks/results/serve_engine_pass-h200.json

A pass of B work items (B = ``--batch``), shaped like ``serve_overload.py``'s traffic on its model
(2 HSTU blocks x 2 heads of 32, float32): half are returning users' candidates (``--candidates``
after a ``--history``-event prefix), half a returning user's 2 new events (a prefill chunk). The
same items run through every variant, side by side in one process:

- ``graphs``: the padded passes (``graphs.py``; the CUDA-graph path, replayed on CUDA, eager on the
  CPU); before = the old ``GraphRunner.run`` item by item (each item's inputs copied alone, its
  scores read back alone), after = ``GraphRunner.run_pass`` (``staging.py``).
- ``graphs-io``: the same with the padded compute replaced by a fixed output: only what the
  serving thread does besides launching the graph (staging, copies, reading scores back), the
  part a replayed graph leaves on the host.
- ``eager``: ``RankEngine.forward`` (the CPU engine's pass, the CUDA fallback), before and after.

Per variant and B: wall time per pass (p50/mean over ``--reps``; on CUDA each pass ends with a
device synchronisation) and the pass's transfers, counted by a ``TorchFunctionMode`` that follows
which tensors live on the host (the items' features and token identities, what is built without a
device, what ``.cpu()`` returns) and which on the device (the rest): host -> device copies (``copy_``,
``.to``, assignment from a host tensor) and device -> host reads (``.cpu()``, ``.item()``,
``.tolist()``, ``.numpy()``, ``copy_`` into a host tensor). On CUDA the synchronisations are also counted
by PyTorch itself (``torch.cuda.set_sync_debug_mode``). Every variant's scores are checked against
the after-eager ones (any difference above 1e-5 fails the run).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from _machine import cpu_model
from serve_load import ACTIONS, NUM_ITEMS, export_model
from recforge.serve.cache_manager import CacheManager
from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.graphs import GraphRunner
from recforge.serve.layout import candidate_tokens, prefix_tokens
from recforge.serve.state import WorkItem
from recforge.io import atomic_write_json


class TransferCounter(TorchFunctionMode):
    """Counts a pass's host <-> device copies and reads by following which storages are host memory.

    Host: ``host`` (the items' features and token identities), tensors made without a ``device`` argument,
    what ``.cpu()`` / ``.to("cpu")`` returns, results of host tensors only. Device: the rest. On the CPU
    ``.to(device)`` and ``.cpu()`` are made to copy, as they do between memories, so the two stay apart."""

    def __init__(self, host: list[torch.Tensor]) -> None:
        super().__init__()
        self.host = {_key(t) for t in host}
        self.h2d = self.d2h = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_host = None  # what the result is: True host, False device, None by its inputs
        if first is not None and name in ("cpu", "to", "cuda"):
            target = "cpu" if name == "cpu" else _target(args, kwargs)
            if self._is_host(first) and target is not None and name != "cpu":  # host -> the engine's device
                self.h2d += 1
                kwargs["copy"], on_host = True, False
            elif not self._is_host(first) and target == "cpu":
                self.d2h += 1
                kwargs["copy"], on_host = True, True
                if name == "cpu":
                    func, args = torch.Tensor.to, (first, "cpu")
        elif first is not None and name in ("item", "tolist", "numpy") and not self._is_host(first):
            self.d2h += 1
        elif name == "copy_" and len(args) > 1:
            dst, src = self._is_host(args[0]), self._is_host(args[1])
            self.h2d += (not dst) and src
            self.d2h += dst and not src
        elif name == "__setitem__" and isinstance(args[2], torch.Tensor):
            self.h2d += (not self._is_host(args[0])) and self._is_host(args[2])
        if "device" in kwargs and kwargs["device"] is not None and name not in ("to", "cuda"):
            on_host = False
            self.h2d += name == "tensor"  # Python values to the device
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and not name.endswith("_") and name != "__setitem__":
            if on_host is None:
                inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                inputs += [x for a in args if isinstance(a, list | tuple) for x in a if isinstance(x, torch.Tensor)]
                on_host = all(self._is_host(t) for t in inputs)  # none (a factory without a device): host
            (self.host.add if on_host else self.host.discard)(_key(out))
        return out

    def _is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and _key(t) in self.host


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _target(args, kwargs) -> str | None:
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, str | torch.device):
            return torch.device(a).type
    return None


def _module(src: Path, rel: str, name: str):
    """``rel`` of the tree ``src``, loaded beside the current package (its imports resolve to the current ``recforge``)."""
    path = src / rel
    if not path.is_file():
        raise SystemExit(f"--before-src {src}: no {path}; e.g. `git archive 58e233e recforge | tar -x -C {src}`")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def workload(engine: RankEngine, batch: int, history: int, candidates: int, seed: int) -> list[WorkItem]:
    """``batch`` work items: half candidates after a computed ``history``-event prefix, half a 2-event prefill chunk."""
    rng = np.random.default_rng(seed)
    cache = CacheManager.for_engine(engine)
    items = []
    for u in range(batch):
        events = history + int(rng.integers(0, 3))
        ts = (1_700_000_000 + np.cumsum(rng.integers(1, 600, events))).tolist()
        hist = {"items": rng.integers(1, NUM_ITEMS + 1, events).tolist(), "timestamps": ts,
                "actions": [ACTIONS[a] for a in rng.integers(0, len(ACTIONS), events)]}  # fmt: skip
        req = engine.encode(f"user{u}", hist, rng.integers(1, NUM_ITEMS + 1, candidates).tolist(),
                            user_features={"user_id": str(u % 1000), "gender": "f"}, timestamp=ts[-1] + 60)  # fmt: skip
        state = engine.prefix_state(req, cache.new_state(engine.num_contextual, 0))
        if u % 2 == 0:
            items.append(WorkItem(state, candidate_tokens(req), "targets"))
        else:  # the last 2 events are new: a prefill chunk from where the cached prefix ended
            tokens = prefix_tokens(req, engine.action_encoding)
            start = tokens["item_ids"].numel() - 2
            state.length = start
            items.append(WorkItem(state, {k: v[start:] for k, v in tokens.items()}, "prefix", start))
    return items


def variants(engine: RankEngine, before_src: Path | None) -> dict:
    """name -> (run(items) -> outputs) for every variant; ``io`` ones stub the padded compute."""
    capture = engine.device.type == "cuda"
    after = GraphRunner(engine, limit=256, capture=capture)
    out = {"graphs/after": _Run(after.run_pass, after.staging), "eager/after": engine.forward}
    io_after = GraphRunner(engine, limit=256, capture=False)
    out["graphs-io/after"] = _stubbed(io_after, io_after.run_pass)
    out["graphs-io/after"].staging = io_after.staging
    if before_src is not None:
        graphs = _module(before_src, "recforge/serve/graphs.py", "graphs_before")
        attention = _module(before_src, "recforge/serve/attention.py", "attention_before")
        eng = _module(before_src, "recforge/serve/engine.py", "engine_before")
        eng.CachedPass = attention.CachedPass
        before = graphs.GraphRunner(engine, limit=256, capture=capture)
        out["graphs/before"] = lambda items: [before.run(it) for it in items]
        out["eager/before"] = lambda items: eng.RankEngine.forward(engine, items)
        io_before = graphs.GraphRunner(engine, limit=256, capture=False)
        out["graphs-io/before"] = _stubbed(io_before, lambda items: [io_before.run(it) for it in items])
    return out


class _Run:
    def __init__(self, run, staging) -> None:
        self.run, self.staging = run, staging

    def __call__(self, items):
        return self.run(items)


def _stubbed(runner, run):
    """``run`` with every padded pass's compute replaced by a fixed output of its shape (kept per bucket)."""
    fixed: dict = {}

    def compute_of(padded):
        def compute():
            key = (padded.kind, padded.m)
            if key not in fixed:
                fixed[key] = torch.zeros(padded.m, 2, device=padded.features.device) if padded.kind == "targets" else None
            return fixed[key]
        return compute

    def wrapped(items):
        for padded in runner.passes.values():
            padded.compute = compute_of(padded)
        out = run(items)
        for padded in runner.passes.values():  # new buckets made during this pass: stub them for the next
            padded.compute = compute_of(padded)
        return out

    return _Run(wrapped, None)


def staging_buffers(engine: RankEngine, run) -> list[torch.Tensor]:
    """The reusable host buffers a variant's passes already hold (made before counting: host memory)."""
    owners = [engine._staging, *(getattr(run, "staging", None),)]
    return [held[0] for owner in owners if owner is not None for held in owner._host if held is not None]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(engine, run, items, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(items)
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    return times


def measure(engine, run, items, times: list[float]) -> tuple[dict, list]:
    """The row of one variant: ``times`` summarised, then one counted pass (and one under the CUDA sync check)."""
    device = engine.device
    host = [t for it in items for t in (*it.features.values(), it.state.tokens)] + staging_buffers(engine, run)
    counter = TransferCounter(host)
    with counter:
        outputs = run(items)
    row = {"p50_ms": float(np.median(times)) * 1e3, "mean_ms": float(np.mean(times)) * 1e3, "reps": len(times),
           "h2d_copies": counter.h2d, "d2h_reads": counter.d2h}  # fmt: skip
    if device.type == "cuda":
        _sync(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run(items)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        row["cuda_syncs"] = sum("synchroniz" in str(w.message) for w in caught)
    return row, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", default="8,32,128", help="work items per pass, comma-separated")
    parser.add_argument("--history", type=int, default=500)
    parser.add_argument("--candidates", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3, help="timed passes per variant and round (graphs-io: 10x as many)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds over every variant, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads on the CPU")
    parser.add_argument("--before-src", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = export_model(Path(tmp), max_len=args.history * 2 + 64)
        engine = RankEngine.from_run(run_dir, EngineConfig(device=args.device, cuda_graphs=0))
    table = variants(engine, args.before_src)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        items = workload(engine, batch, args.history, args.candidates, args.seed + batch)
        reference = engine.forward(items)
        for run in table.values():  # warm: buckets, captures, buffers
            run(items)
        _sync(engine.device)
        times: dict[str, list[float]] = {name: [] for name in table}
        for r in range(args.rounds):  # interleaved, every other round reversed: a busy moment of a shared machine
            for name, run in sorted(table.items(), reverse=bool(r % 2)):  # (or going first) hits every variant alike
                times[name] += timed(engine, run, items, args.reps * (10 if name.startswith("graphs-io") else 1))
        for name, run in sorted(table.items()):
            row, outputs = measure(engine, run, items, times[name])
            if not name.startswith("graphs-io"):
                for out, ref in zip(outputs, reference):
                    if out is not None and not torch.allclose(out, ref, rtol=1e-5, atol=1e-5):
                        raise SystemExit(f"{name} B={batch}: scores differ from the eager pass by "
                                         f"{(out - ref).abs().max().item():.2e}")  # fmt: skip
            rows.append({"variant": name, "batch": batch, **row})
            print(f"B={batch:4d} {name:18s} p50 {row['p50_ms']:9.3f} ms  mean {row['mean_ms']:9.3f} ms  "
                  f"h2d {row['h2d_copies']:4d}  d2h {row['d2h_reads']:4d}"
                  + (f"  cuda syncs {row['cuda_syncs']}" if "cuda_syncs" in row else ""), flush=True)  # fmt: skip
        write(args, engine, rows)  # after every batch size: a long run keeps what it measured


def write(args: argparse.Namespace, engine: RankEngine, rows: list) -> None:
    result = {"benchmark": "serve_engine_pass", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": str(engine.device), "cpu": cpu_model(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}  # fmt: skip
    if engine.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(engine.device)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
