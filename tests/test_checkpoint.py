"""Tests for safetensors checkpoints: round trip, pointers, pruning, atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from recforge import checkpoint as ckpt_mod
from recforge.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from recforge.config import ModelConfig
from recforge.models.builders import build_retrieval_model


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.1)


def _batch(step: int, data_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(data_seed * 1000 + step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, data_seed: int) -> None:
    x, y = _batch(step, data_seed)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _step_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())


def test_round_trip_model_and_adamw_continues_identically(tmp_path: Path) -> None:
    data_seed = int(torch.randint(0, 10_000, ()).item())
    model = _model()
    opt = _optimizer(model)
    for step in range(3):
        _step(model, opt, step, data_seed)
    path = save_checkpoint(tmp_path, step=3, model=model, optimizer=opt, manifest={"epoch": 1, "note": "hi"})
    assert path == tmp_path / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.safetensors", "optimizer.safetensors"]

    restored = _model()  # different random init
    restored_opt = _optimizer(restored)
    manifest = load_checkpoint(path, restored, restored_opt)
    assert manifest["step"] == 3 and manifest["epoch"] == 1 and manifest["note"] == "hi"
    assert manifest["files"] == {"model": "model.safetensors", "optimizer": "optimizer.safetensors"}
    _assert_same_params(model, restored)

    # optimizer state is identical, step counts included
    sa, sb = opt.state_dict(), restored_opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for index in sa["state"]:
        for key, value in sa["state"][index].items():
            assert torch.equal(value, sb["state"][index][key]), (index, key)
            assert value.device == sb["state"][index][key].device
    assert sb["param_groups"][0]["lr"] == 1e-2 and sb["param_groups"][0]["weight_decay"] == 0.1
    assert tuple(sb["param_groups"][0]["betas"]) == (0.9, 0.98)

    # the next steps are bit-identical to the uninterrupted optimizer
    for step in range(3, 5):
        _step(model, opt, step, data_seed)
        _step(restored, restored_opt, step, data_seed)
        _assert_same_params(model, restored)


def test_round_trip_tiny_hstu_weights_only(tmp_path: Path) -> None:
    cfg = ModelConfig(kind="hstu", dim=16, num_blocks=1, num_heads=1, dqk=8, dv=8, dropout=0.0)
    torch.manual_seed(int(torch.randint(0, 1000, ()).item()))
    model = build_retrieval_model(cfg, num_items=30, max_seq_len=20)
    path = save_checkpoint(tmp_path, step=7, model=model, optimizer=None, manifest={})
    assert not (path / "optimizer.safetensors").exists()
    other = build_retrieval_model(cfg, num_items=30, max_seq_len=20)
    manifest = load_checkpoint(path, other)
    assert "optimizer" not in manifest["files"]
    _assert_same_params(model, other)
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))


def test_latest_and_best_pointers(tmp_path: Path) -> None:
    model = _model()
    assert find_checkpoint(tmp_path) is None
    assert find_checkpoint(tmp_path, "best") is None
    save_checkpoint(tmp_path, step=1, model=model, optimizer=None, manifest={}, keep=10)
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000001"
    assert find_checkpoint(tmp_path, "best") is None
    save_checkpoint(tmp_path, step=2, model=model, optimizer=None, manifest={}, keep=10, best=True)
    save_checkpoint(tmp_path, step=3, model=model, optimizer=None, manifest={}, keep=10)
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000003"
    assert find_checkpoint(tmp_path, "best") == tmp_path / "checkpoints" / "step_00000002"
    assert json.loads((tmp_path / "checkpoints" / "latest.json").read_text()) == {"step_dir": "step_00000003"}
    assert json.loads((tmp_path / "checkpoints" / "best.json").read_text()) == {"step_dir": "step_00000002"}


def test_pruning_keeps_recent_and_best(tmp_path: Path) -> None:
    model = _model()
    opt = _optimizer(model)
    _step(model, opt, 0, 0)
    for step in range(1, 7):
        save_checkpoint(tmp_path, step=step, model=model, optimizer=opt, manifest={}, keep=2, best=step == 2)
    assert _step_dirs(tmp_path) == ["step_00000002", "step_00000005", "step_00000006"]
    load_checkpoint(find_checkpoint(tmp_path, "best"), _model(), _optimizer(_model()))
    # the best pointer moves: the old best becomes prunable
    save_checkpoint(tmp_path, step=7, model=model, optimizer=opt, manifest={}, keep=2, best=True)
    assert _step_dirs(tmp_path) == ["step_00000006", "step_00000007"]
    save_checkpoint(tmp_path, step=8, model=model, optimizer=opt, manifest={}, keep=1)
    assert _step_dirs(tmp_path) == ["step_00000007", "step_00000008"]  # best (7) + latest (8)


def test_resaving_the_same_step_replaces_it(tmp_path: Path) -> None:
    model = _model()
    save_checkpoint(tmp_path, step=4, model=model, optimizer=None, manifest={"v": 1})
    with torch.no_grad():
        model[0].weight.add_(1.0)
    save_checkpoint(tmp_path, step=4, model=model, optimizer=None, manifest={"v": 2})
    other = _model()
    assert load_checkpoint(find_checkpoint(tmp_path), other)["v"] == 2
    _assert_same_params(model, other)


@pytest.mark.parametrize("fail_on", ["model.safetensors", "optimizer.safetensors"])
def test_failed_save_leaves_previous_checkpoint_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_on: str) -> None:
    model = _model()
    opt = _optimizer(model)
    _step(model, opt, 0, 1)
    save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, manifest={"epoch": 0})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, 1, 1)

    real_save_file = ckpt_mod.save_file

    def flaky_save_file(tensors, filename, *args, **kwargs):
        if Path(filename).name == fail_on:
            Path(filename).write_bytes(b"partial")  # a half-written file
            raise OSError("disk full")
        return real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "save_file", flaky_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, step=2, model=model, optimizer=opt, manifest={"epoch": 0})

    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest.json", "step_00000001"]  # no partial or temp dir
    assert find_checkpoint(tmp_path) == root / "step_00000001"
    restored = _model()
    load_checkpoint(find_checkpoint(tmp_path), restored, _optimizer(restored))
    for k, v in restored.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_load_directory_without_manifest(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not a recforge checkpoint"):
        load_checkpoint(tmp_path, _model())
    with pytest.raises(ValueError, match="not a recforge checkpoint"):
        load_checkpoint(tmp_path / "missing", _model())


def test_load_unsupported_format_version(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, step=1, model=_model(), optimizer=None, manifest={})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 999
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format 999 is not supported"):
        load_checkpoint(path, _model())


def test_pruning_removes_what_crashed_saves_left(tmp_path: Path) -> None:
    """A crash between the sharded-sparse save and the checkpoint leaves ``.sparse-<step>`` (and temporary
    directories); the next completed save deletes them."""
    root = tmp_path / "checkpoints"
    leftovers = [root / ".sparse-00000004", root / ".step_00000004.tmp-abc", root / "..sparse-00000006.tmp-x1"]
    for path in leftovers:
        (path / "inner").mkdir(parents=True)
    model = _model()
    save_checkpoint(tmp_path, step=5, model=model, optimizer=None, manifest={}, keep=2)
    assert not any(path.exists() for path in leftovers)
    assert _step_dirs(tmp_path) == ["step_00000005"]


def _two_checkpoints(tmp_path: Path) -> tuple[nn.Module, Path, Path]:
    model = _model()
    first = save_checkpoint(tmp_path, step=1, model=model, optimizer=None, manifest={"train_state": {}})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    second = save_checkpoint(tmp_path, step=2, model=model, optimizer=None, manifest={"train_state": {}})
    return model, first, second


def test_checkpoints_follow_the_umask(tmp_path: Path) -> None:
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path, step=1, model=_model(), optimizer=_optimizer(_model()), manifest={})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    for name in ("model.safetensors", "optimizer.safetensors", "manifest.json"):
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o644, name
    assert stat.S_IMODE((tmp_path / "checkpoints" / "latest.json").stat().st_mode) == 0o644


def test_a_truncated_checkpoint_names_the_file_and_the_others(tmp_path: Path) -> None:
    _, first, second = _two_checkpoints(tmp_path)
    weights = second / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ckpt_mod.CorruptCheckpointError) as err:
        load_checkpoint(second, _model())
    assert str(weights) in str(err.value) and first.name in str(err.value)
    candidates, warnings = ckpt_mod.resume_candidates(tmp_path)
    assert candidates == [second, first] and warnings == []


def test_a_corrupt_latest_pointer_is_named_and_resume_falls_back(tmp_path: Path) -> None:
    _, first, second = _two_checkpoints(tmp_path)
    pointer = tmp_path / "checkpoints" / "latest.json"
    pointer.write_text('{"step_dir": "step_000')
    with pytest.raises(ckpt_mod.CorruptCheckpointError, match=str(pointer)):
        find_checkpoint(tmp_path)
    candidates, warnings = ckpt_mod.resume_candidates(tmp_path)
    assert candidates == [second, first] and len(warnings) == 1 and str(pointer) in warnings[0]
    pointer.write_text('{"step_dir": "step_00000099"}')  # dangling
    candidates, warnings = ckpt_mod.resume_candidates(tmp_path)
    assert candidates == [second, first] and "does not exist" in warnings[0]


def test_a_checkpoint_of_another_shape_names_the_tensors(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, step=1, model=_model(), optimizer=None, manifest={})
    wider = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    with pytest.raises(ckpt_mod.CheckpointMismatchError, match=r"0\.weight: saved \(8, 6\), model \(16, 6\)"):
        load_checkpoint(path, wider)


def test_resume_keeps_this_runs_optimizer_implementation(tmp_path: Path) -> None:
    """A checkpoint written by a non-fused AdamW (older CPU runs, FSDP2) resumes into a fused one with the saved
    state and hyperparameters but still fused (the saved ``fused=None`` used to turn the fused kernel off)."""
    model = torch.nn.Linear(5, 3)
    old = torch.optim.AdamW(model.parameters(), lr=float(torch.rand(())) * 1e-2, fused=None)
    model(torch.randn(4, 5)).square().sum().backward()
    old.step()
    path = save_checkpoint(tmp_path, step=1, model=model, optimizer=old, manifest={})
    new = torch.optim.AdamW(model.parameters(), lr=1.0, fused=True)
    load_checkpoint(path, model, new)
    group = new.param_groups[0]
    assert group["fused"] is True and group["lr"] == old.param_groups[0]["lr"]
    for p in model.parameters():
        torch.testing.assert_close(new.state[p]["exp_avg"], old.state[p]["exp_avg"], rtol=0, atol=0)
    model(torch.randn(4, 5)).square().sum().backward()
    new.step()  # the fused kernel runs on the loaded state
