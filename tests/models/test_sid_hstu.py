"""SIDHSTU's own decode-path attention with and without the relative position bias, and its teacher-forced SID scores."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recforge.generate import SidTrie, beam_search
from recforge.models.sid_hstu import SIDHSTU, SIDHSTUConfig


@pytest.mark.parametrize("relative_bias", [True, False])
def test_decode_log_probs_equal_the_full_forward(relative_bias: bool) -> None:
    L, V, b = 3, 7, 3
    torch.manual_seed(4)
    model = SIDHSTU(SIDHSTUConfig(num_levels=L, vocab_size=V, dim=16, num_blocks=2, num_heads=2, dropout=0.0,
                                  max_items=8, kernel="pytorch", relative_bias=relative_bias)).double().eval()  # fmt: skip
    for block in model.encoder.blocks:
        assert (block.pos_weights is not None) == relative_bias
        if relative_bias:  # they start at zero: make the bias matter
            torch.nn.init.normal_(block.pos_weights, std=0.5)
    g = torch.Generator().manual_seed(5)
    codes, target = torch.randint(V, (b, 5, L), generator=g), torch.randint(V, (b, L), generator=g)
    mask = torch.ones(b, 5, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        memory = model.start(codes, mask)
        got = torch.stack([model.next_token_logprobs(memory, target[:, None, :t])[:, 0] for t in range(L)], 1)
        tokens, offsets, _ = model._jagged(torch.cat([codes, target[:, None]], 1),
                                           torch.cat([mask, torch.ones(b, 1, dtype=torch.bool)], 1))  # fmt: skip
        hidden = model._hidden(tokens, offsets)
        for i in range(b):
            end = int(offsets[i + 1])  # the target's digits t are predicted by the tokens before them
            want = torch.stack([F.log_softmax(hidden[end - L - 1 + t] @ model.heads[t].T, -1) for t in range(L)])
            torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-8)


def test_teacher_forced_sid_log_probs_are_the_beams_scores() -> None:
    """``sid_log_probs`` (dense candidates' SID scores) gives each generated SID the beam's own score (the step is
    checked against the full forward above)."""
    L, V, b = 3, 5, 3
    seed = int(torch.randint(1 << 30, (1,)))
    torch.manual_seed(seed)
    model = SIDHSTU(SIDHSTUConfig(num_levels=L, vocab_size=V, dim=16, num_blocks=2, num_heads=2, dropout=0.0,
                                  max_items=8, kernel="pytorch")).eval()  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    trie = SidTrie.build(torch.randint(V, (30, L), generator=g), V)
    history = torch.randint(V, (b, 6, L), generator=g)
    mask = torch.arange(6)[None] >= torch.tensor([[0], [2], [5]])  # histories of 6, 4 and 1 items
    with torch.no_grad():
        memory = model.start(history, mask)
        out = beam_search(lambda c: model.next_token_logprobs(memory, c), trie, batch_size=b, beam=6)
        got = model.sid_log_probs(memory, out.codes)
    assert bool(torch.isfinite(out.scores).all())
    torch.testing.assert_close(got, out.scores, rtol=0, atol=1e-5)
