"""``train.compile``'s first-step cost, cold (empty compile caches) and warm (a second process, same caches),
source trees side by side.

Usage (from the repo root):
    # CPU (Inductor's C++ backend; ~8 minutes on 2 cores): the tree before and after a change
    python benchmarks/compile_time.py --tree base=/tmp/base --tree new=. --variants fp32 bf16 \
        --out benchmarks/results/compile_time-cpu-2core.json
    # GPU (Triton)
    python benchmarks/compile_time.py --tree base=/tmp/base --tree new=. --device cuda --variants bf16 \
        --out benchmarks/results/compile_time-h200.json

Each measurement is a fresh ``python`` child that imports the tree's ``recforge`` (``PYTHONPATH``), builds the
ML-1M-shaped step of ``train_mfu.py`` (HSTU d 128, 8 blocks, max length 200, full softmax over 3,706 items,
16 users a batch; the objective is model + loss, as ``train.compile`` compiles it), compiles it with dynamic
shapes the way the tree's ``train.compile`` does (``recforge.train.compiled.compile_dynamic`` where the tree has
it, else ``objective.compile(dynamic=True)``), and times its first step (trace + compile + run) and a second step
of another size. ``cold``: a new ``TORCHINDUCTOR_CACHE_DIR``; ``warm``: the next child on that directory (what a
user's second run pays). The child also reports dynamo's compile attempts (a second one is a restarted trace) and
AOTAutograd's cache counters (hit / miss / bypass).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _machine import cpu_model, source_trees, write_result

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time
sys.path.insert(0, BENCH)
import argparse, torch
from torch._dynamo.utils import compile_times, counters
import train_mfu as T

T.CASES["compile-probe"] = (dict(dim=128, num_blocks=8, num_heads=2, dqk=64, dv=64), 200, 0, 16, "full", 0, 3706)
options = argparse.Namespace(chunk_size=0, bucket_ratio=1.25, loss_matmul="float32")
runner, _ = T.make_runner("compile-probe", VARIANT, torch.device(DEVICE), options)
try:
    from recforge.train.compiled import compile_dynamic
except ImportError:  # a tree from before compile_dynamic: what its train.compile did
    runner.objective.compile(dynamic=True)
else:
    compile_dynamic(runner.objective)
times = []
for batch in T.make_batches("compile-probe", 2, 0):
    batch = batch.to(torch.device(DEVICE))
    start = time.perf_counter()
    runner([batch])
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
attempts = [line.split(",")[0] for line in compile_times(repr="str", aggregate=True).splitlines() if "attempt" in line]
print("RESULT " + json.dumps({"first_step_s": times[0], "second_step_s": times[1], "compile_attempts": len(attempts),
                              "aot_autograd": dict(counters["aot_autograd"]), "inductor": dict(counters["inductor"])}))
"""

VARIANTS = {"fp32": "fp32-eager", "bf16": "bf16-eager"}  # train_mfu's eager variants, compiled here


def measure(tree: Path, variant: str, device: str, cache_dir: str, timeout: float) -> dict:
    code = CHILD.replace("BENCH", repr(str(HERE))).replace("VARIANT", repr(VARIANTS[variant])).replace("DEVICE", repr(device))
    env = {**os.environ, "PYTHONPATH": str(tree), "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{tree} ({variant}) failed with code {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=PATH", help="a source tree holding recforge/")
    p.add_argument("--variants", nargs="+", default=["fp32", "bf16"], choices=sorted(VARIANTS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=1, help="cold + warm pairs per tree and variant")
    p.add_argument("--timeout", type=float, default=900, help="seconds per child")
    p.add_argument("--out", default="")
    args = p.parse_args()
    trees = source_trees(args.tree)
    rows = []
    for variant in args.variants:
        for _ in range(args.repeats):
            for name, tree in trees.items():  # trees alternate: a busy machine slows them alike
                with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache:
                    cold = measure(tree, variant, args.device, cache, args.timeout)
                    warm = measure(tree, variant, args.device, cache, args.timeout)
                rows.append({"tree": name, "variant": variant, "cold": cold, "warm": warm})
                print(f"{name:>8} {variant:>5}  cold {cold['first_step_s']:7.1f} s ({cold['compile_attempts']} attempts)  "
                      f"warm {warm['first_step_s']:7.1f} s  AOTAutograd warm {warm['aot_autograd']}", flush=True)  # fmt: skip
    print(f"\n{'tree':>8} {'variant':>7} {'cold s':>8} {'warm s':>8} {'warm vs first tree':>19}")
    first = next(iter(trees))
    for variant in args.variants:
        med = {name: {k: statistics.median(r[k]["first_step_s"] for r in rows if r["tree"] == name and r["variant"] == variant)
                      for k in ("cold", "warm")} for name in trees}  # fmt: skip
        for name in trees:
            print(f"{name:>8} {variant:>7} {med[name]['cold']:>8.1f} {med[name]['warm']:>8.1f} "
                  f"{med[first]['warm'] / med[name]['warm']:>18.2f}x")  # fmt: skip
    if args.out:
        machine = cpu_model() if args.device == "cpu" else __import__("torch").cuda.get_device_name()
        write_result(args.out, {"benchmark": "compile_time", "device": args.device, "machine": machine,
                                "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                                "trees": {k: str(v) for k, v in trees.items()}, "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
