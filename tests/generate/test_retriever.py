"""The Retriever follows the evaluation protocol: the same generated list as `recforge eval` for the same history."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recforge.cli import main
from recforge.config import load_config
from recforge.data.sid_sequences import eval_samples
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.generate import RetrieveConfig, RetrieveRequest, Retriever, search_items
from recforge.train import generative
from _sid_runs import histories_of

TINY = ["model.dim=16", "model.num_blocks=1", "generative.decoder_blocks=1", "model.num_heads=2", "model.ffn_dim=32",
        "train.threads=1", "data.max_seq_len=6", "generative.beam=12", "eval.ks=[1,5,10]"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_synthetic(tmp_path_factory.mktemp("retr") / "data",
                           SyntheticConfig(num_users=40, num_items=30, seed=3, mean_seq_len=12, max_seq_len=20))  # fmt: skip
    assert main(["sid", "fit", str(path), "--out", str(path / "sids"), "--codebook-size", "4", "--levels", "2"]) == 0
    return path


def _setup(data: Path, tmp_path: Path, *extra: str) -> generative.Setup:
    cfg = load_config("configs/beauty-sid-tiger.yaml", [f"data.path={data}", f"generative.sids={data / 'sids'}",
                      f"train.output_dir={tmp_path}", *TINY, *extra])  # fmt: skip
    torch.manual_seed(0)
    s = generative.setup(cfg)
    s.model.eval()
    return s


@pytest.mark.parametrize("in_search", [True, False])
def test_retrieve_returns_the_evaluated_list(tmp_path: Path, data: Path, in_search: bool) -> None:
    """For a history without its target, Retriever.retrieve and the evaluation generate the same items in
    the same order: history items (all of them, beyond the model's window too) are excluded either way."""
    s = _setup(data, tmp_path, f"generative.exclude_seen_in_search={str(in_search).lower()}")
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1), 1)
    items, scores, targets = generative.generated_items(s, samples, k=10)
    histories = histories_of(s, samples)
    fresh = [i for i, h in enumerate(histories) if s.seqs.item_vocab[int(targets[i])] not in h]  # eval never drops the target
    assert len(fresh) >= 10 and max(len(histories[i]) for i in fresh) > 6  # some histories exceed data.max_seq_len
    retriever = Retriever(s.model, s.seqs.item_vocab, s.item_codes, s.trie, s.cfg.data.max_seq_len,
                          RetrieveConfig(exclude_in_search=in_search))
    got = retriever.retrieve([histories[i] for i in fresh], k=10, beam=s.cfg.generative.beam)
    for row, (got_items, got_scores) in zip(fresh, got, strict=True):
        keep = items[row] > 0
        assert got_items == s.seqs.item_vocab[items[row][keep].numpy()].tolist()
        torch.testing.assert_close(torch.tensor(got_scores), scores[row][keep], rtol=1e-5, atol=1e-5)
        assert not set(got_items) & set(histories[row])


def test_history_items_come_back_only_when_asked(tmp_path: Path, data: Path) -> None:
    s = _setup(data, tmp_path)
    retriever = Retriever(s.model, s.seqs.item_vocab, s.item_codes, s.trie, s.cfg.data.max_seq_len)
    histories = histories_of(s, eval_samples(s.seqs, s.seqs.evaluable_users(1)[:8], 1))
    codes, mask, _ = retriever.history_batch([retriever.encode(RetrieveRequest(h)) for h in histories])
    with torch.no_grad():
        memory = s.model.start(codes, mask)
        plain, _ = search_items(lambda c: s.model.next_token_logprobs(memory, c), s.trie, batch_size=8, beam=12, k=10)
    kept = retriever.retrieve(histories, k=10, beam=12, exclude_history=False)
    assert [items for items, _ in kept] == [s.seqs.item_vocab[row[row >= 0].numpy() + 1].tolist() for row in plain]
    assert any(set(items) & set(h) for (items, _), h in zip(kept, histories, strict=True))  # repeats are possible
    # allowed items and the history exclusion combine; a free beam drops history items from its result
    allowed = [histories[0][:2] + [int(v) for v in s.seqs.item_vocab[1:6]]] + [None] * 7
    restricted = retriever.retrieve(histories, k=10, beam=12, allowed_items=allowed)
    assert set(restricted[0][0]) <= set(allowed[0]) - set(histories[0])
    free = retriever.retrieve(histories, k=10, beam=12, constrained=False)
    assert all(not set(items) & set(h) for (items, _), h in zip(free, histories, strict=True))
    with pytest.raises(ValueError, match="constrained beam"):
        retriever.retrieve(histories, k=10, beam=12, allowed_items=allowed, constrained=False)
    assert np.all(np.diff(restricted[1][1]) <= 0)


def _exhaustive(retriever: Retriever, histories: list[list[int]]) -> torch.Tensor:
    """(B, N) total SID log-probability of every catalogue item for each history, one digit at a time."""
    codes, mask, _ = retriever.history_batch([retriever.encode(RetrieveRequest(h)) for h in histories])
    every = retriever.item_codes[1:]  # (N, L)
    b = len(histories)
    with torch.no_grad():
        memory = retriever.model.start(codes, mask)
        total = torch.zeros(b, every.shape[0])
        for t in range(every.shape[1]):
            logp = retriever.model.next_token_logprobs(memory, every[None, :, :t].expand(b, -1, -1))  # (B, N, V)
            total += logp.gather(2, every[None, :, t, None].expand(b, -1, 1))[..., 0]
    return total


def test_engine_batch_equals_brute_force_per_request(tmp_path: Path, data: Path) -> None:
    """Mixed requests in one batch (k, allowed items, exclusion on/off): each gets exactly the top-k of all
    its eligible items by SID log-probability (a beam over every SID), as if it ran alone."""
    s = _setup(data, tmp_path)
    n = s.seqs.num_items
    retriever = Retriever(s.model, s.seqs.item_vocab, s.item_codes, s.trie, s.cfg.data.max_seq_len,
                          RetrieveConfig(beam=n, max_batch=3))  # fmt: skip
    vocab = [int(v) for v in s.seqs.item_vocab[1:]]
    g = torch.Generator().manual_seed(7)
    requests = []
    for i in range(8):
        history = [vocab[j] for j in torch.randint(n, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)]
        allowed = [vocab[j] for j in torch.randperm(n, generator=g)[:12]] if i % 3 == 1 else None
        requests.append(RetrieveRequest(history, k=int(torch.randint(1, 15, (1,), generator=g)), allowed_items=allowed,
                                        exclude_history=i % 4 != 3))  # fmt: skip
    results = retriever.retrieve_requests(requests)  # 3 batches of at most 3
    total = _exhaustive(retriever, [r.history for r in requests])
    for req, result, scores in zip(requests, results, total, strict=True):
        eligible = set(req.allowed_items if req.allowed_items is not None else vocab)
        if req.exclude_history:
            eligible -= set(req.history)
        index = torch.tensor([vocab.index(v) for v in sorted(eligible)])
        best = scores[index].argsort(descending=True, stable=True)[: req.k]
        assert result.items == [sorted(eligible)[i] for i in best.tolist()]  # unique SIDs: no ties
        torch.testing.assert_close(torch.tensor(result.scores), scores[index][best], rtol=1e-4, atol=1e-4)
        alone = retriever.run([retriever.encode(req)])[0]
        assert alone.items == result.items


BAD_REQUESTS = {
    "empty history": (RetrieveRequest([]), "history is empty"),
    "k zero": (RetrieveRequest([1], k=0), "k=0: must be an integer in 1..10"),
    "k too large": (RetrieveRequest([1], k=11), "k=11"),
    "k float": (RetrieveRequest([1], k=2.5), "k=2.5"),
    "unknown": (RetrieveRequest([1, 10**9]), "history: unknown item IDs \\[1000000000\\]"),
    "not ints": (RetrieveRequest(["a"]), "history: item IDs must be integers"),
    "float ids": (RetrieveRequest([1, 2.5]), "history: item IDs must be integers"),
    "long history": (RetrieveRequest(list(range(1, 30))), "at most 20"),
    "allowed unknown": (RetrieveRequest([1], allowed_items=[10**9]), "allowed_items: unknown item IDs"),
    "allowed empty": (RetrieveRequest([1], allowed_items=[]), "holds no item of the catalogue"),
    "allowed too many": (RetrieveRequest([1], allowed_items=list(range(1, 9))), "at most 4"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_engine_refuses_bad_requests_before_batching(tmp_path: Path, data: Path, case: str) -> None:
    s = _setup(data, tmp_path)
    config = RetrieveConfig(beam=8, max_k=10, max_history=20, max_allowed=4)
    retriever = Retriever(s.model, s.seqs.item_vocab, s.item_codes, s.trie, s.cfg.data.max_seq_len, config)
    request, message = BAD_REQUESTS[case]
    request.history = [int(s.seqs.item_vocab[1]) if v == 1 else v for v in request.history]  # 1: a known item
    with pytest.raises(ValueError, match=message):
        retriever.encode(request)


def test_engine_can_skip_items_without_a_sid(tmp_path: Path, data: Path) -> None:
    s = _setup(data, tmp_path)
    known = [int(v) for v in s.seqs.item_vocab[1:4]]
    lenient = Retriever(s.model, s.seqs.item_vocab, s.item_codes, s.trie, s.cfg.data.max_seq_len,
                        RetrieveConfig(beam=8, skip_unknown=True))  # fmt: skip
    encoded = lenient.encode(RetrieveRequest(known + [10**9], allowed_items=[10**9 + 1, *known]))
    assert encoded.unknown == 2 and encoded.history.size == 3 and encoded.allowed.size == 3
    assert lenient.run([encoded])[0].items == lenient.run([lenient.encode(RetrieveRequest(known, allowed_items=known))])[0].items
    free = Retriever(s.model, s.seqs.item_vocab, s.item_codes, s.trie, s.cfg.data.max_seq_len,
                     RetrieveConfig(beam=8, constrained=False))  # fmt: skip
    with pytest.raises(ValueError, match="needs the constrained beam"):
        free.encode(RetrieveRequest(known, allowed_items=known))
    assert not set(free.run([free.encode(RetrieveRequest(known))])[0].items) & set(known)


@pytest.mark.parametrize("per_row", [3, 400])  # few items: flat positions; many: the dense slab
def test_mark_items_sets_exactly_the_listed_items(per_row: int) -> None:
    from recforge.generate.retriever import mark_items

    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    b, n = 6, 500
    for value in (True, False):
        mask = torch.rand(b, n, generator=g) < 0.5
        want = mask.clone()
        rows_items = [(row, torch.randperm(n, generator=g)[:per_row].numpy()) for row in (0, 2, 5)]
        for row, items in rows_items:
            want[row, torch.from_numpy(items)] = value
        mark_items(mask, rows_items, value)
        assert torch.equal(mask, want)
