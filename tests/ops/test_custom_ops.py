"""The HSTU attention custom op (what torch.compile calls): same values and gradients as the eager
Triton path, a valid op registration, and a compiled HSTU model in one graph.

CPU: Triton's interpreter on tiny float32 shapes and the aot_eager backend (no Inductor code
generation), so the tests check the op and the capture, not Inductor's kernels (the gpu tests in
``tests/train/test_compiled_step.py`` do that).
"""

from __future__ import annotations


import pytest
import torch
from _oracles import offsets_of, random_lengths, random_mask, relative_error

from recforge.config import ModelConfig
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import offsets_from_lengths
from recforge.models.builders import build_retrieval_model
from recforge.ops.custom_ops import hstu_attention_op
from recforge.ops.hstu_attention import hstu_attention





def _inputs(kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, 4, 12)
    total = sum(lengths)
    ts = 1_600_000_000 + torch.cumsum(torch.randint(0, 5000, (total,), generator=gen), 0)
    mask = random_mask(kind, gen, lengths, ts)
    q, k, v = (torch.randn(total, 2, 8, generator=gen).requires_grad_() for _ in range(3))
    pos_w = torch.randn(6, generator=gen).requires_grad_()
    time_w = torch.randn(9, generator=gen).requires_grad_()
    return (q, k, v, offsets_of(lengths), 12, mask), dict(scale=0.3, pos_weights=pos_w, timestamps=ts, time_weights=time_w)


@pytest.mark.parametrize("kind", ["all", pytest.param("causal", marks=pytest.mark.slow),
                                  pytest.param("targets", marks=pytest.mark.slow)])
def test_op_matches_eager_triton(interpreter, kind: str) -> None:
    args, kw = _inputs(kind, int(torch.randint(0, 2**30, ())))
    leaves = [args[0], args[1], args[2], kw["pos_weights"], kw["time_weights"]]
    eager = hstu_attention(*args, kernel="triton", **kw)
    op = hstu_attention_op(*args, **kw)
    torch.testing.assert_close(op, eager, rtol=0, atol=0)
    grad = torch.randn_like(eager)
    expected = torch.autograd.grad(eager, leaves, grad)
    got = torch.autograd.grad(op, leaves, grad)
    for name, g, e in zip(["q", "k", "v", "pos", "time"], got, expected, strict=True):
        assert relative_error(g, e) == 0.0, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused_dq", [False, True])
def test_op_gradients_with_unscaled_dq(interpreter, monkeypatch, fused_dq: bool, dtype: torch.dtype) -> None:
    """The backward op returns dQ * 2 / scale in float32 (the fused dK/dV kernel's sums as they are, or the dQ
    kernel's with its scale argument 2) and the autograd formula rescales it and rounds it to q's dtype: the eager
    path's gradients, both ways."""
    monkeypatch.setattr(interpreter, "fused_dq", fused_dq)
    launched = []
    real_launch = interpreter.launch
    monkeypatch.setattr(interpreter, "launch", lambda kernel, *a: (launched.append(kernel), real_launch(kernel, *a)))
    args, kw = _inputs("all", int(torch.randint(0, 2**30, ())))
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in args[:3])
    args = (q, k, v, *args[3:])
    leaves = [q, k, v, kw["pos_weights"], kw["time_weights"]]
    grad = torch.randn(q.shape[0], 2, 8).to(dtype)
    expected = torch.autograd.grad(hstu_attention(*args, kernel="triton", **kw), leaves, grad)
    got = torch.autograd.grad(hstu_attention_op(*args, **kw), leaves, grad)
    for name, g, e in zip(["q", "k", "v", "pos", "time"], got, expected, strict=True):
        assert g.dtype == e.dtype and relative_error(g, e) <= (1e-6 if dtype == torch.float32 else 2e-3), name
    assert (interpreter._bwd_dq in launched) != fused_dq


def test_opcheck(interpreter) -> None:
    """torch.library's own checks: schema, fake (meta) implementation, autograd registration, dynamic shapes."""
    args, kw = _inputs("all", int(torch.randint(0, 2**30, ())))
    q, k, v, offsets, max_len, mask = args
    op_args = (q, k, v, offsets, max_len, mask.num_targets, mask.num_contextual, mask.segment_lengths, mask.timestamps,
               mask.causal, -1 if mask.max_attn_len is None else mask.max_attn_len,
               sum(1 << s for s, f in enumerate(mask.segment_full or ()) if f), 0.3, kw["pos_weights"],
               kw["timestamps"], kw["time_weights"])  # fmt: skip
    torch.library.opcheck(torch.ops.recforge.hstu_attention.default, op_args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))  # fmt: skip


@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_compiled_model_is_one_graph_with_eager_values(interpreter, backend: str) -> None:
    """An HSTU model with the Triton attention compiles into one graph (no break per block), reuses it
    across token counts (dynamic shapes) and gives the eager outputs and gradients. ``eager``: Dynamo's
    capture only (seconds); ``aot_eager`` (slow): also the backward through AOTAutograd and the op's
    registered autograd."""
    torch.manual_seed(int(torch.randint(0, 2**30, ())))
    cfg = ModelConfig(kind="hstu", dim=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0, kernel="triton")
    model = build_retrieval_model(cfg, 30, 12)
    weights = torch.randn(16)

    def batch(n: int) -> JaggedBatch:
        offsets = offsets_from_lengths(torch.randint(2, 7, (n,)))  # no length 1: Dynamo specialises sizes of 1
        return JaggedBatch(offsets, {"item_ids": torch.randint(1, 31, (int(offsets[-1]),))}, 12)

    def loss(b: JaggedBatch) -> torch.Tensor:
        return (model(b) @ weights).square().sum()

    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]
    before = frames["unique_graphs"]
    compiled = torch.compile(loss, backend=backend, dynamic=True, fullgraph=True)  # fullgraph: a break raises
    for n in (2, 3):
        b = batch(n)
        expected_loss = loss(b)
        expected = torch.autograd.grad(expected_loss, list(model.parameters()), allow_unused=True)
        got_loss = compiled(b)
        got = torch.autograd.grad(got_loss, list(model.parameters()), allow_unused=True)
        torch.testing.assert_close(got_loss, expected_loss, rtol=1e-5, atol=1e-5)
        for (name, _), g, e in zip(model.named_parameters(), got, expected, strict=True):
            if e is None:
                assert g is None, name
            else:
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=name)
    assert frames["unique_graphs"] - before == 1  # one graph for both token counts: no recompile per shape


def test_backward_op_without_biases_returns_no_aliases(interpreter) -> None:
    """Without position and time bias both bias gradients are empty: two distinct tensors, since outputs of a custom
    op may not alias each other (torch.compile's AOTAutograd refused the shared one: model.relative_bias=false)."""
    args, _ = _inputs("causal", int(torch.randint(0, 2**30, ())))
    q, k, v, offsets, max_len, mask = args
    grad = torch.randn_like(v)
    op_args = (grad, q.detach(), k.detach(), v.detach(), offsets, max_len, mask.num_targets, mask.num_contextual,
               mask.segment_lengths, mask.timestamps, mask.causal, -1 if mask.max_attn_len is None else mask.max_attn_len,
               0, 0.3, None, None, None, False, False)  # fmt: skip
    outputs = torch.ops.recforge.hstu_attention_backward(*op_args)
    assert outputs[3].numel() == outputs[4].numel() == 0 and outputs[3] is not outputs[4]
    torch.library.opcheck(torch.ops.recforge.hstu_attention_backward.default, op_args, test_utils=("test_schema",))
