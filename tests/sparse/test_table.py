"""DynamicEmbedding: admission, eviction, defaults, bad input, the non-finite gradient guard."""

from __future__ import annotations

import logging

import pytest
import torch

from recforge.sparse import AdmissionConfig, DynamicEmbedding, EvictionConfig, SparseOptimConfig, TableConfig

D = 4


def _table(**kw) -> DynamicEmbedding:
    kw.setdefault("optimizer", SparseOptimConfig(kind="sgd", lr=0.1))
    return DynamicEmbedding(TableConfig(name="t", dim=D, **kw))


def _step(table: DynamicEmbedding, ids: list[int]) -> torch.Tensor:
    out = table(torch.tensor(ids))
    out.sum().backward()
    table.apply_gradients()
    return out


def _has(table: DynamicEmbedding, ids: list[int]) -> list[bool]:
    keys = torch.tensor(ids)
    return (table.index.lookup(keys, torch.zeros_like(keys)) >= 0).tolist()


def test_count_admission_and_default_rows_get_no_gradient() -> None:
    table = _table(admission=AdmissionConfig(kind="count", threshold=3), default="fixed")
    out = _step(table, [5, 5, 9])
    assert _has(table, [5, 9]) == [False, False]
    torch.testing.assert_close(out, table.default_row.expand(3, D))  # not admitted: the shared fixed row
    assert table.stats["not_admitted"] == 3 and table.stats["updated_rows"] == 0
    _step(table, [5, 9])  # 5 reaches 3 occurrences across batches, 9 has 2
    assert _has(table, [5, 9]) == [True, False]


def test_learned_default_row_trains_through_the_dense_path() -> None:
    table = _table(admission=AdmissionConfig(kind="count", threshold=100), default="learned")
    (table(torch.tensor([1, 2, 2])) * 2).sum().backward()
    torch.testing.assert_close(table.default_row.grad, torch.full((D,), 6.0))
    assert table.stats["admitted"] == 0


def test_probability_admission_rate() -> None:
    table = _table(admission=AdmissionConfig(kind="probability", probability=0.2), capacity=4096)
    table(torch.arange(4000))  # one occurrence each: ~20% admitted
    assert 0.15 < table.num_live / 4000 < 0.25
    table2 = _table(admission=AdmissionConfig(kind="probability", probability=0.2), capacity=4096)
    table2(torch.arange(1000).repeat(10))  # 10 occurrences: 1 - 0.8**10 = 0.89
    assert 0.85 < table2.num_live / 1000 < 0.93


def test_show_click_admission() -> None:
    table = _table(admission=AdmissionConfig(kind="show_click", threshold=2.0, show_weight=0.1, click_weight=1.0))
    table.record_feedback(torch.tensor([1, 2, 2]), shows=torch.ones(3), clicks=torch.tensor([0.0, 1.0, 1.0]))
    table(torch.tensor([1, 2]))
    assert _has(table, [1, 2]) == [False, True]  # scores 0.1 and 2.2


@pytest.mark.parametrize(
    ("policy", "expected_kept"),
    [
        (EvictionConfig(kind="lru"), [False, True, True]),  # 10 least recently used
        (EvictionConfig(kind="lfu"), [True, False, True]),  # 11 least frequently used
        (EvictionConfig(kind="time_freq", decay=0.5), [False, True, True]),  # 10: count 3 but 3 steps old
    ],
)
def test_pressure_eviction_order_and_slot_reuse(policy: EvictionConfig, expected_kept: list[bool]) -> None:
    table = _table(capacity=3, max_rows=3, eviction=policy)
    _step(table, [10, 10, 10, 11, 12])  # step 0
    _step(table, [12])
    _step(table, [11, 12])
    _step(table, [12, 12])
    row_count = table.num_rows
    _step(table, [13])  # full: one row must go
    assert _has(table, [10, 11, 12]) == expected_kept and _has(table, [13]) == [True]
    assert table.num_rows == row_count == 3 and table.stats["evicted"] == 1


def test_l2_and_show_click_eviction() -> None:
    table = _table(capacity=4, max_rows=4, eviction=EvictionConfig(kind="l2", every_steps=1, l2_threshold=0.5))
    from recforge.sparse import warm_start

    warm_start(table, torch.tensor([[1.0] * D, [0.01] * D, [0.3] * D]), torch.tensor([1, 2, 3]))
    table.apply_gradients()  # scheduled pass: norms 2.0, 0.02, 0.6
    assert _has(table, [1, 2, 3]) == [True, False, True] and table.stats["evicted_scheduled"] == 1
    sc = _table(eviction=EvictionConfig(kind="show_click", min_score=1.0))
    _step(sc, [1, 2])
    sc.record_feedback(torch.tensor([1, 2]), shows=torch.ones(2), clicks=torch.tensor([2.0, 0.0]))
    assert sc.run_eviction() == 1 and _has(sc, [1, 2]) == [True, False]


def test_ttl_in_steps_and_seconds() -> None:
    table = _table(eviction=EvictionConfig(kind="ttl", ttl_steps=2, every_steps=1))
    _step(table, [1, 2])
    _step(table, [2])
    assert _has(table, [1, 2]) == [True, True]  # 1 last seen at step 0, now step 2: not more than 2 steps ago
    _step(table, [2])  # now step 3
    assert _has(table, [1, 2]) == [False, True]
    now = [100.0]
    timed = _table(eviction=EvictionConfig(kind="ttl", ttl_seconds=5.0))
    timed.clock = lambda: now[0]
    _step(timed, [1])
    now[0] = 103.0
    _step(timed, [2])
    now[0] = 107.0
    assert timed.run_eviction() == 1 and _has(timed, [1, 2]) == [False, True]


def test_full_table_without_eviction_counts_refusals(caplog: pytest.LogCaptureFixture) -> None:
    table = _table(capacity=2, max_rows=2)
    with caplog.at_level(logging.WARNING):
        out = table(torch.tensor([1, 2, 3, 3]))
    assert table.stats["rejected_full"] == 1 and "is full" in caplog.text
    assert torch.equal(out[2:], torch.zeros(2, D))


def test_grows_without_a_row_limit() -> None:
    table = _table(capacity=2)
    table(torch.arange(100))
    assert table.num_live == 100 and table.stats["grown"] >= 1


def test_eval_mode_neither_admits_nor_counts() -> None:
    table = _table()
    table.eval()
    out = table(torch.tensor([1, 2]))
    assert table.num_live == 0 and torch.equal(out, torch.zeros(2, D))


@pytest.mark.parametrize(
    ("ids", "message"),
    [(torch.tensor([1, -3]), "negative IDs"), (torch.tensor([1.0, 2.0]), "not an integer type"), ([1, 2], "torch.Tensor")],
)
def test_bad_ids_raise(ids, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _table()(ids)


def test_empty_batch_and_int32_ids() -> None:
    table = _table()
    assert table(torch.zeros(0, 3, dtype=torch.int64)).shape == (0, 3, D)
    table.apply_gradients()
    assert table(torch.tensor([4], dtype=torch.int32)).shape == (1, D)


def test_nonfinite_gradients_skip_rows_and_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    table = _table()
    out = table(torch.tensor([1, 2]))
    before = table.store.weight[:2].clone()
    (out * torch.tensor([[float("nan")] * D, [1.0] * D])).sum().backward()
    with caplog.at_level(logging.WARNING):
        table.apply_gradients()
    assert table.stats["nonfinite_grad_rows"] == 1 and "NaN/inf" in caplog.text
    assert torch.equal(table.store.weight[0], before[0]) and not torch.equal(table.store.weight[1], before[1])


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="schedule_steps"):
        _table(optimizer=SparseOptimConfig(schedule="cosine"))
    with pytest.raises(ValueError, match="eviction kind"):
        _table(eviction=EvictionConfig(kind="random"))
