"""An engine pass moves its inputs in one host -> device copy and its scores in one device -> host copy,
whatever its batch size (``serve/staging.py``), and gives the scores of its items run one at a time."""

from __future__ import annotations

import warnings

import pytest
import torch

from recforge.serve.cache_manager import CacheManager
from recforge.serve.engine import EngineConfig, RankEngine
from recforge.serve.graphs import GraphRunner
from recforge.serve.layout import candidate_tokens, prefix_tokens
from recforge.serve.state import WorkItem
from _serve_helpers import build_model, export, random_history


def _engine(tmp_path, **config) -> RankEngine:
    return RankEngine.from_run(export(build_model(), tmp_path / "run"), EngineConfig(**config))


def _items(engine: RankEngine, seed: int, prefilled: int = 4, chunks: int = 3) -> list[WorkItem]:
    """One pass: candidates of ``prefilled`` users (two of them in one bucket), then the first prefill chunk
    of ``chunks`` others; fresh random histories, the same ones for the same ``seed``."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for u in range(prefilled + chunks):
        events = int(torch.randint(1, 60, (1,), generator=g)) if u != 1 else 23
        hist = random_history(events, seed * 100 + u)
        n_cands = int(torch.randint(1, 40, (1,), generator=g)) if u != 1 else 13
        cands = (1000 + torch.randint(0, 50, (n_cands,), generator=g)).tolist()
        req = engine.encode(f"u{u}", hist, cands, user_features={"user_id": "u2", "gender": "f"}, timestamp=hist["timestamps"][-1] + 7)
        if u < prefilled:
            items.append(WorkItem(engine.prefix_state(req, _state(engine, 0)), candidate_tokens(req), "targets"))
        else:
            tokens = prefix_tokens(req, engine.action_encoding)
            end = min(tokens["item_ids"].numel(), 2 + u)
            items.append(WorkItem(_state(engine, tokens["item_ids"].numel()), {k: v[:end] for k, v in tokens.items()},
                                  "prefix", 0))  # fmt: skip
    return items


def _state(engine: RankEngine, capacity: int):
    return CacheManager.for_engine(engine).new_state(engine.num_contextual, capacity)


def _check_same(together, alone, items_together, items_alone, exact: bool) -> None:
    for out, ref, a, b in zip(together, alone, items_together, items_alone):
        if a.kind == "targets":
            assert out.dtype == torch.float32 and out.device.type == "cpu"
            if exact:
                assert torch.equal(out, ref)
            else:
                torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        else:
            assert out is None and ref is None and a.state.length == b.state.length
            n = a.state.length
            assert torch.equal(a.state.timestamps[:n], b.state.timestamps[:n])
            assert torch.equal(a.state.tokens[:n], b.state.tokens[:n])
            torch.testing.assert_close(a.state.keys[:, :n], b.state.keys[:, :n], rtol=1e-6, atol=1e-6)


def test_padded_pass_of_many_items_copies_once_each_way(tmp_path) -> None:
    """Through the padded buckets: a pass of 7 items (candidates and prefill chunks, two in one bucket) gives
    exactly the scores and keys of each item alone, with one upload and one download, and reuses its buffers."""
    engine = _engine(tmp_path)
    runner = GraphRunner(engine, limit=64, capture=False)
    alone_items = _items(engine, seed=1)
    alone = [runner.run(item) for item in alone_items]
    together_items = _items(engine, seed=1)
    stats = dict(runner.stats)
    together = runner.run_pass(together_items)
    assert (runner.stats["uploads"] - stats["uploads"], runner.stats["downloads"] - stats["downloads"]) == (1, 1)
    _check_same(together, alone, together_items, alone_items, exact=True)
    buffers = [held[0].data_ptr() for held in runner.staging._host if held is not None]
    for _ in range(2):  # equal passes reuse the same two host buffers
        runner.run_pass(_items(engine, seed=1))
    assert [held[0].data_ptr() for held in runner.staging._host if held is not None][: len(buffers)] == buffers
    prefill_only = _items(engine, seed=4, prefilled=0, chunks=4)
    before = dict(runner.stats)
    assert runner.run_pass(prefill_only) == [None] * len(prefill_only)
    assert (runner.stats["uploads"] - before["uploads"], runner.stats["downloads"] - before["downloads"]) == (1, 0)
    assert runner.stats["staging_waits"] == 0


def test_eager_pass_of_many_items_copies_once_each_way(tmp_path) -> None:
    """The eager pass (``forward``, all items' tokens at once): one upload, one download for 7 items, the scores
    of each item alone (within rounding: the linear layers see another batch) and the training forward's."""
    engine = _engine(tmp_path)
    alone_items = _items(engine, seed=5)
    alone = [engine.forward([item])[0] for item in alone_items]
    together_items = _items(engine, seed=5)
    before = dict(engine.transfers)
    together = engine.forward(together_items)
    assert (engine.transfers["uploads"] - before["uploads"], engine.transfers["downloads"] - before["downloads"]) == (1, 1)
    _check_same(together, alone, together_items, alone_items, exact=False)


def test_scores_returned_by_a_pass_survive_the_next_pass(tmp_path) -> None:
    """Scores are the caller's own tensors: later passes (reusing the device and host buffers) never change them."""
    engine = _engine(tmp_path)
    runner = GraphRunner(engine, limit=64, capture=False)
    first = runner.run_pass(_items(engine, seed=6))
    kept = [None if out is None else out.clone() for out in first]
    runner.run_pass(_items(engine, seed=7))
    engine.forward(_items(engine, seed=8))
    for out, ref in zip(first, kept):
        assert (out is None and ref is None) or torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("prefilled", [1, 8])
def test_a_graph_pass_waits_for_the_device_once(tmp_path, cuda_device, prefilled) -> None:
    """On CUDA, once its buckets are captured, a pass of 1 or 8 candidates items and prefill chunks synchronises
    with the device once (its scores' download), counted by PyTorch's sync debug mode; a prefill-only pass never."""
    engine = _engine(tmp_path, device="cuda")
    items = _items(engine, seed=9, prefilled=prefilled, chunks=2)
    engine.run(items)  # captures every bucket
    expected = engine.run(_items(engine, seed=9, prefilled=prefilled, chunks=2))
    for batch, syncs in ((_items(engine, seed=9, prefilled=prefilled, chunks=2), 1),
                         ([it for it in _items(engine, seed=9, prefilled=0, chunks=3)], 0)):  # fmt: skip
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = engine.run(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found = [w for w in caught if "called a synchronizing" in str(w.message)]  # not the prototype notice
        assert len(found) == syncs, [str(w.message) for w in found]
        if syncs:
            for a, b in zip(out, expected):
                assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-6, atol=1e-6)
