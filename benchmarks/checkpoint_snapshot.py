"""The training loop's checkpoint snapshot, before / after one batched transfer (issue 18), side by side in one run.

Usage:
    python benchmarks/checkpoint_snapshot.py --cases ml1m large --out benchmarks/results/checkpoint_snapshot-h200.json
    python benchmarks/checkpoint_snapshot.py --device cpu --cases tiny   # smoke run

Each case (``benchmarks/train_mfu.py``'s: the model and the fused AdamW of ``StepRunner``, trained a few steps so the
moments exist) snapshots its model and optimizer state to the host, as ``recforge.train.loop`` does at every
checkpoint, three ways, alternating, ``--repeats`` times each, one training step between snapshots and the device
idle when one starts (the loop has just evaluated and read its losses):

    before   ``.to("cpu", copy=True)`` per tensor, as until issue 18: each copy blocks until the device is idle
             and goes through pageable memory (one wait per tensor)
    after    ``host_snapshot`` into reused ``HostBuffers`` (pinned; ``non_blocking`` copies, one wait), as the loop
             does now
    fresh    ``host_snapshot`` with new buffers each time (what a one-off caller pays: pinned allocation included)

Every snapshot is checked bit for bit against a ``before`` copy of the same state (``identical`` in the JSON).
Reported: the median and min milliseconds of each, the tensors and MB per snapshot, and the run's total for
``--checkpoints`` checkpoints (150: ``configs/ml1m-hstu-plus-d128.yaml`` checkpoints at each of its epochs).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

import train_mfu as tm  # benchmarks/ is sys.path[0] when run as a script
from recforge.io import atomic_write_json
from recforge.train.async_save import HostBuffers, host_snapshot, host_snapshot_reference


def _tensors(tree) -> list[torch.Tensor]:
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return []


def identical(a, b) -> bool:
    """Same tensors in the same order, each equal bit for bit (dtype, shape, bytes)."""
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(ta, tb, strict=True)
    )  # fmt: skip


def run_case(case: str, variant: str, device: torch.device, args) -> dict:
    options = argparse.Namespace(chunk_size=0, bucket_ratio=1.125, loss_matmul="float32")  # train_mfu's defaults
    runner, _ = tm.make_runner(case, variant, device, options)
    batches = [b.to(device) for b in tm.make_batches(case, 2, seed=1)]
    for i in range(3):  # AdamW's moments and step counts exist from the first step on
        runner([batches[i % 2]])
    model, optimizer, buffers = runner.model, runner.optimizer, HostBuffers()
    ways = {"before": lambda: host_snapshot_reference(model, optimizer),
            "after": lambda: host_snapshot(model, optimizer, buffers),
            "fresh": lambda: host_snapshot(model, optimizer)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in ways}
    same = {name: True for name in ways}
    for i in range(args.repeats):
        for name, take in ways.items():
            runner([batches[i % 2]])  # the state changes between snapshots
            tm._sync(device)  # idle device, as after the loop's evaluation and loss read
            t0 = time.perf_counter()
            snapshot = take()
            times[name].append((time.perf_counter() - t0) * 1e3)
            same[name] &= identical(snapshot, host_snapshot_reference(model, optimizer))
    tensors = _tensors(host_snapshot_reference(model, optimizer))
    row = {"case": case, "variant": variant, "tensors": len(tensors),
           "mb": sum(t.numel() * t.element_size() for t in tensors) / 1e6,
           "device_tensors": sum(t.is_cuda for t in _tensors((model.state_dict(), optimizer.state_dict()))),
           "identical": same}  # fmt: skip
    for name, values in times.items():
        row[name] = {"median_ms": statistics.median(values), "min_ms": min(values),
                     "run_total_s": statistics.median(values) * args.checkpoints / 1e3}  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", nargs="*", default=["ml1m", "large"], choices=list(tm.CASES))
    parser.add_argument("--variant", default="bf16-eager", choices=list(tm.VARIANTS),
                        help="how the steps between snapshots run (the snapshot itself is the same)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--checkpoints", type=int, default=150, help="checkpoints of a run, for run_total_s")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for case in args.cases:
        try:
            row = run_case(case, args.variant, device, args)
        except Exception as err:  # noqa: BLE001 - reported, and the other cases still run
            row = {"case": case, "variant": args.variant, "error": f"{type(err).__name__}: {err}"}
            print(f"{case}: FAILED: {row['error']}", flush=True)
            rows.append(row)
            continue
        rows.append(row)
        ok = "bit-identical" if all(row["identical"].values()) else f"NOT IDENTICAL {row['identical']}"
        print(f"{case:<8} {row['tensors']} tensors ({row['device_tensors']} on the device), {row['mb']:.1f} MB; "
              + ", ".join(f"{n} {row[n]['median_ms']:.2f} ms (min {row[n]['min_ms']:.2f})" for n in ("before", "after", "fresh"))
              + f"; {args.checkpoints} checkpoints: {row['before']['run_total_s']:.2f} -> {row['after']['run_total_s']:.2f} s; {ok}",
              flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        atomic_write_json(Path(args.out), {
            "benchmark": "checkpoint_snapshot", "command": "python benchmarks/checkpoint_snapshot.py " + " ".join(sys.argv[1:]),
            "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "repeats": args.repeats, "rows": rows,
        })  # fmt: skip


if __name__ == "__main__":
    main()
