"""The TIGER model's opt-in dense head (``Seq2SeqConfig.dense_items``, LIGER): off is today's model, the SID loss
is unchanged by it, dense logits are cosine / temperature with 0 for items without a row, and the history-cache
pieces carry the user vector."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recforge.generate import encodings
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq

L, V, N = 3, 5, 12


def _model(dense_items: int = 0, num_item_ids: int = 0, seed: int = 0, dropout: float = 0.1) -> SIDSeq2Seq:
    torch.manual_seed(seed)
    return SIDSeq2Seq(Seq2SeqConfig(num_levels=L, vocab_size=V, dim=16, encoder_layers=2, decoder_layers=1, num_heads=2,
                                    ffn_dim=32, dropout=dropout, max_items=6, num_item_ids=num_item_ids,
                                    dense_items=dense_items, dense_temperature=0.1))  # fmt: skip


def _batch(g: torch.Generator, b: int = 4, h: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(V, (b, h, L), generator=g)
    lengths = torch.randint(1, h + 1, (b,), generator=g)
    mask = torch.arange(h)[None, :] >= h - lengths[:, None]  # right-aligned histories
    return codes * mask[..., None], mask, torch.randint(V, (b, L), generator=g)


@pytest.mark.parametrize("num_item_ids", [0, N])
def test_the_dense_head_leaves_the_sid_model_and_loss_bit_identical(num_item_ids: int) -> None:
    seed = int(torch.randint(1 << 30, (1,)))
    off, on = _model(0, num_item_ids, seed), _model(N, num_item_ids, seed)
    head = {"dense_user.weight", "dense_user.bias", "dense_items.weight"}
    assert set(on.state_dict()) - set(off.state_dict()) == head | ({"item_id_vocab"} if not num_item_ids else set())
    for name, value in off.state_dict().items():  # built last: every other weight draws the same initial values
        assert torch.equal(on.state_dict()[name], value), name
    assert not off.has_dense_head and on.has_dense_head
    codes, mask, target = _batch(torch.Generator().manual_seed(seed))
    items = torch.randint(0, N + 1, mask.shape) * mask if num_item_ids else None
    torch.manual_seed(seed + 1)  # dropout on: both draw the same masks (the head draws no random numbers)
    want = off.loss(codes, mask, target, items)
    torch.manual_seed(seed + 1)
    got, user = on.loss_and_user(codes, mask, target, items)
    assert torch.equal(got, want)
    assert off.loss_and_user(codes, mask, target, items)[1] is None and off.start(codes, mask, items).user is None
    torch.testing.assert_close(user.norm(dim=-1), torch.ones(4), rtol=0, atol=1e-5)


def test_dense_logits_are_cosine_over_temperature_and_zero_without_a_row() -> None:
    model = _model(N, dropout=0.0).eval()
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    codes, mask, _ = _batch(g)
    with torch.no_grad():
        memory = model.start(codes, mask)
        encoded, _ = model.encode(codes, mask)
        rows = torch.randint(1, N + 1, (4, 7), generator=g)
        rows[:, 0], rows[:, 1] = 0, N + 5  # padding / no row, and a row outside the table
        logits = model.dense_logits(memory.user, rows)
    user = F.normalize(model.dense_user(encoded[:, -1]), dim=-1)  # the last (most recent) token's output
    torch.testing.assert_close(memory.user, user, rtol=1e-5, atol=1e-6)
    items = F.normalize(model.dense_items.weight[rows[:, 2:]], dim=-1)
    torch.testing.assert_close(logits[:, 2:], torch.einsum("bkd,bd->bk", items, user) / 0.1, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[:, :2], torch.zeros(4, 2))
    assert logits.dtype == torch.float32 and logits.abs().max() <= 1 / 0.1 + 1e-4
    with pytest.raises(ValueError, match="no dense head"):
        _model(0).dense_logits(memory.user, rows)


def test_item_rows_map_raw_ids_for_a_dense_head_alone_and_tables_must_agree() -> None:
    model = _model(N)
    raw = torch.randperm(500)[:N] + 10
    model.set_item_vocab(torch.cat([torch.tensor([-1]), raw]))
    assert torch.equal(model.item_rows(torch.cat([raw, torch.tensor([3])])), torch.tensor([*range(1, N + 1), 0]))
    assert not model.reads_item_ids and model.item_table_rows == N + 1
    with pytest.raises(ValueError, match="share one row mapping"):
        _model(N, num_item_ids=N - 1)


def test_history_cache_pieces_keep_the_user_vector() -> None:
    model = _model(N, dropout=0.0).eval()
    codes, mask, _ = _batch(torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,)))))
    with torch.no_grad():
        memory = model.start(codes, mask)
        pieces = encodings.split(model, memory, (mask.sum(1) * L).tolist())
        again = encodings.assemble(model, pieces)
        alone = [model.start(codes[b : b + 1, -int(mask[b].sum()) :], None) for b in range(4)]
    assert torch.equal(again.user, memory.user)
    for b in range(4):  # each request encoded alone (no padding) has the same user vector
        torch.testing.assert_close(alone[b].user[0], memory.user[b], rtol=1e-4, atol=1e-5)
