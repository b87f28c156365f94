"""RetrievalModel (prefix -> encoder -> postfix) and the paper-configuration builders."""

from __future__ import annotations

import pytest
import torch

from recforge.config import ModelConfig
from recforge.jagged.batch import JaggedBatch
from recforge.models import HSTUEncoder, SASRecEncoder
from recforge.models.builders import build_retrieval_model, hstu_large, hstu_small

NUM_ITEMS = 30


def make_batch(lengths: list[int], seed: int = 0, max_seq_len: int = 8) -> JaggedBatch:
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    total = sum(lengths)
    features = {
        "item_ids": torch.randint(1, NUM_ITEMS + 1, (total,), generator=gen),
        "timestamps": 1_700_000_000 + torch.randint(0, 3600, (total,), generator=gen).cumsum(0),
    }
    return JaggedBatch(offsets, features, max_seq_len)


@pytest.mark.parametrize("kind", ["hstu", "sasrec"])
def test_forward_gives_unit_vectors(kind: str) -> None:
    torch.manual_seed(0)
    model = build_retrieval_model(ModelConfig(kind=kind, dim=16, dqk=8, dv=8, ffn_dim=16), NUM_ITEMS, 8).eval()
    batch = make_batch([3, 0, 1, 8, 5])
    out = model(batch)
    assert out.shape == (17, 16)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(17), rtol=1e-5, atol=1e-5)
    items = model.item_vectors()
    assert items.shape == (NUM_ITEMS + 1, 16)
    torch.testing.assert_close(items[1:].norm(dim=-1), torch.ones(NUM_ITEMS), rtol=1e-5, atol=1e-5)
    assert torch.equal(items[0], torch.zeros(16))  # the padding row stays zero
    some = torch.tensor([3, 1, 3])
    torch.testing.assert_close(model.item_vectors(some), items[some])


@pytest.mark.parametrize("kind", ["hstu", "sasrec"])
def test_last_token_vectors(kind: str) -> None:
    torch.manual_seed(1)
    model = build_retrieval_model(ModelConfig(kind=kind, dim=16, dqk=8, dv=8, ffn_dim=16), NUM_ITEMS, 8).eval()
    lengths = [3, 1, 8, 5, 2]
    batch = make_batch(lengths, seed=1)
    with torch.no_grad():
        full = model(batch)
        last = model.last_token_vectors(batch)
    assert last.shape == (len(lengths), 16)
    start = 0
    for b, n in enumerate(lengths):
        torch.testing.assert_close(last[b], full[start + n - 1], rtol=0, atol=0)
        start += n


def test_last_token_vectors_empty_sequence_is_not_a_neighbours_vector() -> None:
    torch.manual_seed(2)
    model = build_retrieval_model(ModelConfig(kind="sasrec", dim=16, ffn_dim=16), NUM_ITEMS, 8).eval()
    batch = make_batch([0, 3, 0, 2], seed=2)
    with torch.no_grad():
        full = model(batch)
        try:
            last = model.last_token_vectors(batch)
        except ValueError:
            return  # refusing empty sequences is fine
    assert not torch.equal(last[0], full[-1]), "empty sequence 0 got the batch's last token"
    assert not torch.equal(last[2], full[2]), "empty sequence 2 got sequence 1's last token"


def _encoder_shapes(model) -> tuple:
    enc = model.encoder
    assert isinstance(enc, HSTUEncoder)
    cfg = enc.cfg
    return cfg.num_blocks, cfg.num_heads, cfg.dqk, cfg.dv, cfg.dim


def test_hstu_small_is_the_paper_ml1m_config() -> None:
    model = hstu_small(NUM_ITEMS)
    assert _encoder_shapes(model) == (2, 1, 50, 50, 50)
    assert len(model.encoder.blocks) == 2
    block = model.encoder.blocks[0]
    assert block.uvqk.weight.shape == (4 * 50, 50)  # u, v: 1 x 50; q, k: 1 x 50
    assert block.out.weight.shape == (50, 50)
    assert block.pos_weights.shape == (200,)
    assert model.prefix.item_embedding.weight.shape == (NUM_ITEMS + 1, 50)
    assert model.prefix.position_embedding.weight.shape == (200, 50)
    assert model.encoder.cfg.max_seq_len == 200


def test_hstu_large_is_the_paper_large_config() -> None:
    model = hstu_large(NUM_ITEMS, max_seq_len=64)
    assert _encoder_shapes(model) == (8, 2, 25, 25, 50)
    assert len(model.encoder.blocks) == 8
    block = model.encoder.blocks[-1]
    assert block.uvqk.weight.shape == (2 * 25 * 4, 50)
    assert block.attn_norm.normalized_shape == (2 * 25,)
    assert block.out.weight.shape == (50, 2 * 25)
    assert model.encoder.cfg.max_seq_len == 64 and block.pos_weights.shape == (64,)


@pytest.mark.parametrize("builder", [hstu_small, hstu_large])
def test_builders_run_forward(builder) -> None:
    torch.manual_seed(0)
    model = builder(NUM_ITEMS, max_seq_len=8).eval()
    with torch.no_grad():
        out = model(make_batch([4, 1, 0, 8]))
    assert out.shape == (13, 50)


def test_build_sasrec_and_unknown_kind() -> None:
    model = build_retrieval_model(ModelConfig(kind="sasrec", num_heads=2, ffn_dim=20), NUM_ITEMS, 16)
    assert isinstance(model.encoder, SASRecEncoder)
    assert model.encoder.cfg.num_heads == 2 and model.encoder.cfg.ffn_dim == 20
    with pytest.raises(ValueError, match="expected hstu or sasrec"):
        build_retrieval_model(ModelConfig(kind="bert4rec"), NUM_ITEMS, 16)
