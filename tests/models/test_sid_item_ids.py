"""The TIGER model's opt-in item-ID input (``Seq2SeqConfig.num_item_ids``): off is today's model, unknown IDs
read the zero row, raw IDs map to rows, and the IDs let the model learn what SIDs alone cannot tell apart."""

from __future__ import annotations

import pytest
import torch

from recforge.models.sid_hstu import SIDHSTU, SIDHSTUConfig
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq

L, V, N = 3, 5, 12  # digits per SID, digits per level, items in the ID table


def _model(num_item_ids: int, seed: int = 0, dropout: float = 0.1) -> SIDSeq2Seq:
    torch.manual_seed(seed)
    return SIDSeq2Seq(Seq2SeqConfig(num_levels=L, vocab_size=V, dim=16, encoder_layers=1, decoder_layers=1, num_heads=2,
                                    ffn_dim=32, dropout=dropout, max_items=6, num_item_ids=num_item_ids))  # fmt: skip


def _batch(g: torch.Generator, b: int = 4, h: int = 5):
    codes = torch.randint(V, (b, h, L), generator=g)
    mask = torch.ones(b, h, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    items = torch.randint(1, N + 1, (b, h), generator=g) * mask
    return codes, mask, items, torch.randint(V, (b, L), generator=g)


def test_off_is_the_sid_only_model_and_a_zero_table_changes_nothing() -> None:
    """The table is built last: every other weight starts as without it, so with zero rows the loss (dropout
    included) is bit-identical to the model without the option, and its state dict gains only the table."""
    seed = int(torch.randint(1 << 30, (1,)))
    off, on = _model(0, seed), _model(N, seed)
    assert set(on.state_dict()) - set(off.state_dict()) == {"item_embedding.weight", "item_id_vocab"}
    for name, value in off.state_dict().items():
        assert torch.equal(on.state_dict()[name], value), name
    with torch.no_grad():
        on.item_embedding.weight.zero_()
    codes, mask, items, target = _batch(torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    want = off.loss(codes, mask, target)
    torch.manual_seed(seed)
    assert torch.equal(on.loss(codes, mask, target, items), want)
    assert not off.reads_item_ids and off.loss(codes, mask, target, items).isfinite()  # an SID-only model ignores IDs


def test_unknown_and_padding_rows_read_the_zero_row() -> None:
    model = _model(N, dropout=0.0).eval()
    codes, mask, items, _ = _batch(torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,)))))
    assert torch.equal(model.item_embedding.weight[0], torch.zeros(16))
    unknown = items.clone()
    unknown[0, 1], unknown[2, 4], unknown[3, 0] = N + 1, 10**9, -7  # outside the table: never an index error
    zero = unknown.clone()
    zero[0, 1] = zero[2, 4] = zero[3, 0] = 0
    with torch.no_grad():
        a, _ = model.encode(codes, mask, unknown)
        b, _ = model.encode(codes, mask, zero)
        c, _ = model.encode(codes, mask, items)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - c).abs().amax() > 1e-3  # the IDs do change the encoding
    model.train()
    model.loss(codes, mask, torch.zeros(4, L, dtype=torch.long), unknown).backward()
    assert torch.equal(model.item_embedding.weight.grad[0], torch.zeros(16))  # padding/unknown row stays zero


def test_raw_item_ids_map_to_their_rows() -> None:
    model = _model(N)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    raw = torch.randperm(1000, generator=g)[:N] + 10  # rows 1..N, in no particular order
    model.set_item_vocab(torch.cat([torch.tensor([-1]), raw]))
    query = torch.cat([raw[torch.randperm(N, generator=g)], torch.tensor([5, 2000, -1])])
    rows = model.item_rows(query)
    assert torch.equal(model.item_id_vocab[rows[:N]], query[:N])
    assert rows[N:].tolist() == [0, 0, 0]  # IDs the table does not hold
    with pytest.raises(ValueError, match="does not fit"):
        model.set_item_vocab(torch.arange(N))
    with pytest.raises(ValueError, match="no item-ID embedding"):
        _model(0).item_rows(query)


def test_a_model_with_ids_refuses_a_history_without_them_and_hstu_refuses_ids() -> None:
    codes, mask, items, target = _batch(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="pass history_items"):
        _model(N).loss(codes, mask, target)
    with pytest.raises(ValueError, match="shape"):
        _model(N).start(codes, mask, items[:, 1:])
    hstu = SIDHSTU(SIDHSTUConfig(num_levels=L, vocab_size=V, dim=16, num_blocks=1, num_heads=2, max_items=6,
                                 kernel="pytorch"))  # fmt: skip
    assert not hstu.reads_item_ids
    with pytest.raises(ValueError, match="reads no item IDs"):
        hstu.start(codes, mask, items)
    with pytest.raises(ValueError, match="reads no item IDs"):
        hstu.loss(codes, mask, target, items)


def _chains(g: torch.Generator, item_codes: torch.Tensor, successor: torch.Tensor, b: int, h: int):
    """Histories that follow ``successor`` from random starts; the target is the last item's successor."""
    items = torch.empty(b, h, dtype=torch.long)
    items[:, 0] = torch.randint(1, N + 1, (b,), generator=g)
    for t in range(1, h):
        items[:, t] = successor[items[:, t - 1]]
    return item_codes[items], items, item_codes[successor[items[:, -1]]]


def test_item_ids_learn_what_shared_sids_hide() -> None:
    """Items share SIDs in pairs, and the next item follows from the last one's identity: the loss falls with
    the IDs, and below what the same model reaches from SIDs alone."""
    seed = int(torch.randint(1 << 30, (1,)))
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(V, (N // 2, L), generator=g)
    item_codes = torch.cat([torch.zeros(1, L, dtype=torch.long), shared.repeat_interleave(2, 0)])  # (N + 1, L)
    successor = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(N, generator=g) + 1])
    final = {}
    for num_item_ids in (0, N):
        model = _model(num_item_ids, seed, dropout=0.0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        batches = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(120):
            codes, items, target = _chains(batches, item_codes, successor, b=32, h=1)
            loss = model.loss(codes, None, target, items if num_item_ids else None)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        final[num_item_ids] = sum(losses[-10:]) / 10
        if num_item_ids:
            assert final[num_item_ids] < 0.3 * sum(losses[:5]) / 5, (seed, losses[:5], losses[-10:])
    assert final[N] < final[0] - 0.1, (seed, final)
