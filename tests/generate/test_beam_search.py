"""Constrained beam search against brute-force enumeration on small catalogues."""

from __future__ import annotations

import itertools

import pytest
import torch

from recforge.generate import SidTrie, beam_search, resolve_items


def random_step(batch: int, vocab: int, levels: int, seed: int, hash_size: int = 9973):
    """A deterministic stand-in model: next-digit log-probs looked up by (request, level, prefix hash)."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.randn(levels, batch, hash_size, vocab, generator=g, dtype=torch.float64).log_softmax(-1)
    weights = 31 ** torch.arange(levels, dtype=torch.long)
    on_device: dict = {}  # the tables and weights copied once per device: the step itself never syncs

    def step(codes: torch.Tensor) -> torch.Tensor:
        b, w, t = codes.shape
        if codes.device not in on_device:
            on_device[codes.device] = (tables.to(codes.device), weights.to(codes.device))
        dev_tables, dev_weights = on_device[codes.device]
        key = ((codes + 1) * dev_weights[:t]).sum(-1) % hash_size  # (B, W)
        rows = torch.arange(b, device=codes.device)[:, None]
        return dev_tables[t][rows, key]  # (B, W, V)

    return step


def brute_force(step, sequences: list[tuple[int, ...]], batch: int) -> torch.Tensor:
    """(B, len(sequences)) total log-prob of each sequence for each request, scored one digit at a time."""
    seqs = torch.tensor(sequences, dtype=torch.long)  # (S, L)
    total = torch.zeros(batch, len(sequences), dtype=torch.float64)
    for t in range(seqs.shape[1]):
        logp = step(seqs[None, :, :t].expand(batch, -1, -1))  # (B, S, V)
        total += logp.gather(2, seqs[None, :, t, None].expand(batch, -1, 1)).squeeze(2)
    return total


def catalogue(num_items: int, vocab: int, levels: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (num_items, levels), generator=g)  # collisions likely on purpose


@pytest.mark.parametrize("layout", ["dense", "csr"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exhaustive_beam_equals_brute_force_topk(seed: int, layout: str) -> None:
    vocab, levels, batch = 5, 3, 3
    codes = catalogue(40, vocab, levels, seed)
    trie = SidTrie.build(codes, vocab, layout)
    step = random_step(batch, vocab, levels, seed)
    valid = sorted(set(map(tuple, codes.tolist())))
    beam = 64  # >= the number of valid prefixes at every depth: the search is exhaustive
    out = beam_search(step, trie, batch_size=batch, beam=beam)
    expected = brute_force(step, valid, batch)
    for b in range(batch):
        order = torch.argsort(expected[b], descending=True, stable=True)
        want = [valid[i] for i in order]
        got = [tuple(c) for c, s in zip(out.codes[b].tolist(), out.scores[b].tolist(), strict=True) if s > float("-inf")]
        assert got == want, f"seed {seed} request {b}"
        torch.testing.assert_close(out.scores[b, : len(valid)].double(), expected[b][order], rtol=1e-5, atol=1e-5)
    # items: each SID expands to all its items, in beam order then item order
    items, scores = resolve_items(out, trie, k=len(codes))
    for b in range(batch):
        order = torch.argsort(expected[b], descending=True, stable=True)
        want_items = [i for v in order for i in range(len(codes)) if tuple(codes[i].tolist()) == valid[v]]
        assert items[b].tolist() == want_items
        assert torch.isfinite(scores[b]).all()


@pytest.mark.parametrize("layout", ["dense", "csr"])
@pytest.mark.parametrize("beam", [1, 3, 8])
def test_small_beam_emits_only_valid_sids_best_first(beam: int, layout: str) -> None:
    vocab, levels, batch = 16, 4, 4
    codes = catalogue(60, vocab, levels, 7)
    trie = SidTrie.build(codes, vocab, layout)
    out = beam_search(random_step(batch, vocab, levels, 7), trie, batch_size=batch, beam=beam)
    valid = set(map(tuple, codes.tolist()))
    assert out.codes.shape == (batch, beam, levels)
    for b in range(batch):
        for c, s in zip(out.codes[b].tolist(), out.scores[b].tolist(), strict=True):
            if s > float("-inf"):
                assert tuple(c) in valid
        assert (out.scores[b][:-1] >= out.scores[b][1:]).all()
    items, _ = resolve_items(out, trie, k=beam)
    for b in range(batch):
        for i in items[b].tolist():
            assert i == -1 or tuple(codes[i].tolist()) in {tuple(c) for c in out.codes[b].tolist()}


@pytest.mark.parametrize("layout", ["dense", "csr"])
def test_allowed_items_restrict_the_search_exactly(layout: str) -> None:
    vocab, levels, batch, n = 4, 3, 3, 30
    codes = torch.cat([catalogue(n - 1, vocab, levels, 3), torch.tensor([[3, 3, 3]])])
    trie = SidTrie.build(codes, vocab, layout)
    step = random_step(batch, vocab, levels, 3)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(batch, n, generator=g) < 0.3
    mask[2] = False
    mask[2, n - 1] = True  # one allowed item only
    out = beam_search(step, trie, batch_size=batch, beam=64, allowed=trie.allowed_nodes(mask))
    items, scores = resolve_items(out, trie, k=n, item_mask=mask)
    for b in range(batch):
        allowed_sids = sorted({tuple(codes[i].tolist()) for i in range(n) if mask[b, i]})
        expected = brute_force(step, allowed_sids, batch)[b]
        order = torch.argsort(expected, descending=True, stable=True)
        got = [tuple(c) for c, s in zip(out.codes[b].tolist(), out.scores[b].tolist(), strict=True) if s > float("-inf")]
        assert got == [allowed_sids[i] for i in order]
        kept = [i for i in items[b].tolist() if i >= 0]
        assert kept and all(mask[b, i] for i in kept)
        assert sorted(kept) == sorted(torch.nonzero(mask[b]).flatten().tolist())
    assert items[2].tolist()[:2] == [n - 1, -1]


@pytest.mark.parametrize("layout", ["dense", "csr"])
def test_free_beam_searches_all_sequences_and_drops_invalid_ones(layout: str) -> None:
    vocab, levels, batch = 3, 3, 2
    codes = catalogue(6, vocab, levels, 5)
    trie = SidTrie.build(codes, vocab, layout)
    step = random_step(batch, vocab, levels, 5)
    every = list(itertools.product(range(vocab), repeat=levels))
    out = beam_search(step, trie, batch_size=batch, beam=vocab**levels, constrained=False)
    expected = brute_force(step, every, batch)
    valid = set(map(tuple, codes.tolist()))
    for b in range(batch):
        order = torch.argsort(expected[b], descending=True, stable=True)
        assert [tuple(c) for c in out.codes[b].tolist()] == [every[i] for i in order]
        leaves_valid = [leaf >= 0 for leaf in out.leaves[b].tolist()]
        assert leaves_valid == [every[i] in valid for i in order]
    items, _ = resolve_items(out, trie, k=3)
    assert (items >= 0).all()  # the first three catalogue items, invalid sequences skipped


def test_resolve_cuts_collisions_at_k() -> None:
    codes = torch.tensor([[0, 1]] * 5 + [[1, 0]])  # five items share one SID
    trie = SidTrie.build(codes, 2)
    assert trie.max_items_per_leaf == 5
    out = beam_search(random_step(1, 2, 2, 0), trie, batch_size=1, beam=4)
    items, _ = resolve_items(out, trie, k=3)
    assert items.shape == (1, 3) and len(set(items[0].tolist())) == 3


def test_csr_and_dense_tries_give_the_same_child_rows() -> None:
    codes = catalogue(300, 16, 3, 9)
    dense, csr = SidTrie.build(codes, 16, "dense"), SidTrie.build(codes, 16, "csr")
    assert csr.nbytes() < dense.nbytes() and csr.num_nodes == dense.num_nodes
    for level in range(3):
        nodes = torch.arange(-1, dense.num_nodes[level - 1] if level else 1).view(-1, 1).expand(-1, 2)
        assert torch.equal(dense.child_rows(level, nodes), csr.child_rows(level, nodes))


def test_trie_rejects_out_of_range_digits() -> None:
    with pytest.raises(ValueError, match="digits must lie in"):
        SidTrie.build(torch.tensor([[0, 5]]), 4)


@pytest.mark.gpu
def test_gpu_matches_cpu_without_host_sync(cuda_device: torch.device) -> None:
    vocab, levels, batch = 32, 4, 4
    codes = catalogue(2000, vocab, levels, 11)
    trie = SidTrie.build(codes, vocab)
    step = random_step(batch, vocab, levels, 11)
    cpu = beam_search(step, trie, batch_size=batch, beam=64)
    gpu_trie = trie.to(cuda_device)
    csr_trie = SidTrie.build(codes, vocab, "csr").to(cuda_device)
    beam_search(step, gpu_trie, batch_size=batch, beam=64)  # warm-up (lazy CUDA init syncs)
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = beam_search(step, gpu_trie, batch_size=batch, beam=64)
        items_gpu, _ = resolve_items(gpu, gpu_trie, k=64)
        gpu_csr = beam_search(step, csr_trie, batch_size=batch, beam=64)
        mask = (torch.arange(2000, device=cuda_device) % 3 == 0).expand(batch, -1)
        restricted = beam_search(step, gpu_trie, batch_size=batch, beam=64, allowed=gpu_trie.allowed_nodes(mask))
        items_restricted, _ = resolve_items(restricted, gpu_trie, k=64, item_mask=mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu.codes.cpu(), cpu.codes) and torch.equal(gpu_csr.codes.cpu(), cpu.codes)
    torch.testing.assert_close(gpu.scores.cpu(), cpu.scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(items_gpu.cpu(), resolve_items(cpu, trie, k=64)[0])
    cpu_mask = mask.cpu()
    cpu_restricted = beam_search(step, trie, batch_size=batch, beam=64, allowed=trie.allowed_nodes(cpu_mask))
    assert torch.equal(items_restricted.cpu(), resolve_items(cpu_restricted, trie, k=64, item_mask=cpu_mask)[0])
    assert (items_restricted[items_restricted >= 0] % 3 == 0).all()
