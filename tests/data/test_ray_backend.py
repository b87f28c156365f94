"""Ray Data backend: same functions, one iterator per rank, row identity and resume state kept."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from recforge.data.bad_rows import RowRules
from recforge.data.collate import JaggedCollate
from recforge.data.pipeline import Pipeline
from recforge.data.ray_backend import RayPipeline, ray_unavailable
from recforge.data.transforms import min_length, truncate_lists
from tests.data.test_pipeline import write_samples

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance (2 CPUs) for the whole test run."""
    reason = ray_unavailable()
    if reason:
        pytest.skip(f"needs Ray Data: {reason}")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


def _drain(iterators) -> list[list]:
    out = [[] for _ in iterators]

    def run(i, it):
        out[i] = list(it)

    threads = [threading.Thread(target=run, args=(i, it)) for i, it in enumerate(iterators)]  # ranks consume concurrently
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def test_ray_matches_the_local_pipeline_and_resumes(ray_session, tmp_path):
    write_samples(tmp_path, files=2, rows=300, row_group=50)
    fns = [("map", truncate_lists(["item_ids"], 5)), ("filter", min_length("item_ids", 2))]
    collate = JaggedCollate({"item_ids": "item_ids"}, dense={"user_id": "user_id"})
    local = Pipeline.from_parquet(tmp_path).map(fns[0][1]).filter(fns[1][1]).batch(1000).collate(collate)
    expected = {int(u): b.item_ids[b.seq_offsets[i] : b.seq_offsets[i + 1]].tolist()
                for b in local for i, u in enumerate(b.dense["user_id"])}  # fmt: skip

    rp = RayPipeline(tmp_path, ["user_id", "item_ids"], map_fns=fns, rules=RowRules(ids=("user_id", "item_ids")))
    per_rank = _drain(rp.rank_iterators(world_size=2, batch_size=64, collate=collate))
    assert all(len(batches) > 0 for batches in per_rank)  # both ranks got data
    got = {}
    for batches in per_rank:
        for b in batches:
            b.validate()
            for i, u in enumerate(b.dense["user_id"]):
                assert int(u) not in got
                got[int(u)] = b.item_ids[b.seq_offsets[i] : b.seq_offsets[i + 1]].tolist()
    assert got == expected
    consumed = rp.state.num_consumed
    assert consumed == len(expected)

    # resume: a state with part of the rows consumed reads only the rest
    partial = Pipeline.from_parquet(tmp_path)
    it = iter(partial.batch(100))
    first = [next(it) for _ in range(2)]
    rest = RayPipeline(tmp_path, state=partial.state_dict())
    (batches,) = _drain(rest.rank_iterators(world_size=1, batch_size=1000))
    seen = np.concatenate([b.column("__row_id__").to_numpy() for b in first + batches])
    assert len(seen) == 600 and len(np.unique(seen)) == 600
