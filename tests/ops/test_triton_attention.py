"""Triton HSTU and softmax attention against the float64 PyTorch reference, forward and every gradient.

CPU: Triton's interpreter (TRITON_INTERPRET=1) on tiny float32 shapes, one case per mask kind.
GPU (``pytest -m gpu``): every mask kind, float32/bfloat16/float16, head dims 32..256 and an
odd one, long jagged batches that take the autotuned path. Fresh random inputs each run.
"""

from __future__ import annotations


import pytest
import torch
from _oracles import offsets_of, random_lengths, random_mask, relative_error

from recforge.ops.hstu_attention import hstu_attention, hstu_attention_reference
from recforge.ops.softmax_attention import softmax_attention

MASK_KINDS = ["causal", "full", "contextual", "targets", "window", "segments", "timestamps", "all"]
NUM_POS = 6
NUM_BUCKETS = 12


def _timestamps(gen: torch.Generator, total: int) -> torch.Tensor:
    gaps = torch.exp(torch.rand(total, dtype=torch.float64, generator=gen) * 9).long()
    gaps = gaps * (torch.rand(total, generator=gen) < 0.8)  # a fifth share a second
    return 1_600_000_000 + torch.cumsum(gaps, 0)


def _case(op: str, kind: str, seed: int, batch: int, max_len: int, heads: int, dqk: int, dv: int,
          dtype: torch.dtype, device: torch.device | str, bias: bool | str = True):
    """Run Triton and the float64 reference on the same fresh inputs; return {name: relative error}.
    ``bias`` (hstu): True both biases, False none, "pos" or "time" that one alone (model.relative_bias=false
    keeps the time bias)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, batch, max_len)
    total = sum(lengths)
    offsets = offsets_of(lengths)
    ts = _timestamps(gen, total)
    mask = random_mask(kind, gen, lengths, ts)
    if op == "softmax":
        dv = dqk
    q, k = (torch.randn(total, heads, dqk, generator=gen) for _ in range(2))
    v = torch.randn(total, heads, dv, generator=gen)
    grad_out = torch.randn(total, heads, dv, generator=gen).to(dtype)  # the kernel's and the reference's
    pos_w = torch.randn(NUM_POS, generator=gen) if bias in (True, "pos") and op == "hstu" else None
    time_w = torch.randn(NUM_BUCKETS + 1, generator=gen) if bias in (True, "time") and op == "hstu" else None
    named = {"q": q, "k": k, "v": v, "pos_weights": pos_w, "time_weights": time_w}
    names = [name for name, x in named.items() if x is not None]
    leaves_in = [named[name] for name in names]

    def run(leaves, dev, kernel):
        q_, k_, v_, *w = leaves
        off, m = offsets.to(dev), mask.to(dev)
        if op == "hstu":
            given = dict(zip(names[3:], w, strict=True))
            pw, tw = given.get("pos_weights"), given.get("time_weights")
            tsd = ts.to(dev) if tw is not None else None
            if kernel == "reference":
                return hstu_attention_reference(q_, k_, v_, off, max_len, m, 0.7, pw, tsd, tw)
            return hstu_attention(q_, k_, v_, off, max_len, m, scale=0.7, pos_weights=pw, timestamps=tsd,
                                  time_weights=tw, kernel="triton")
        return softmax_attention(q_, k_, v_, off, max_len, m, kernel="pytorch" if kernel == "reference" else "triton")

    # the kernel sees inputs rounded to its dtype; the reference gets the same rounded values
    low = [x.to(device=device, dtype=dtype if i < 3 else torch.float32).requires_grad_() for i, x in enumerate(leaves_in)]
    ref_low = [x.detach().cpu().double().requires_grad_() for x in low]
    ref = run(ref_low, "cpu", "reference")
    out = run(low, device, "triton")
    assert out.shape == ref.shape and out.dtype == dtype
    errors = {"out": relative_error(out.detach().cpu(), ref.detach())}
    assert torch.isfinite(out).all()
    if total:
        grads = torch.autograd.grad(out, low, grad_out.to(device), allow_unused=True)
        ref_grads = torch.autograd.grad(ref, ref_low, grad_out.double(), allow_unused=True)
        for name, g, e in zip(names, grads, ref_grads):
            e = torch.zeros_like(ref_low[names.index(name)]) if e is None else e
            assert g is not None, f"no gradient for {name}"
            assert torch.isfinite(g).all(), f"non-finite gradient for {name}"
            errors[name] = relative_error(g.cpu(), e)
    return errors


def _check(errors: dict, tol: float, where: str) -> None:
    # bias gradients sum dS over every pair of every head (float32 atomics); their terms cancel,
    # so their relative error is a few times that of q/k/v
    bad = {k: e for k, e in errors.items() if not e <= (10 * tol if k.endswith("_weights") else tol)}
    assert not bad, f"{where}: relative errors over {tol:g}: {bad}"


# ----------------------------------------------------------------------------------------- CPU




@pytest.mark.parametrize("op", ["hstu", "softmax"])
@pytest.mark.parametrize("kind", ["causal", "full", "targets", "window", "segments", "all"])
@pytest.mark.parametrize("loops", ["split", "merged"])
def test_interpreter_matches_reference(interpreter, monkeypatch, op: str, kind: str, loops: str) -> None:
    # both tile walks: two loops (the GPU speed path) and one loop (GPU fixed-tile launches)
    from recforge.ops.triton import tuning

    monkeypatch.setattr(tuning, "split_loops", lambda fixed_tile: loops == "split")
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    errors = _case(op, kind, seed, batch=4, max_len=37, heads=2, dqk=24, dv=20, dtype=torch.float32, device="cpu")
    _check(errors, 1e-5, f"{op}/{kind}/{loops} seed {seed}")


@pytest.mark.parametrize("kind", ["causal", "all"])
def test_interpreter_fused_dq(interpreter, monkeypatch, kind: str) -> None:
    """hstu.fused_dq: dQ from the dK/dV kernel (float32 atomics, no dQ launch) gives the reference's gradients."""
    monkeypatch.setattr(interpreter, "fused_dq", True)
    launched = []
    real_launch = interpreter.launch
    monkeypatch.setattr(interpreter, "launch", lambda kernel, *a: (launched.append(kernel), real_launch(kernel, *a)))
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    errors = _case("hstu", kind, seed, batch=4, max_len=37, heads=2, dqk=24, dv=20, dtype=torch.float32, device="cpu")
    _check(errors, 1e-5, f"hstu/{kind}/fused dq seed {seed}")
    assert interpreter._bwd_dq not in launched and interpreter._bwd_dkdv in launched


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["causal", "all"])
def test_interpreter_longest_sequences_first(interpreter, monkeypatch, kind: str, fused: bool) -> None:
    """Programs launched by the sequences' length order (``SEQ_ORDER_MIN_LEN`` 0 here: every batch of 2 or more) give
    the reference's outputs and gradients: every sequence's programs run once, whatever the order."""
    monkeypatch.setattr(interpreter, "SEQ_ORDER_MIN_LEN", 0)
    monkeypatch.setattr(interpreter, "fused_dq", fused)
    orders = []
    real_launch = interpreter.launch

    def launch(kernel, grid_blocks, batch, heads, max_seq_len, args, meta):
        assert meta["SEQ_ORDER"], "a batch of 5 sequences over SEQ_ORDER_MIN_LEN launched in batch order"
        orders.append(args[list(kernel.fn.arg_names).index("seq_order")].tolist())
        real_launch(kernel, grid_blocks, batch, heads, max_seq_len, args, meta)

    monkeypatch.setattr(interpreter, "launch", launch)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    errors = _case("hstu", kind, seed, batch=5, max_len=37, heads=2, dqk=24, dv=20, dtype=torch.float32, device="cpu")
    _check(errors, 1e-5, f"hstu/{kind}/longest first, fused dq {fused}, seed {seed}")
    assert len(orders) == (2 if fused else 3) and all(sorted(order) == list(range(5)) for order in orders)
    lengths = random_lengths(torch.Generator().manual_seed(seed), 5, 37)  # _case's lengths: the same generator draw
    assert all([lengths[b] for b in order] == sorted(lengths, reverse=True) for order in orders)  # longest first


def test_sequence_order_is_longest_first_ties_in_batch_order() -> None:
    from recforge.ops.triton._common import sequence_order

    lengths = torch.randint(0, 4, (int(torch.randint(2, 40, (1,))),))
    order = sequence_order(offsets_of(lengths.tolist()))
    want = sorted(range(len(lengths)), key=lambda b: (-int(lengths[b]), b))
    assert order.tolist() == want and order.dtype == torch.int64


def test_fused_dq_off_in_deterministic_mode(interpreter, monkeypatch) -> None:
    monkeypatch.setattr(interpreter, "fused_dq", True)
    assert interpreter._fused_dq(1000, "tf32", 128)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not interpreter._fused_dq(1000, "tf32", 128)


def test_fused_dq_default_by_length(monkeypatch) -> None:
    """Unset (None): fused for autotuned launches on sequences longer than FUSED_DQ_AUTO_LEN at head dims over 64;
    never for float32."""
    from recforge.ops.triton import hstu as hstu_mod

    monkeypatch.setattr(hstu_mod, "is_interpreting", lambda: False)
    monkeypatch.setattr(hstu_mod, "fused_dq", None)
    n = hstu_mod.FUSED_DQ_AUTO_LEN
    assert hstu_mod._fused_dq(n + 1, "tf32", 128) and not hstu_mod._fused_dq(n, "tf32", 128)
    assert hstu_mod._fused_dq(n + 1, "tf32", 96) and not hstu_mod._fused_dq(n + 1, "tf32", 64)
    assert not hstu_mod._fused_dq(n + 1, "ieee", 128)
    monkeypatch.setattr(hstu_mod, "fused_dq", False)
    assert not hstu_mod._fused_dq(4 * n, "tf32", 128)
    monkeypatch.setattr(hstu_mod, "fused_dq", True)
    assert hstu_mod._fused_dq(300, "tf32", 64) and not hstu_mod._fused_dq(256, "tf32", 64)


@pytest.mark.parametrize("bias", ["time", "pos"])
def test_interpreter_one_bias_alone(interpreter, bias: str) -> None:
    """model.relative_bias=false runs with the time bias alone (pos_weights=None); and the other way round."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    errors = _case("hstu", "all", seed, batch=4, max_len=37, heads=2, dqk=24, dv=20, dtype=torch.float32, device="cpu",
                   bias=bias)  # fmt: skip
    assert ("pos_weights" in errors) == (bias == "pos") and ("time_weights" in errors) == (bias == "time")
    _check(errors, 1e-5, f"hstu/all/{bias} only seed {seed}")


def test_triton_on_cpu_without_interpreter_raises(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(3, 1, 4)
    with pytest.raises(ValueError, match="needs (CUDA tensors|the triton package)"):
        hstu_attention(q, q, q, offsets_of([1, 2]), 2, random_mask("causal", torch.Generator(), [1, 2]), kernel="triton")


def test_softmax_dropout_is_refused_by_triton_kernel(interpreter) -> None:
    q = torch.randn(3, 1, 4)
    with pytest.raises(ValueError, match="does not support attention dropout"):
        softmax_attention(q, q, q, offsets_of([1, 2]), 2, random_mask("causal", torch.Generator(), [1, 2]),
                          dropout=0.1, kernel="triton")


# ----------------------------------------------------------------------------------------- GPU

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["hstu", "softmax"])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_gpu_every_mask_float32(cuda_device, op: str, kind: str) -> None:
    for trial in range(2):
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        errors = _case(op, kind, seed, batch=9, max_len=[150, 256][trial], heads=2, dqk=40, dv=72,
                       dtype=torch.float32, device=cuda_device)
        _check(errors, TOL[torch.float32], f"{op}/{kind} seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["hstu", "softmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_gpu_low_precision_head_dims(cuda_device, op: str, dtype: torch.dtype, dim: int) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    errors = _case(op, "all" if dim == 64 else "targets", seed, batch=6, max_len=200, heads=2, dqk=dim, dv=dim,
                   dtype=dtype, device=cuda_device)
    _check(errors, TOL[dtype], f"{op}/{dtype}/d{dim} seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["hstu", "softmax"])
@pytest.mark.parametrize(("kind", "dim"), [("causal", 128), ("all", 128), ("causal", 64)])
def test_gpu_long_jagged_autotuned(cuda_device, op: str, kind: str, dim: int) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    errors = _case(op, kind, seed, batch=5, max_len=1100, heads=2, dqk=dim, dv=dim, dtype=torch.bfloat16,
                   device=cuda_device)
    _check(errors, TOL[torch.bfloat16], f"{op}/{kind}/d{dim}/long seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "dim", "bias"), [("causal", 128, False), ("all", 64, True), ("targets", 128, True)])
def test_gpu_fused_dq_autotuned(cuda_device, monkeypatch, kind: str, dim: int, bias: bool) -> None:
    """hstu.fused_dq on the autotuned bf16 path (sequences over 256 tokens), with and without the biases."""
    from recforge.ops.triton import hstu as hstu_mod

    monkeypatch.setattr(hstu_mod, "fused_dq", True)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    errors = _case("hstu", kind, seed, batch=5, max_len=1100, heads=2, dqk=dim, dv=dim, dtype=torch.bfloat16,
                   device=cuda_device, bias=bias)
    _check(errors, TOL[torch.bfloat16], f"hstu/{kind}/d{dim}/fused dq seed {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("bias", ["time", "pos", False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_without_one_or_both_biases(cuda_device, bias, dtype: torch.dtype) -> None:
    """model.relative_bias=false (pos_weights=None) with and without the time bias, autotuned, jagged."""
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for kind in ("all", "causal"):
        errors = _case("hstu", kind, seed, batch=6, max_len=600, heads=2, dqk=64, dv=64, dtype=dtype,
                       device=cuda_device, bias=bias)  # fmt: skip
        _check(errors, TOL[dtype], f"hstu/{kind}/{bias}/{dtype} seed {seed}")


def _force_tile(monkeypatch, kernel_module, kind: str, tile) -> None:
    """Launches of ``kernel_module``'s ``kind`` kernel take ``tile`` (through the fixed-tile path of
    ``tuning.launch``, so sequences must be <= 256 tokens); every launch walks tiles in two loops."""
    from recforge.ops.triton import tuning

    launch, default_tile = tuning.launch, tuning.fixed_config
    monkeypatch.setattr(tuning, "split_loops", lambda fixed_tile: True)

    def forcing_launch(kernel, *args):
        forced = kernel.tuning_kind == kind
        tuning.fixed_config = (lambda *config_args: tile) if forced else default_tile
        try:
            launch(kernel, *args)
        finally:
            tuning.fixed_config = default_tile

    monkeypatch.setattr(kernel_module, "launch", forcing_launch)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["softmax_bwd_dq", "softmax_bwd_dkdv"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("index", range(6))
def test_gpu_softmax_backward_candidate_tile(cuda_device, monkeypatch, kind: str, dim: int, index: int) -> None:
    """Each tile the softmax backward autotuner may pick, forced on its kernel (with the two-loop
    tile walk of autotuned launches; the other kernels take the fixed tile): autotuning keeps
    whichever is fastest, so each must be right."""
    from recforge.ops.triton import softmax as softmax_mod
    from recforge.ops.triton import tuning

    tiles = tuning.candidates(kind, dim, dim)
    if index >= len(tiles):
        pytest.skip(f"{kind} has {len(tiles)} candidate tiles at head dim {dim}")
    _force_tile(monkeypatch, softmax_mod, kind, tiles[index])
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    errors = _case("softmax", "targets", seed, batch=5, max_len=250, heads=2, dqk=dim, dv=dim,
                   dtype=torch.bfloat16, device=cuda_device)
    _check(errors, TOL[torch.bfloat16], f"softmax/d{dim}/{kind} tile {tuning._key(tiles[index])} seed {seed}")


def _longest_tile_list(*kinds: str) -> int:
    """Candidates in the longest autotuning list of these kernel kinds (a test per index; shorter lists skip)."""
    from recforge.ops.triton import tuning

    return max(len(tiles) for kind in kinds for tiles in tuning._TABLES[kind].values())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bwd_dq", "bwd_dkdv", "bwd_dkdv_fused"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("index", range(_longest_tile_list("bwd_dq", "bwd_dkdv", "bwd_dkdv_fused")))
def test_gpu_hstu_backward_candidate_tile(cuda_device, monkeypatch, kind: str, dim: int, index: int) -> None:
    """Each tile the HSTU backward autotuners may pick (dQ, dK/dV, dK/dV computing dQ), alone on the autotuned
    path (jagged bf16 sequences over 256 tokens): with both biases, or, where that specialization needs more shared
    memory than the GPU has (autotuning skips such a candidate), without (the long-sequence benchmarks' one).
    Autotuning keeps whichever is fastest, so each must be right."""
    from triton.runtime.errors import OutOfResources

    from recforge.ops.triton import hstu as hstu_mod
    from recforge.ops.triton import tuning

    tiles = tuning.candidates(kind, dim, dim)
    if index >= len(tiles):
        pytest.skip(f"{kind} has {len(tiles)} candidate tiles at head dim {dim}")
    tile = tuning._key(tiles[index])
    monkeypatch.setitem(tuning._TABLES, kind, {dims: [tile] for dims in tuning._TABLES[kind]})
    monkeypatch.setattr(tuning.plans, "enabled", False)  # every launch through the autotuner, which now has one tile
    monkeypatch.setattr(hstu_mod, "fused_dq", kind == "bwd_dkdv_fused")
    kernel = hstu_mod._bwd_dq if kind == "bwd_dq" else hstu_mod._bwd_dkdv
    kernel.cache.clear()
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for bias in (True, False):
        try:
            errors = _case("hstu", "causal", seed, batch=5, max_len=700, heads=2, dqk=dim, dv=dim,
                           dtype=torch.bfloat16, device=cuda_device, bias=bias)  # fmt: skip
        except OutOfResources:
            continue
        finally:
            kernel.cache.clear()
        assert tuning._key(kernel.best_config) == tile
        _check(errors, TOL[torch.bfloat16], f"hstu/d{dim}/{kind} tile {tile} bias {bias} seed {seed}")
        return
    pytest.skip(f"{kind} tile {tile} does not fit in shared memory at head dim {dim}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["hstu", "softmax"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("index", range(_longest_tile_list("fwd")))
def test_gpu_forward_candidate_tile(cuda_device, monkeypatch, op: str, dim: int, index: int) -> None:
    """Each tile the forward autotuner may pick (HSTU and softmax share the list), forced on the
    forward kernel with the two-loop walk of autotuned launches: under the 'all' mask with bias,
    or, where that specialization needs more shared memory than the GPU has (autotuning skips
    such a candidate), under the targets mask without bias (the benchmark's specialization)."""
    from triton.runtime.errors import OutOfResources

    from recforge.ops.triton import hstu as hstu_mod
    from recforge.ops.triton import softmax as softmax_mod
    from recforge.ops.triton import tuning

    tiles = tuning.candidates("fwd", dim, dim)
    if index >= len(tiles):
        pytest.skip(f"the forward has {len(tiles)} candidate tiles at head dim {dim}")
    _force_tile(monkeypatch, hstu_mod if op == "hstu" else softmax_mod, "fwd", tiles[index])
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    for kind, bias in (("all", True), ("targets", False)):
        try:
            errors = _case(op, kind, seed, batch=5, max_len=250, heads=2, dqk=dim, dv=dim, dtype=torch.bfloat16,
                           device=cuda_device, bias=bias)
        except OutOfResources:
            continue
        _check(errors, TOL[torch.bfloat16], f"{op}/{kind}/d{dim}/fwd tile {tuning._key(tiles[index])} seed {seed}")
        return
    pytest.skip(f"forward tile {tuning._key(tiles[index])} does not fit in shared memory at head dim {dim}")


@pytest.mark.gpu
def test_gpu_strided_inputs_and_empty_batch(cuda_device) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    lengths = random_lengths(gen, 7, 90)
    total, heads, d = sum(lengths), 2, 32
    fused = torch.randn(total, 3 * heads * d, generator=gen).to(cuda_device)
    q, k, v = (x.view(total, heads, d) for x in fused.split(heads * d, dim=1))  # strided views, as in the encoder
    offsets = offsets_of(lengths).to(cuda_device)
    mask = random_mask("targets", gen, lengths).to(cuda_device)
    out = hstu_attention(q, k, v, offsets, 90, mask, kernel="triton")
    ref = hstu_attention(q, k, v, offsets, 90, mask, kernel="pytorch")
    assert relative_error(out, ref) < 1e-5
    empty = torch.zeros(0, heads, d, device=cuda_device)
    assert hstu_attention(empty, empty, empty, offsets_of([0, 0]).to(cuda_device), 4, mask.__class__(), kernel="triton").shape == (0, heads, d)


@pytest.mark.gpu
def test_gpu_repeated_calls_take_launch_plans(cuda_device) -> None:
    """A repeated call launches the compiled kernels directly (``tuning.plans``) with the same result;
    inputs 2 bytes off a 16-byte boundary get kernels of their own and are right too."""
    from recforge.ops.triton import tuning

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    lengths = random_lengths(gen, 5, 600)  # > 256 tokens: the autotuned path
    total, heads, d = sum(lengths), 2, 64
    fused = (torch.randn(total, 3 * heads * d + 1, generator=gen) * 0.5).to(cuda_device, torch.bfloat16)
    offsets = offsets_of(lengths).to(cuda_device)
    mask = random_mask("targets", gen, lengths).to(cuda_device)
    grad = torch.randn(total, heads, d, generator=gen).to(cuda_device, torch.bfloat16)

    def run(shift: int):
        x = fused[:, shift:shift + 3 * heads * d].detach().requires_grad_()
        q, k, v = (t.view(total, heads, d) for t in x.split(heads * d, dim=1))
        out = hstu_attention(q, k, v, offsets, 600, mask, kernel="triton")
        (dx,) = torch.autograd.grad(out, x, grad)
        ref_x = x.detach().float().requires_grad_()
        rq, rk, rv = (t.view(total, heads, d) for t in ref_x.split(heads * d, dim=1))
        ref = hstu_attention(rq, rk, rv, offsets, 600, mask, kernel="pytorch")
        (ref_dx,) = torch.autograd.grad(ref, ref_x, grad.float())
        assert relative_error(out.float(), ref) < 2e-2 and relative_error(dx.float(), ref_dx) < 2e-2, f"shift {shift}"
        return out, dx

    first = [run(shift) for shift in (0, 1)]
    hits = tuning.plans.hits
    again = [run(shift) for shift in (0, 1)]
    assert tuning.plans.hits >= hits + 6  # forward, dQ and dK/dV, twice
    for (out, dx), (out2, dx2) in zip(first, again):
        assert torch.equal(out, out2) and torch.equal(dx, dx2)
