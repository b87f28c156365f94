"""Item-feature join: embedded Arrow store and Redis (a real redis-server on loopback)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import numpy as np
import pyarrow as pa
import pytest

from recforge.data.collate import JaggedCollate
from recforge.data.feature_store import (
    ArrowFeatureStore,
    RedisFeatureStore,
    join_features,
)
from recforge.data.pipeline import Pipeline

REDIS_REQUIREMENT = "the redis-server binary on PATH and the redis Python client (.ci/run installs both)"


def items_table(n: int = 100) -> pa.Table:
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.arange(1, n + 1, dtype=np.int64) * 10)  # unsorted on purpose
    return pa.table({
        "item_id": keys,
        "category": (keys // 10 % 7).astype(np.int64),
        "price": (keys / 10).astype(np.float32),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(keys, 4).astype(np.float32)), 4),
    })  # fmt: skip


@pytest.fixture
def arrow_store(tmp_path):
    ArrowFeatureStore.write(items_table(), tmp_path / "items.arrow")
    return ArrowFeatureStore(tmp_path / "items.arrow", defaults={"category": -1, "price": 0.0})


def check_lookup(store) -> None:
    out = store.lookup(np.array([30, 5, 1000, 30, 999_999], np.int64))
    assert out.column("category").to_pylist() == [3, -1, 100 % 7, 3, -1]
    assert out.column("price").to_pylist() == [3.0, 0.0, 100.0, 3.0, 0.0]
    emb = out.column("embedding").to_pylist()
    assert emb[0] == [30.0] * 4 and emb[1] is None and emb[2] == [1000.0] * 4
    assert store.stats.lookups == 5 and store.stats.missing == 2


def test_arrow_store_lookup_defaults_and_counts(arrow_store):
    check_lookup(arrow_store)
    assert arrow_store.lookup(np.zeros(0, np.int64)).num_rows == 0


def test_arrow_store_write_rejects_bad_tables(tmp_path):
    with pytest.raises(ValueError, match="duplicate keys"):
        ArrowFeatureStore.write(pa.table({"item_id": [1, 1]}), tmp_path / "x.arrow")
    with pytest.raises(ValueError, match="integer key column"):
        ArrowFeatureStore.write(pa.table({"id": [1]}), tmp_path / "x.arrow")
    (tmp_path / "junk.arrow").write_bytes(b"not arrow")
    with pytest.raises(ValueError, match=r"junk\.arrow: cannot open the feature store"):
        ArrowFeatureStore(tmp_path / "junk.arrow")


def test_unknown_default_column(tmp_path):
    ArrowFeatureStore.write(items_table(), tmp_path / "items.arrow")
    with pytest.raises(ValueError, match="unknown feature columns"):
        ArrowFeatureStore(tmp_path / "items.arrow", defaults={"colour": 1})


def test_join_in_the_pipeline(arrow_store, tmp_path):
    import pyarrow.parquet as pq

    item_ids = pa.array([[10, 20, 5], [], [30]], pa.large_list(pa.int64()))
    pq.write_table(pa.table({"item_ids": item_ids}), tmp_path / "s.parquet")
    # thread workers: the store's lookup counters are updated in this process (process workers
    # run the join in forked children, whose counters the test cannot see)
    pipe = (
        Pipeline.from_parquet(tmp_path / "s.parquet", worker_mode="thread")
        .map(join_features(arrow_store, "item_ids", columns=["category", "price"], prefix="item_"))
        .batch(10)
        .collate(JaggedCollate({"item_ids": "item_ids", "item_category": "category", "item_price": "price"}))
    )
    (batch,) = list(pipe)
    batch.validate()
    assert batch.features["category"].tolist() == [1, 2, -1, 3]
    assert batch.features["price"].tolist() == [1.0, 2.0, 0.0, 3.0]
    assert arrow_store.stats.lookups == 4 and arrow_store.stats.missing == 1  # distinct keys only


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_client():
    redis = pytest.importorskip("redis", reason=f"needs {REDIS_REQUIREMENT}")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(f"needs {REDIS_REQUIREMENT}")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"redis-server did not answer on 127.0.0.1:{port}")
        yield client
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_redis_store_matches_the_arrow_store(redis_client):
    table = items_table()
    store = RedisFeatureStore(redis_client, table.drop_columns(["item_id"]).schema, prefix="t1:",
                              defaults={"category": -1, "price": 0.0})  # fmt: skip
    store.write(table, chunk=32)
    check_lookup(store)


def test_redis_store_rejects_variable_width_columns(redis_client):
    schema = pa.schema([("tags", pa.list_(pa.int64()))])
    with pytest.raises(ValueError, match="fixed-size list"):
        RedisFeatureStore(redis_client, schema)
