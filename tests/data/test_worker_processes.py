"""Worker-process mode under stress: overlapping pipelines, worker errors, per-task randomness,
file descriptors and shared memory over a run, the plan hand-over, token shares after maps."""

from __future__ import annotations

import os
import pickle
import random
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

import recforge.data.worker_processes as worker_processes
from recforge.data.pipeline import Pipeline
from recforge.data.stages import task_rng
from recforge.data.transforms import truncate_lists
from tests.data.test_pipeline import write_samples
from tests.data.test_workers import _skewed_files


def _pipe(directory, **kw) -> Pipeline:
    return Pipeline.from_parquet(directory, num_workers=2, worker_mode="process", seed=kw.pop("seed", 3), **kw)


def test_a_second_pipeline_does_not_keep_the_first_ones_workers_alive(tmp_path):
    """Eval during training: pipeline B's workers, forked while A runs, must not hold A's sockets open
    (A's workers then never see their end of the iteration, and closing A waited 5 s per worker)."""
    write_samples(tmp_path, files=3, rows=1000, row_group=50)
    a = iter(_pipe(tmp_path).shuffle(100).batch(20))
    next(a)
    b = iter(_pipe(tmp_path, seed=4).shuffle(100).batch(20))
    next(b)
    start = time.monotonic()
    a.close()
    assert time.monotonic() - start < 2.0
    assert 1 + sum(batch.num_rows for batch in b) == 3000 - 19


def test_a_new_epoch_while_the_old_one_drains_in_the_prefetch_thread(tmp_path):
    write_samples(tmp_path, files=3, rows=1000, row_group=50)
    pipe = _pipe(tmp_path).shuffle(100).batch(20).prefetch(2)
    start = time.monotonic()
    for _ in range(3):  # each epoch stops early: the old generator is closed while the next one forks
        it = iter(pipe)
        next(it)
        del it
    assert sum(b.num_rows for b in pipe) > 0
    assert time.monotonic() - start < 8.0


class NeedsTwoArguments(Exception):
    """Pickles, but cannot be unpickled (``Exception.__reduce__`` passes only the message)."""

    def __init__(self, row: int, why: str) -> None:
        super().__init__(f"row {row}: {why}")


class HoldsALock(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()  # cannot be pickled


def _raise_needs_two(rb):
    raise NeedsTwoArguments(7, "negative item id in the history")


def _raise_holds_lock(rb):
    raise HoldsALock("the feature store is closed")


@pytest.mark.parametrize(("fn", "message"), [(_raise_needs_two, "row 7: negative item id in the history"),
                                             (_raise_holds_lock, "the feature store is closed")])  # fmt: skip
def test_a_worker_exception_that_cannot_cross_processes_reaches_the_caller(tmp_path, fn, message):
    write_samples(tmp_path)
    with pytest.raises(BaseException) as info:  # noqa: PT011 - the type is what is being checked below
        list(_pipe(tmp_path).map(fn).batch(10))
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert message in text
    assert fn.__name__ in text  # the worker's traceback text names the function that raised
    assert "pipeline reader worker" in text


def _draws(rb: pa.RecordBatch) -> pa.RecordBatch:
    """An augmentation drawing from the global generators and from ``task_rng()``."""
    n = rb.num_rows
    return (rb.append_column("np", pa.array(np.random.random(n)))
              .append_column("py", pa.array([random.random() for _ in range(n)]))
              .append_column("torch", pa.array(torch.rand(n).numpy().astype(np.float64)))
              .append_column("task", pa.array(task_rng().random(n))))  # fmt: skip


def _epoch_draws(pipe_iter) -> dict[str, np.ndarray]:
    out: dict[str, list] = {}
    rows = []
    for rb in pipe_iter:
        rows.append(rb.column("__row_id__").to_numpy())
        for k in ("np", "py", "torch", "task"):
            out.setdefault(k, []).append(rb.column(k).to_numpy())
    order = np.argsort(np.concatenate(rows))
    return {k: np.concatenate(v)[order] for k, v in out.items()}


def test_worker_randomness_differs_per_epoch_and_worker_and_is_reproducible(tmp_path):
    write_samples(tmp_path, files=2, rows=400, row_group=50)
    pipe = _pipe(tmp_path, seed=11).map(_draws).shuffle(100).batch(25)
    first, second = _epoch_draws(pipe), _epoch_draws(pipe)
    again = _epoch_draws(_pipe(tmp_path, seed=11).map(_draws).shuffle(100).batch(25))
    for k in first:
        assert not np.allclose(first[k], second[k]), k  # epoch 1 and epoch 2 draw differently
        assert np.array_equal(first[k], again[k]), k  # the same (seed, epoch) draws the same
        assert len(np.unique(first[k])) > 0.99 * len(first[k]), k  # the two workers do not repeat each other
    # task_rng() is seeded per task: the same draws in thread mode and with any number of workers
    threads = _epoch_draws(Pipeline.from_parquet(tmp_path, num_workers=3, seed=11).map(_draws).shuffle(100).batch(25))
    assert np.array_equal(threads["task"], first["task"])


def test_worker_randomness_after_a_resume_is_reproduced_by_the_same_resume(tmp_path):
    write_samples(tmp_path, files=2, rows=400, row_group=50)
    pipe = _pipe(tmp_path, seed=2).map(_draws).shuffle(100).batch(25)
    it = iter(pipe)
    for _ in range(5):
        next(it)
    pipe_state = pipe.state_dict()
    it.close()
    resumed = [_epoch_draws(_pipe(tmp_path, seed=2, state=pipe_state).map(_draws).shuffle(100).batch(25)) for _ in range(2)]
    for k in resumed[0]:
        assert np.array_equal(resumed[0][k], resumed[1][k]), k


def _fds(pid: int | str = "self") -> list[str]:
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except FileNotFoundError:
            continue
    return out


def _reader_pids() -> list[int]:
    import multiprocessing

    return [p.pid for p in multiprocessing.active_children() if p.name.startswith("recforge-read")]


def test_held_batches_do_not_hold_a_file_descriptor_each(tmp_path):
    """A caller keeping batches (a replay cache, a list(...)) must not run the process (or a worker) out of
    file descriptors: a mapping of a result holds no descriptor, and a worker keeps a bounded pool."""
    write_samples(tmp_path, files=4, rows=1000, row_group=25)
    before = len(_fds())
    held, worker_fds = [], 0
    for i, batch in enumerate(_pipe(tmp_path).shuffle(50).batch(50)):
        held.append(batch)  # 80 tasks' memory, all held: more than a worker keeps
        if i == 70:
            worker_fds = max(sum("memfd" in link for link in _fds(pid)) for pid in _reader_pids())
    assert len(held) == 80
    assert len(_fds()) - before < 8
    assert worker_fds <= worker_processes.LENT_MAX + 4  # lent ones kept for reuse, and free ones (depth + 2)
    assert sum(b.num_rows for b in held) == 4000


def test_idle_workers_give_back_their_shared_memory(tmp_path, monkeypatch):
    """Free shared-memory buffers do not stay at their peak size: a worker shrinks a reused buffer to what
    the task needs and closes its free ones when the consumer has been idle."""
    import recforge.data.read_tasks as read_tasks

    monkeypatch.setattr(worker_processes, "IDLE_RELEASE_S", 0.3)
    monkeypatch.setattr(read_tasks, "DEFAULT_TASK_ROWS", 100)  # one row group (one batch) per task
    rng = np.random.default_rng(0)
    for f, length in enumerate([400, 2, 2]):  # the first file's tasks are ~200x larger than the others'
        rows = 400
        off = np.arange(rows + 1, dtype=np.int64) * length
        table = pa.table({"user_id": np.arange(rows, dtype=np.int64),
                          "item_ids": pa.LargeListArray.from_arrays(pa.array(off), pa.array(rng.integers(1, 9, off[-1])))})  # fmt: skip
        import pyarrow.parquet as pq

        pq.write_table(table, tmp_path / f"part-{f}.parquet", row_group_size=100)
    pipe = Pipeline.from_parquet(tmp_path, num_workers=1, worker_mode="process").batch(100)
    it = iter(pipe)
    held = [next(it) for _ in range(8)]  # the 4 large tasks and the first small ones
    time.sleep(0.1)
    del held  # freed together while the worker waits for a credit: its free buffers include the large ones
    time.sleep(1.0)  # the consumer is idle (a long eval, a checkpoint)
    (pid,) = _reader_pids()
    sizes = [os.stat(f"/proc/{pid}/fd/{n}").st_size for n in os.listdir(f"/proc/{pid}/fd")
             if "memfd" in os.readlink(f"/proc/{pid}/fd/{n}")]  # fmt: skip
    large_task = 100 * 400 * 8
    assert sum(sizes) < large_task, sizes  # no free buffer kept at the large tasks' size
    assert len(sizes) <= 3, sizes  # only the results in flight (credits) and the one the consumer is on
    rest = sum(b.num_rows for b in it)
    assert rest == 400 * 3 - 8 * 100


def test_the_epoch_plan_is_never_pickled_for_the_workers(tmp_path, monkeypatch):
    """Workers are forked per epoch and inherit the plan (units, keep masks: O(rows)) copy-on-write; no
    part of it is serialised per worker. Guard: the task runner refuses to be pickled."""
    from recforge.data.read_tasks import TaskRunner

    def refuse(self):
        raise AssertionError("the epoch plan was pickled")

    monkeypatch.setattr(TaskRunner, "__reduce__", refuse)
    write_samples(tmp_path)
    with pytest.raises(AssertionError):
        pickle.dumps(TaskRunner.__new__(TaskRunner))
    assert sum(b.num_rows for b in _pipe(tmp_path).shuffle(100).batch(50)) == 1500


def _token_batch_counts(directory, world: int, truncate) -> tuple[list[int], np.ndarray]:
    counts, rows = [], []
    for rank in range(world):
        pipe = Pipeline.from_parquet(directory, rank=rank, world_size=world, seed=1).map(truncate).shuffle(120)
        batches = list(pipe.batch(token_budget=400))
        counts.append(len(batches))
        rows.append(np.concatenate([b.column("__row_id__").to_numpy() for b in batches]))
    return counts, np.concatenate(rows)


@pytest.mark.parametrize("world", [2, 3])
def test_token_shares_use_the_lengths_after_the_maps(tmp_path, world):
    """With a truncating map, ranks' token shares must be balanced on the truncated lengths: the files'
    lengths (up to 140 here, 20 after the map) would give ranks very different numbers of batches."""
    _skewed_files(tmp_path)
    truncate = truncate_lists(["item_ids"], 20)
    counts, rows = _token_batch_counts(tmp_path, world, truncate)
    assert max(counts) - min(counts) <= 1, counts
    assert len(rows) == 1200 and len(np.unique(rows)) == 1200  # each rank its own rows, every row once
    # the test can fail: a map that does not say how it changes lengths is balanced on the files' lengths
    blind, rows = _token_batch_counts(tmp_path, world, lambda rb: truncate(rb))
    assert max(blind) - min(blind) > 2, blind
    assert len(np.unique(rows)) == 1200


def test_a_result_that_cannot_be_mapped_releases_its_memfd(monkeypatch):
    """The consumer fails to map a worker's result (e.g. ENOMEM): the error reaches the caller and the worker is told
    the memfd is free again (it used to stay lent, one descriptor and its memory per failure)."""
    import ctypes
    import os
    import socket

    import recforge.data.worker_processes as wp

    class _FailingLibc:
        @staticmethod
        def mmap(*args):
            ctypes.set_errno(12)
            return ctypes.c_void_p(-1).value

    consumer, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.memfd_create("result")
    os.write(fd, b"x" * 64)
    key = 7 + int.from_bytes(os.urandom(1), "little")
    socket.send_fds(worker, [wp._MESSAGE.pack(key, 8, 8, 56)], [fd])
    monkeypatch.setattr(wp, "_libc", _FailingLibc)
    with pytest.raises(OSError, match="mapping a pipeline worker's result"):
        wp._receive(consumer, 0)
    worker.settimeout(5)  # no release sent: fail, not hang
    assert worker.recv(64) == b"r" + wp._ID.pack(key)
    os.close(fd)
    consumer.close()
    worker.close()
