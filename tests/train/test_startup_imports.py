"""Start-up of ``recforge train``: what a plain run imports, and the optimizer that keeps it from importing more."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train import runtime
from recforge.train.runtime import EagerAdamW

ROOT = Path(__file__).resolve().parents[2]
# seconds of start-up each (torch._dynamo pulls in torch._inductor, sympy and triton), none needed by an eager run
NOT_IMPORTED = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.tensor",
                "pandas", "pyarrow.compute", "fastapi")  # and pandas (pyarrow's to_numpy), pyarrow.compute, serving


def test_plain_cpu_run_imports_no_dynamo(tmp_path: Path) -> None:
    synthetic = SyntheticConfig(num_users=40, num_items=50, num_clusters=4, mean_seq_len=8, min_seq_len=3,
                                max_seq_len=20, seed=3)  # fmt: skip
    data = write_synthetic(tmp_path / "synth", synthetic)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "name": "startup-tiny", "data": {"path": str(data), "protocol": "paper", "max_seq_len": 16},
        "model": {"kind": "hstu", "dim": 16, "num_blocks": 1, "num_heads": 1, "dqk": 8, "dv": 8, "dropout": 0.1},
        "loss": {"negatives": "per_position", "num_negatives": 8},
        "train": {"epochs": 1, "batch_size": 8, "eval_every": 0, "max_steps": 2, "output_dir": str(tmp_path / "run"),
                  "device": "cpu", "threads": 1, "compile": "none"},
    }))  # fmt: skip
    script = ("import json, sys\nfrom recforge.cli import main\n"
              f"code = main(['--quiet', 'train', {str(config)!r}])\n"
              f"imported = [m for m in {NOT_IMPORTED!r} if m in sys.modules]\n"
              "print(json.dumps({'code': code, 'imported': imported}))")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints").is_dir()  # the run trained, saved and evaluated a checkpoint
    assert result["imported"] == [], f"a plain CPU run (train.compile=none) imported {result['imported']}"


def _train(optimizer_cls, fused: bool | None, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.SiLU(), torch.nn.Linear(12, 3))
    optimizer = optimizer_cls(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1, fused=fused)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(4):
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(16, 6, generator=gen)
        model(x).square().mean().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("dynamo_loaded", [False, True])
@pytest.mark.parametrize("fused", [True, None])
def test_eager_adamw_equals_torch_adamw(monkeypatch: pytest.MonkeyPatch, dynamo_loaded: bool, fused: bool | None):
    """Both paths (torch's undecorated methods; torch's own once torch._dynamo is loaded): torch's update and state."""
    monkeypatch.setattr(runtime, "_dynamo_loaded", lambda: dynamo_loaded)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    ours, ours_opt = _train(EagerAdamW, fused, seed)
    theirs, theirs_opt = _train(torch.optim.AdamW, fused, seed)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad)
    ours_state, theirs_state = ours_opt.state_dict(), theirs_opt.state_dict()
    assert ours_state["param_groups"] == theirs_state["param_groups"]
    for i, state in theirs_state["state"].items():
        assert all(torch.equal(ours_state["state"][i][k], v) for k, v in state.items())
    ours_opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in ours.parameters())
    # torch's state dict loads into ours, and the next step (the same gradients) matches torch's
    ours_opt.load_state_dict(copy.deepcopy(theirs_state))  # a copy: loading keeps the very tensors it is given
    x = torch.randn(16, 6)
    for model, optimizer in ((ours, ours_opt), (theirs, theirs_opt)):
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()
        assert torch.is_grad_enabled()  # the step's no-grad mode is undone
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
