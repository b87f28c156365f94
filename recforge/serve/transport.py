"""Messages between the HTTP front-end processes and the engine process: ZeroMQ sockets, msgpack maps.

    front end DEALER ──requests──► engine ROUTER     rank, cancel, reload, health, metrics, spec
    front end DEALER ◄──replies─── engine ROUTER     one reply per request id (none for cancel)
    front end SUB    ◄──status──── engine PUB        every ``STATUS_INTERVAL_S``: heartbeat, queue delay, version

Both sockets are ``ipc://`` files in a private directory (``Endpoints``). Every message is one msgpack
map (no pickle); tensors travel as raw little-endian int64 / float32 bytes and are checked on arrival.
A rank request is already validated and encoded by the front end (``EncodedRequest``) and names the
model version whose vocabulary encoded it (``spec``): the engine answers ``stale`` when the model has
changed since, and the front end re-encodes with the new ``EngineSpec`` (what it needs to validate
and encode: vocabulary, limits, tasks; no weights).

Example:
    >>> wire = request_to_wire(req)                  # front end
    >>> assert request_from_wire(unpack(pack(wire))).items.equal(req.items)   # engine
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from recforge.serve.api import TIME_LIMIT
from recforge.serve.engine import EngineConfig, RankEngine, RankResult
from recforge.serve.layout import EncodedRequest, Vocab

STATUS_INTERVAL_S = 0.02  # the engine's heartbeat period
_INT64, _FLOAT32 = np.dtype("<i8"), np.dtype("<f4")


class WireError(ValueError):
    """A message that does not have the documented shape (a bug or a foreign peer, never a client's fault)."""


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as err:
        raise WireError(f"not a msgpack message: {err}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise WireError(f"expected a map with an 'op' string, got {type(message).__name__}")
    return message


@dataclass(frozen=True)
class Endpoints:
    """The two ipc sockets of one engine process, in ``directory`` (short: ipc paths are limited to ~100 bytes)."""

    directory: str

    @property
    def requests(self) -> str:
        return f"ipc://{Path(self.directory) / 'engine.sock'}"

    @property
    def status(self) -> str:
        return f"ipc://{Path(self.directory) / 'status.sock'}"


# ----------------------------------------------------------------------------------------------- tensors


def _ints(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().astype(_INT64, copy=False).tobytes()


def _tensor(message: dict, key: str, dtype: np.dtype = _INT64) -> torch.Tensor:
    raw = message.get(key)
    if not isinstance(raw, bytes) or len(raw) % dtype.itemsize:
        raise WireError(f"{key}: expected {dtype} bytes")
    return torch.from_numpy(np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True))


def _int(message: dict, key: str) -> int:
    value = message.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{key}: expected an integer, got {value!r}")
    return value


def request_to_wire(req: EncodedRequest) -> dict[str, Any]:
    return {"user": req.user, "context_ids": _ints(req.context_ids), "items": _ints(req.items),
            "actions": _ints(req.actions), "timestamps": _ints(req.timestamps), "candidates": _ints(req.candidates),
            "request_time": req.request_time, "truncated": req.truncated}  # fmt: skip


def request_from_wire(message: dict[str, Any]) -> EncodedRequest:
    user = message.get("user")
    if not isinstance(user, str):
        raise WireError("user: expected a string")
    req = EncodedRequest(user, _tensor(message, "context_ids"), _tensor(message, "items"), _tensor(message, "actions"),
                         _tensor(message, "timestamps"), _tensor(message, "candidates"),
                         _int(message, "request_time"), _int(message, "truncated"))  # fmt: skip
    if not req.items.numel() == req.actions.numel() == req.timestamps.numel() or not req.num_candidates:
        raise WireError("items, actions and timestamps must have one value per event, and candidates at least one")
    return req


def wire_sizes(message: dict[str, Any]) -> tuple[int, int]:
    """(history events, candidates) of a rank message, read from its byte lengths without decoding it (what
    admission needs to refuse a request before the engine spends any work on it)."""
    items, candidates = message.get("items"), message.get("candidates")
    if not isinstance(items, bytes) or not isinstance(candidates, bytes):
        raise WireError("items, candidates: expected int64 bytes")
    return len(items) // _INT64.itemsize, len(candidates) // _INT64.itemsize


def _out_of(array: np.ndarray, low: int, high: int) -> bool:
    return bool(array.size) and not (low <= int(array.min()) and int(array.max()) <= high)


def check_ranges(req: EncodedRequest, spec: EngineSpec) -> None:
    """``WireError`` unless every value of ``req`` is within what ``spec``'s model takes (what the front end's
    encoding guarantees): codes within the vocabularies, one context id per user feature, at most
    ``max_events`` events and ``max_candidates`` candidates, times within +-``TIME_LIMIT`` (as over HTTP)."""
    vocab, problems = spec.vocab, []
    # numpy views of the (CPU) tensors: a few microseconds per check instead of torch's per-op dispatch
    context, items, actions, candidates, ts = (t.numpy() for t in (req.context_ids, req.items, req.actions,
                                                                    req.candidates, req.timestamps))  # fmt: skip
    if context.size != len(vocab.feature_names):
        problems.append(f"context_ids: {context.size} values for {len(vocab.feature_names)} user features")
    if items.size > spec.max_events:
        problems.append(f"{items.size} events; the model takes at most {spec.max_events}")
    if candidates.size > spec.config.max_candidates:
        problems.append(f"{candidates.size} candidates; the limit is {spec.config.max_candidates}")
    for name, codes, top in (("items", items, vocab.num_items), ("candidates", candidates, vocab.num_items),
                             ("actions", actions, vocab.num_actions)):  # fmt: skip
        if _out_of(codes, 0, top):
            problems.append(f"{name}: codes must be within 0..{top}")
    if context.size and int(context.min()) < 0:
        problems.append("context_ids: codes must be >= 0")
    if context.size and len(vocab.user_features) == len(vocab.feature_names):  # every feature has a vocabulary
        top = max(f["offset"] + len(f["values"]) for f in vocab.user_features.values())
        if int(context.max()) > top:
            problems.append(f"context_ids: codes must be within 0..{top}")
    if not -TIME_LIMIT <= req.request_time <= TIME_LIMIT or _out_of(ts, -TIME_LIMIT, TIME_LIMIT):
        problems.append(f"times must be within +-{TIME_LIMIT} seconds")
    elif ts.size > 1 and bool((ts[1:] < ts[:-1]).any()):
        problems.append("timestamps must be non-decreasing")
    if req.truncated < 0:
        problems.append(f"truncated: {req.truncated} is negative")
    if problems:
        raise WireError("rank request out of range for model " + spec.version + ": " + "; ".join(problems))


def result_to_wire(result: RankResult) -> dict[str, Any]:
    scores = result.scores.float().contiguous()
    return {"scores": scores.numpy().astype(_FLOAT32, copy=False).tobytes(), "shape": list(scores.shape),
            "cached_tokens": result.cached_tokens, "computed_tokens": result.computed_tokens,
            "truncated_events": result.truncated_events, "model_version": result.model_version,
            "timings_ms": result.timings_ms}  # fmt: skip


def result_from_wire(message: dict[str, Any], tasks: list[dict]) -> RankResult:
    shape = message.get("shape")
    scores = _tensor(message, "scores", _FLOAT32)
    if not isinstance(shape, list) or len(shape) != 2 or shape[0] * shape[1] != scores.numel():
        raise WireError(f"scores: shape {shape!r} does not match {scores.numel()} values")
    return RankResult(scores.view(shape[0], shape[1]), tasks, _int(message, "cached_tokens"),
                      _int(message, "computed_tokens"), _int(message, "truncated_events"),
                      dict(message.get("timings_ms") or {}), str(message.get("model_version", "")))  # fmt: skip


# ----------------------------------------------------------------------------------------------- spec


@dataclass
class EngineSpec:
    """What a front end needs to validate and encode requests for one model version (duck-types the parts of
    ``RankEngine`` that ``RequestModels.for_engine`` and ``encode_request`` read)."""

    version: str
    vocab: Vocab
    config: EngineConfig
    max_events: int
    tasks: list[dict]
    device: str
    dtype: str

    @classmethod
    def of(cls, engine: RankEngine) -> EngineSpec:
        return cls(engine.version, engine.vocab, engine.config, engine.max_events, engine.tasks,
                   str(engine.device), engine.config.dtype)  # fmt: skip

    def to_wire(self, vocab_json: dict | None) -> dict[str, Any]:
        v = self.vocab
        return {"version": self.version, "vocab": vocab_json, "feature_names": v.feature_names,
                "num_items": v.num_items, "num_actions": v.num_actions, "config": asdict(self.config),
                "max_events": self.max_events, "tasks": self.tasks, "device": self.device, "dtype": self.dtype}  # fmt: skip

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> EngineSpec:
        try:
            vocab = Vocab.from_json(message["vocab"], {"user_features": message["feature_names"]},
                                    message["num_items"], message["num_actions"])  # fmt: skip
            return cls(str(message["version"]), vocab, EngineConfig(**message["config"]), int(message["max_events"]),
                       list(message["tasks"]), str(message["device"]), str(message["dtype"]))  # fmt: skip
        except (KeyError, TypeError) as err:
            raise WireError(f"engine spec: {err!r}") from None


__all__ = ["STATUS_INTERVAL_S", "EngineSpec", "Endpoints", "WireError", "check_ranges", "pack", "request_from_wire",
           "request_to_wire", "result_from_wire", "result_to_wire", "unpack", "wire_sizes"]  # fmt: skip
