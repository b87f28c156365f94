"""HSTU for long histories: checkpointed blocks (same loss and gradients as plain ones), visible-key counts without the dense mask."""

from __future__ import annotations

import pytest
import torch

from recforge.config import ConfigError, config_from_dict
from recforge.jagged import AttentionMask
from recforge.jagged.index import offsets_from_lengths, padding_index
from recforge.models import HSTUConfig, HSTUEncoder
from recforge.models.hstu import visible_key_counts
from recforge.models.builders import build_retrieval_model


def _encoders(checkpoint_blocks: int, kernel: str, attn_norm: str, dtype: torch.dtype) -> tuple[HSTUEncoder, HSTUEncoder]:
    cfg = dict(dim=16, num_blocks=3, num_heads=2, dqk=8, dv=8, dropout=0.3, max_seq_len=24, num_time_buckets=16,
               kernel=kernel, attn_norm=attn_norm)  # fmt: skip
    plain = HSTUEncoder(HSTUConfig(**cfg)).to(dtype)
    with torch.no_grad():  # the biases start at zero; make them matter
        for block in plain.blocks:
            block.pos_weights.normal_()
            block.time_weights.normal_()
    ckpt = HSTUEncoder(HSTUConfig(**cfg, checkpoint_blocks=checkpoint_blocks)).to(dtype)
    ckpt.load_state_dict(plain.state_dict())
    return plain.train(), ckpt.train()


def _count_projections(blocks) -> list[int]:
    """A list that grows by one each time one of ``blocks`` runs its projection W_uvqk (module hooks do not
    see the recomputation)."""
    runs: list[int] = []
    for block in blocks:
        project = block.uvqk.forward
        block.uvqk.forward = lambda x, project=project: (runs.append(1), project(x))[1]
    return runs


def _run(encoder: HSTUEncoder, x: torch.Tensor, offsets: torch.Tensor, ts: torch.Tensor, seed: int):
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # the same dropout draws in both runs (and in the recomputation)
    out = encoder(x, offsets, 24, AttentionMask(), ts)
    loss = (out * torch.linspace(-1, 1, out.shape[1], dtype=out.dtype, device=out.device)).square().sum()
    loss.backward()
    return loss.detach(), x.grad, {n: p.grad for n, p in encoder.named_parameters()}


@pytest.mark.parametrize(
    ("kernel", "attn_norm", "checkpoint_blocks"),
    [("pytorch", "layernorm", 3), ("pytorch", "visible_mean", 2), ("pytorch", "layernorm", 1), ("triton", "layernorm", 3)],
)
def test_checkpointed_blocks_match_plain(kernel: str, attn_norm: str, checkpoint_blocks: int) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()))
    torch.manual_seed(seed)
    dtype = torch.float32 if kernel == "triton" else torch.float64  # the Triton interpreter takes float32
    lengths = torch.randint(0, 25, (5,))
    lengths[1] = 0  # an empty sequence in the jagged batch
    offsets = offsets_from_lengths(lengths)
    total = int(offsets[-1])
    x = torch.randn(total, 16, dtype=dtype)
    ts = 1_700_000_000 + torch.cumsum(torch.randint(1, 10_000, (total,)), 0)
    plain, ckpt = _encoders(checkpoint_blocks, kernel, attn_norm, dtype)
    runs = _count_projections(ckpt.blocks[:checkpoint_blocks])
    loss_p, dx_p, grads_p = _run(plain, x, offsets, ts, seed)
    loss_c, dx_c, grads_c = _run(ckpt, x, offsets, ts, seed)
    assert len(runs) == 2 * checkpoint_blocks  # forward once, recomputed once in backward
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(loss_c, loss_p, **tol)
    torch.testing.assert_close(dx_c, dx_p, **tol)
    for name, grad in grads_p.items():
        assert grad is not None, name
        torch.testing.assert_close(grads_c[name], grad, **tol, msg=name)


def test_no_recomputation_without_gradients() -> None:
    _, ckpt = _encoders(3, "pytorch", "layernorm", torch.float64)
    runs = _count_projections(ckpt.blocks[:1])
    x = torch.randn(6, 16, dtype=torch.float64)
    with torch.no_grad():
        ckpt(x, torch.tensor([0, 6]), 24, AttentionMask())
    ckpt.eval()(x.requires_grad_(True), torch.tensor([0, 6]), 24, AttentionMask()).sum().backward()
    assert len(runs) == 2  # once per call: neither no_grad nor eval mode checkpoints


@pytest.mark.parametrize(("value", "expected"), [(True, 4), (False, 0), (2, 2)])
def test_config_key_reaches_the_encoder(value: bool | int, expected: int) -> None:
    cfg = config_from_dict({"data": {"path": "x"}, "model": {"num_blocks": 4}}, [f"model.checkpoint_blocks={value}"])
    model = build_retrieval_model(cfg.model, 10, 8)
    assert model.encoder.cfg.checkpoint_blocks == expected


@pytest.mark.parametrize("value", ["-1", "all", "1.5"])
def test_config_rejects_bad_checkpoint_blocks(value: str) -> None:
    with pytest.raises(ConfigError, match="model.checkpoint_blocks"):
        config_from_dict({"data": {"path": "x"}}, [f"model.checkpoint_blocks={value}"])


@pytest.mark.gpu
def test_checkpointed_blocks_match_plain_on_gpu_bf16(cuda_device: torch.device) -> None:
    """The Triton kernels under bf16 autocast: checkpointed blocks recompute the same forward."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    lengths = torch.randint(1, 25, (6,))
    offsets = offsets_from_lengths(lengths).to(cuda_device)
    total = int(lengths.sum())
    x = torch.randn(total, 16, device=cuda_device)
    ts = (1_700_000_000 + torch.cumsum(torch.randint(1, 10_000, (total,)), 0)).to(cuda_device)
    plain, ckpt = (e.to(cuda_device) for e in _encoders(3, "triton", "layernorm", torch.float32))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_p, dx_p, grads_p = _run(plain, x, offsets, ts, 5)
        loss_c, dx_c, grads_c = _run(ckpt, x, offsets, ts, 5)
    tol = {"rtol": 2e-2, "atol": 2e-2}  # bf16 matmuls; the two runs differ only in atomics' summation order
    torch.testing.assert_close(loss_c, loss_p, **tol)
    torch.testing.assert_close(dx_c, dx_p, **tol)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_c[name], grad, **tol, msg=name)


@pytest.mark.parametrize("kind", ["causal", "window", "full", "full_window", "targets", "contextual_segments"])
def test_visible_key_counts_match_the_dense_mask(kind: str) -> None:
    """The O(T) closed form and the blockwise rows agree with summing the (B, N, N) reference mask."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    lengths = torch.randint(3, 30, (5,))
    lengths[2] = 0
    offsets = offsets_from_lengths(lengths)
    total, max_len = int(lengths.sum()), int(lengths.max())
    small = torch.minimum(lengths, torch.full_like(lengths, 2))
    mask = {
        "causal": AttentionMask(),
        "window": AttentionMask(max_attn_len=4),
        "full": AttentionMask(causal=False),
        "full_window": AttentionMask(causal=False, max_attn_len=3),
        "targets": AttentionMask(num_targets=small, timestamps=torch.randint(0, 5, (total,))),
        "contextual_segments": AttentionMask(num_contextual=small.clamp(max=1), segment_lengths=small.clamp(max=1).view(-1, 1),
                                             segment_full=(True,)),  # fmt: skip
    }[kind]
    seq, pos = padding_index(offsets, total)
    expected = mask.dense(offsets, max_len).sum(-1)[seq, pos]
    torch.testing.assert_close(visible_key_counts(offsets, max_len, mask, total, block=7), expected, rtol=0, atol=0)
