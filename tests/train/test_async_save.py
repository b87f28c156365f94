"""Checkpoints written off the training thread: the host snapshot and the background writer."""

import pytest
import torch

from recforge.checkpoint import load_checkpoint, save_checkpoint
from recforge.train.async_save import BackgroundWriter, HostBuffers, host_snapshot, host_snapshot_reference


def _model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 5)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def test_snapshot_is_a_copy_that_later_steps_do_not_change(tmp_path):
    model, optimizer = _model_and_optimizer()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    weights, optimizer_state = host_snapshot(model, optimizer)
    model(torch.randn(3, 5)).square().sum().backward()
    optimizer.step()  # in place: a snapshot aliasing the live tensors would change too
    assert any(not torch.equal(expected[k], v) for k, v in model.state_dict().items())
    for key, value in expected.items():
        assert torch.equal(weights[key], value)
    assert torch.equal(optimizer_state["state"][0]["exp_avg"], moments)
    writer = BackgroundWriter()
    writer.submit(lambda: save_checkpoint(tmp_path, step=1, model=model, optimizer=optimizer, manifest={},
                                          weights=weights, optimizer_state=optimizer_state))  # fmt: skip
    writer.wait()
    fresh, _ = _model_and_optimizer()
    load_checkpoint(tmp_path / "checkpoints" / "step_00000001", fresh)
    for key, value in expected.items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_writes_run_in_order_and_a_failure_is_raised_by_the_next_call():
    writer, done = BackgroundWriter(), []
    for i in range(3):
        writer.submit(lambda i=i: done.append(i))
    writer.wait()
    assert done == [0, 1, 2]

    def fail():
        raise OSError("disk full")

    writer.submit(fail)
    with pytest.raises(RuntimeError, match="writing a checkpoint failed: OSError: disk full"):
        writer.submit(lambda: done.append(3))
    assert done == [0, 1, 2]  # the write after a failure does not start
    writer.wait()  # the error was raised once


def _assert_same(new, old) -> None:
    """Equal structure, and every tensor equal bit for bit (dtype, shape, bytes), on the host."""
    assert type(new) is type(old)
    if torch.is_tensor(old):
        assert new.device.type == "cpu" and new.dtype == old.dtype and new.shape == old.shape
        assert torch.equal(new.reshape(-1).view(torch.uint8), old.reshape(-1).view(torch.uint8))
    elif isinstance(old, dict):
        assert new.keys() == old.keys()
        for key in old:
            _assert_same(new[key], old[key])
    elif isinstance(old, list | tuple):
        assert len(new) == len(old)
        for a, b in zip(new, old, strict=True):
            _assert_same(a, b)
    else:
        assert new == old


def _train_step(model, optimizer, device) -> None:
    model(torch.randn(7, 5, device=device)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _check_reused_buffers_equal_the_old_path(device: torch.device, tmp_path) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3)).to(device)
    model.register_buffer("counts", torch.arange(4, dtype=torch.int64, device=device))
    model.register_buffer("strided", torch.randn(4, 3, device=device).t())  # a non-contiguous state entry
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=device.type == "cuda")
    buffers = HostBuffers()
    _train_step(model, optimizer, device)
    first = host_snapshot(model, optimizer, buffers)
    _assert_same(first, host_snapshot_reference(model, optimizer))
    pinned = [t for t in first[0].values()]
    assert all(t.is_pinned() == (device.type == "cuda") for t in pinned)
    held = buffers.nbytes
    _train_step(model, optimizer, device)  # changes every weight and moment in place
    second = host_snapshot(model, optimizer, buffers)
    _assert_same(second, host_snapshot_reference(model, optimizer))
    assert buffers.nbytes == held  # nothing allocated again: the same host tensors, overwritten
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first[0].values(), second[0].values(), strict=True))
    # the checkpoint files hold the same bytes as one written from the old path's copies
    for name, (weights, state) in (("new", second), ("old", host_snapshot_reference(model, optimizer))):
        save_checkpoint(tmp_path / name, step=2, model=model, optimizer=optimizer, manifest={}, weights=weights,
                        optimizer_state=state)  # fmt: skip
    for file in ("model.safetensors", "optimizer.safetensors"):
        new = (tmp_path / "new" / "checkpoints" / "step_00000002" / file).read_bytes()
        assert new == (tmp_path / "old" / "checkpoints" / "step_00000002" / file).read_bytes(), file


def test_reused_buffers_give_the_old_path_bytes_on_cpu(tmp_path):
    _check_reused_buffers_equal_the_old_path(torch.device("cpu"), tmp_path)


def test_a_snapshot_is_never_an_alias_of_a_live_cpu_tensor():
    model, optimizer = _model_and_optimizer()
    weights, state = host_snapshot(model, optimizer, HostBuffers())
    live = [t.data_ptr() for t in model.state_dict().values()]
    live += [t.data_ptr() for s in optimizer.state_dict()["state"].values() for t in s.values()]
    copies = [t.data_ptr() for t in weights.values()] + [t.data_ptr() for s in state["state"].values() for t in s.values()]
    assert not set(live) & set(copies)


@pytest.mark.gpu
def test_reused_pinned_buffers_give_the_old_path_bytes_on_cuda(cuda_device, tmp_path):
    _check_reused_buffers_equal_the_old_path(cuda_device, tmp_path)
