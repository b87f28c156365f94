"""SID models: the beam-search decode path (shared history encoding) equals the training forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recforge.models.sid_hstu import SIDHSTU, SIDHSTUConfig
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq


def _batch(seed: int, b: int = 3, h: int = 5, L: int = 3, vocab: int = 7):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(vocab, (b, h, L), generator=g)
    mask = torch.ones(b, h, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    mask[2, :4] = False
    target = torch.randint(vocab, (b, L), generator=g)
    return codes, mask, target


def _models(L: int = 3, vocab: int = 7):
    torch.manual_seed(0)
    return [
        SIDSeq2Seq(Seq2SeqConfig(num_levels=L, vocab_size=vocab, dim=16, encoder_layers=2, decoder_layers=2, num_heads=2,
                                 ffn_dim=32, dropout=0.0, max_items=8)).double().eval(),
        SIDHSTU(SIDHSTUConfig(num_levels=L, vocab_size=vocab, dim=16, num_blocks=2, num_heads=2, dropout=0.0,
                              max_items=8, kernel="pytorch")).double().eval(),
    ]  # fmt: skip


@pytest.mark.parametrize("index", [0, 1], ids=["seq2seq", "hstu"])
def test_decode_path_matches_teacher_forced_loss(index: int) -> None:
    model = _models()[index]
    codes, mask, target = _batch(0)
    with torch.no_grad():
        memory = model.start(codes, mask)
        beams = torch.stack([target, torch.randint(7, target.shape, generator=torch.Generator().manual_seed(1))], 1)
        total = torch.zeros(3)
        for t in range(3):
            logp = model.next_token_logprobs(memory, beams[:, :, :t])  # (B, 2 beams, V)
            assert logp.shape == (3, 2, 7)
            total -= logp[:, 0].gather(1, target[:, t, None]).squeeze(1)
        if index == 0:  # seq2seq: the loss is exactly the mean digit cross-entropy of the target
            torch.testing.assert_close(model.loss(codes, mask, target), (total / 3).mean().float(), rtol=1e-5, atol=1e-6)
        else:  # hstu: the loss covers every item; check the target's digits against the full forward
            history = torch.cat([codes, target[:, None]], 1)
            full_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.bool)], 1)
            tokens, offsets, lengths = model._jagged(history, full_mask)
            hidden = model._hidden(tokens, offsets)
            want = torch.zeros(3)
            for b in range(3):
                end = int(offsets[b + 1])
                for t in range(3):
                    logits = hidden[end - 4 + t] @ model.heads[t].T
                    want[b] -= F.log_softmax(logits, -1)[target[b, t]]
            torch.testing.assert_close(total, want.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index", [0, 1], ids=["seq2seq", "hstu"])
def test_padding_does_not_change_a_request(index: int) -> None:
    model = _models()[index]
    codes, mask, target = _batch(2)
    with torch.no_grad():
        together = model.next_token_logprobs(model.start(codes, mask), target[:, None, :2])
        alone = model.next_token_logprobs(model.start(codes[2:, 4:], None), target[2:, None, :2])
    torch.testing.assert_close(together[2:], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_hstu_decode_on_gpu_matches_cpu(cuda_device: torch.device) -> None:
    """Triton kernel (history pass) + dense decode on the GPU vs the PyTorch reference on the CPU."""
    cpu = _models()[1].float()
    gpu = SIDHSTU(SIDHSTUConfig(num_levels=3, vocab_size=7, dim=16, num_blocks=2, num_heads=2, dropout=0.0, max_items=8,
                                kernel="auto")).to(cuda_device).eval()  # fmt: skip
    gpu.load_state_dict(cpu.state_dict())
    codes, mask, target = _batch(3)
    with torch.no_grad():
        want = cpu.next_token_logprobs(cpu.start(codes, mask), target[:, None, :2])
        got = gpu.next_token_logprobs(gpu.start(codes.to(cuda_device), mask.to(cuda_device)), target[:, None, :2].to(cuda_device))
        loss_cpu, loss_gpu = cpu.loss(codes, mask, target), gpu.loss(codes.to(cuda_device), mask.to(cuda_device), target.to(cuda_device))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(loss_gpu.cpu(), loss_cpu, rtol=1e-3, atol=1e-3)
