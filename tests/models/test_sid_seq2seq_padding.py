"""SIDSeq2Seq with left-padded histories: padded key lengths and the kernel choice change no answer."""

from __future__ import annotations

import pytest
import torch

from recforge.models import sid_seq2seq
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq

L, V = 3, 11


def _model(dtype: torch.dtype = torch.float64) -> SIDSeq2Seq:
    cfg = Seq2SeqConfig(num_levels=L, vocab_size=V, dim=32, encoder_layers=2, decoder_layers=2, num_heads=4, ffn_dim=64,
                        dropout=0.0, max_items=40)  # fmt: skip
    return SIDSeq2Seq(cfg).to(dtype).eval()


def _requests(g: torch.Generator, b: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Histories of distinct lengths (at least one not a multiple of KEY_ALIGN tokens), left-padded."""
    lengths = (torch.randperm(35, generator=g)[:b] + 1).tolist()
    lengths[0] = 7  # 21 tokens: padded to 32
    width = max(lengths)
    codes = torch.randint(V, (b, width, L), generator=g)
    mask = torch.arange(width)[None] >= width - torch.tensor(lengths)[:, None]
    target = torch.randint(V, (b, L), generator=g)
    return codes, mask, target, lengths


def _beams(g: torch.Generator, b: int, w: int = 4) -> torch.Tensor:
    return torch.randint(V, (b, w, L - 1), generator=g)


@pytest.mark.parametrize("seed", range(3))
def test_padded_batch_equals_each_request_alone(seed: int) -> None:
    g = torch.Generator().manual_seed(1000 + seed + int(torch.randint(1 << 20, (1,))))
    torch.manual_seed(seed)
    model = _model()
    codes, mask, target, lengths = _requests(g)
    beams = _beams(g, len(lengths))
    with torch.no_grad():
        memory = model.start(codes, mask)
        s = memory.kv[0][0].shape[2]
        assert s % sid_seq2seq.KEY_ALIGN == 0 and s >= max(lengths) * L
        assert memory.key_mask.shape == (len(lengths), 1, 1, s)
        assert memory.key_mask.sum((1, 2, 3)).tolist() == [n * L for n in lengths]
        for t in range(L):
            together = model.next_token_logprobs(memory, beams[:, :, :t])
            for b, n in enumerate(lengths):
                alone = model.next_token_logprobs(model.start(codes[b : b + 1, -n:], None), beams[b : b + 1, :, :t])
                torch.testing.assert_close(together[b : b + 1], alone, rtol=1e-9, atol=1e-9)
        # training: the batch loss is the mean of the requests' losses (each a mean over its L digits)
        alone = torch.stack([model.loss(codes[b : b + 1, -n:], None, target[b : b + 1]) for b, n in enumerate(lengths)])
        torch.testing.assert_close(model.loss(codes, mask, target), alone.mean(), rtol=1e-6, atol=1e-6)  # float32 loss


def test_key_padding_and_kernel_choice_change_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The new layout (keys padded to KEY_ALIGN, cuDNN excluded) against PyTorch's defaults, unpadded."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    model = _model(torch.float32)
    codes, mask, target, lengths = _requests(g, b=6)
    beams = _beams(g, len(lengths), w=8)
    with torch.no_grad():
        new_memory = model.start(codes, mask)
        new = [model.next_token_logprobs(new_memory, beams[:, :, :t]) for t in range(L)]
        new_loss = model.loss(codes, mask, target)
        monkeypatch.setattr(sid_seq2seq, "KEY_ALIGN", 1)
        monkeypatch.setattr(sid_seq2seq, "SDPA_BACKENDS", None)
        old_memory = model.start(codes, mask)
        assert old_memory.kv[0][0].shape[2] == codes.shape[1] * L  # unpadded
        for t in range(L):
            torch.testing.assert_close(new[t], model.next_token_logprobs(old_memory, beams[:, :, :t]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_loss, model.loss(codes, mask, target), rtol=1e-6, atol=1e-6)


def test_training_gradients_do_not_see_padding() -> None:
    """A padded batch's gradients equal the sum of its requests' (loss scaled to one request each)."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    model = _model()
    codes, mask, target, lengths = _requests(g, b=3)
    model.loss(codes, mask, target).backward()
    together = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for b, n in enumerate(lengths):
        (model.loss(codes[b : b + 1, -n:], None, target[b : b + 1]) / len(lengths)).backward()
    for name_param, want in zip(model.named_parameters(), together, strict=True):
        name, p = name_param
        got = p.grad if p.grad is not None else torch.zeros_like(want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.gpu
def test_cuda_padded_batch_skips_cudnn_and_matches_alone(cuda_device: torch.device) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    model = _model(torch.bfloat16).to(cuda_device)
    codes, mask, _, lengths = _requests(g)
    beams = _beams(g, len(lengths)).to(cuda_device)
    codes, mask = codes.to(cuda_device), mask.to(cuda_device)
    with torch.no_grad():
        memory = model.start(codes, mask)
        q = torch.randn(len(lengths), 4, 64, 8, device=cuda_device, dtype=torch.bfloat16)
        k = memory.kv[0][0]
        with sid_seq2seq._kernels(torch.device("cuda")):
            choice = torch._fused_sdp_choice(q, k, k, memory.key_mask)
        assert choice != int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
        together = model.next_token_logprobs(memory, beams)
        for b, n in enumerate(lengths):
            alone = model.next_token_logprobs(model.start(codes[b : b + 1, -n:], None), beams[b : b + 1])
            torch.testing.assert_close(together[b : b + 1], alone, rtol=0.05, atol=0.05)  # bf16 rounding


@pytest.mark.slow
def test_compiled_loss_with_dynamic_lengths_equals_eager() -> None:
    """``train.compile`` (dynamic shapes) traces the padded encoder: same loss as eager for two lengths."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    model = _model(torch.float32)
    compiled = torch.compile(model.loss, dynamic=True)
    for b in (5, 3):
        codes, mask, target, _ = _requests(g, b=b)
        torch.testing.assert_close(compiled(codes, mask, target), model.loss(codes, mask, target), rtol=1e-5, atol=1e-5)


def test_kernel_choice_flips_no_process_flags_where_it_changes_nothing(monkeypatch) -> None:
    """``sdpa_kernel`` sets process-wide flags: never entered on CPU, nor once cuDNN attention is off
    (a serving process turns it off at start, so its threads never flip the flags under each other)."""
    entered = []
    monkeypatch.setattr(sid_seq2seq, "sdpa_kernel", lambda backends: entered.append(backends))
    with sid_seq2seq._kernels(torch.device("cpu")):
        pass
    assert entered == []
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        sid_seq2seq._kernels(torch.device("cuda"))  # cuDNN on: the context chooses the kernels
        assert entered == [sid_seq2seq.SDPA_BACKENDS]
        sid_seq2seq.disable_cudnn_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        with sid_seq2seq._kernels(torch.device("cuda")):  # cuDNN off: nothing to change, no flip
            pass
        assert len(entered) == 1
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_folded_key_mask_equals_the_masked_attention(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """``attention`` with the mask folded into the head dimension (forced on here; on its own only on CUDA in
    half precision) gives masked SDPA's output: masked keys get no weight, the scale is the real head's."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    b, heads, q_len, s, dh = 3, 2, 5, 24, 8
    q, k, v = (torch.randn(b, heads, n, dh, generator=g).to(dtype) for n in (q_len, s, s))
    start = torch.randint(0, s - 1, (b,), generator=g)  # left padding; every row keeps a real key
    mask = (torch.arange(s)[None] >= start[:, None]).view(b, 1, 1, s)
    k = torch.where(mask.view(b, 1, s, 1), k, torch.full_like(k, 1e3))  # masked keys that would dominate if read
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    monkeypatch.setattr(sid_seq2seq, "fold_key_mask", lambda q: True)
    got = sid_seq2seq.attention(q, k, v, mask)
    assert got.shape == q.shape and got.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
    assert sid_seq2seq.attention(q, k, v, None).equal(torch.nn.functional.scaled_dot_product_attention(q, k, v))
    one = mask[:1].expand(b, 1, 1, s).contiguous()[:1]  # a mask of batch 1 broadcasts over the keys' batch, as in SDPA
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=one)
    torch.testing.assert_close(sid_seq2seq.attention(q, k, v, one).double(), expected, rtol=tol, atol=tol)


def test_folded_key_mask_leaves_the_model_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole model, folded vs masked, on a padded batch: same log-probabilities (float64)."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    model = _model()
    codes, mask, _, lengths = _requests(g)
    beams = _beams(g, len(lengths))
    with torch.no_grad():
        masked = model.next_token_logprobs(model.start(codes, mask), beams)
        monkeypatch.setattr(sid_seq2seq, "fold_key_mask", lambda q: True)
        folded = model.next_token_logprobs(model.start(codes, mask), beams)
    torch.testing.assert_close(folded, masked, rtol=1e-9, atol=1e-9)


def test_the_mask_is_folded_only_at_bfloat16_inference_on_cuda() -> None:
    q = torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        assert not sid_seq2seq.fold_key_mask(q)  # CPU
    if torch.cuda.is_available():
        with torch.no_grad():
            assert sid_seq2seq.fold_key_mask(q.cuda()) and not sid_seq2seq.fold_key_mask(q.cuda().float())
            assert not sid_seq2seq.fold_key_mask(q.cuda().half())
        assert not sid_seq2seq.fold_key_mask(q.cuda())  # autograd on: training keeps the masked kernel
