"""The sharding planner: row-wise for big tables, table-wise (balanced) for small ones; printable, JSON round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from recforge.sparse import SparseOptimConfig, TableConfig
from recforge.sparse.planner import ShardingPlan, plan_sharding, row_bytes
from recforge.sparse.sharded import ShardedDynamicEmbedding


def _tables() -> list[TableConfig]:
    return [
        TableConfig("item", dim=128, capacity=1 << 16, max_rows=50_000_000, optimizer=SparseOptimConfig(kind="adam")),
        TableConfig("user", dim=64, capacity=1 << 16, max_rows=10_000_000, optimizer=SparseOptimConfig(kind="sgd")),
        TableConfig("genre", dim=16, capacity=64),
        TableConfig("city", dim=16, capacity=4096),
        TableConfig("device", dim=8, capacity=128),
    ]


def test_row_bytes_counts_weight_state_counters_index() -> None:
    adam, sgd = TableConfig(dim=128, optimizer=SparseOptimConfig(kind="adam")), TableConfig(dim=128, optimizer=SparseOptimConfig(kind="sgd"))
    assert row_bytes(adam) - row_bytes(sgd) == 2 * 128 * 4 + 8  # exp_avg, exp_avg_sq (float32) + int64 step
    assert row_bytes(sgd) == 128 * 4 + 32 + 32


def test_big_tables_row_wise_small_ones_balanced_table_wise() -> None:
    plan = plan_sharding(_tables(), world_size=4)
    assert [plan.tables[n].kind for n in ("item", "user")] == ["row_wise", "row_wise"]
    assert plan.tables["item"].ranks == [0, 1, 2, 3] and plan.tables["item"].owner_rank is None
    small = {n: plan.tables[n].ranks for n in ("genre", "city", "device")}
    assert all(p.kind == "table_wise" for n, p in plan.tables.items() if n in small)
    assert sorted(r for ranks in small.values() for r in ranks) == [0, 1, 2]  # largest first, each on the least-loaded rank
    assert small["city"] == [0]
    assert plan.tables["item"].bytes == 50_000_000 * row_bytes(_tables()[0])
    assert list(plan.tables) == [t.name for t in _tables()]  # callers' order


def test_a_table_over_its_even_share_is_row_wise_even_when_small() -> None:
    tables = [TableConfig("a", dim=16, capacity=100_000), TableConfig("b", dim=16, capacity=10)]
    plan = plan_sharding(tables, world_size=2)
    assert plan.tables["a"].kind == "row_wise" and plan.tables["b"].kind == "table_wise"
    one = plan_sharding(tables, world_size=1)
    assert {p.kind for p in one.tables.values()} == {"table_wise"} and one.tables["a"].ranks == [0]


def test_plan_prints_and_round_trips(tmp_path: Path) -> None:
    plan = plan_sharding(_tables(), world_size=4)
    text = str(plan)
    assert "item" in text and "row_wise" in text and "0-3" in text and "table_wise" in text
    assert len(text.splitlines()) == 2 + len(_tables()) + 1
    plan.save(tmp_path / "plan.json")
    assert ShardingPlan.load(tmp_path / "plan.json") == plan
    assert sum(plan.bytes_per_rank()) == pytest.approx(sum(p.bytes for p in plan.tables.values()))


def test_bad_plans_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        plan_sharding(_tables(), 0)
    with pytest.raises(ValueError, match="distinct"):
        plan_sharding([TableConfig("a"), TableConfig("a")], 2)
    data = plan_sharding(_tables(), 2).to_dict()
    data["tables"]["genre"]["ranks"] = [5]
    with pytest.raises(ValueError, match="genre"):
        ShardingPlan.from_dict(data)


def test_build_follows_the_plan() -> None:
    plan = plan_sharding(_tables()[2:], world_size=1)
    table = plan.build(TableConfig("city", dim=16, capacity=4096))
    assert isinstance(table, ShardedDynamicEmbedding) and table.owner_rank == 0
    with pytest.raises(ValueError, match="no table 'nope'"):
        plan.build(TableConfig("nope"))
    four = plan_sharding(_tables(), world_size=4)
    with pytest.raises(ValueError, match="owner_rank=2 is not a rank"):  # no process group here: world size 1
        four.build(TableConfig("genre", dim=16, capacity=64))
