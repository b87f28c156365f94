"""Export a ranking run's slices for serving outside Python: torch.export programs and ONNX models.

Four programs, each with dynamic token counts, and ``export.json`` saying how they connect::

    prefix          item_ids, actions, context_ids, timestamps (T,)   -> embeddings (T, d)
    encoder_prefill embeddings (n, d), timestamps (n,), num_contextual -> keys (B, n, H, Dqk), values (B, n, H, Dv)
                    (the user's contextual + history tokens: the KV cache)
    encoder_score   candidate embeddings (C, d), candidate timestamps (C,), keys, values,
                    key timestamps (n,), num_contextual                -> candidate states (C, d)
    postfix         candidate states (C, d)                            -> task outputs (C, K)
                    ([states, candidate embeddings] (C, 2d) when the postfix has a candidate tower)

They compute what ``RankEngine`` computes (one sequence; no chunking or pool), so an ONNX
runtime can serve prefix-cached ranking: run ``prefix`` + ``encoder_prefill`` once per history,
keep keys/values, then ``prefix`` + ``encoder_score`` + ``postfix`` per candidate batch.

Example:
    >>> export_run("runs/ranking-taobao-hstu", "runs/ranking-taobao-hstu/export")   # or `recforge export`
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from recforge.io import atomic_write_json
from recforge.jagged.mask import AttentionMask
from recforge.models.hstu import HSTUEncoder
from recforge.models.ranking import RankingModel, load_slices
from recforge.serve.attention import attend_cached
from recforge.serve.model_dir import model_dir_of

log = logging.getLogger(__name__)


class PrefixProgram(nn.Module):
    def __init__(self, prefix: nn.Module) -> None:
        super().__init__()
        self.prefix = prefix

    def forward(self, item_ids: Tensor, actions: Tensor, context_ids: Tensor, timestamps: Tensor) -> Tensor:
        return self.prefix({"item_ids": item_ids, "actions": actions, "context_ids": context_ids, "timestamps": timestamps})


def _encode(encoder: HSTUEncoder, x: Tensor, whole_times: Tensor, num_contextual: Tensor, num_targets: Tensor,
            cache: tuple[Tensor, Tensor] | None, on_layer=None) -> Tensor:  # fmt: skip
    """``x`` (the new tokens) through the encoder's blocks, attending with ``ops.cached_hstu_attention``
    (the engine's op, its PyTorch reference: it traces) over ``cache`` (per-layer keys, values) or none."""
    m = x.shape[0]
    n = cache[0].shape[1] if cache is not None else 0
    step = torch.arange(2, device=x.device)  # [0, 1]
    q_offsets, cache_offsets = step * m, step * n
    mask = AttentionMask(num_contextual=num_contextual.view(1), num_targets=num_targets.view(1), timestamps=whole_times)
    scale = 1.0 / encoder.cfg.max_seq_len

    def attend(layer: int, block, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if on_layer is not None:
            on_layer(k, v)
        k_cache, v_cache = (cache[0][layer], cache[1][layer]) if cache is not None else (k[:0], v[:0])
        return attend_cached(block, q, k, v, k_cache, v_cache, q_offsets, cache_offsets, m, max(n, 1), mask,
                             whole_times, scale, "pytorch")  # fmt: skip

    return encoder.encode(x, attend)


class PrefillProgram(nn.Module):
    """Contextual + history tokens through every block; returns each block's keys and values."""

    def __init__(self, encoder: HSTUEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, x: Tensor, timestamps: Tensor, num_contextual: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = [], []
        _encode(self.encoder, x, timestamps, num_contextual, num_contextual * 0, None,
                lambda k, v: (keys.append(k), values.append(v)))  # fmt: skip
        return torch.stack(keys), torch.stack(values)


class ScoreProgram(nn.Module):
    """Candidates (the targets of the user's sequence) through every block, attending to the cached
    keys/values and to themselves."""

    def __init__(self, encoder: HSTUEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, x: Tensor, timestamps: Tensor, keys: Tensor, values: Tensor, key_timestamps: Tensor,
                num_contextual: Tensor) -> Tensor:  # fmt: skip
        num_targets = torch.ones_like(num_contextual) * x.shape[0]
        return _encode(self.encoder, x, torch.cat([key_timestamps, timestamps]), num_contextual, num_targets,
                       (keys, values))  # fmt: skip


def _programs(model: RankingModel) -> dict[str, tuple[nn.Module, tuple, dict]]:
    if not isinstance(model.encoder, HSTUEncoder):
        raise ValueError(f"export needs an HSTU encoder; this run's encoder is {type(model.encoder).__name__}")
    cfg = model.encoder.cfg
    if cfg.attn_norm != "layernorm":
        raise ValueError(f"export supports attn_norm=layernorm; this run's encoder uses {cfg.attn_norm} "
                         "(`recforge serve` serves it with the full forward pass)")  # fmt: skip
    d = model.prefix.dim if hasattr(model.prefix, "dim") else cfg.dim
    n, c = 9, 2
    tokens = torch.arange(1, n + 1, dtype=torch.int64)
    ts = torch.arange(n, dtype=torch.int64) * 1000 + 1_000_000
    ctx = torch.tensor(c, dtype=torch.int64)
    layers, heads = cfg.num_blocks, cfg.num_heads
    T, N, C = (torch.export.Dim(name, min=2, max=1 << 20) for name in ("tokens", "prefix_len", "candidates"))
    return {
        "prefix": (PrefixProgram(model.prefix), (tokens.clamp(max=1), tokens * 0, tokens * 0, ts),
                   {"item_ids": {0: T}, "actions": {0: T}, "context_ids": {0: T}, "timestamps": {0: T}}),
        "encoder_prefill": (PrefillProgram(model.encoder), (torch.randn(n, d), ts, ctx),
                            {"x": {0: N}, "timestamps": {0: N}, "num_contextual": None}),
        "encoder_score": (ScoreProgram(model.encoder),
                          (torch.randn(5, d), torch.full((5,), 1_000_000 + 5500), torch.randn(layers, n, heads, cfg.dqk),
                           torch.randn(layers, n, heads, cfg.dv), ts, ctx),
                          {"x": {0: C}, "timestamps": {0: C}, "keys": {1: N}, "values": {1: N},
                           "key_timestamps": {0: N}, "num_contextual": None}),
        "postfix": (model.postfix, (torch.randn(5, 2 * d if _takes_candidate(model) else d),), {"x": {0: C}}),
    }  # fmt: skip


def _takes_candidate(model: RankingModel) -> bool:
    return bool(getattr(model.postfix, "takes_candidate", False))


IO = {
    "prefix": (["item_ids", "actions", "context_ids", "timestamps"], ["embeddings"]),
    "encoder_prefill": (["x", "timestamps", "num_contextual"], ["keys", "values"]),
    "encoder_score": (["x", "timestamps", "keys", "values", "key_timestamps", "num_contextual"], ["states"]),
    "postfix": (["x"], ["outputs"]),
}


def export_run(run_dir: str | Path, out_dir: str | Path, formats: tuple[str, ...] = ("torch", "onnx"),
               check: bool = True) -> Path:  # fmt: skip
    """Export the run's programs (see the module docstring) to ``out_dir``; with ``check``, run each
    exported program on its example inputs and compare with PyTorch (raises on a mismatch)."""
    unknown = set(formats) - {"torch", "onnx"}
    if unknown:
        raise ValueError(f"unknown export formats {sorted(unknown)}; expected torch and/or onnx")
    model_dir = model_dir_of(run_dir)
    model, manifest = load_slices(model_dir)
    model = model.float().eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    programs, report = {}, {}
    for name, (module, args, dynamic) in _programs(model).items():
        module = module.eval()
        with torch.no_grad():
            expected = module(*args)
        entry = {"inputs": IO[name][0], "outputs": IO[name][1], "files": {}}
        if "torch" in formats:
            program = torch.export.export(module, args, dynamic_shapes=dynamic)
            torch.export.save(program, out / f"{name}.pt2")
            entry["files"]["torch"] = f"{name}.pt2"
            if check:
                report[f"{name}/torch"] = _max_diff(program.module()(*args), expected)
        if "onnx" in formats:
            onnx_program = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic,
                                             input_names=IO[name][0], output_names=IO[name][1], verbose=False)  # fmt: skip
            onnx_program.save(str(out / f"{name}.onnx"))
            entry["files"]["onnx"] = f"{name}.onnx"
            if check:
                report[f"{name}/onnx"] = _max_diff(run_onnx(out / f"{name}.onnx", args), expected)
        programs[name] = entry
    bad = {k: v for k, v in report.items() if not v <= 1e-4}
    if bad:
        raise RuntimeError(f"exported programs disagree with PyTorch (max |diff|): {bad}")
    cfg = model.encoder.cfg
    atomic_write_json(out / "export.json", {
        "format": "recforge-ranking-export",
        "format_version": 1,
        "programs": programs,
        "flow": [
            "history: prefix(contextual + history tokens) -> encoder_prefill -> keys, values (cache them per user)",
            "candidates: prefix(candidate tokens) -> encoder_score(.., keys, values, history timestamps) -> postfix"
            + (" of [states, prefix embeddings] concatenated (C, 2d): the postfix has a candidate-only tower"
               if _takes_candidate(model) else ""),
        ],
        "layout": {
            "action_encoding": manifest.get("action_encoding", "sum"),
            "num_contextual": manifest.get("num_contextual"),
            "user_features": manifest.get("user_features"),
            "contextual_tokens": "context_ids per user feature, timestamp = request time",
            "history_tokens": "sum: item + action per event; interleave: item token then action token",
            "candidate_tokens": "item_ids, actions 0, context_ids 0, timestamp = request time",
            "max_seq_len": cfg.max_seq_len,
        },
        "tasks": manifest.get("tasks", []),
        "check_max_abs_diff": report,
    })  # fmt: skip
    return out


def run_onnx(path: Path, args: tuple) -> tuple | Tensor:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    outs = [torch.from_numpy(o) for o in session.run(None, feeds)]
    return outs[0] if len(outs) == 1 else tuple(outs)


def _max_diff(got, expected) -> float:
    got = got if isinstance(got, tuple | list) else (got,)
    expected = expected if isinstance(expected, tuple | list) else (expected,)
    return max(float((g - e).abs().max()) for g, e in zip(got, expected))


__all__ = ["PrefillProgram", "PrefixProgram", "ScoreProgram", "export_run", "run_onnx"]
