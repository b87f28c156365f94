"""RankingCollate: the ranking layout against a per-row Python loop, fused slices, clear errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from recforge.data.collate import RankingCollate
from recforge.data.parquet_source import ROW_ID


def _lists(rng: np.random.Generator, lengths: np.ndarray, high: int, dtype=np.int64) -> pa.Array:
    offsets = np.r_[0, np.cumsum(lengths)]
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(1, high, offsets[-1]).astype(dtype)))


def random_rows(seed: int, rows: int = 23, tasks: int = 2) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    h_len, t_len = rng.integers(0, 12, rows), rng.integers(1, 5, rows)
    t_off = np.r_[0, np.cumsum(t_len)]
    labels = rng.random(t_off[-1] * tasks).astype(np.float32)
    labels[rng.random(labels.size) < 0.2] = np.nan
    return pa.RecordBatch.from_pydict({
        "user_id": rng.integers(0, 100, rows), "ctx_a": rng.integers(0, 9, rows), "ctx_b": rng.integers(0, 9, rows),
        "history_item_ids": _lists(rng, h_len, 50), "history_timestamps": _lists(rng, h_len, 10**6),
        "history_action": _lists(rng, h_len, 4), "target_item_ids": _lists(rng, t_len, 50),
        "target_timestamps": _lists(rng, t_len, 10**6), "target_click": _lists(rng, t_len, 2).cast(pa.large_list(pa.float32())),
        "target_tasks": pa.LargeListArray.from_arrays(pa.array(t_off), pa.FixedSizeListArray.from_arrays(pa.array(labels), tasks)),
        ROW_ID: np.arange(rows) + 1000,
    })  # fmt: skip


def loop_layout(rb: pa.RecordBatch, context: tuple[str, ...], interleave: bool) -> dict[str, list]:
    """The ranking layout row by row: contextual tokens, history (item [+ action] per event), targets."""
    out = {"item_ids": [], "actions": [], "context_ids": [], "timestamps": [], "lengths": []}
    for r in rb.to_pylist():
        tokens = [(0, 0, r[c], 0) for c in context]  # (item, action, context, timestamp)
        for item, ts, act in zip(r["history_item_ids"], r["history_timestamps"], r["history_action"], strict=True):
            tokens += [(item, 0, 0, ts), (0, act, 0, ts)] if interleave else [(item, act, 0, ts)]
        tokens += [(item, 0, 0, ts) for item, ts in zip(r["target_item_ids"], r["target_timestamps"], strict=True)]
        for name, column in zip(("item_ids", "actions", "context_ids", "timestamps"), zip(*tokens, strict=True), strict=True):
            out[name] += column
        out["lengths"].append(len(tokens))
    return out


@pytest.mark.parametrize("action_encoding", ["sum", "interleave"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_equals_a_per_row_loop(action_encoding: str, seed: int) -> None:
    rb = random_rows(seed)
    collate = RankingCollate(("click", "tasks"), action_column="action", context_columns=("ctx_a", "ctx_b"),
                             action_encoding=action_encoding)  # fmt: skip
    batch = collate(rb)
    batch.validate()
    want = loop_layout(rb, ("ctx_a", "ctx_b"), action_encoding == "interleave")
    assert batch.seq_offsets.diff().tolist() == want["lengths"] and batch.max_seq_len == max(want["lengths"])
    for name in ("item_ids", "actions", "context_ids", "timestamps"):
        assert batch.features[name].tolist() == want[name], name
    t_len = [len(t) for t in rb.column("target_item_ids").to_pylist()]
    assert batch.mask.num_targets.tolist() == t_len and batch.mask.num_contextual.tolist() == [2] * rb.num_rows
    click = np.concatenate(rb.column("target_click").to_pylist()).astype(np.float32)
    assert torch.equal(batch.labels["click"], torch.from_numpy(click))
    tasks = np.array([x for t in rb.column("target_tasks").to_pylist() for x in t], np.float32)  # (N, 2)
    torch.testing.assert_close(batch.labels["tasks"], torch.from_numpy(tasks), rtol=0, atol=0, equal_nan=True)
    assert batch.dense["user_id"].tolist() == rb.column("user_id").to_pylist()
    assert batch.dense["row_ids"].tolist() == rb.column(ROW_ID).to_pylist()


def test_fused_slices_equal_one_call_per_slice() -> None:
    rb = random_rows(3, rows=40)
    collate = RankingCollate(("tasks",), action_column="action", context_columns=("ctx_a",), max_seq_len=64)
    cuts = np.array([0, 7, 8, 25, 40])
    for got, (a, b) in zip(collate.collate_slices(rb, cuts), zip(cuts[:-1], cuts[1:]), strict=True):
        want = collate(rb.slice(a, b - a))
        assert torch.equal(got.seq_offsets, want.seq_offsets) and got.max_seq_len == want.max_seq_len == 64
        for name in want.features:
            assert torch.equal(got.features[name], want.features[name]), name
        torch.testing.assert_close(got.labels["tasks"], want.labels["tasks"], rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got.dense["row_ids"], want.dense["row_ids"])


def test_without_actions_or_context_those_features_are_zero() -> None:
    batch = RankingCollate()(random_rows(4))
    assert not batch.features["actions"].any() and not batch.features["context_ids"].any()
    assert batch.mask.num_contextual.tolist() == [0] * batch.batch_size


def test_bad_rows_are_explained() -> None:
    rb = random_rows(5)
    with pytest.raises(ValueError, match="'target_likes'"):
        RankingCollate(("likes",))(rb)
    short = rb.set_column(rb.schema.get_field_index("history_timestamps"), "history_timestamps",
                          _lists(np.random.default_rng(0), np.ones(rb.num_rows, np.int64), 9))  # fmt: skip
    with pytest.raises(ValueError, match="different lengths"):
        RankingCollate()(short)
    with pytest.raises(ValueError, match="action_encoding"):
        RankingCollate(action_encoding="concat")
