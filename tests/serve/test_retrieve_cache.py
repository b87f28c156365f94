"""`/v1/retrieve`'s history cache behind HTTP and the batching worker: returning users hit it (counted in
/health and /metrics), a reload empties it and never mixes two models' encodings, cache_mb=0 turns it off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from recforge.generate import HistoryCache, RetrieveConfig, RetrieveRequest, Retriever, SidTrie
from recforge.models.sid_hstu import SIDHSTU, SIDHSTUConfig
from recforge.models.sid_tokenizer import add_collision_level
from recforge.serve.retrieve_app import RetrieveSettings, create_retrieve_app
from recforge.serve.retrieve_runner import RetrieveRunner
from recforge.serve.scheduler import SchedulerConfig
from recforge.serve.server import ServerConfig

ITEMS = 40


def _retriever(seed: int, version: str, cache: HistoryCache | None) -> Retriever:
    torch.manual_seed(seed)
    codes = add_collision_level(torch.randint(5, (ITEMS, 2), generator=torch.Generator().manual_seed(3)))
    vocab = max(5, int(codes.max()) + 1)
    model = SIDHSTU(SIDHSTUConfig(num_levels=codes.shape[1], vocab_size=vocab, dim=16, num_blocks=1, num_heads=2,
                                  dropout=0.0, max_items=12, kernel="pytorch"))  # fmt: skip
    retriever = Retriever(model, np.arange(ITEMS + 1, dtype=np.int64) + 1000, torch.cat([codes[:1] * 0, codes]),
                          SidTrie.build(codes, vocab, "dense"), 12, RetrieveConfig(beam=12, max_k=10, max_batch=8))  # fmt: skip
    retriever.version, retriever.cache = version, cache
    return retriever


def _cold(retriever: Retriever, request: RetrieveRequest):
    twin = Retriever(retriever.model, retriever.item_vocab, retriever.item_codes, retriever.trie, retriever.max_items,
                     retriever.config)  # fmt: skip
    return twin.run([twin.encode(request)])[0]


def test_returning_users_hit_the_cache_counted_in_health_and_metrics() -> None:
    retriever = _retriever(0, "v1", HistoryCache(8 << 20, "v1"))
    config = ServerConfig(scheduler=SchedulerConfig(max_wait_ms=1.0))
    history = [1001, 1007, 1003]
    with TestClient(create_retrieve_app(retriever, "v1", config, RetrieveSettings(max_k=10, max_batch=8))) as client:
        for grown in [history, history, [*history, 1010], [*history, 1010, 1020, 1002]]:
            out = client.post("/v1/retrieve", json={"user_id": 7, "history": grown, "k": 5})
            assert out.status_code == 200, out.text
            want = _cold(retriever, RetrieveRequest(grown, 5))
            assert out.json()["items"] == want.items and out.json()["model_version"] == "v1"
            np.testing.assert_allclose(out.json()["scores"], want.scores, rtol=0, atol=1e-4)
        cache = client.get("/health").json()["history_cache"]
        assert cache["enabled"] and (cache["misses"], cache["hits"], cache["extends"]) == (1, 1, 2), cache
        assert 0 < cache["bytes_used"] <= cache["bytes_capacity"] and cache["users"] == 1
        metrics = client.get("/metrics").text
        assert "recforge_retrieve_cache_extends 2.0" in metrics and "recforge_retrieve_cache_hits 1.0" in metrics


def test_reload_empties_the_cache_and_queued_requests_run_on_their_own_model() -> None:
    cache = HistoryCache(8 << 20, "a")
    old, new = _retriever(0, "a", cache), _retriever(1, "b", None)
    runner = RetrieveRunner(old, SchedulerConfig(max_wait_ms=1.0))
    request = RetrieveRequest([1001, 1002, 1005], k=6, user_id="u")
    try:
        assert runner.submit(old.encode(request)).result(timeout=30).items == _cold(old, request).items
        assert cache.entries["u"].version == "a"
        queued = old.encode(request)  # encoded by the old model just before the reload
        runner.reload(new)
        assert new.cache is cache and cache.version == "b" and not cache.entries
        assert runner.submit(queued, retriever=old).result(timeout=30).items == _cold(old, request).items
        assert not cache.entries  # the old model's late write-back was refused
        answer = runner.submit(new.encode(request)).result(timeout=30)
        assert answer.items == _cold(new, request).items != _cold(old, request).items
        assert cache.entries["u"].version == "b" and cache.report()["stale_writes"] == 1
        hit = runner.submit(new.encode(request)).result(timeout=30)
        assert hit.items == answer.items and (cache.report()["hits"], cache.report()["misses"]) == (1, 3)
    finally:
        runner.close()


def test_without_a_cache_health_says_so() -> None:
    assert RetrieveSettings(cache_mb=-1).problems() == ["cache_mb: must be >= 0 (0 turns the history cache off), got -1"]
    retriever = _retriever(0, "v", None)
    with TestClient(create_retrieve_app(retriever, "v", ServerConfig(), RetrieveSettings(max_k=10))) as client:
        assert client.post("/v1/retrieve", json={"user_id": "a", "history": [1001], "k": 3}).status_code == 200
        assert client.get("/health").json()["history_cache"] == {"enabled": False}
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        HistoryCache(0)
