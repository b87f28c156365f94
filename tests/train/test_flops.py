"""The FLOP counter against a hand count and against PyTorch's own FLOP counter; MFU in the training log."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from recforge.config import LossConfig, ModelConfig
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import offsets_from_lengths
from recforge.jagged.mask import AttentionMask
from recforge.models.builders import build_retrieval_model
from recforge.train.flops import (
    attention_pairs,
    hstu_forward_flops,
    matmul_precision,
    measure_matmul_peak,
    peak_tflops,
    step_flops_counter,
)
from recforge.train.losses import sampled_softmax_loss
from recforge.train.step_log import StepLog


def test_hand_count_small_hstu() -> None:
    """2 blocks, d 8, 2 heads of dqk 3 / dv 5, sequences of 3 and 4 tokens, per_position loss with 4 negatives."""
    model = ModelConfig(kind="hstu", dim=8, num_blocks=2, num_heads=2, dqk=3, dv=5)
    loss = LossConfig(negatives="per_position", num_negatives=4)
    lengths = torch.tensor([3, 4])
    # per token per block: uvqk 2*8*(2*(2*5 + 2*3)) = 512, output 2*(2*5)*8 = 160 -> 672; 7 tokens, 2 blocks
    linear = 2 * 7 * 672
    # causal pairs: 3*4/2 + 4*5/2 = 16; per pair per head 2*(3 + 5) = 16 FLOPs, 2 heads, 2 blocks
    attention = 2 * 16 * 16 * 2
    assert attention_pairs(lengths) == 16
    assert hstu_forward_flops(lengths, model) == linear + attention
    # loss: 7 targets x (1 positive + 4 negatives) x 2*8
    head = 7 * 5 * 16
    batch = JaggedBatch(offsets_from_lengths(lengths), {"item_ids": torch.ones(7, dtype=torch.int64)}, 4,
                        labels={"next_item": torch.ones(7, dtype=torch.int64)})  # fmt: skip
    assert step_flops_counter(model, loss, num_items=50)(batch) == 3 * (linear + attention + head)
    full = step_flops_counter(model, LossConfig(negatives="full"), num_items=50)(batch)
    assert full == 3 * (linear + attention + 7 * 51 * 16)


def test_attention_pairs_with_targets_and_full_attention() -> None:
    lengths, targets = torch.tensor([5, 2]), torch.tensor([2, 0])
    # sequence 0: history 3 (causal 6 pairs) + 2 targets each seeing 3 + itself; sequence 1: 3 pairs
    assert attention_pairs(lengths, targets) == 6 + 2 * 4 + 3
    assert attention_pairs(lengths, causal=False) == 25 + 4


@pytest.mark.parametrize("kind", ["hstu", "sasrec"])
def test_matches_pytorch_flop_counter_on_equal_lengths(kind: str) -> None:
    """With full attention on equal-length sequences the padded reference does exactly the counted
    pairs, so PyTorch's FlopCounterMode (forward + backward) must agree with the counter."""
    torch.manual_seed(torch.seed() % 2**31)
    batch_size, length, items = int(torch.randint(2, 5, ())), int(torch.randint(3, 9, ())), 40
    cfg = ModelConfig(kind=kind, dim=16, num_blocks=2, num_heads=2, dqk=8, dv=6, ffn_dim=24, dropout=0.0, kernel="pytorch")
    model = build_retrieval_model(cfg, items, length)
    total = batch_size * length
    batch = JaggedBatch(offsets_from_lengths(torch.full((batch_size,), length)),
                        {"item_ids": torch.randint(1, items + 1, (total,))}, length, mask=AttentionMask(causal=False),
                        labels={"next_item": torch.randint(1, items + 1, (total,))})  # fmt: skip
    loss_cfg = LossConfig(negatives="shared", num_negatives=7)
    # the shared-negatives loss accumulates its gradients in place (addmm_), which PyTorch's table leaves out
    inplace = {torch.ops.aten.addmm_: lambda _acc, a, b, **_: 2 * a[0] * a[1] * b[1]}  # (m, k) @ (k, n): 2 m k n
    with FlopCounterMode(display=False, custom_mapping=inplace) as counter:
        user = model(batch)
        loss = sampled_softmax_loss(user, batch.labels["next_item"], model.item_vectors, items,
                                    negatives="shared", num_negatives=7)  # fmt: skip
        loss.backward()
    counted = step_flops_counter(cfg, loss_cfg, items)(batch)
    # FlopCounterMode skips the positive's elementwise dot (2 d per target, forward + backward), and
    # SASRec's CPU scaled_dot_product_attention (so there only the linear layers and the loss are compared)
    skipped = 3 * 2 * cfg.dim * total
    if kind == "sasrec":
        skipped += 3 * cfg.num_blocks * 4 * cfg.dim * attention_pairs(batch.lengths, causal=False)
    assert counter.get_total_flops() == counted - skipped


def test_peaks_and_precision() -> None:
    assert peak_tflops(torch.device("cpu"), "bfloat16") is None
    assert matmul_precision("bfloat16") == "bfloat16"
    assert measure_matmul_peak(torch.device("cpu"), torch.float32, n=64, seconds=0.01) > 0


def test_step_log_reads_once_per_interval_and_reports_mfu(tmp_path) -> None:
    path = tmp_path / "train_log.jsonl"
    log = StepLog(path, None, log_every=3, peak_tflops=1e-6, main=True)
    for step in range(1, 6):
        log.add({"step": step, "epoch": 0, "lr": 0.1}, torch.tensor(float(step)), tokens=10, flops=1e6)
        written = len(path.read_text().splitlines()) if path.exists() else 0
        assert written == (3 if step >= 3 else 0)  # nothing is read or written before the interval ends
    log.flush()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert {"tokens_per_s", "tflops", "mfu"} <= rows[2].keys() and {"tokens_per_s", "mfu"} <= rows[4].keys()
    assert "mfu" not in rows[0] and "mfu" not in rows[3]
    assert rows[2]["mfu"] == pytest.approx(rows[2]["tflops"] / 1e-6)


def test_step_log_non_finite_keeps_earlier_rows(tmp_path) -> None:
    path = tmp_path / "train_log.jsonl"
    log = StepLog(path, None, log_every=10, peak_tflops=None, main=True)
    log.add({"step": 1, "epoch": 0, "lr": 0.1}, torch.tensor(1.0), tokens=1, flops=0.0)
    log.add({"step": 2, "epoch": 0, "lr": 0.1}, torch.tensor(float("inf")), tokens=1, flops=0.0)
    with pytest.raises(FloatingPointError, match="training loss is inf at step 2"):
        log.flush()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
