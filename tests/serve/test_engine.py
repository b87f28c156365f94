"""Engine: prefix-cached scores equal the training-time forward pass; chunking and extension are exact."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.layout import RequestError, prefix_tokens
from _serve_helpers import build_model, export, random_history

ATOL = 1e-5


def _engine(tmp_path, encoding="sum", **config) -> RankEngine:
    return RankEngine.from_run(export(build_model(), tmp_path / encoding, encoding), EngineConfig(**config))


def _request(engine, n_events=40, n_cands=12, seed=0, late_events=0):
    hist = random_history(n_events, seed)
    request_time = hist["timestamps"][-1 - late_events] + 1 if late_events else hist["timestamps"][-1] + 10
    g = torch.Generator().manual_seed(seed + 1)
    cands = (1000 + torch.randint(0, 50, (n_cands,), generator=g)).tolist()
    return engine.encode("u1", hist, cands, user_features={"user_id": "u2", "gender": "m"}, timestamp=request_time)


@pytest.mark.parametrize("encoding", ["sum", "interleave"])
@pytest.mark.parametrize("late_events", [0, 3])
def test_scores_equal_training_forward_per_candidate(tmp_path, encoding, late_events) -> None:
    """Each candidate's score equals RankingModel.forward on [contextual, history, that candidate];
    history events at or after the request time are invisible to candidates in both."""
    engine = _engine(tmp_path, encoding)
    req = _request(engine, late_events=late_events)
    cached = engine.rank_encoded(req).scores
    naive = engine.rank_naive(req)
    assert cached.shape == (12, 2)
    torch.testing.assert_close(cached, naive, rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("time_buckets", [0, 16])
def test_without_relative_bias_cached_scores_equal_the_forward(tmp_path, time_buckets) -> None:
    """model.relative_bias=false: no pos_weights saved or served; cached and extended scores stay exact."""
    model = build_model(time_buckets=time_buckets, relative_bias=False)
    assert all(b.pos_weights is None for b in model.encoder.blocks)
    assert not any(name.endswith("pos_weights") for name in model.state_dict())
    engine = RankEngine.from_run(export(model, tmp_path / "run"), EngineConfig(prefill_chunk=8))
    assert engine.model.encoder.cfg.relative_bias is False  # the saved encoder config carries the switch
    req = _request(engine, n_events=45, late_events=2)
    torch.testing.assert_close(engine.rank_encoded(req).scores, engine.rank_naive(req), rtol=1e-5, atol=ATOL)
    hist = random_history(60, seed=4)
    now = hist["timestamps"][-1] + 5
    first = engine.encode("u1", {k: v[:35] for k, v in hist.items()}, [1001, 1010], timestamp=now)
    full = engine.encode("u1", hist, [1001, 1010], timestamp=now)
    extended = engine.rank_encoded(full, engine.prefix_state(first))
    assert extended.cached_tokens == 2 + 35
    torch.testing.assert_close(extended.scores, engine.rank_naive(full), rtol=1e-5, atol=ATOL)


def test_chunked_prefill_is_exact(tmp_path) -> None:
    whole = _engine(tmp_path, prefill_chunk=4096)
    chunked = RankEngine(whole.model, whole.manifest, None, EngineConfig(prefill_chunk=3))
    chunked.vocab = whole.vocab
    req = _request(whole, n_events=50)
    torch.testing.assert_close(chunked.rank_encoded(req).scores, whole.rank_encoded(req).scores, rtol=1e-5, atol=ATOL)


def test_extending_a_state_equals_encoding_from_scratch(tmp_path) -> None:
    engine = _engine(tmp_path, prefill_chunk=8)
    hist = random_history(60, seed=4)
    now = hist["timestamps"][-1] + 5
    cands = [1001, 1002, 1010, 1033]
    first = engine.encode("u1", {k: v[:35] for k, v in hist.items()}, cands, timestamp=now)
    state = engine.prefix_state(first)
    full = engine.encode("u1", hist, cands, timestamp=now)
    assert state.is_prefix_of(prefix_tokens(full, engine.action_encoding), 2)
    extended = engine.rank_encoded(full, state)
    assert extended.cached_tokens == 2 + 35 and extended.computed_tokens == 25
    scratch = engine.rank_encoded(full)
    torch.testing.assert_close(extended.scores, scratch.scores, rtol=1e-5, atol=ATOL)


def test_state_is_reused_at_a_later_time_but_not_across_histories(tmp_path) -> None:
    engine = _engine(tmp_path)
    hist = random_history(20, seed=5)
    now = hist["timestamps"][-1] + 5
    req = engine.encode("u1", hist, [1001], timestamp=now)
    state = engine.prefix_state(req)
    later = engine.encode("u1", hist, [1001], timestamp=now + 3600)  # contextual tokens get no time bias
    assert state.is_prefix_of(prefix_tokens(later, "sum"), 2)
    cached = engine.rank_encoded(later, state)
    scratch = engine.rank_encoded(later)
    torch.testing.assert_close(cached.scores, scratch.scores, rtol=1e-5, atol=ATOL)
    other = engine.encode("u1", {**hist, "actions": ["buy"] * 20}, [1001], timestamp=now)
    assert not state.is_prefix_of(prefix_tokens(other, "sum"), 2)
    with pytest.raises(ValueError, match="not a prefix"):
        engine.rank_encoded(other, state)


def test_long_history_keeps_the_latest_events(tmp_path) -> None:
    engine = _engine(tmp_path)
    req = _request(engine, n_events=300, n_cands=3)
    assert req.truncated == 300 - engine.max_events and req.items.numel() == engine.max_events
    torch.testing.assert_close(engine.rank_encoded(req).scores, engine.rank_naive(req), rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(candidates=[]), "candidates is empty"),
        (dict(candidates=[1001] * 2001), "limit is 2000"),
        (dict(candidates=[1001, 99]), "unknown candidate items"),
        (dict(history={"items": [1001], "timestamps": [1, 2]}), "same length"),
        (dict(history={"items": [1001, 1002], "timestamps": [5, 2]}), "non-decreasing"),
        (dict(history={"items": [1001], "timestamps": ["x"]}), "integers"),
        (dict(history={"items": [1001], "timestamps": [1], "actions": ["jump"]}), "unknown history actions"),
        (dict(user_features={"age": 3}), "unknown user features"),
        (dict(timestamp="now"), "must be an integer"),
    ],
)
def test_bad_requests_are_rejected_with_a_clear_message(tmp_path, change, message) -> None:
    engine = _engine(tmp_path)
    args = dict(history={"items": [1001], "timestamps": [1]}, candidates=[1001], user_features={}, timestamp=10)
    args.update(change)
    with pytest.raises(RequestError, match=message):
        engine.encode("u1", args["history"], args["candidates"], user_features=args["user_features"],
                      timestamp=args["timestamp"])  # fmt: skip


def test_unknown_feature_values_map_to_none_unless_configured_to_fail(tmp_path) -> None:
    lenient = _engine(tmp_path)
    assert lenient.encode("u1", {"items": [], "timestamps": []}, [1001], user_features={"user_id": "new", "gender": "m"},
                          timestamp=5).context_ids.tolist() == [0, 5]  # fmt: skip
    strict = _engine(tmp_path, unknown_feature_values="error")
    with pytest.raises(RequestError, match="gender='q' was not seen in training"):
        strict.encode("u1", {"items": [], "timestamps": []}, [1001], user_features={"gender": "q"}, timestamp=5)


def test_unknown_ids_zero_policy_maps_to_none(tmp_path) -> None:
    engine = _engine(tmp_path, unknown_ids="zero")
    req = engine.encode("u1", {"items": [1001, 5], "timestamps": [1, 2]}, [1001, 7], timestamp=10)
    assert req.items.tolist() == [2, 0] and req.candidates.tolist() == [2, 0]


def test_bfloat16_is_close_to_float32(tmp_path) -> None:
    full = _engine(tmp_path)
    half = RankEngine(build_model(), full.manifest, None, EngineConfig(dtype="bfloat16"))
    req = _request(full)
    got = half.rank_encoded(req).scores
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, full.rank_encoded(req).scores, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("encoding", ["sum", "interleave"])
def test_scores_equal_training_forward_with_every_candidate_in_one_sequence(tmp_path, encoding) -> None:
    from recforge.serve.layout import training_batch

    engine = _engine(tmp_path, encoding)
    req = _request(engine, n_events=30, n_cands=9, late_events=2)
    with torch.no_grad():  # every target at the history end: ops commit "targets share the history-end position"
        expected = engine.model(training_batch(req, engine.action_encoding, 0)).float()
    torch.testing.assert_close(engine.rank_encoded(req).scores, expected, rtol=1e-5, atol=ATOL)


def test_candidate_scores_are_permutation_equivariant_and_independent(tmp_path) -> None:
    engine = _engine(tmp_path)
    req = _request(engine, n_cands=10)
    scores = engine.rank_encoded(req).scores
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    permuted = engine.rank_encoded(req.__class__(**{**req.__dict__, "candidates": req.candidates[perm]})).scores
    torch.testing.assert_close(permuted, scores[perm], rtol=1e-5, atol=ATOL)
    alone = engine.rank_encoded(req.__class__(**{**req.__dict__, "candidates": req.candidates[3:4]})).scores
    torch.testing.assert_close(alone, scores[3:4], rtol=1e-5, atol=ATOL)


def test_candidate_tower_postfix_is_served(tmp_path) -> None:
    """A postfix with a candidate-only tower (model.item_tower) reads [encoder output, candidate
    embedding]: the cached engine and its padded CUDA-graph pass give the training forward's scores."""
    from recforge.serve.graphs import GraphRunner
    from recforge.serve.layout import candidate_tokens
    from recforge.serve.state import WorkItem

    engine = RankEngine.from_run(export(build_model(tower=True), tmp_path / "tower"))
    req = _request(engine, n_events=33, n_cands=9)
    cached = engine.rank_encoded(req).scores
    torch.testing.assert_close(cached, engine.rank_naive(req), rtol=1e-5, atol=ATOL)
    state = engine.prefix_state(req)
    padded = GraphRunner(engine, limit=4, capture=False).run(WorkItem(state, candidate_tokens(req), "targets"))
    torch.testing.assert_close(padded, cached, rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("wrapper", ["context_cross", "din", "visible_mean"])
def test_wrapped_encoders_are_served_uncached(tmp_path, wrapper) -> None:
    """model.context_cross / model.target_attention=din wrap the HSTU encoder, and model.attn_norm=visible_mean
    divides by visible-key counts the cached passes do not carry: the engine serves them with the full
    forward pass (all candidates as targets of one sequence), equal to per-candidate scoring."""
    import dataclasses

    from recforge.models import HSTUEncoder
    from recforge.models.ranking import ContextCross, RankingModel, TargetHistoryPool
    from recforge.serve.export import export_run
    from _serve_helpers import DIM

    base = build_model(seed=6)
    torch.manual_seed(6)
    if wrapper == "visible_mean":
        encoder = HSTUEncoder(dataclasses.replace(base.encoder.cfg, attn_norm="visible_mean"))
        for mine, theirs in zip(encoder.blocks, base.encoder.blocks):  # the biases as build_model set them
            mine.pos_weights.data.copy_(theirs.pos_weights.data)
            if theirs.time_weights is not None:
                mine.time_weights.data.copy_(theirs.time_weights.data)
    else:
        encoder = (ContextCross.wrap if wrapper == "context_cross" else TargetHistoryPool.wrap)(base.encoder, DIM)
    model = RankingModel(base.prefix, encoder, base.postfix).eval()
    if wrapper == "visible_mean":
        with pytest.raises(ValueError, match="attn_norm=layernorm"):
            export_run(export(model, tmp_path / "export-source"), tmp_path / "exported")
    engine = RankEngine.from_run(export(model, tmp_path / wrapper))
    assert not engine.cached
    req = _request(engine, n_events=30, n_cands=6)
    torch.testing.assert_close(engine.rank_encoded(req).scores, engine.rank_naive(req), rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
def test_one_pass_of_several_requests_equals_each_alone(tmp_path, kernel) -> None:
    """``run`` with prefill chunks and candidates of several requests in one pass (one jagged
    ``cached_hstu_attention`` call per block) gives each request's own scores. "triton": the kernel in Triton's
    interpreter."""
    from concurrent.futures import Future

    from recforge.serve.scheduler import Scheduler, SchedulerConfig, Sequence

    if kernel == "triton" and (torch.cuda.is_available() or importlib.util.find_spec("triton") is None):
        pytest.skip("the interpreter check runs on CPU-only machines with triton installed")
    engine = _engine(tmp_path, prefill_chunk=16)
    engine.model.encoder.cfg.kernel = kernel
    reqs = [_request(engine, n, c, seed=n, late_events=n % 3) for n, c in ((40, 12), (7, 5), (23, 30))]
    alone = [engine.rank_encoded(r).scores for r in reqs]
    sched = Scheduler(engine, SchedulerConfig(token_budget=4096, prefill_chunk=16))
    seqs = [Sequence(r.__class__(**{**r.__dict__, "user": f"u{i}"}), Future(), 0.0) for i, r in enumerate(reqs)]
    for seq in seqs:
        sched.add(seq)
    kinds = []
    while sched.running:  # the requests' chunks side by side, then candidates beside chunks
        plan = sched.schedule()
        kinds.append(sorted(item.kind for item in plan.items))
        sched.update(plan, engine.run(plan.items))
    assert kinds[0] == ["prefix"] * 3 and ["prefix", "prefix", "targets"] in kinds
    for seq, want in zip(seqs, alone):
        torch.testing.assert_close(torch.cat(seq.scores), want, rtol=1e-5, atol=ATOL)
