"""Requests in raw IDs -> the token codes a ranking model was trained on, and back to a training batch.

A ranking request is one user's history (events: item, action, time), the user's contextual
features and the candidates to score at one request time. ``Vocab`` maps raw values to the
codes of ``vocab.json`` (written with the model slices); ``encode`` builds an
``EncodedRequest``; ``prefix_tokens`` lays out the cached part of the sequence exactly as
``recforge.data.ranking.RankingData.batch`` does::

    | contextual: one token per user feature | history: one token per event (sum) | candidates |
    | time = request time                    | or item, action tokens (interleave)|            |

``training_batch`` rebuilds the full training-time ``JaggedBatch`` of a request (all
candidates as the targets of one sequence, or one sequence per candidate); the engine's
scores are tested against ``RankingModel.forward`` on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import offsets_from_lengths
from recforge.jagged.mask import AttentionMask

if TYPE_CHECKING:
    from recforge.serve.engine import EngineConfig


class RequestError(ValueError):
    """A request the engine cannot serve (bad types, sizes, unknown IDs); the message says what to fix."""


@dataclass
class History:
    """A user's events, oldest first: raw item IDs, action values (None = no action signal) and times (s)."""

    items: list[Any]
    timestamps: list[int]
    actions: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class EncodedRequest:
    """A request in model codes (CPU int64 tensors)."""

    user: str  # cache key
    context_ids: Tensor  # (c,) one id per user feature (0 = unknown / missing)
    items: Tensor  # (L,) history item codes
    actions: Tensor  # (L,) history action codes (0 = none)
    timestamps: Tensor  # (L,) history event times, non-decreasing
    candidates: Tensor  # (C,) candidate item codes
    request_time: int  # the candidates' timestamp
    truncated: int = 0  # oldest events dropped to fit the model's max_seq_len
    encoding: str = ""  # RankEngine.encoding of the engine that encoded it ("": built by hand)

    @property
    def num_candidates(self) -> int:
        return self.candidates.numel()


@dataclass
class Vocab:
    """Raw value -> code maps of a trained ranking model (from ``vocab.json``).

    Without a vocabulary (runs exported before ``vocab.json`` existed) requests must already
    carry model codes: items 1..num_items, actions 1..num_actions, user features as context ids.
    """

    item_ids: list[Any] | None
    actions: list[str] | None
    user_features: dict[str, dict]  # name -> {"offset": int, "values": [str]}
    feature_names: list[str]  # contextual token order
    num_items: int
    num_actions: int
    _item_code: dict = field(default_factory=dict, repr=False)
    _action_code: dict = field(default_factory=dict, repr=False)
    _feature_code: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.item_ids is not None:
            self._item_code = {_key(v): c + 1 for c, v in enumerate(self.item_ids)}
            ints = [(v, c) for v, c in self._item_code.items() if isinstance(v, int) and -(2**63) <= v < 2**63]
            ints.sort()
            # integer IDs map without a Python loop: searchsorted over the sorted IDs (the dict serves the rest)
            self._int_ids = np.array([v for v, _ in ints], dtype=np.int64)
            self._int_codes = np.array([c for _, c in ints], dtype=np.int64)
        if self.actions is not None:
            self._action_code = {str(v): c + 1 for c, v in enumerate(self.actions)}
        for name, spec in self.user_features.items():
            self._feature_code[name] = {str(v): spec["offset"] + 1 + i for i, v in enumerate(spec["values"])}

    @classmethod
    def from_json(cls, vocab: dict | None, manifest: dict, num_items: int, num_actions: int) -> Vocab:
        vocab = vocab or {}
        names = list(manifest.get("user_features") or list((vocab.get("user_features") or {}).keys()))
        return cls(
            item_ids=vocab.get("item_ids"),
            actions=vocab.get("actions") if vocab else None,
            user_features=vocab.get("user_features") or {},
            feature_names=names,
            num_items=num_items,
            num_actions=num_actions,
        )

    def item_codes(self, values: list[Any], what: str, unknown: str) -> Tensor:
        if self.item_ids is None:  # codes given directly
            codes = [_int(v, what) for v in values]
            bad = [v for v in codes if not 1 <= v <= self.num_items]
        else:
            codes = self._int_item_codes(values)
            if codes is None:
                codes = [self._item_code.get(_key(v), 0) for v in values]
            bad = [v for v, c in zip(values, codes) if c == 0] if 0 in codes else []
        if bad and unknown == "error":
            raise RequestError(f"{len(bad)} unknown {what} (not in the model's vocabulary), e.g. {bad[:5]}")
        out = _int64(codes)
        if self.item_ids is None:
            out[(out < 1) | (out > self.num_items)] = 0
        return out

    def _int_item_codes(self, values: list[Any]) -> list[int] | None:
        """Codes of integer IDs, vectorised; None when ``values`` holds anything but int64 integers."""
        if not values or self._int_ids.size == 0 or not _all_ints(values):
            return None
        try:
            raw = np.array(values, dtype=np.int64)
        except OverflowError:
            return None
        pos = np.minimum(np.searchsorted(self._int_ids, raw), self._int_ids.size - 1)
        return np.where(self._int_ids[pos] == raw, self._int_codes[pos], 0).tolist()

    def action_codes(self, values: list[Any] | None, length: int, unknown: str) -> Tensor:
        if values is None or self.num_actions == 0:
            return torch.zeros(length, dtype=torch.int64)
        if self.actions is None:
            codes = [0 if v is None else _int(v, "history action") for v in values]
            bad = [v for v in codes if not 0 <= v <= self.num_actions]
        else:
            table = {v: self._action_code.get(str(v), -1) if v is not None else 0 for v in set(values)}  # few distinct
            codes = [table[v] for v in values]
            bad = [v for v, c in table.items() if c < 0]
        if bad and unknown == "error":
            known = self.actions if self.actions is not None else f"1..{self.num_actions}"
            raise RequestError(f"unknown history actions, e.g. {bad[:5]} (known: {known})")
        out = _int64(codes)  # int64 when empty too (a user with no history yet)
        out[(out < 0) | (out > self.num_actions)] = 0
        return out

    def context_codes(self, features: dict[str, Any], unknown: str) -> Tensor:
        extra = set(features) - set(self.feature_names)
        if extra:
            raise RequestError(f"unknown user features {sorted(extra)}; the model uses {self.feature_names}")
        codes = []
        for name in self.feature_names:
            value = features.get(name)
            if value is None:
                codes.append(0)  # missing, as a null in training
                continue
            if name not in self._feature_code:  # no vocabulary: a context id
                codes.append(_int(value, f"user feature {name!r}"))
                continue
            code = self._feature_code[name].get(str(value))
            if code is None and unknown == "error":
                raise RequestError(f"user feature {name}={value!r} was not seen in training")
            codes.append(code or 0)
        return torch.tensor(codes, dtype=torch.int64)


def encode_request(vocab: Vocab, config: EngineConfig, max_events: int, user: Any, history: History | dict,
                   candidates: list[Any], *, user_features: dict[str, Any] | None = None,
                   timestamp: int | None = None) -> EncodedRequest:  # fmt: skip
    """Validate a request against ``config``'s limits and map it to model codes (the latest
    ``max_events`` events that fit the model); raises ``RequestError`` saying what is wrong."""
    if isinstance(history, dict):
        history = History(**history)
    items, stamps, actions = list(history.items), list(history.timestamps), history.actions
    if len(stamps) != len(items) or (actions is not None and len(actions) != len(items)):
        raise RequestError(
            f"history: items ({len(items)}), timestamps ({len(stamps)}) and actions "
            f"({'-' if actions is None else len(actions)}) must have the same length"
        )
    if len(items) > config.max_history_events:
        raise RequestError(f"history has {len(items)} events; the limit is {config.max_history_events}")
    if not candidates:
        raise RequestError("candidates is empty; give at least one item to score")
    if len(candidates) > config.max_candidates:
        raise RequestError(f"{len(candidates)} candidates; the limit is {config.max_candidates}")
    if stamps and not _all_ints(stamps):
        raise RequestError("history timestamps must be integers (seconds)")
    try:
        ts = _int64(stamps)
    except OverflowError:
        raise RequestError("history timestamps must fit in 64-bit integers (seconds)") from None
    if ts.numel() > 1 and bool((ts[1:] < ts[:-1]).any()):
        raise RequestError("history timestamps must be non-decreasing (oldest event first)")
    if timestamp is None:
        timestamp = int(time.time())
    if isinstance(timestamp, bool) or not isinstance(timestamp, int):
        raise RequestError(f"timestamp {timestamp!r} must be an integer (seconds)")
    unknown = config.unknown_ids
    item_codes = vocab.item_codes(items, "history items", unknown)
    action_codes = vocab.action_codes(actions, len(items), unknown)
    cand_codes = vocab.item_codes(list(candidates), "candidate items", unknown)
    context = vocab.context_codes(user_features or {}, config.unknown_feature_values)
    drop = max(0, len(items) - max_events)  # training keeps the latest events that fit, too
    return EncodedRequest(
        user=str(user), context_ids=context, items=item_codes[drop:], actions=action_codes[drop:],
        timestamps=ts[drop:], candidates=cand_codes, request_time=timestamp, truncated=drop,
    )  # fmt: skip


def _all_ints(values: list[Any]) -> bool:
    """Every value is a plain int (not a bool, float or str); one pass in C."""
    return set(map(type, values)) == {int}


def _int64(values: list[int]) -> Tensor:
    """A CPU int64 tensor of Python ints (through numpy: ~3x faster than torch.tensor on a list)."""
    return torch.from_numpy(np.array(values, dtype=np.int64).reshape(-1))


def _key(value: Any) -> Any:
    """Raw IDs match by JSON type and value: the integer 12 is not the string "12" (nor "١٢"); IDs are the
    vocabulary's own values, integers or strings as the dataset had them."""
    return str(value) if isinstance(value, bool) else value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{what} {value!r}: this model has no vocabulary, so IDs must be integer codes")
    return value


TOKEN_FEATURES = ("item_ids", "actions", "context_ids", "timestamps")  # the columns of a token identity (state.py)


def prefix_tokens(req: EncodedRequest, action_encoding: str) -> dict[str, Tensor]:
    """Token features of the cached part (contextual + history), in sequence order."""
    return prefix_layout(req, action_encoding)[0]


def prefix_layout(req: EncodedRequest, action_encoding: str) -> tuple[dict[str, Tensor], Tensor]:
    """``prefix_tokens`` and their (n, 4) token identities (``state.token_identity``), both views of one
    (4, n) array: built with NumPy (a few small host writes, far cheaper than torch ops per request)."""
    c, events = req.context_ids.numel(), req.items.numel()
    per_event = 2 if action_encoding == "interleave" else 1
    table = np.zeros((len(TOKEN_FEATURES), c + per_event * events), dtype=np.int64)
    item_ids, actions, context_ids, timestamps = table  # contextual tokens are not events: no time
    context_ids[:c] = req.context_ids.numpy()
    ts = req.timestamps.numpy()
    item_ids[c::per_event] = req.items.numpy()
    timestamps[c::per_event] = ts
    if per_event == 1:
        actions[c:] = req.actions.numpy()
    else:  # item, action tokens: the action one after its item, at the same time
        actions[c + 1 :: 2] = req.actions.numpy()
        timestamps[c + 1 :: 2] = ts
    tokens = {name: torch.from_numpy(row) for name, row in zip(TOKEN_FEATURES, table)}
    return tokens, torch.from_numpy(table).T


def candidate_tokens(req: EncodedRequest) -> dict[str, Tensor]:
    """Token features of the candidates (no action, no context, the request time); rows of one NumPy array.
    ``OverflowError`` when the request time does not fit in int64."""
    table = np.zeros((len(TOKEN_FEATURES), req.num_candidates), dtype=np.int64)
    table[0] = req.candidates.numpy()
    table[3] = req.request_time
    return {name: torch.from_numpy(row) for name, row in zip(TOKEN_FEATURES, table)}


def training_batch(req: EncodedRequest, action_encoding: str, max_seq_len: int, per_candidate: bool = False) -> JaggedBatch:
    """The training-time batch of a request: one sequence with every candidate as a target, or
    (``per_candidate``) one sequence per candidate — the naive way to score C candidates."""
    prefix = prefix_tokens(req, action_encoding)
    cands = candidate_tokens(req)
    n_prefix, count = prefix["item_ids"].numel(), req.num_candidates
    groups = [torch.arange(i, i + 1) for i in range(count)] if per_candidate else [torch.arange(count)]
    features = {
        name: torch.cat([t for g in groups for t in (prefix[name], cands[name][g])]) for name in prefix
    }
    lengths = torch.tensor([n_prefix + g.numel() for g in groups])
    mask = AttentionMask(
        causal=True,
        num_targets=torch.tensor([g.numel() for g in groups]),
        num_contextual=torch.full((len(groups),), req.context_ids.numel(), dtype=torch.int64),
        timestamps=features["timestamps"],
    )
    return JaggedBatch(offsets_from_lengths(lengths), features, max(max_seq_len, int(lengths.max())), mask=mask)


__all__ = ["TOKEN_FEATURES", "EncodedRequest", "History", "RequestError", "Vocab", "candidate_tokens", "prefix_layout",
           "prefix_tokens", "training_batch"]
