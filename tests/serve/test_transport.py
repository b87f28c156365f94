"""The front end <-> engine messages: lossless round trips of requests, results and the engine spec; malformed
messages refused with WireError (never pickle, never a crash)."""

from __future__ import annotations

import msgpack
import pytest
import torch

from recforge.serve.engine import EngineConfig, RankEngine, RankResult
from recforge.serve.layout import EncodedRequest, encode_request
from recforge.serve.procs import default_http_workers
from recforge.serve.transport import EngineSpec, WireError, pack, request_from_wire, request_to_wire, result_from_wire, result_to_wire, unpack
from _serve_helpers import TASKS, build_model, export, random_history


def test_request_and_result_round_trip() -> None:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    n, c = int(torch.randint(0, 40, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    req = EncodedRequest(
        "user-é", torch.randint(0, 7, (2,), generator=g), torch.randint(-2**62, 2**62, (n,), generator=g),
        torch.randint(0, 4, (n,), generator=g), torch.sort(torch.randint(0, 2**40, (n,), generator=g)).values,
        torch.randint(1, 50, (c,), generator=g), 2**45, 3)  # fmt: skip
    back = request_from_wire(unpack(pack({"op": "rank", **request_to_wire(req)})))
    for name in ("context_ids", "items", "actions", "timestamps", "candidates"):
        assert torch.equal(getattr(back, name), getattr(req, name)) and getattr(back, name).dtype == torch.int64
    assert (back.user, back.request_time, back.truncated) == (req.user, req.request_time, req.truncated)
    result = RankResult(torch.randn(c, 2, generator=g), TASKS, 5, 7, 1, {"prefill": 0.5}, "step3-1")
    again = result_from_wire(unpack(pack({"op": "result", **result_to_wire(result)})), TASKS)
    assert torch.equal(again.scores, result.scores) and again.task_scores() == result.task_scores()
    assert (again.cached_tokens, again.computed_tokens, again.model_version) == (5, 7, "step3-1")


def test_engine_spec_encodes_exactly_like_the_engine(tmp_path) -> None:
    engine = RankEngine.from_run(export(build_model(), tmp_path / "run"), EngineConfig(max_candidates=9))
    spec = EngineSpec.from_wire(unpack(pack({"op": "spec", **EngineSpec.of(engine).to_wire(engine.vocab_json)})))
    assert spec.version == engine.version and spec.config == engine.config and spec.max_events == engine.max_events
    hist = random_history(200, seed=3)  # longer than the model: truncated the same way
    a = engine.encode("u", hist, [1001, 1049], user_features={"gender": "m", "user_id": "u2"}, timestamp=hist["timestamps"][-1])
    b = encode_request(spec.vocab, spec.config, spec.max_events, "u", hist, [1001, 1049],
                       user_features={"gender": "m", "user_id": "u2"}, timestamp=hist["timestamps"][-1])  # fmt: skip
    for name in ("context_ids", "items", "actions", "timestamps", "candidates"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert a.truncated == b.truncated > 0


@pytest.mark.parametrize("frame", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"id": 1}), msgpack.packb({1: "op"})])
def test_malformed_frames_are_refused(frame) -> None:
    with pytest.raises(WireError):
        unpack(frame)


@pytest.mark.parametrize("change", [{"items": b"1234567"}, {"items": "text"}, {"request_time": 1.5}, {"user": 5},
                                    {"candidates": b""}, {"actions": b""}])  # fmt: skip
def test_malformed_requests_are_refused(change) -> None:
    req = EncodedRequest("u", torch.zeros(2, dtype=torch.int64), torch.ones(3, dtype=torch.int64),
                                                       torch.ones(3, dtype=torch.int64), torch.arange(3), torch.ones(2, dtype=torch.int64), 9)  # fmt: skip
    with pytest.raises(WireError):
        request_from_wire({**request_to_wire(req), **change})


def test_default_http_workers() -> None:
    assert default_http_workers("cpu", cpus=16) == 0
    assert default_http_workers("cuda", cpus=16) == 4 and default_http_workers("cuda:1", cpus=4) == 1
    assert default_http_workers("cuda", cpus=3) == 0  # no core to spare for a front end: in-process
    assert default_http_workers("cuda", cpus=128) == 4
