"""The chunked sampled-softmax loss (forward + backward) of this tree against another tree's, side by side.

Usage (from the repo root; BASE: an older checkout, e.g. ``git archive 58e233e recforge | tar -x -C /tmp/base``):
    python benchmarks/chunked_loss.py --base /tmp/base --device cuda --out benchmarks/results/chunked_loss-h200.json
    python benchmarks/chunked_loss.py --base /tmp/base --device cpu --scale 0.05     # a quick CPU check

Cases, at the ML-1M configs' shapes: ``full`` (configs/ml1m-hstu-plus-d128.yaml: ~50K positions of d = 128 against the
3,707-row catalogue, chunks of 8,192) and ``per_position`` (configs/ml1m-hstu-large.yaml: ~25K positions of d = 50, 128
sampled negatives each, chunks of 8,192); ``--scale`` multiplies the positions. Both trees get the same inputs, as their
``sampled_softmax_loss`` would hand them to ``recforge.train.chunked_softmax``; each case checks that the losses and
every gradient agree (float32, rtol/atol 1e-4 relative to the largest entry), then reports the median (and fastest) wall time
of forward + backward (device synchronised; the trees interleaved), the host time of the same calls (until the last one is queued) and, on CUDA,
the ops (top-level ``aten::``) and kernels one call runs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from recforge.io import atomic_write_json

# ops that only make a view (no kernel, no copy): left out of ``non_view_ops``
VIEW_OPS = {f"aten::{name}" for name in ("slice", "select", "unsqueeze", "squeeze", "reshape", "view", "t", "transpose",
                                         "expand", "expand_as", "as_strided", "detach", "numpy_T", "alias", "permute",
                                         "split", "split_with_sizes", "_reshape_alias", "lift_fresh")}  # fmt: skip
CASES = {"full": dict(positions=50_000, dim=128, items=3706, negatives=0, chunk=8192),
         "per_position": dict(positions=25_000, dim=50, items=3706, negatives=128, chunk=8192)}  # fmt: skip


def _module(tree: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, tree / "recforge" / "train" / "chunked_softmax.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(case: dict, scale: float, device: torch.device, gen: torch.Generator) -> dict:
    positions = max(1, int(case["positions"] * scale))
    user = F.normalize(torch.randn(positions, case["dim"], generator=gen), dim=-1).to(device)
    table = F.normalize(torch.randn(case["items"] + 1, case["dim"], generator=gen), dim=-1).to(device)
    targets = torch.randint(1, case["items"] + 1, (positions,), generator=gen).to(device)
    out = {"user": user, "table": table, "targets": targets, "chunk": min(case["chunk"], max(1, positions // 6))}
    if case["negatives"]:
        ids = torch.randint(1, case["items"] + 1, (positions, case["negatives"]), generator=gen).to(device)
        out["distinct"], out["rows"] = torch.unique(ids, return_inverse=True)
        out["ids"] = ids
    return out


def _run(module, kind: str, x: dict, temperature: float = 0.05):
    """(loss, grads) of one forward + backward, as ``losses._chunked_loss`` calls the tree's module."""
    user, table = x["user"].detach().requires_grad_(), x["table"].detach().requires_grad_()
    if kind == "full" and hasattr(module, "chunked_full_softmax_cross_entropy"):
        loss = module.chunked_full_softmax_cross_entropy(user, table, x["targets"], temperature=temperature, chunk=x["chunk"])
    elif kind == "full":
        loss = module.chunked_softmax_cross_entropy(user, table[x["targets"]], x["targets"], shared=table,
                                                    shared_ids=torch.arange(table.shape[0], device=user.device),
                                                    temperature=temperature, chunk=x["chunk"])  # fmt: skip
    else:
        loss = module.chunked_softmax_cross_entropy(user, table[x["targets"]], x["targets"], own=table[x["distinct"]],
                                                    own_rows=x["rows"], own_ids=x["ids"], temperature=temperature,
                                                    chunk=x["chunk"])  # fmt: skip
    loss.backward()
    return loss.detach(), (user.grad, table.grad)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max().clamp_min(1e-30))))


def _time(trees: dict, kind: str, x: dict, sync, repeats: int) -> dict:
    """Per tree: median and fastest wall and host ms of forward + backward (trees interleaved within each repeat, so
    a busy machine slows them alike), and the ops and kernels of one call."""
    walls, hosts = {name: [] for name in trees}, {name: [] for name in trees}
    for _ in range(repeats):
        for name, module in trees.items():
            sync()
            start = time.perf_counter()
            _run(module, kind, x)
            hosts[name].append(time.perf_counter() - start)
            sync()
            walls[name].append(time.perf_counter() - start)
    out = {}
    for name, module in trees.items():
        activities = [torch.profiler.ProfilerActivity.CPU]
        if x["user"].is_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            _run(module, kind, x)
            sync()
        events = prof.events()
        aten = [e for e in events if e.name.startswith("aten::")]
        top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
        kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events) if x["user"].is_cuda else None
        out[name] = {"wall_ms": 1e3 * statistics.median(walls[name]), "wall_ms_min": 1e3 * min(walls[name]),
                     "host_ms": 1e3 * statistics.median(hosts[name]), "top_level_aten_ops": len(top),
                     "non_view_ops": sum(e.name not in VIEW_OPS for e in top), "cuda_kernels": kernels}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the tree to compare with (holds recforge/train/chunked_softmax.py)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the number of positions")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    trees = {"base": _module(Path(args.base), "base_chunked_softmax"),
             "new": _module(Path(__file__).resolve().parents[1], "new_chunked_softmax")}  # fmt: skip
    results = {}
    for kind in args.cases:
        x = _inputs(CASES[kind], args.scale, device, torch.Generator().manual_seed(0))
        (loss_a, grads_a), (loss_b, grads_b) = (_run(m, kind, x) for m in trees.values())
        same = _close(loss_b, loss_a) and all(_close(b, a) for a, b in zip(grads_a, grads_b, strict=True))
        if not same:
            raise SystemExit(f"{kind}: the trees disagree (loss {float(loss_a):.6f} vs {float(loss_b):.6f})")
        for _ in range(3):  # warm-up: allocator, cuBLAS handles
            for module in trees.values():
                _run(module, kind, x)
        results[kind] = {"positions": x["user"].shape[0], "chunk": x["chunk"], "loss": float(loss_a),
                         **_time(trees, kind, x, sync, args.repeats)}  # fmt: skip
        r = results[kind]
        print(f"{kind:>12}: base {r['base']['wall_ms']:8.2f} ms (min {r['base']['wall_ms_min']:.2f}, host {r['base']['host_ms']:.2f}, "
              f"{r['base']['non_view_ops']} non-view ops, {r['base']['cuda_kernels']} kernels)   new {r['new']['wall_ms']:8.2f} ms "
              f"(min {r['new']['wall_ms_min']:.2f}, host {r['new']['host_ms']:.2f}, {r['new']['non_view_ops']} non-view ops, {r['new']['cuda_kernels']} kernels)   "
              "losses and gradients agree", flush=True)  # fmt: skip
    if args.out:
        out = {"benchmark": "chunked_loss", "device": str(device), "scale": args.scale, "base": args.base,
               "results": results, "torch": torch.__version__, "date": datetime.date.today().isoformat()}  # fmt: skip
        if device.type == "cuda":
            out["gpu"] = torch.cuda.get_device_name(device)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.out), out)


if __name__ == "__main__":
    main()
