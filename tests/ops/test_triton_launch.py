"""``tuning.launch``'s plans: a repeated launch calls the compiled kernel with the same arguments
Triton's launch path would give it, and anything Triton specializes on makes a new plan.

A fake kernel records what each path receives (these run on CPU; the GPU tests in
test_triton_attention.py run the real kernels through both paths)."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from recforge.ops.triton import tuning

NAMES = ["X", "n", "scale", "DOT_PREC", "BD_QK", "BD_V", "FLAG", "SPLIT_LOOPS", "BLOCK_M", "BLOCK_N"]


class _Compiled:
    """Stands in for triton's CompiledKernel: ``compiled[grid](*all_arguments)``."""

    function = object()

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        assert len(grid) == 3  # triton's CompiledKernel.__getitem__ reads grid[0], grid[1] and grid[2]
        return lambda *args: self.calls.append(("plan", grid, args))


class _JIT:
    arg_names = NAMES

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return _Compiled(self.calls)

        return run


class _Kernel:
    def __init__(self):
        self.calls: list = []
        self.fn = _JIT(self.calls)


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(tuning, "is_interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tuning, "plans", tuning._LaunchPlans())
    return _Kernel()


META = {"DOT_PREC": "ieee", "BD_QK": 32, "BD_V": 32, "FLAG": True}  # ieee: the fixed 32 x 32 tile


def test_second_launch_calls_the_compiled_kernel_with_every_argument_in_order(kernel) -> None:
    x, y = torch.randn(64), torch.randn(64)
    tuning.launch(kernel, "m", 3, 2, 100, (x, 7, 0.5), META)
    kind, grid, args, kwargs = kernel.calls[0]
    assert kind == "triton" and grid == (4 * 3 * 2, 1, 1) and args == (x, 7, 0.5)  # cdiv(128, 32) blocks per sequence/head
    assert kwargs["BLOCK_M"] == 32 and kwargs["SPLIT_LOOPS"] is False and kwargs["FLAG"] is True

    tuning.launch(kernel, "n", 5, 2, 100, (y, 7, 0.25), META)  # new batch, data and float: same specialization
    kind, grid, args = kernel.calls[1]
    assert kind == "plan" and grid == (4 * 5 * 2, 1, 1)
    assert args == (y, 7, 0.25, "ieee", 32, 32, True, False, 32, 32)  # as JITFunction.run binds them
    assert tuning.plans.hits == 1


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int", "bool", "meta", "device"])
def test_what_triton_specializes_on_makes_a_new_plan(kernel, monkeypatch, change: str) -> None:
    x = torch.randn(64)
    tuning.launch(kernel, "m", 3, 2, 100, (x, 7, 0.5), META)
    args, meta = (x, 7, 0.5), META
    if change == "misaligned":
        args = (x[1:], 7, 0.5)  # 4 bytes past a 16-byte boundary: Triton drops its divisibility hint
    elif change == "dtype":
        args = (x.double(), 7, 0.5)
    elif change == "int":
        args = (x, 16, 0.5)  # Triton specializes ints on == 1 and on divisibility by 16
    elif change == "bool":
        tuning.launch(kernel, "m", 3, 2, 100, (x, 1, 0.5), META)
        args = (x, True, 0.5)  # True == 1 in Python, but Triton passes a bool as i1
    elif change == "meta":
        meta = dict(META, FLAG=False)
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    tuning.launch(kernel, "m", 3, 2, 100, args, meta)
    assert set(c[0] for c in kernel.calls) == {"triton"} and tuning.plans.hits == 0


def test_the_fixed_tile_is_part_of_the_plan(kernel, monkeypatch) -> None:
    x = torch.randn(64)
    tuning.launch(kernel, "m", 1, 1, 100, (x, 7, 0.5), META)
    monkeypatch.setattr(tuning, "fixed_config", lambda *a: tuning._cfg(16, 64, 4, 2))  # as a test forcing a tile
    tuning.launch(kernel, "m", 1, 1, 100, (x, 7, 0.5), META)
    assert kernel.calls[1][0] == "triton" and kernel.calls[1][3]["BLOCK_N"] == 64


def test_interpreter_launches_never_make_plans(kernel, monkeypatch) -> None:
    monkeypatch.setattr(tuning, "is_interpreting", lambda: True)
    x = torch.randn(64)
    for _ in range(2):
        tuning.launch(kernel, "m", 1, 1, 100, (x, 7, 0.5), META)
    assert [c[0] for c in kernel.calls] == ["triton", "triton"] and not tuning.plans.plans


def test_plans_are_bounded(kernel) -> None:
    tuning.plans.limit = 3
    x = torch.randn(64)
    for n in range(5):
        tuning.launch(kernel, "m", 1, 1, 100, (x, n, 0.5), META)
    assert 1 <= len(tuning.plans.plans) <= 3


def test_disabled_plans_launch_through_triton(kernel) -> None:
    tuning.plans.enabled = False
    x = torch.randn(64)
    for _ in range(2):
        tuning.launch(kernel, "m", 1, 1, 100, (x, 7, 0.5), META)
    assert [c[0] for c in kernel.calls] == ["triton", "triton"] and not tuning.plans.plans


def test_autotuning_caches_its_results_only_where_triton_takes_the_option(monkeypatch) -> None:
    seen = []

    def new_autotune(configs, key, prune_configs_by=None, reset_to_zero=None, do_bench=None, cache_results=False):
        seen.append(cache_results)
        return lambda kernel: kernel

    def old_autotune(configs, key, prune_configs_by=None, reset_to_zero=None, do_bench=None):
        seen.append("old")
        return lambda kernel: kernel

    assert tuning.cache_kwargs(new_autotune) == {"cache_results": True}
    assert tuning.cache_kwargs(old_autotune) == {}
    monkeypatch.setattr(tuning, "is_interpreting", lambda: False)
    for autotune in (new_autotune, old_autotune):
        monkeypatch.setattr(tuning.triton, "autotune", autotune)
        kernel = type("Kernel", (), {})()
        assert tuning.tuned(kernel, "fwd") is kernel  # no TypeError from the old signature
    assert seen == [True, "old"]


def test_fixed_tile_warps_for_bias_gradients(monkeypatch) -> None:
    """The tensor-core fixed tile (64 x 64) of a dK/dV launch that sums bias gradients takes
    ``bias_grad_fixed_warps``; float32 ("ieee") and wide-head tiles, and launches without bias gradients, keep 4."""
    monkeypatch.setattr(tuning, "is_interpreting", lambda: False)
    assert tuning.fixed_config(64, 64, "tf32", bias_grads=True).num_warps == tuning.bias_grad_fixed_warps == 8
    assert tuning.fixed_config(64, 64, "tf32").num_warps == 4
    assert tuning.fixed_config(64, 64, "ieee", bias_grads=True).num_warps == 4
    assert tuning.fixed_config(256, 256, "tf32", bias_grads=True).num_warps == 4
    monkeypatch.setattr(tuning, "bias_grad_fixed_warps", None)
    assert tuning.fixed_config(64, 64, "tf32", bias_grads=True).num_warps == 4


def test_tuning_key_holds_every_constexpr_of_every_tuned_kernel() -> None:
    """A tile picked for one specialization is never reused for another: every constexpr that changes an attention
    kernel's code is in the autotuning key (the tile's own BLOCK_M / BLOCK_N aside). A dK/dV tile picked without
    bias gradients needs too much shared memory with them (an H200 test crashed before the key held them)."""
    from recforge.ops.triton import cached, hstu, softmax

    kernels = [hstu._hstu_fwd, hstu._hstu_bwd_dq, hstu._hstu_bwd_dkdv, softmax._sm_fwd, softmax._sm_bwd_dq,
               softmax._sm_bwd_dkdv, cached._cached_fwd]  # fmt: skip
    for kernel in kernels:
        fn = kernel
        while not inspect.isfunction(fn):  # a JITFunction (or the interpreter's wrapper) around the Python function
            fn = fn.fn
        parameters = inspect.signature(fn).parameters.values()
        constexprs = {p.name for p in parameters if "constexpr" in str(p.annotation)} - {"BLOCK_M", "BLOCK_N"}
        assert len(constexprs) > 5, fn.__name__
        assert constexprs <= set(tuning.TUNING_KEY), (fn.__name__, constexprs - set(tuning.TUNING_KEY))


def test_shortened_lists_keep_each_lists_smallest_tile(monkeypatch) -> None:
    """``shorten_hstu_candidates``: the first n tiles and the smallest, which fits where larger ones do not."""
    monkeypatch.setattr(tuning, "_TABLES", {kind: dict(tables) for kind, tables in tuning._TABLES.items()})
    full = {kind: dict(tuning._TABLES[kind]) for kind in ("fwd", "bwd_dq", "bwd_dkdv", "bwd_dkdv_fused")}
    tuning.shorten_hstu_candidates(1)
    for kind, tables in full.items():
        for dims, tiles in tables.items():
            smallest = min(tiles, key=lambda t: t[0] * t[1] * t[3])
            kept = tuning._TABLES[kind][dims]
            assert kept[0] == tiles[0] and smallest in kept and len(kept) <= 2, (kind, dims, kept)
