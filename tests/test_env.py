"""recforge.env: each variable is read when its function is called."""

from __future__ import annotations

import pytest

from recforge import env


def test_variables_are_read_at_call_time(monkeypatch) -> None:
    monkeypatch.delenv("RECFORGE_DATA", raising=False)
    monkeypatch.delenv(env.TRUSTED_SLICE_MODULES, raising=False)
    monkeypatch.delenv("RECFORGE_TRITON_LAUNCH_PLANS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert env.data_dir() is None and env.trusted_slice_modules() == set()
    assert env.triton_launch_plans() and not env.triton_interpret()
    monkeypatch.setenv("RECFORGE_DATA", "/tmp/d")
    monkeypatch.setenv(env.TRUSTED_SLICE_MODULES, " mypkg, other.sub ,")
    monkeypatch.setenv("RECFORGE_TRITON_LAUNCH_PLANS", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert env.data_dir() == "/tmp/d" and env.trusted_slice_modules() == {"mypkg", "other.sub"}
    assert not env.triton_launch_plans() and env.triton_interpret()


def test_launch_plans_switch_words(monkeypatch) -> None:
    for value, on in (("0", False), ("false", False), ("OFF", False), ("no", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("RECFORGE_TRITON_LAUNCH_PLANS", value)
        assert env.triton_launch_plans() is on, value
    monkeypatch.setenv("RECFORGE_TRITON_LAUNCH_PLANS", "of")  # a typo is refused, not read as on
    with pytest.raises(ValueError, match="RECFORGE_TRITON_LAUNCH_PLANS='of'"):
        env.triton_launch_plans()


def test_fused_norm_gate_on_unless_switched_off(monkeypatch) -> None:
    monkeypatch.delenv("RECFORGE_FUSED_NORM_GATE", raising=False)
    assert env.fused_norm_gate()
    for value, on in (("0", False), ("false", False), ("Off", False), ("no", False), ("1", True), ("on", True)):
        monkeypatch.setenv("RECFORGE_FUSED_NORM_GATE", value)
        assert env.fused_norm_gate() is on, value
    monkeypatch.setenv("RECFORGE_FUSED_NORM_GATE", "flase")
    with pytest.raises(ValueError, match="RECFORGE_FUSED_NORM_GATE='flase'"):
        env.fused_norm_gate()


def test_fused_gather_dot_switch(monkeypatch) -> None:
    monkeypatch.delenv("RECFORGE_FUSED_GATHER_DOT", raising=False)
    assert env.fused_gather_dot() is None  # unset: the float32-only default
    for value, on in (
        ("0", False),
        ("", None),
        ("off", False),
        ("1", True),
        ("TRUE", True),
        (" on ", True),
        ("yes", True),
    ):
        monkeypatch.setenv("RECFORGE_FUSED_GATHER_DOT", value)
        assert env.fused_gather_dot() is on, value
    monkeypatch.setenv("RECFORGE_FUSED_GATHER_DOT", "ture")
    with pytest.raises(ValueError, match="RECFORGE_FUSED_GATHER_DOT='ture'"):
        env.fused_gather_dot()


def test_hstu_fused_dq_switch(monkeypatch) -> None:
    monkeypatch.delenv("RECFORGE_HSTU_FUSED_DQ", raising=False)
    assert env.hstu_fused_dq() is None  # unset: the length rule (hstu.FUSED_DQ_AUTO_LEN)
    for value, on in (("1", True), ("on", True), ("0", False), ("no", False)):
        monkeypatch.setenv("RECFORGE_HSTU_FUSED_DQ", value)
        assert env.hstu_fused_dq() is on, value
    monkeypatch.setenv("RECFORGE_HSTU_FUSED_DQ", "2")
    with pytest.raises(ValueError, match="RECFORGE_HSTU_FUSED_DQ='2'"):
        env.hstu_fused_dq()
