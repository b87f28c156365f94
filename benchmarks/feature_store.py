"""Feature-join lookups/s: embedded candidates (memory-mapped Arrow + sorted index, SQLite) and Redis.

Usage:
    python benchmarks/feature_store.py --items 200000 --out benchmarks/results/feature_store-cpu-2core.json

Each store holds ``--items`` items with an int64 category, a float32 price and a float32[16]
embedding. A lookup batch is ``--batch`` random keys (1% absent: they get defaults); the
result is an Arrow RecordBatch aligned with the keys, as the pipeline's ``join_features``
uses it. Redis runs as a local ``redis-server`` on loopback (skipped when not installed).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from recforge.data.feature_store import ArrowFeatureStore, RedisFeatureStore
from recforge.io import atomic_write_json

sys.path.insert(0, str(Path(__file__).parent))
from _machine import cpu_model

DIM = 16


def items_table(n: int) -> pa.Table:
    rng = np.random.default_rng(0)
    keys = rng.choice(np.arange(1, 100 * n, dtype=np.int64), n, replace=False)
    return pa.table({
        "item_id": keys,
        "category": rng.integers(0, 1000, n),
        "price": rng.random(n).astype(np.float32),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * DIM).astype(np.float32)), DIM),
    })  # fmt: skip


class SqliteFeatureStore:
    """Candidate embedded store: SQLite with an INTEGER PRIMARY KEY, ``IN (...)`` per chunk of keys."""

    def __init__(self, path: Path, table: pa.Table | None = None):
        self.db = sqlite3.connect(str(path))
        if table is not None:
            self.db.execute("CREATE TABLE items (item_id INTEGER PRIMARY KEY, category INTEGER, price REAL, embedding BLOB)")
            emb = table.column("embedding").combine_chunks().flatten().to_numpy().reshape(-1, DIM)
            rows = zip(table.column("item_id").to_pylist(), table.column("category").to_pylist(), table.column("price").to_pylist(),
                       (e.tobytes() for e in emb), strict=True)  # fmt: skip
            self.db.executemany("INSERT INTO items VALUES (?, ?, ?, ?)", rows)
            self.db.commit()

    def lookup(self, keys: np.ndarray) -> pa.RecordBatch:
        found_ids, cats, prices, embs = [], [], [], []
        for a in range(0, len(keys), 900):
            chunk = keys[a : a + 900].tolist()
            q = f"SELECT item_id, category, price, embedding FROM items WHERE item_id IN ({','.join('?' * len(chunk))})"
            for row in self.db.execute(q, chunk):
                found_ids.append(row[0]), cats.append(row[1]), prices.append(row[2]), embs.append(row[3])
        order = np.argsort(found_ids)
        ids = np.asarray(found_ids, np.int64)[order]
        pos = np.minimum(np.searchsorted(ids, keys), max(len(ids) - 1, 0))
        found = ids[pos] == keys
        category = np.where(found, np.asarray(cats, np.int64)[order][pos], -1)
        price = np.where(found, np.asarray(prices, np.float32)[order][pos], 0)
        emb = np.frombuffer(b"".join(embs), np.float32).reshape(-1, DIM)[order][pos]
        emb[~found] = 0
        return pa.RecordBatch.from_arrays(
            [pa.array(category), pa.array(price), pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), DIM)],
            names=["category", "price", "embedding"],
        )


def bench(store, key_batches: list[np.ndarray], seconds: float) -> dict:
    store.lookup(key_batches[0])  # warm-up
    n = calls = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        batch = store.lookup(key_batches[calls % len(key_batches)])
        n += batch.num_rows
        calls += 1
    elapsed = time.perf_counter() - t0
    return {"lookups": n, "calls": calls, "seconds": elapsed, "lookups_per_s": n / elapsed, "ms_per_batch": 1e3 * elapsed / calls}


def start_redis(port: int):
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return proc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", default="")
    args = p.parse_args()
    load_at_start = os.getloadavg()[0]
    table = items_table(args.items)
    rng = np.random.default_rng(1)
    keys = table.column("item_id").to_numpy()
    key_batches = []
    for _ in range(16):
        batch = rng.choice(keys, args.batch)
        absent = rng.random(args.batch) < 0.01
        batch[absent] = -rng.integers(1, 1 << 40, int(absent.sum()))
        key_batches.append(batch)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ArrowFeatureStore.write(table, Path(tmp) / "items.arrow")
        arrow = ArrowFeatureStore(Path(tmp) / "items.arrow", defaults={"category": -1, "price": 0.0})
        rows.append({"store": "Arrow IPC mmap + sorted index (embedded)", "build_s": time.perf_counter() - t0, **bench(arrow, key_batches, args.seconds)})
        t0 = time.perf_counter()
        sqlite = SqliteFeatureStore(Path(tmp) / "items.sqlite", table)
        rows.append({"store": "SQLite, INTEGER PRIMARY KEY (embedded)", "build_s": time.perf_counter() - t0, **bench(sqlite, key_batches, args.seconds)})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = start_redis(port)
        if proc is None:
            print("redis-server not installed: Redis row skipped")
        else:
            import redis

            try:
                client = redis.Redis(host="127.0.0.1", port=port)
                for _ in range(100):
                    try:
                        client.ping()
                        break
                    except redis.ConnectionError:
                        time.sleep(0.05)
                else:
                    raise RuntimeError(f"redis-server did not answer on 127.0.0.1:{port}")
                t0 = time.perf_counter()
                store = RedisFeatureStore(client, table.drop_columns(["item_id"]).schema, defaults={"category": -1, "price": 0.0})
                store.write(table)
                rows.append({"store": "Redis 7 on loopback, MGET (networked)", "build_s": time.perf_counter() - t0,
                             "server": client.info()["redis_version"], **bench(store, key_batches, args.seconds)})  # fmt: skip
            finally:
                proc.terminate()
                proc.wait(timeout=10)
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    print(f"\nfeature lookups: {args.items} items (int64, float32, float32[{DIM}]), batches of {args.batch} keys, 1% absent; "
          f"{machine}; 1-min load average at start {load_at_start:.2f}")  # fmt: skip
    print(f"{'store':44s} {'build s':>8s} {'lookups/s':>12s} {'ms/batch':>9s}")
    for r in rows:
        print(f"{r['store']:44s} {r['build_s']:8.2f} {r['lookups_per_s']:12,.0f} {r['ms_per_batch']:9.2f}")
    if args.out:
        payload = {"benchmark": "feature_store", "command": "python " + " ".join(sys.argv), "machine": machine,
                   "pyarrow": pa.__version__, "sqlite": sqlite3.sqlite_version, "date": datetime.date.today().isoformat(),
                   "load_average_at_start": load_at_start, "args": vars(args), "rows": rows}  # fmt: skip
        atomic_write_json(Path(args.out), payload)


if __name__ == "__main__":
    main()
