"""GPU runs of the models match the CPU (run with `pytest -m gpu` on a CUDA machine)."""

from __future__ import annotations

import pytest
import torch

from recforge.config import ModelConfig
from recforge.data.batch import JaggedBatch
from recforge.models.builders import build_retrieval_model
from recforge.ops.jagged import offsets_from_lengths

pytestmark = pytest.mark.gpu


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
    out_cpu.square().sum().backward()
    out_gpu.square().sum().backward()
    for (name, p_cpu), p_gpu in zip(cpu_model.named_parameters(), gpu_model.parameters(), strict=True):
        if p_cpu.grad is not None:
            torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-7, atol=1e-9, msg=name)
