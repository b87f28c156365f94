"""CUDA-graph passes: the padded arithmetic equals the eager pass (CPU, no capture); replayed graphs
equal eager scores on CUDA."""

from __future__ import annotations

import pytest
import torch

from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.graphs import GraphRunner, bucket
from recforge.serve.layout import candidate_tokens
from recforge.serve.scheduler import prefill_alone
from recforge.serve.state import WorkItem
from _serve_helpers import build_model, export, random_history

ATOL = 1e-5


def _engine(tmp_path, encoding="sum", **config) -> RankEngine:
    return RankEngine.from_run(export(build_model(), tmp_path / encoding, encoding), EngineConfig(**config))


def _request(engine, n_events, n_cands, seed, late_events=0):
    hist = random_history(n_events, seed)
    last = hist["timestamps"][-1] if n_events else 1_000_000
    request_time = hist["timestamps"][-1 - late_events] + 1 if late_events else last + 10
    g = torch.Generator().manual_seed(seed + 1)
    cands = (1000 + torch.randint(0, 50, (n_cands,), generator=g)).tolist()
    return engine.encode("u1", hist, cands, user_features={"user_id": "u2", "gender": "m"}, timestamp=request_time)


def _prefill_and_score(engine: RankEngine, run, req) -> tuple[torch.Tensor, object]:
    """The engine's chunked prefill (its scheduler) and candidate scoring with ``run`` doing each work item."""

    def execute(items):
        assert len(items) == 1 and items[0].kind == "prefix"
        return [run(items[0])]

    state = prefill_alone(engine, req, execute=execute).state
    return run(WorkItem(state, candidate_tokens(req), "targets")), state


def test_bucket_sizes() -> None:
    assert [bucket(n) for n in (0, 1, 16, 17, 24, 25, 33, 49, 65, 97, 129, 1000, 2000)] == [
        16, 16, 16, 24, 24, 32, 48, 64, 96, 128, 192, 1024, 2048]  # fmt: skip
    sizes = sorted({bucket(n) for n in range(1, 5000)})
    assert all(b / a <= 1.5 for a, b in zip(sizes, sizes[1:]))  # padding never exceeds 50%


@pytest.mark.parametrize("encoding", ["sum", "interleave"])
@pytest.mark.parametrize("events,cands,chunk,late", [(40, 12, 1024, 0), (57, 5, 8, 3), (1, 30, 3, 0), (0, 7, 16, 0)])
def test_padded_passes_equal_the_eager_engine(tmp_path, encoding, events, cands, chunk, late) -> None:
    """Prefill chunks and candidates through padded buckets (uneven sizes, contextual tokens split
    from or sharing a chunk, events after the request time) give the eager keys and scores."""
    engine = _engine(tmp_path, encoding, prefill_chunk=chunk)
    req = _request(engine, events, cands, seed=events + cands, late_events=late)
    runner = GraphRunner(engine, limit=64, capture=False)
    padded_scores, padded_state = _prefill_and_score(engine, runner.run, req)
    eager_scores, eager_state = _prefill_and_score(engine, lambda item: engine.run([item])[0], req)
    assert padded_state.length == eager_state.length
    n = eager_state.length
    torch.testing.assert_close(padded_state.keys[:, :n], eager_state.keys[:, :n], rtol=1e-5, atol=ATOL)
    torch.testing.assert_close(padded_state.values[:, :n], eager_state.values[:, :n], rtol=1e-5, atol=ATOL)
    assert torch.equal(padded_state.tokens[:n], eager_state.tokens[:n])
    torch.testing.assert_close(padded_scores, eager_scores, rtol=1e-5, atol=ATOL)
    torch.testing.assert_close(padded_scores, engine.rank_naive(req), rtol=1e-5, atol=ATOL)


def test_buffers_are_reused_across_requests_and_bounded(tmp_path) -> None:
    """A bucket's buffers serve any request that fits it: keys past the request's history (here NaN, as
    stale or never-written memory may hold anything) stay invisible; the LRU keeps at most ``limit`` buckets."""
    engine = _engine(tmp_path)
    runner = GraphRunner(engine, limit=2, capture=False)
    long_req, short_req = _request(engine, 60, 9, seed=1), _request(engine, 50, 10, seed=2)  # 62 and 52 tokens
    _prefill_and_score(engine, runner.run, long_req)
    first = list(runner.passes)
    for padded in runner.passes.values():
        padded.keys.fill_(float("nan"))
        padded.values.fill_(float("nan"))
    scores, _ = _prefill_and_score(engine, runner.run, short_req)
    assert list(runner.passes) == first == [("prefix", 64, 64), ("targets", 16, 64)]  # the same two buckets
    torch.testing.assert_close(scores, engine.rank_naive(short_req), rtol=1e-5, atol=ATOL)
    _prefill_and_score(engine, runner.run, _request(engine, 40, 9, seed=3))  # 42 tokens: two new buckets
    assert len(runner.passes) == 2 and runner.stats["evictions"] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("encoding", ["sum", "interleave"])
def test_cuda_graphs_equal_eager_on_cuda(tmp_path, cuda_device, encoding) -> None:
    """Engine on CUDA: replayed graphs give the eager CUDA scores, through the pool-less engine API;
    a second request in the same buckets replays without a new capture."""
    graphs = _engine(tmp_path, encoding, device="cuda", prefill_chunk=16)
    eager = RankEngine(graphs.model, graphs.manifest, None, EngineConfig(device="cuda", prefill_chunk=16, cuda_graphs=0))
    eager.vocab = graphs.vocab
    assert graphs.graphs is not None and eager.graphs is None
    captures_after_first = None  # set by the first request, checked after the second
    for seed, (events, cands) in enumerate([(50, 20), (50, 18), (90, 300)]):  # the second fits the first's buckets
        req = _request(graphs, events, cands, seed=seed)
        torch.testing.assert_close(graphs.rank_encoded(req).scores, eager.rank_encoded(req).scores, rtol=1e-4, atol=1e-4)
        if seed == 1:
            assert graphs.graphs.report()["captures"] == captures_after_first
        captures_after_first = graphs.graphs.report()["captures"]
    report = graphs.graphs.report()
    assert report["replays"] > report["captures"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
def test_cuda_graphs_with_either_kernel_equal_the_training_forward(tmp_path, cuda_device, kernel) -> None:
    """The cached op's PyTorch reference and its Triton kernel, each replayed as CUDA graphs over several
    requests of the same buckets (nothing of an earlier request may be replayed), give the training forward."""
    engine = _engine(tmp_path, device="cuda", prefill_chunk=16)
    engine.model.encoder.cfg.kernel = kernel
    for seed, (events, cands) in enumerate([(50, 20), (47, 18), (52, 19), (90, 300)]):
        req = _request(engine, events, cands, seed=seed, late_events=seed % 3)
        torch.testing.assert_close(engine.rank_encoded(req).scores, engine.rank_naive(req), rtol=1e-4, atol=1e-4)
    assert engine.graphs.report()["replays"] > engine.graphs.report()["captures"]
