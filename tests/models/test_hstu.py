"""HSTU encoder: shapes, causality, padding-free invariance, max_seq_len check."""

from __future__ import annotations

import pytest
import torch

from recforge.jagged import AttentionMask
from recforge.jagged.batch import JaggedBatch
from recforge.models import HSTUConfig, HSTUEncoder, ItemPrefix, L2NormPostfix, RetrievalModel
from recforge.models.hstu import residual_stream_dtype

NUM_ITEMS = 40
MAX_LEN = 10
LENGTHS = [5, 0, 1, 8, 3, 6]


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def make_batch(seed: int, lengths: list[int] = LENGTHS, with_time: bool = True, max_seq_len: int | None = None) -> JaggedBatch:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    features = {"item_ids": torch.randint(1, NUM_ITEMS + 1, (total,), generator=gen)}
    if with_time:
        gaps = torch.exp(torch.rand(total, dtype=torch.float64, generator=gen) * 9).long()
        features["timestamps"] = 1_700_000_000 + torch.cumsum(gaps, 0)
    return JaggedBatch(_offsets(lengths), features, max(lengths) if max_seq_len is None else max_seq_len)


def slice_batch(batch: JaggedBatch, b: int) -> JaggedBatch:
    s, e = int(batch.seq_offsets[b]), int(batch.seq_offsets[b + 1])
    features = {k: v[s:e].clone() for k, v in batch.features.items()}
    return JaggedBatch(torch.tensor([0, e - s]), features, e - s)


def make_model(seed: int = 0, num_time_buckets: int = 16) -> RetrievalModel:
    torch.manual_seed(seed)
    cfg = HSTUConfig(
        dim=16, num_blocks=2, num_heads=2, dqk=6, dv=5, dropout=0.3, max_seq_len=MAX_LEN, num_time_buckets=num_time_buckets
    )
    model = RetrievalModel(ItemPrefix(NUM_ITEMS, 16, MAX_LEN, 0.3), HSTUEncoder(cfg), L2NormPostfix())
    with torch.no_grad():  # the biases start at zero; make them matter
        for block in model.encoder.blocks:
            block.pos_weights.normal_()
            if block.time_weights is not None:
                block.time_weights.normal_()
    return model.double().eval()


def encode(model: RetrievalModel, batch: JaggedBatch) -> torch.Tensor:
    with torch.no_grad():
        x = model.prefix(batch)
        return model.encoder(x, batch.seq_offsets, batch.max_seq_len, AttentionMask(), batch.timestamps)


@pytest.mark.parametrize("with_time", [False, True])
def test_shapes(with_time: bool) -> None:
    model = make_model()
    batch = make_batch(0, with_time=with_time)
    out = encode(model, batch)
    assert out.shape == (sum(LENGTHS), 16) and out.dtype == torch.float64
    assert torch.isfinite(out).all()
    assert model(batch).shape == (sum(LENGTHS), 16)


def test_time_weights_are_used_only_with_timestamps() -> None:
    model = make_model()
    with_time = make_batch(0, with_time=True)
    without = JaggedBatch(with_time.seq_offsets, {"item_ids": with_time.item_ids}, with_time.max_seq_len)
    assert not torch.allclose(encode(model, with_time), encode(model, without))
    no_bucket_model = make_model(num_time_buckets=0)
    assert all(block.time_weights is None for block in no_bucket_model.encoder.blocks)
    torch.testing.assert_close(encode(no_bucket_model, with_time), encode(no_bucket_model, without), rtol=0, atol=0)


# (sequence, position): first, middle and last tokens of long and short sequences, and a length-1 one
CHANGE_POINTS = [(0, 2), (2, 0), (3, 0), (3, 4), (3, 7), (4, 2), (5, 5)]


@pytest.mark.parametrize("with_time,what", [(False, "item"), (True, "item"), (True, "timestamp")])
def test_causality(with_time: bool, what: str) -> None:
    model = make_model(1)
    batch = make_batch(1, with_time=with_time)
    base = encode(model, batch)
    offsets = batch.seq_offsets.tolist()
    changed_itself = 0
    for b, p in CHANGE_POINTS:
        changed = make_batch(1, with_time=with_time)
        tok = offsets[b] + p
        if what == "item":
            changed.features["item_ids"][tok] = changed.item_ids[tok] % NUM_ITEMS + 1
        else:  # a later timestamp at p (and all after it in the sequence stay where they are)
            changed.features["timestamps"][tok] += 37
        out = encode(model, changed)
        keep = torch.ones(base.shape[0], dtype=torch.bool)
        keep[tok : offsets[b + 1]] = False  # positions >= p of sequence b may change
        torch.testing.assert_close(out[keep], base[keep], rtol=1e-12, atol=1e-12, msg=f"sequence {b}, position {p}")
        changed_itself += not torch.allclose(out[tok], base[tok])
        if what == "item":
            assert not torch.allclose(out[tok], base[tok]), "the changed token itself must see the change"
    assert changed_itself  # the perturbation is not a no-op


def test_targets_only_affect_themselves() -> None:
    """With num_targets (ranking), a target token is seen by no other token, later targets included."""
    model = make_model(4)
    targets = torch.tensor([2, 0, 1, 3, 1, 2])
    batch = make_batch(4)
    mask = AttentionMask(num_targets=targets)
    with torch.no_grad():
        base = model.encoder(model.prefix(batch), batch.seq_offsets, batch.max_seq_len, mask, batch.timestamps)
    offsets = batch.seq_offsets.tolist()
    for b, t in enumerate(targets.tolist()):
        for p in range(LENGTHS[b] - t, LENGTHS[b]):
            tok = offsets[b] + p
            changed = make_batch(4)
            changed.features["item_ids"][tok] = changed.item_ids[tok] % NUM_ITEMS + 1
            with torch.no_grad():
                x = model.prefix(changed)
                fresh_mask = AttentionMask(num_targets=targets)
                out = model.encoder(x, changed.seq_offsets, changed.max_seq_len, fresh_mask, changed.timestamps)
            keep = torch.ones(base.shape[0], dtype=torch.bool)
            keep[tok] = False
            torch.testing.assert_close(out[keep], base[keep], rtol=1e-12, atol=1e-12, msg=f"sequence {b}, target {p}")
            assert not torch.allclose(out[tok], base[tok])


@pytest.mark.parametrize("with_time", [False, True])
def test_padding_free_invariance(with_time: bool) -> None:
    model = make_model(2)
    batch = make_batch(2, with_time=with_time, max_seq_len=MAX_LEN)
    out = encode(model, batch)
    for b, n in enumerate(LENGTHS):
        if n == 0:
            continue
        alone = encode(model, slice_batch(batch, b))  # batched alone, max_seq_len = its own length
        s = int(batch.seq_offsets[b])
        torch.testing.assert_close(out[s : s + n], alone, rtol=1e-10, atol=1e-12)
    # and the batch's own max_seq_len does not matter either
    tight = JaggedBatch(batch.seq_offsets, batch.features, max(LENGTHS))
    torch.testing.assert_close(encode(model, tight), out, rtol=1e-10, atol=1e-12)


def test_rejects_batch_longer_than_configured() -> None:
    model = make_model()
    x = torch.zeros(3, 16, dtype=torch.float64)
    offsets = torch.tensor([0, 3])
    with pytest.raises(ValueError, match=f"max_seq_len {MAX_LEN + 1} exceeds the encoder's max_seq_len {MAX_LEN}"):
        model.encoder(x, offsets, MAX_LEN + 1, AttentionMask())
    assert model.encoder(x, offsets, MAX_LEN, AttentionMask()).shape == (3, 16)


def test_train_mode_backward() -> None:
    model = make_model().train()
    batch = make_batch(3)
    model(batch).sum().backward()
    block = model.encoder.blocks[0]
    assert block.pos_weights.grad is not None and block.time_weights.grad is not None
    assert torch.isfinite(block.uvqk.weight.grad).all()


def test_batch_of_empty_sequences() -> None:
    model = make_model()
    out = model.encoder(torch.zeros(0, 16, dtype=torch.float64), torch.zeros(3, dtype=torch.int64), 1, AttentionMask())
    assert out.shape == (0, 16)


@pytest.mark.parametrize("residual_dtype", ["float32", "compute", "auto"])
def test_residual_dtype_under_autocast(residual_dtype: str) -> None:
    """``residual_dtype=compute`` (and the default ``auto``, under bfloat16) carries the stream in the autocast dtype
    (bfloat16 here: the blocks' outputs and the input's gradient), ``float32`` keeps autocast's float32 stream; all
    close to the float32 encoder, and nothing changes without autocast."""
    torch.manual_seed(int(torch.randint(0, 2**30, ())))
    cfg = HSTUConfig(dim=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0, max_seq_len=MAX_LEN,
                     num_time_buckets=0, residual_dtype=residual_dtype)  # fmt: skip
    encoder = HSTUEncoder(cfg)
    offsets = _offsets(LENGTHS)
    x = torch.randn(sum(LENGTHS), 16, requires_grad=True)
    expected = encoder(x, offsets, MAX_LEN, AttentionMask())
    assert expected.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = encoder(x, offsets, MAX_LEN, AttentionMask())
    assert y.dtype == (torch.float32 if residual_dtype == "float32" else torch.bfloat16)
    torch.testing.assert_close(y.float(), expected, rtol=0.05, atol=0.05)
    (grad,) = torch.autograd.grad(y.float().sum(), x)
    (grad_ref,) = torch.autograd.grad(expected.sum(), x)
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
    torch.testing.assert_close(grad, grad_ref, rtol=0.1, atol=0.1)


@pytest.mark.parametrize(("residual_dtype", "autocast_dtype", "cast"), [
    ("auto", torch.float16, None), ("compute", torch.float16, torch.float16),
    ("auto", torch.bfloat16, torch.bfloat16), ("float32", torch.bfloat16, None)])  # fmt: skip
def test_residual_stream_dtype(residual_dtype: str, autocast_dtype: torch.dtype, cast: torch.dtype | None) -> None:
    """``auto`` leaves the float32 stream under float16 autocast (float16's range; ``compute`` casts anyway) and casts
    to bfloat16 under bfloat16; ``encode`` (serving's path) casts as ``forward`` does."""
    assert residual_stream_dtype(residual_dtype, "cpu") is None  # no autocast, no cast
    with torch.autocast("cpu", dtype=autocast_dtype):
        assert residual_stream_dtype(residual_dtype, "cpu") == cast
        cfg = HSTUConfig(dim=16, num_blocks=1, num_heads=2, dqk=8, dv=8, dropout=0.0, max_seq_len=MAX_LEN,
                         num_time_buckets=0, residual_dtype=residual_dtype)  # fmt: skip
        x = torch.randn(sum(LENGTHS), 16)
        y = HSTUEncoder(cfg).eval().encode(x, lambda layer, block, q, k, v: v)
    assert y.dtype == (cast or torch.float32)


def test_residual_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="residual_dtype"):
        HSTUEncoder(HSTUConfig(residual_dtype="bfloat16"))
