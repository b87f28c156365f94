"""GPU runs of the models match the CPU (run with `pytest -m gpu` on a CUDA machine)."""

from __future__ import annotations

import pytest
import torch
from _oracles import relative_error

from recforge.config import ModelConfig
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import offsets_from_lengths
from recforge.models.builders import build_retrieval_model

pytestmark = pytest.mark.gpu


def _probe_loss(out: torch.Tensor, seed: int) -> torch.Tensor:
    """A loss whose gradients are the model's: the outputs are unit vectors (the L2-normalising postfix), so
    ``out.square().sum()`` is the constant token count and every gradient of it only rounding noise."""
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (out * probe.to(out.device, out.dtype)).sum()


def _assert_informative(grads: dict) -> None:
    """The compared gradients are not noise around zero (the item table's reaches the loss through every block)."""
    norm = float(grads["prefix.item_embedding.weight"].norm())
    assert norm > 1e-3, f"the item table's gradient is {norm:.1e}: the test compares rounding noise"


@pytest.mark.parametrize("kind", ["hstu", "sasrec"])
def test_forward_and_gradients_match_cpu(kind: str, cuda_device: torch.device) -> None:
    torch.manual_seed(torch.seed() % 2**31)
    lengths = torch.randint(1, 40, (6,))
    offsets = offsets_from_lengths(lengths)
    total = int(offsets[-1])
    features = {"item_ids": torch.randint(1, 101, (total,)), "timestamps": torch.randint(0, 10**6, (total,)).sort().values}
    batch = JaggedBatch(offsets, features, 40)
    cfg = ModelConfig(kind=kind, dim=32, num_blocks=2, num_heads=2, dqk=16, dv=16, ffn_dim=32, dropout=0.0)
    cpu_model = build_retrieval_model(cfg, 100, 40).double()
    gpu_model = build_retrieval_model(cfg, 100, 40).double().to(cuda_device)
    gpu_model.load_state_dict(cpu_model.state_dict())
    out_cpu = cpu_model(batch)
    out_gpu = gpu_model(batch.to(cuda_device))
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-9, atol=1e-9)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    _probe_loss(out_cpu, seed).backward()
    _probe_loss(out_gpu, seed).backward()
    _assert_informative({n: p.grad for n, p in cpu_model.named_parameters()})
    for (name, p_cpu), p_gpu in zip(cpu_model.named_parameters(), gpu_model.parameters(), strict=True):
        if p_cpu.grad is not None:
            torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-7, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["hstu", "sasrec"])
def test_triton_kernel_matches_reference_in_model(kind: str, cuda_device: torch.device) -> None:
    """The same float32 model on GPU with kernel='triton' and kernel='pytorch': outputs and gradients."""
    pytest.importorskip("triton")
    torch.manual_seed(torch.seed() % 2**31)
    lengths = torch.randint(1, 40, (6,))
    offsets = offsets_from_lengths(lengths)
    total = int(offsets[-1])
    features = {"item_ids": torch.randint(1, 101, (total,)), "timestamps": torch.randint(0, 10**6, (total,)).sort().values}
    batch = JaggedBatch(offsets, features, 40).to(cuda_device)
    outs, grads = [], []
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for kernel in ("pytorch", "triton"):
        cfg = ModelConfig(kind=kind, dim=32, num_blocks=2, num_heads=2, dqk=16, dv=16, ffn_dim=32, dropout=0.0, kernel=kernel)
        torch.manual_seed(0)
        model = build_retrieval_model(cfg, 100, 40).to(cuda_device)
        out = model(batch)
        _probe_loss(out, seed).backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    _assert_informative(grads[0])
    for name in grads[0]:  # over the whole tensor: an entry that is a cancelling sum of larger terms (an item table
        # row) differs by rounding at the terms' scale, not its own (measured ~4e-7 on an H200)
        err = relative_error(grads[1][name], grads[0][name])
        assert err < 1e-5, f"{name}: relative error {err:.1e} between the Triton and PyTorch attention's gradients"


def test_ml1m_loss_curve_triton_matches_pytorch(cuda_device: torch.device) -> None:
    """ML-1M HSTU training steps with the Triton attention follow the reference loss curve."""
    pytest.importorskip("triton")
    from pathlib import Path

    from recforge.config import load_config
    from recforge.train.retrieval import _train_step, setup

    if not Path("data/ml-1m/dataset.json").is_file():
        pytest.skip("needs the prepared ML-1M dataset in data/ml-1m")
    steps = 200
    curves = {}
    for kernel in ("pytorch", "triton"):
        s = setup(load_config("configs/ml1m-hstu.yaml", [f"model.kernel={kernel}", "train.device=cuda"]))
        samples = s.seqs.training_samples(s.holdout, s.cfg.data.max_seq_len, s.cfg.data.train_windows)
        order = samples[torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(0))]
        bs = s.cfg.train.batch_size
        full_batches = samples.shape[0] // bs  # ML-1M: ~47 per epoch; later steps revisit them (epochs in one order)
        torch.manual_seed(1)
        curves[kernel] = []
        for i in range(steps):
            rows = order[(i % full_batches) * bs : (i % full_batches + 1) * bs]
            curves[kernel].append(_train_step(s, s.seqs.training_batch(rows, s.cfg.data.max_seq_len))[0])
    ref, got = torch.tensor(curves["pytorch"]), torch.tensor(curves["triton"])
    for i in range(0, steps, 20):
        print(f"step {i:4d}  loss pytorch {ref[i]:.5f}  triton {got[i]:.5f}")
    print(f"max |diff| over {steps} steps: {float((got - ref).abs().max()):.2e}; last-20 mean {float(ref[-20:].mean()):.5f} vs {float(got[-20:].mean()):.5f}")
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got)), "the two kernels' losses are not finite at the same steps"
    ref, got = ref[finite], got[finite]
    assert float((got - ref).abs().max()) < 0.02 * float(ref.abs().max())
    assert abs(float(got[-20:].mean() - ref[-20:].mean())) < 0.01 * float(ref[-20:].mean())
