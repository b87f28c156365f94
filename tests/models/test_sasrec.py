"""SASRec encoder: shapes, causality, padding-free invariance, max_seq_len check."""

from __future__ import annotations

import pytest
import torch

from recforge.jagged import AttentionMask
from recforge.jagged.batch import JaggedBatch
from recforge.models import ItemPrefix, L2NormPostfix, RetrievalModel, SASRecConfig, SASRecEncoder

NUM_ITEMS = 40
MAX_LEN = 10
DIM = 12
LENGTHS = [5, 0, 1, 8, 3, 6]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def make_batch(seed: int, lengths: list[int] = LENGTHS, max_seq_len: int | None = None) -> JaggedBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, NUM_ITEMS + 1, (sum(lengths),), generator=gen)
    return JaggedBatch(_offsets(lengths), {"item_ids": ids}, max(lengths) if max_seq_len is None else max_seq_len)


def make_model(seed: int = 0, num_heads: int = 3) -> RetrievalModel:
    torch.manual_seed(seed)
    cfg = SASRecConfig(dim=DIM, num_blocks=2, num_heads=num_heads, ffn_dim=10, dropout=0.3, max_seq_len=MAX_LEN)
    model = RetrievalModel(ItemPrefix(NUM_ITEMS, DIM, MAX_LEN, 0.3), SASRecEncoder(cfg), L2NormPostfix())
    return model.double().eval()


def encode(model: RetrievalModel, batch: JaggedBatch) -> torch.Tensor:
    with torch.no_grad():
        return model.encoder(model.prefix(batch), batch.seq_offsets, batch.max_seq_len, AttentionMask())


@pytest.mark.parametrize("num_heads", [1, 3])
def test_shapes(num_heads: int) -> None:
    model = make_model(num_heads=num_heads)
    batch = make_batch(0)
    out = encode(model, batch)
    assert out.shape == (sum(LENGTHS), DIM) and out.dtype == torch.float64
    assert torch.isfinite(out).all()
    assert model(batch).shape == (sum(LENGTHS), DIM)


def test_dim_must_divide_by_heads() -> None:
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        SASRecEncoder(SASRecConfig(dim=10, num_heads=3))


def test_causality() -> None:
    model = make_model(1)
    batch = make_batch(1)
    base = encode(model, batch)
    offsets = batch.seq_offsets.tolist()
    for b, p in [(0, 2), (2, 0), (3, 0), (3, 4), (3, 7), (4, 2), (5, 5)]:  # (sequence, position)
        changed = make_batch(1)
        tok = offsets[b] + p
        changed.features["item_ids"][tok] = changed.item_ids[tok] % NUM_ITEMS + 1
        out = encode(model, changed)
        keep = torch.ones(base.shape[0], dtype=torch.bool)
        keep[tok : offsets[b + 1]] = False
        torch.testing.assert_close(out[keep], base[keep], rtol=1e-12, atol=1e-12, msg=f"sequence {b}, position {p}")
        assert not torch.allclose(out[tok], base[tok])


def test_padding_free_invariance() -> None:
    model = make_model(2)
    batch = make_batch(2, max_seq_len=MAX_LEN)
    out = encode(model, batch)
    for b, n in enumerate(LENGTHS):
        if n == 0:
            continue
        s = int(batch.seq_offsets[b])
        alone = JaggedBatch(torch.tensor([0, n]), {"item_ids": batch.item_ids[s : s + n].clone()}, n)
        torch.testing.assert_close(out[s : s + n], encode(model, alone), rtol=1e-10, atol=1e-12)


def test_rejects_batch_longer_than_configured() -> None:
    model = make_model()
    x = torch.zeros(3, DIM, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"max_seq_len {MAX_LEN + 1} exceeds the encoder's max_seq_len {MAX_LEN}"):
        model.encoder(x, torch.tensor([0, 3]), MAX_LEN + 1, AttentionMask())


def test_eval_is_deterministic_and_train_mode_uses_dropout() -> None:
    model = make_model(3)
    batch = make_batch(3)
    torch.testing.assert_close(encode(model, batch), encode(model, batch), rtol=0, atol=0)
    model.train()
    torch.manual_seed(0)
    a = encode(model, batch)
    torch.manual_seed(1)
    b = encode(model, batch)
    assert not torch.allclose(a, b)


def test_batch_of_empty_sequences() -> None:
    model = make_model()
    out = model.encoder(torch.zeros(0, DIM, dtype=torch.float64), torch.zeros(3, dtype=torch.int64), 1, AttentionMask())
    assert out.shape == (0, DIM)
