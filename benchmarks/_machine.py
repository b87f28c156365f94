"""What machine a benchmark ran on (shared by the benchmark scripts, which run from this folder)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from recforge.io import atomic_file


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_result(out: str | Path, doc: dict, indent: int = 1) -> None:
    """Write a benchmark's JSON result to ``out`` (its folder made first) and say where."""
    out = Path(out)
    with atomic_file(out) as tmp:  # a stopped run never leaves half a file
        tmp.write_text(json.dumps(doc, indent=indent) + "\n")
    print(f"wrote {out}")


def call_ms(run, device) -> float:
    """Milliseconds of one ``run()``: CUDA events on a GPU (device time, no host sync inside), else the wall clock."""
    if device.type == "cuda":
        import torch

        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        run()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e3


def relative_error(got, expected) -> float:
    """||got - expected|| / ||expected|| of two tensors, in float64."""
    got, expected = got.detach().double(), expected.detach().double()
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))


def kernel_header(benchmark: str, device) -> dict:
    """The common fields of a kernel benchmark's JSON: name, UTC date, device (GPU name or the CPU interpreter),
    torch and triton versions, the command line."""
    import datetime
    import sys

    import torch
    import triton

    return {"benchmark": benchmark, "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv)}  # fmt: skip


def source_trees(items: list[str], holds: str = "recforge/__init__.py") -> dict[str, Path]:
    """``--tree NAME=PATH`` arguments as {name: resolved path}; each PATH must be a checkout holding ``holds``."""
    trees = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not name or not sep or not (Path(path) / holds).is_file():
            raise SystemExit(f"--tree {item!r}: expected NAME=PATH with PATH a checkout holding {holds}")
        trees[name] = Path(path).resolve()
    return trees



def switch_state(value: bool | None) -> bool | str:
    """A ``recforge.env`` switch as a benchmark's JSON records it: true / false, or "auto" when unset (its default
    rule applies)."""
    return "auto" if value is None else value
