"""The dense head's own top items joined to the beam's (``generative.dense_candidates``, ``add_dense_candidates``):
the teacher-forced SID scorer against the beam's scores, the merged ranking against a brute force, K = 0 exactly
today's path, the allowed items, and evaluation and the Retriever on the same requests."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch

from recforge.config import ConfigError, load_config
from recforge.data.sid_sequences import eval_samples
from recforge.generate import DenseCandidates, RetrieveConfig, Retriever, SidTrie, beam_search, resolve_items, search_items
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq
from recforge.train import generative
from _sid_runs import TINY, check_retrieves_evaluated, histories_of, run_args, sid_dataset
from tests.generate.test_beam_search import catalogue, random_step

DENSE = "configs/beauty-sid-tiger-dense.yaml"
INF = float("inf")


def teacher_forced(step):
    """A ``ScoreFn`` through a step function: each level's log-prob of the SID's own digit, summed (the reference)."""

    def score(codes: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(codes.shape[:2], dtype=torch.float64)
        for t in range(codes.shape[2]):
            total = total + step(codes[:, :, :t]).gather(2, codes[:, :, t, None]).squeeze(2)
        return total.float()

    return score


def _tiny_model(levels: int, vocab: int, items: int, seed: int) -> SIDSeq2Seq:
    torch.manual_seed(seed)
    model = SIDSeq2Seq(Seq2SeqConfig(num_levels=levels, vocab_size=vocab, dim=16, encoder_layers=1, decoder_layers=2,
                                     num_heads=2, ffn_dim=32, dropout=0.0, max_items=8, dense_items=items))  # fmt: skip
    model.set_item_vocab(torch.arange(-1, items, dtype=torch.long))
    return model.eval()


@pytest.mark.parametrize("seed", [0, 1])
def test_the_teacher_forced_score_of_a_beam_sid_is_the_beams_score(seed: int) -> None:
    levels, vocab, items, batch = 3, 8, 40, 3
    model = _tiny_model(levels, vocab, items, seed)
    codes = catalogue(items, vocab, levels, seed)
    trie = SidTrie.build(codes, vocab)
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(vocab, (batch, 6, levels), generator=g)
    mask = torch.arange(6)[None] >= torch.tensor([[0], [2], [5]])  # left-padded histories of 6, 4 and 1 items
    with torch.no_grad():
        memory = model.start(history, mask)
        out = beam_search(lambda c: model.next_token_logprobs(memory, c), trie, batch_size=batch, beam=7)
        got = model.sid_log_probs(memory, out.codes)
        reference = teacher_forced(lambda c: model.next_token_logprobs(memory, c))(out.codes)
    assert bool(torch.isfinite(out.scores).all())
    torch.testing.assert_close(got, out.scores, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)
    # the catalogue's dense logits (one matmul) are the per-item ones; a row the table lacks is never a candidate
    rows = torch.tensor([0, *range(1, items + 1), items + 5])
    every = model.catalogue_dense_logits(memory.user, rows)  # (B, items + 2)
    assert bool(torch.isneginf(every[:, [0, -1]]).all())
    per_item = model.dense_logits(memory.user, rows[1:-1].expand(batch, -1))
    torch.testing.assert_close(every[:, 1:-1], per_item, rtol=1e-5, atol=1e-5)


def _brute_force(step, trie_codes, beam_items, dense_table, item_mask, count, rescore):
    """(B, N) combined score of every candidate item (-inf elsewhere): the beam's items and the ``count`` best
    allowed items by dense logit, each scored by enumerating its SID's digits."""
    batch, n = dense_table.shape
    sid = teacher_forced(step)(trie_codes[None].expand(batch, -1, -1))  # (B, N) log p(SID) of every item
    combined = torch.full((batch, n), -INF)
    for b in range(batch):
        allowed = [i for i in range(n) if item_mask[b, i] and torch.isfinite(dense_table[b, i])]
        top = sorted(allowed, key=lambda i: -dense_table[b, i].item())[:count]
        for i in {*top, *(int(i) for i in beam_items[b] if i >= 0)}:
            dense = dense_table[b, i] if torch.isfinite(dense_table[b, i]) else 0.0
            combined[b, i] = sid[b, i] + rescore * dense
    return combined


@pytest.mark.parametrize("seed,rescore", [(0, 0.0), (1, 0.7), (2, 2.0)])
def test_the_merged_list_is_the_brute_force_ranking_of_beam_and_dense_items(seed: int, rescore: float) -> None:
    vocab, levels, batch, num_items, beam, count = 4, 3, 4, 50, 3, 6
    codes = catalogue(num_items, vocab, levels, seed)  # 50 items over 64 SIDs: some collide
    trie = SidTrie.build(codes, vocab)
    step = random_step(batch, vocab, levels, seed)
    g = torch.Generator().manual_seed(seed + 100)
    table = torch.randn(batch, num_items, generator=g) * 3
    table[:, :5] = -INF  # items without a dense row: never added, and no dense term
    item_mask = torch.rand(batch, num_items, generator=g) > 0.3
    candidates = DenseCandidates(count, table, codes, teacher_forced(step))
    dense = lambda items: torch.where(items >= 0, table.gather(1, items.clamp_min(0)), 0.0).nan_to_num(neginf=0.0)  # noqa: E731
    out = beam_search(step, trie, batch_size=batch, beam=beam, allowed=trie.allowed_nodes(item_mask))
    beam_items, _ = resolve_items(out, trie, beam * trie.max_items_per_leaf, item_mask=item_mask)
    want = _brute_force(step, codes, beam_items, table, item_mask, count, rescore)
    for k in (4, num_items):  # a cut inside the candidates, and room for all of them
        items, scores = search_items(step, trie, batch_size=batch, beam=beam, k=k, item_mask=item_mask,
                                     search_mask=item_mask, dense=dense, rescore=rescore, candidates=candidates)  # fmt: skip
        for b in range(batch):
            union = torch.isfinite(want[b]).nonzero().flatten()
            n = min(k, union.numel())
            got = items[b, :n]
            assert len(set(got.tolist())) == n and bool((got >= 0).all()) and bool(item_mask[b, got].all())
            assert (items[b, n:] == -1).all() and torch.isneginf(scores[b, n:]).all()
            torch.testing.assert_close(scores[b, :n], want[b, got], rtol=0, atol=1e-5)  # each one's definition
            assert bool((scores[b, 1:n] <= scores[b, : n - 1]).all())  # ranked
            left = want[b, [i for i in union.tolist() if i not in set(got.tolist())]]
            assert bool((left <= scores[b, n - 1] + 1e-5).all())  # nothing better was cut
            if k == num_items:  # every candidate is in: the dense top-K and the beam's items
                assert set(got.tolist()) == set(union.tolist())
                dense_top = table[b].masked_fill(~item_mask[b], -INF).topk(count)
                assert set(dense_top.indices[torch.isfinite(dense_top.values)].tolist()) <= set(got.tolist())
                assert {int(i) for i in beam_items[b] if i >= 0} <= set(got.tolist())


@pytest.mark.parametrize("rescore", [0.0, 0.7])
def test_zero_dense_candidates_is_exactly_the_beams_path(rescore: float) -> None:
    vocab, levels, batch, num_items = 5, 3, 3, 60
    codes = catalogue(num_items, vocab, levels, 3)
    trie = SidTrie.build(codes, vocab)
    step = random_step(batch, vocab, levels, 3)
    table = torch.randn(batch, num_items)
    dense = lambda items: table.gather(1, items.clamp_min(0))  # noqa: E731
    mask = torch.rand(batch, num_items) > 0.2
    args = dict(batch_size=batch, beam=4, k=8, item_mask=mask, search_mask=mask, dense=dense, rescore=rescore)
    today = search_items(step, trie, **args)
    zero = search_items(step, trie, **args, candidates=DenseCandidates(0, table, codes, teacher_forced(step)))
    assert all(torch.equal(a, b) for a, b in zip(today, zero, strict=True))
    more = search_items(step, trie, **args, candidates=DenseCandidates(20, table, codes, teacher_forced(step)))
    assert not torch.equal(more[0], today[0])  # candidates beyond the beam do change the lists
    with pytest.raises(ValueError, match="count=-1"):
        search_items(step, trie, **args, candidates=DenseCandidates(-1, table, codes, teacher_forced(step)))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sid_dataset(tmp_path_factory.mktemp("liger") / "data", seed=11)


def test_config_and_retriever_errors_say_how_to_fix_them(tmp_path: Path, data: Path) -> None:
    args = run_args(tmp_path, data, *TINY, "generative.beam=10")
    with pytest.raises(ConfigError, match="generative.dense_head is off and generative.dense_scorer is empty; set generative.dense_scorer="):
        load_config("configs/beauty-sid-tiger.yaml", [*args, "generative.dense_candidates=50"])
    with pytest.raises(ConfigError, match=r"generative.dense_candidates: must be >= 0 \(0: the beam's items only\)"):
        load_config(DENSE, [*args, "generative.dense_candidates=-3"])
    assert load_config(DENSE, [*args, "generative.dense_candidates=50", "eval.ks=[1,50]"]).generative.dense_candidates == 50
    s = generative.setup(load_config("configs/beauty-sid-tiger.yaml", args))
    with pytest.raises(ValueError, match="needs a model with a dense head"):
        Retriever(s.model, s.seqs.item_vocab, s.item_codes, s.trie, 8, dense_candidates=5)
    dense = generative.setup(load_config(DENSE, args))
    with pytest.raises(ValueError, match="dense_candidates=-1: must be >= 0"):
        Retriever(dense.model, dense.seqs.item_vocab, dense.item_codes, dense.trie, 8, dense_candidates=-1)


def test_the_liger_config_is_the_dense_config_plus_dense_candidates() -> None:
    dense, liger = load_config(DENSE).to_dict(), load_config("configs/beauty-sid-tiger-liger.yaml").to_dict()
    assert dense["generative"]["dense_candidates"] == 0 and liger["generative"]["dense_candidates"] > 0
    liger["generative"]["dense_candidates"], liger["name"] = 0, dense["name"]
    assert liger == dense


@pytest.mark.parametrize("rescore", [0.0, 1.5])
def test_evaluation_and_the_retriever_agree_and_respect_allowed_items(tmp_path: Path, data: Path, rescore: float) -> None:
    args = run_args(tmp_path, data, *TINY, "generative.beam=3", f"generative.rescore={rescore}", "eval.ks=[1,5]",
                    "generative.dense_candidates=8")  # fmt: skip
    s = generative.setup(load_config(DENSE, args))  # untrained weights: the paths, not the quality, are compared
    s.model.eval()
    retriever = Retriever(s.model, s.seqs.item_vocab, s.item_codes, s.trie, s.cfg.data.max_seq_len,
                          RetrieveConfig(beam=3), rescore=rescore, dense_candidates=8)  # fmt: skip
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1)[:20], 1)
    items, scores, targets = generative.generated_items(s, samples, k=10)
    s.cfg.generative.dense_candidates = 0
    beam_only, _, _ = generative.generated_items(s, samples, k=10)
    assert (items > 0).sum() > (beam_only > 0).sum()  # the dense head's items extend the beam's lists
    histories = histories_of(s, samples)
    check_retrieves_evaluated(retriever, s, histories, targets, items, scores, beam=3)
    # an allowed-item set bounds the dense candidates too; they still reach beyond the beam's few SIDs
    raw = [int(v) for v in s.seqs.item_vocab[1:]]
    for history, allowed in itertools.islice(zip(histories, (raw[i::3] for i in itertools.cycle(range(3)))), 6):
        ((got_items, _),) = retriever.retrieve([history], k=30, beam=1, allowed_items=[allowed])
        assert got_items and set(got_items) <= set(allowed) - set(history)
        ((beam_items, _),) = Retriever(s.model, s.seqs.item_vocab, s.item_codes, s.trie, s.cfg.data.max_seq_len,
                                     RetrieveConfig(beam=1), rescore=rescore).retrieve(
            [history], k=30, beam=1, allowed_items=[allowed])  # fmt: skip
        assert set(beam_items) < set(got_items)


@pytest.mark.gpu
def test_gpu_dense_candidates_match_cpu(tmp_path: Path, data: Path, cuda_device: torch.device) -> None:
    args = run_args(tmp_path, data, *TINY, "generative.beam=4", "eval.ks=[1,4]", "eval.select_metric=ndcg@4", "train.device=cpu")
    s = generative.setup(load_config(DENSE, args))
    engines = [Retriever(model, s.seqs.item_vocab, s.item_codes, trie, s.cfg.data.max_seq_len, RetrieveConfig(beam=4),
                         rescore=rescore, dense_candidates=8)  # fmt: skip
               for model, trie in ((s.model, s.trie), (copy.deepcopy(s.model).to(cuda_device), s.trie.to(cuda_device)))
               for rescore in (0.0, 1.0)]  # fmt: skip
    raw = [int(v) for v in s.seqs.item_vocab[1:]]
    histories = [raw[i : i + 1 + i % 7] for i in range(0, 24, 3)]  # mixed lengths: padded batches
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32's ~1e-3 on a cosine is ~0.02 on a logit: it could swap items
    try:
        answers = [engine.retrieve(histories, k=12, beam=4) for engine in engines]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    for want, got in ((answers[0], answers[2]), (answers[1], answers[3])):
        for (items_cpu, scores_cpu), (items_gpu, scores_gpu) in zip(want, got, strict=True):
            assert items_cpu == items_gpu
            torch.testing.assert_close(torch.tensor(scores_gpu), torch.tensor(scores_cpu), rtol=1e-4, atol=1e-4)
