"""The sampled-softmax loss with shared negatives, compiled, in several formulations: which one reads its logits least.

Usage:
    PYTHONPATH=. python benchmarks/loss_nll.py --positions 65536 --negatives 8192 --dim 1024 \
        --out benchmarks/results/loss_nll-h200.json

The MFU benchmark's loss (``benchmarks/train_mfu.py``: float32 logits from float16-input matmuls, ``loss.matmul:
float16``, temperature 0.05, accidental hits masked), forward and backward under ``torch.compile``, its
``-log softmax(column 0)`` over the [positive | shared negatives] columns computed as:

- ``cat``: ``-log_softmax(torch.cat([positive, masked negatives], 1))[:, 0]`` (recforge before 2026-11-25, 16th
  session);
- ``lse``: the negatives' ``logsumexp``, then the logsumexp of [positive, that] (no concatenated copy; autograd's
  backward, which may keep the scaled, masked logits);
- ``online``: one row maximum over both (no gradient through it), then ``log(sum(exp(x - max)))``;
- ``recforge``: ``recforge.train.losses.sampled_softmax_loss`` as it is in the tree that runs (since the 25th session
  one chunk of ``recforge.train.chunked_softmax``: the loss and the logit gradients from one read of the logits,
  ``recforge.ops.softmax_nll``; before, ``lse``'s form). In ``loss_nll-autograd-fn-h200.json`` it was an autograd
  function whose backward recomputed the scaled, masked logits from the matmul's output: no faster than ``lse``
  (Inductor already recomputes them), so not kept.
- ``f16-logits``: ``recforge``'s computation with the logits written in float16 by the matmul (float32 sums)
  instead of float32: half the bytes written and read, the logits rounded to float16 (up to ~0.008 at the
  temperature's largest logits, 20). Not in the library: measured to see what it would save.

Each variant: median ms of ``--steps`` compiled fwd+bwd calls (CUDA events), the loss and the user gradient
against the first variant's (``cat`` unless ``--variants`` says otherwise), and its kernels' GPU time (profiler) by
name. (In the two JSONs of 2026-11-25 ``cat`` masked with the lowest finite float32, not -inf.)
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from _machine import kernel_header, write_result

from recforge.ops.half_matmul import half_input_logits
from recforge.ops.softmax_nll import softmax_nll
from recforge.train import losses

TEMPERATURE = 0.05


def _blocks(user, table, targets, neg_ids, masked=losses.MASKED):
    pos = (user * table[targets]).sum(-1, keepdim=True) / TEMPERATURE  # (T, 1)
    neg = (half_input_logits(user, table[neg_ids]) / TEMPERATURE).masked_fill(neg_ids[None, :] == targets[:, None],
                                                                             masked)  # fmt: skip
    return pos, neg


def loss_cat(user, table, targets, neg_ids):
    return -F.log_softmax(torch.cat(_blocks(user, table, targets, neg_ids, float("-inf")), 1), 1)[:, 0].mean()


def loss_lse(user, table, targets, neg_ids):
    pos, neg = _blocks(user, table, targets, neg_ids)
    return (torch.logsumexp(torch.stack([pos[:, 0], neg.logsumexp(1)], 1), 1) - pos[:, 0]).mean()


def loss_online(user, table, targets, neg_ids):
    pos, neg = _blocks(user, table, targets, neg_ids)
    top = torch.maximum(pos[:, 0], neg.detach().amax(1))[:, None]
    return (top[:, 0] + ((pos - top).exp()[:, 0] + (neg - top).exp().sum(1)).log() - pos[:, 0]).mean()


def loss_recforge(user, table, targets, neg_ids):
    sampled = losses.SampledNegatives(ids=neg_ids)
    return losses.sampled_softmax_loss(user, targets, lambda ids: table if ids is None else table[ids],
                                       table.shape[0] - 1, negatives="shared", num_negatives=neg_ids.numel(),
                                       temperature=TEMPERATURE, sampled=sampled, matmul="float16")  # fmt: skip


class _F16Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, user, positive, shared, targets, neg_ids):
        scaled = user / TEMPERATURE
        pos = (scaled * positive).sum(-1)
        logits = scaled.half() @ shared.half().T  # (T, K) float16 out, float32 sums
        nll, g, g_pos = softmax_nll(logits, pos, neg_ids, targets, grad_dtype=torch.bfloat16)
        scale = 1.0 / (TEMPERATURE * user.shape[0])
        g_pos = g_pos[:, None]
        grad_user = (torch.mm(g, shared.bfloat16(), out_dtype=torch.float32) + g_pos * positive) * scale
        ctx.save_for_backward(grad_user, g_pos * user * scale, torch.mm(g.T, user.bfloat16(), out_dtype=torch.float32) * scale)
        return nll.mean()

    @staticmethod
    def backward(ctx, grad_out):
        return (*(t * grad_out for t in ctx.saved_tensors), None, None)


def loss_f16_logits(user, table, targets, neg_ids):
    return _F16Logits.apply(user, table[targets], table[neg_ids], targets, neg_ids)


VARIANTS = {"cat": loss_cat, "lse": loss_lse, "online": loss_online, "recforge": loss_recforge,
            "f16-logits": loss_f16_logits}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, default=65536)
    p.add_argument("--negatives", type=int, default=8192)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    table = F.normalize(torch.randn(a.items + 1, a.dim, device=device, generator=gen), dim=1).requires_grad_()
    user0 = F.normalize(torch.randn(a.positions, a.dim, device=device, generator=gen), dim=1)
    targets = torch.randint(1, a.items + 1, (a.positions,), device=device, generator=gen)
    sampled = losses.draw_negatives(targets, a.items, negatives="shared", num_negatives=a.negatives, generator=gen)
    doc = dict(kernel_header("loss_nll", device), positions=a.positions, negatives=a.negatives, dim=a.dim, rows=[])
    reference = None
    for name in a.variants:
        torch._dynamo.reset()

        def step(user, fn=VARIANTS[name]):
            loss = fn(user, table, targets, sampled.ids)
            loss.backward()
            return loss

        compiled = torch.compile(step)
        user = user0.clone().requires_grad_()
        for _ in range(3):
            user.grad = table.grad = None
            loss = compiled(user)
        grad = user.grad.clone()
        times = []
        for _ in range(a.steps):
            user.grad = table.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compiled(user)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            user.grad = table.grad = None
            compiled(user)
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
                kernels[e.key[:90]] = e.device_time_total / 1e3
        if reference is None:
            reference = (float(loss.detach()), grad)
        row = {"variant": name, "ms": statistics.median(times), "loss": float(loss.detach()),
               "loss_diff": abs(float(loss.detach()) - reference[0]),
               "grad_rel_diff": float((grad - reference[1]).norm() / reference[1].norm()),
               "kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])}  # fmt: skip
        doc["rows"].append(row)
        print(f"{name:8s} {row['ms']:8.3f} ms  loss {row['loss']:.6f} (diff {row['loss_diff']:.1e}, grad rel diff "
              f"{row['grad_rel_diff']:.1e})", flush=True)  # fmt: skip
        for k, v in row["kernels_ms"].items():
            print(f"    {v:7.3f}  {k}")
    if a.out:
        write_result(a.out, doc)


if __name__ == "__main__":
    main()
