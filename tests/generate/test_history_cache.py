"""The per-user history cache: cached answers equal cold ones for both SID models over random history
extensions, byte-bounded LRU eviction, stale writers refused, and a hammer of threads over few users."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from recforge.generate import HistoryCache, RetrieveConfig, RetrieveRequest, Retriever, SidTrie, encodings
from recforge.models.sid_hstu import SIDHSTU, SIDHSTUConfig
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq
from recforge.models.sid_tokenizer import add_collision_level

ITEMS, MAX_ITEMS, ATOL = 60, 10, 1e-4  # scores: float32 rounding of another summation order (cached vs one pass)


def _retriever(kind: str, seed: int = 0, cache_bytes: int = 64 << 20, device: str = "cpu") -> Retriever:
    torch.manual_seed(seed)
    codes = add_collision_level(torch.randint(6, (ITEMS, 2), generator=torch.Generator().manual_seed(7)))
    vocab = max(6, int(codes.max()) + 1)
    L = codes.shape[1]
    if kind == "tiger":
        model = SIDSeq2Seq(Seq2SeqConfig(num_levels=L, vocab_size=vocab, dim=16, encoder_layers=2, decoder_layers=1,
                                         num_heads=2, ffn_dim=32, dropout=0.0, max_items=MAX_ITEMS))  # fmt: skip
    else:
        model = SIDHSTU(SIDHSTUConfig(num_levels=L, vocab_size=vocab, dim=16, num_blocks=2, num_heads=2, dropout=0.0,
                                      max_items=MAX_ITEMS, kernel="pytorch" if device == "cpu" else "auto"))  # fmt: skip
    model.to(device)
    trie = SidTrie.build(codes, vocab, "dense").to(device)
    retriever = Retriever(model, np.arange(100, 101 + ITEMS).astype(np.int64), torch.cat([codes[:1] * 0, codes]), trie,
                          MAX_ITEMS, RetrieveConfig(beam=16, max_k=20, max_batch=32))  # fmt: skip
    retriever.cache = HistoryCache(cache_bytes) if cache_bytes else None
    return retriever


def _cold(retriever: Retriever) -> Retriever:
    twin = Retriever(retriever.model, retriever.item_vocab, retriever.item_codes, retriever.trie, retriever.max_items,
                     retriever.config)  # fmt: skip
    return twin  # same model, no cache


def _same(got, want, atol: float = ATOL) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.items == w.items
        np.testing.assert_allclose(g.scores, w.scores, rtol=0, atol=atol)


def _grow(history: list[int], g: np.random.Generator) -> list[int]:
    """Next request of a returning user: mostly 0-2 appended events, sometimes a rewritten history."""
    if g.random() < 0.1:
        return (100 + 1 + g.integers(ITEMS, size=int(g.integers(1, 8)))).tolist()
    return history + (100 + 1 + g.integers(ITEMS, size=int(g.integers(0, 3)))).tolist()


@pytest.mark.parametrize("kind", ["tiger", "sid_hstu"])
def test_cached_answers_equal_cold_ones_over_random_extensions(kind: str) -> None:
    _check_random_extensions(_retriever(kind), ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tiger", "sid_hstu"])
def test_cached_answers_equal_cold_ones_on_the_gpu(kind: str, cuda_device: torch.device) -> None:
    """The Triton kernels (``hstu_attention`` cold, ``cached_hstu_attention`` extending) in float32."""
    _check_random_extensions(_retriever(kind, device=str(cuda_device)), 1e-3)


def _check_random_extensions(cached: Retriever, atol: float) -> None:
    kind = "sid_hstu" if encodings.extendable(cached.model) else "tiger"
    cold = _cold(cached)
    g = np.random.default_rng(int(torch.randint(1 << 30, (1,))))
    histories = {f"u{i}": (100 + 1 + g.integers(ITEMS, size=int(g.integers(1, 6)))).tolist() for i in range(5)}
    for _ in range(12):
        users = list(g.choice(list(histories), size=int(g.integers(1, 7)), replace=True))  # repeats: same user twice
        batch = []
        for user in users:
            histories[user] = _grow(histories[user], g)
            batch.append(RetrieveRequest(histories[user], k=int(g.integers(1, 12)), user_id=user,
                                         exclude_history=bool(g.random() < 0.7)))  # fmt: skip
        _same(cached.run([cached.encode(r) for r in batch]), cold.run([cold.encode(r) for r in batch]), atol)
    report = cached.cache.report()
    assert report["hits"] > 0 and report["misses"] > 0, report  # some windows slide past MAX_ITEMS: misses
    assert (report["extends"] > 0) == (kind == "sid_hstu"), report  # a bidirectional encoder never extends
    for entry in cached.cache.entries.values():  # every entry still encodes exactly its items
        want = encodings.split(cached.model, cached.model.start(*cold.history_batch([cold.encode(
            RetrieveRequest((entry.items + 100).tolist()))])), [entry.items.size * 3])[0]  # fmt: skip
        for a, b in zip(entry.tensors, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_extending_a_decoder_only_piece_equals_encoding_the_whole_history() -> None:
    retriever = _retriever("sid_hstu")
    model, L = retriever.model, retriever.item_codes.shape[1]
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    full = [torch.randint(1, ITEMS + 1, (int(torch.randint(2, MAX_ITEMS + 1, (1,), generator=g)),), generator=g)
            for _ in range(4)]  # fmt: skip
    cut = [int(torch.randint(1, h.numel(), (1,), generator=g)) for h in full]

    def pieces(histories: list[torch.Tensor]) -> list[tuple]:
        batch = [retriever.encode(RetrieveRequest((h + 100).tolist(), exclude_history=False)) for h in histories]
        with torch.no_grad():
            memory = model.start(*retriever.history_batch(batch))
        return encodings.split(model, memory, [h.numel() * L for h in histories])

    grown = encodings.extend_hstu(model, pieces([h[:c] for h, c in zip(full, cut, strict=True)]),
                                  [retriever.item_codes[h[c:]] for h, c in zip(full, cut, strict=True)])  # fmt: skip
    for got, want in zip(grown, pieces(full), strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_lru_eviction_keeps_the_byte_bound() -> None:
    items = np.arange(1, 9, dtype=np.int64)
    piece = (torch.randn(64, 8),)  # 2 KiB of tensors + metadata per user
    one = 2048 + items.nbytes + 2 + 512
    cache = HistoryCache(max_bytes=2 * one + 100)
    for user in ("u1", "u2"):
        assert cache.put(user, items, piece, "0", cache.lookup(user, items, "0", False).generation)
    assert cache.lookup("u1", items, "0", False).reused == 8  # u1 is now the most recently used
    assert cache.put("u3", items, piece, "0", 0)
    assert list(cache.entries) == ["u1", "u3"] and cache.bytes == 2 * one <= cache.max_bytes
    assert not cache.put("u4", items, (torch.randn(1024, 8),), "0", 0)  # larger than the whole bound
    report = cache.report()
    assert report["evicted"] == 1 and report["too_large"] == 1 and report["bytes_used"] == 2 * one


def test_a_stale_writer_never_overwrites_a_newer_entry() -> None:
    cache, old, new = HistoryCache(1 << 20), np.arange(1, 4), np.arange(1, 6)
    slow = cache.lookup("u", old, "0", True)  # two requests of one user look up before either writes
    fast = cache.lookup("u", new, "0", True)
    assert cache.put("u", new, (torch.ones(3),), "0", fast.generation)
    assert not cache.put("u", old, (torch.zeros(3),), "0", slow.generation)  # refused: the entry changed
    assert np.array_equal(cache.entries["u"].items, new) and cache.report()["stale_writes"] == 1
    late = cache.lookup("u", old, "0", True)  # a late request of the earlier history: the entry is newer
    assert late.entry is None and late.superseded and not cache.lookup("u", np.arange(2, 4), "0", True).superseded
    found = cache.lookup("u", np.arange(1, 8), "0", True)  # a prefix of a longer history: extendable
    assert found.reused == 5 and cache.lookup("u", np.arange(1, 8), "0", False).entry is None
    cache.invalidate("1")  # a reload: nothing of version 0 is read or written any more
    assert cache.lookup("u", new, "0", True).entry is None and cache.lookup("u", new, "1", True).entry is None
    assert not cache.put("u", new, (torch.ones(3),), "0", 0) and not cache.entries


@pytest.mark.parametrize("kind", ["tiger", "sid_hstu"])
def test_threads_hammering_few_users_get_cold_answers(kind: str) -> None:
    """Threads call ``run`` at once for 3 users whose histories grow: every answer equals the cold one, and
    every entry left in the cache encodes exactly its items (no writer mixed into another's entry)."""
    cached = _retriever(kind)
    cold = _cold(cached)
    seed = int(torch.randint(1 << 30, (1,)))
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        g = np.random.default_rng(seed + t)
        histories = {f"u{i}": [101 + i] for i in range(3)}
        try:
            for _ in range(8):
                user = f"u{int(g.integers(3))}"
                histories[user] = _grow(histories[user], g)
                request = RetrieveRequest(histories[user], k=8, user_id=user)
                _same(cached.run([cached.encode(request)]), cold.run([cold.encode(request)]))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for entry in cached.cache.entries.values():
        request = cold.encode(RetrieveRequest((entry.items + 100).tolist()))
        want = encodings.split(cached.model, cached.model.start(*cold.history_batch([request])), [entry.items.size * 3])[0]
        for a, b in zip(entry.tensors, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    assert cached.cache.report()["lookups"] == 32
