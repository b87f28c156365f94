"""``Seq2SeqConfig.item_dim``: item tables of another width than the model's (a loaded retrieval table's). The
dense user tower projects to it, the item-ID input goes through a learned projection, and the default width is
today's model, weight for weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq

L, V, N, D = 3, 5, 12, 16


def _model(item_dim: int, seed: int) -> SIDSeq2Seq:
    torch.manual_seed(seed)
    return SIDSeq2Seq(Seq2SeqConfig(num_levels=L, vocab_size=V, dim=D, encoder_layers=1, decoder_layers=1, num_heads=2,
                                    ffn_dim=32, dropout=0.0, max_items=6, num_item_ids=N, dense_items=N,
                                    item_dim=item_dim))  # fmt: skip


def test_item_tables_of_another_width_project_and_the_default_width_is_unchanged() -> None:
    seed = int(torch.randint(1 << 30, (1,)))
    default, same, narrow = _model(0, seed), _model(D, seed), _model(8, seed)
    assert same.state_dict().keys() == default.state_dict().keys()
    for name, value in default.state_dict().items():  # item_dim = dim is the default model, bit for bit
        assert torch.equal(same.state_dict()[name], value), name
    assert not hasattr(default, "item_id_projection")
    assert narrow.item_embedding.weight.shape == narrow.dense_items.weight.shape == (N + 1, 8)
    assert narrow.dense_user.weight.shape == (8, D) and narrow.item_id_projection.weight.shape == (D, 8)

    g = torch.Generator().manual_seed(seed)
    codes, items = torch.randint(V, (4, 5, L), generator=g), torch.randint(1, N + 1, (4, 5), generator=g)
    loss, user = narrow.loss_and_user(codes, None, torch.randint(V, (4, L), generator=g), items)
    assert user.shape == (4, 8)
    torch.testing.assert_close(user.norm(dim=-1), torch.ones(4), rtol=1e-5, atol=1e-5)
    logits = narrow.dense_logits(user, items)  # (4, 5) cosines / temperature against the 8-wide table
    cosines = (F.normalize(narrow.dense_items.weight[items], dim=-1) @ user[:, :, None]).squeeze(2)  # (4, 5)
    want = cosines / narrow.cfg.dense_temperature
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    (loss + logits.sum()).backward()
    assert narrow.item_id_projection.weight.grad.abs().sum() > 0  # the item-ID input reaches the loss through it
    # the projected item-ID embedding is what the encoder adds: zeroing the projection equals zero item rows
    with torch.no_grad():
        narrow.item_id_projection.weight.zero_()
        a = narrow.encode(codes, None, items)[0]
        narrow.item_embedding.weight.zero_()
        torch.testing.assert_close(narrow.encode(codes, None, items)[0], a, rtol=0, atol=0)

