"""The HTTP request and response models of one served model: what validates a request is what
``/openapi.json`` documents.

``RequestModels.for_engine(engine)`` builds them from the engine's vocabulary and limits: the user
features are the model's (any other name is refused), list lengths are the serving limits, the
example is made of the model's own IDs, actions and feature values (so it is accepted). Parsing
is strict, done by pydantic on the raw bytes (``parse``):

- integers only as JSON integers (``"10"`` is not 10, ``10.0`` is not 10, ``true`` is not 1);
  IDs within int64, timestamps within +-2^53 seconds;
- finite numbers only (``NaN``, ``Infinity`` and ``1e400`` are refused);
- valid UTF-8 and no lone surrogates (``"\\ud800"``), every string at most ``max_string_chars``.

Example:
    >>> models = RequestModels.for_engine(engine)
    >>> body = models.parse(b'{"user_id": "u1", "candidates": [7, 9]}')   # raises RequestError on bad input
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, create_model

from recforge.serve.layout import RequestError

if TYPE_CHECKING:
    from recforge.serve.engine import RankEngine
    from recforge.serve.transport import EngineSpec

INT64 = 2**63
TIME_LIMIT = 2**53  # seconds; keeps every time difference inside int64
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RankResponseOut(BaseModel):
    user_id: StrictInt | StrictStr
    model_version: str = Field(description="the model that computed every score of this response")
    scores: dict[str, list[float]] = Field(description="per task: probabilities (binary) or values (regression), "
                                           "in candidate order")  # fmt: skip
    cached_tokens: int = Field(description="prefix tokens reused from the user's KV cache")
    computed_tokens: int = Field(description="prefix tokens computed for this request")
    truncated_events: int = Field(description="oldest events dropped to fit the model's max_seq_len")
    latency_ms: float


class ReloadIn(BaseModel):
    model_config = STRICT
    run_dir: StrictStr | None = Field(None, max_length=4096, description="run or model directory; default: the one "
                                      "the server started with")  # fmt: skip


class ErrorOut(BaseModel):
    detail: str = Field(description="what is wrong and how to fix it")


@dataclass
class RequestModels:
    """The request model of one served model (rebuilt on reload, when the vocabulary may change)."""

    rank: type[BaseModel]
    feature_names: list[str]

    @classmethod
    def for_engine(cls, engine: RankEngine | EngineSpec, max_string_chars: int = 256) -> RequestModels:
        text = Annotated[StrictStr, Field(max_length=max_string_chars)]
        raw_id = Annotated[StrictInt, Field(ge=-INT64, lt=INT64)] | text
        stamp = Annotated[StrictInt, Field(ge=-TIME_LIMIT, le=TIME_LIMIT)]
        value = StrictBool | Annotated[StrictInt, Field(ge=-INT64, lt=INT64)] | StrictFloat | text | None
        limits = engine.config
        history = create_model(
            "HistoryIn", __config__=STRICT, __doc__="The user's events, oldest first.",
            items=(list[raw_id], Field(default_factory=list, max_length=limits.max_history_events,
                                       description="raw item IDs, oldest first")),
            timestamps=(list[stamp], Field(default_factory=list, max_length=limits.max_history_events,
                                           description="event times (seconds), non-decreasing, one per item")),
            actions=(list[raw_id | None] | None, Field(None, max_length=limits.max_history_events,
                                                       description="action value per event (e.g. 'click', 4)")),
        )  # fmt: skip
        names = list(engine.vocab.feature_names)
        features = create_model(
            "UserFeaturesIn", __config__=STRICT, __doc__="Contextual features by name (missing ones count as unknown).",
            **{f"f{i}": (value, Field(None, alias=name)) for i, name in enumerate(names)},
        )  # fmt: skip
        rank = create_model(
            "RankRequestIn", __config__=ConfigDict(**STRICT, json_schema_extra={"examples": [_example(engine)]}),
            __doc__="Score ``candidates`` for ``user_id`` after ``history``.",
            user_id=(raw_id, Field(description="the user; keys the KV cache")),
            history=(history, Field(default_factory=history)),
            candidates=(list[raw_id], Field(min_length=1, max_length=limits.max_candidates,
                                            description="raw item IDs to score")),
            user_features=(features, Field(default_factory=features)),
            timestamp=(stamp | None, Field(None, description="request time (seconds); default: now. Candidates see "
                                           "only events strictly before it")),
        )  # fmt: skip
        return cls(rank, names)

    def parse(self, raw: bytes) -> BaseModel:
        """The validated request; ``RequestError`` naming every problem otherwise."""
        try:
            return self.rank.model_validate_json(raw)
        except ValidationError as err:
            raise RequestError(describe(err, {("user_features", "extra_forbidden"):
                                              f"unknown user feature; this model's are {self.feature_names}"})) from None

    def user_features(self, body: BaseModel) -> dict[str, Any]:
        return {k: v for k, v in body.user_features.model_dump(by_alias=True).items() if v is not None}


def describe(err: ValidationError, messages: dict[tuple[str, str], str] | None = None, limit: int = 5) -> str:
    """One line per problem: where (a JSON path) and what. ``messages``: (first path element, error type) ->
    a clearer message for that case."""
    lines = []
    for e in err.errors(include_url=False)[:limit]:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        msg = (messages or {}).get((str(e["loc"][0]) if e["loc"] else "", e["type"]), e["msg"])
        if e["type"] == "json_invalid":
            msg = (f"not valid JSON ({e['msg'].removeprefix('Invalid JSON: ')}); strings must be valid UTF-8 "
                   "without lone surrogates such as \\ud800")  # fmt: skip
        lines.append(f"{where}: {msg}")
    more = err.error_count() - limit
    return "; ".join(lines) + (f"; and {more} more" if more > 0 else "")


def _example(engine: RankEngine | EngineSpec) -> dict:
    """A request this model accepts: its own item IDs, actions and feature values."""
    vocab = engine.vocab
    items = list(vocab.item_ids[:5]) if vocab.item_ids else list(range(1, min(vocab.num_items, 5) + 1))
    if not items:
        items = [1]
    actions = list(vocab.actions[:2]) if vocab.actions else None
    history = {"items": items[:2], "timestamps": [1700000000, 1700000360]}
    if actions:
        history["actions"] = [actions[0], actions[-1]]
    features = {}
    for name in vocab.feature_names[:2]:
        spec = vocab.user_features.get(name)
        if spec and spec.get("values"):
            features[name] = spec["values"][0]
    return {"user_id": "u42", "history": history, "candidates": items[2:5] or items[:1], "user_features": features,
            "timestamp": 1700000400}  # fmt: skip


__all__ = ["ErrorOut", "RankResponseOut", "ReloadIn", "RequestModels", "describe"]
