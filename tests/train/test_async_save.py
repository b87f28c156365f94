"""Checkpoints written off the training thread: the host snapshot and the background writer."""

import pytest
import torch

from recforge.checkpoint import load_checkpoint, save_checkpoint
from recforge.train.async_save import BackgroundWriter, host_snapshot


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
