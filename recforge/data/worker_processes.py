"""Process reader workers (see ``recforge.data.workers``): forked processes, results passed as
Arrow IPC streams in memfds over Unix sockets, credit-based flow control, memfd reuse.

::

    consumer                              worker k (tasks k, k+W, k+2W, ...)
      b"c" (credit) ───────────────────►  run(task) → Arrow IPC into a memfd (a reused one if free)
      recv_fds ◄── (id, sizes) + memfd ──  send_fds
      mmap → RecordBatch (zero-copy)
      b"r"+id when its batches are freed ─► the memfd is free for a later task

Bounded resources: a consumer's mapping holds no file descriptor (so batches kept by the caller
cost no descriptors); a worker keeps at most ``LENT_MAX`` descriptors of memfds lent to the
consumer and ``keep`` free ones, shrinks a reused memfd to what its task needs, and closes its free ones
once the consumer has been idle for ``IDLE_RELEASE_S``. Workers forked for one iteration close
the sockets of every other iteration still running in this process (an eval pipeline next to the
training one, a new epoch while the old one drains), so each iteration's workers see its end.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import multiprocessing as mp
import os
import pickle
import select
import signal
import socket
import struct
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator

import pyarrow as pa

from recforge.data.workers import Task, TaskResult

log = logging.getLogger(__name__)
_MESSAGE = struct.Struct("qqqq")  # memfd id, header bytes, offset of the IPC stream, IPC stream bytes
_ID = struct.Struct("q")
_ALIGN = 64  # the IPC stream starts aligned, so its (8-byte padded) buffers are read in place, zero-copy
IDLE_RELEASE_S = 1.0  # a worker that heard nothing from its consumer for this long closes its free memfds
LENT_MAX = 32  # memfds lent to the consumer that a worker keeps open for reuse (the rest are closed once sent)
_OPEN: set[socket.socket] = set()  # this process's sockets of running iterations (closed in forked workers)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


class _Mapping:
    """A private copy-on-write mapping of a memfd that, unlike ``mmap.mmap`` (which keeps a duplicate of
    the descriptor), holds no file descriptor. Unmapped, and its memfd released to the worker, when the
    last buffer viewing it is freed."""

    __slots__ = ("address", "size", "__weakref__")

    def __init__(self, fd: int, size: int, sock: socket.socket, key: int) -> None:
        # private: a caller writing into a batch tensor in place gets its own pages (no SIGSEGV), and never
        # writes into the memfd the worker reuses
        address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mapping a pipeline worker's result ({size} bytes) failed: {os.strerror(err)}")
        self.address, self.size = address, size
        # not at exit: a batch still alive then may be read by later exit code; the process's end unmaps it
        weakref.finalize(self, _unmap, address, size, sock, key).atexit = False

    def buffer(self) -> pa.Buffer:
        return pa.foreign_buffer(self.address, self.size, base=self)


def _unmap(address: int, size: int, sock: socket.socket, key: int) -> None:
    _libc.munmap(address, size)
    _release(sock, key)


class _WorkerChannel:
    """A worker's end of its socket: credits and releases in, results out, and a pool of memfds.

    The consumer sends ``b"c"`` (a credit: start one more task) and ``b"r" + id`` (memfd ``id`` is
    no longer mapped: its batches were freed). A released memfd is rewritten for a later task, so
    its pages are allocated once instead of being allocated here and freed in the consumer for
    every task (that freeing cost the consumer about a third of its time per batch).
    """

    def __init__(self, sock: socket.socket, parent_pid: int, keep: int) -> None:
        self.sock, self.parent_pid, self.keep = sock, parent_pid, keep
        self.credits = 0
        self.lent: dict[int, int] = {}  # memfd id -> fd, mapped by the consumer (at most ``LENT_MAX``)
        self.free: list[tuple[int, int, int]] = []  # (id, fd, size) ready for reuse (at most ``keep``)
        self.next_id = 0
        sock.settimeout(IDLE_RELEASE_S)

    def _handle(self, msg: bytes) -> None:
        if msg == b"c":
            self.credits += 1
        else:
            key = _ID.unpack(msg[1:])[0]
            fd = self.lent.pop(key, None)
            if fd is None:  # not kept for reuse (the consumer held more than ``LENT_MAX``): already closed
                return
            if len(self.free) < self.keep:
                self.free.append((key, fd, os.fstat(fd).st_size))
            else:
                os.close(fd)

    def release_free(self) -> None:
        """The consumer is idle: give the free memfds' memory back instead of holding it at its peak."""
        for _, fd, _ in self.free:
            os.close(fd)
        self.free.clear()

    def _recv(self, block: bool) -> bool:
        """Handle one message; False when the consumer is gone (or, without ``block``, nothing is queued)."""
        if not block and not select.select([self.sock], [], [], 0)[0]:
            return False
        while True:
            try:
                msg = self.sock.recv(16)
            except TimeoutError:
                if os.getppid() != self.parent_pid:
                    return False
                self.release_free()
                continue
            except (ConnectionResetError, BrokenPipeError):
                return False
            if not msg:
                return False
            self._handle(msg)
            return True

    def wait_for_credit(self) -> bool:
        while self._recv(block=False):  # releases queued while the last task ran
            pass
        while self.credits == 0:
            if not self._recv(block=True):
                return False
        self.credits -= 1
        return True

    def wait_for_close(self) -> None:
        """Stay until the consumer closes its end: exiting earlier with unread messages (releases
        of freed batches) would reset the socket before the consumer has read our last results."""
        while self._recv(block=True):
            pass

    def send(self, result: TaskResult | None, error: BaseException | None) -> None:
        """Write one result (pickled header + Arrow IPC stream) into a memfd and pass its descriptor."""
        batch = result.batch if result is not None else None
        meta = (result.index, result.cuts, result.bad_rows) if result is not None else None
        # our own forked child talks to its parent: the same trust boundary as multiprocessing's pickles
        header = pickle.dumps((meta, _portable(error)), protocol=pickle.HIGHEST_PROTOCOL)
        start = -(-len(header) // _ALIGN) * _ALIGN
        body = None
        if batch is not None:
            # serialise into (reused, allocator-cached) memory, then one write into the memfd: cheaper
            # than faulting in shared pages while Arrow writes through a memory map
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batch.schema) as writer:
                writer.write_batch(batch)
            body = sink.getvalue()
        size = body.size if body is not None else 0
        need = start + size
        if self.free:
            key, fd, capacity = self.free.pop()
        else:
            key, fd, capacity = self.next_id, os.memfd_create("recforge-task", os.MFD_CLOEXEC), 0
            self.next_id += 1
        if capacity < need or capacity > 2 * need:  # grow, or shrink a buffer kept from a larger task
            os.ftruncate(fd, need)
        _write_all(fd, memoryview(header), 0)
        if body is not None:
            _write_all(fd, memoryview(body), start)
        socket.send_fds(self.sock, [_MESSAGE.pack(key, len(header), start, size)], [fd])
        if len(self.lent) < LENT_MAX:
            self.lent[key] = fd
        else:  # the consumer holds many results: this one's memory is freed with its mapping, not reused
            os.close(fd)


def _portable(error: BaseException | None) -> BaseException | None:
    """``error`` if it survives a pickle round trip, else a RuntimeError carrying its type, message and
    the worker's traceback text (an exception with extra ``__init__`` arguments pickles but cannot be
    unpickled; one holding a lock or a file cannot be pickled)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL))  # noqa: S301 - our own bytes
        return error
    except Exception as err:  # noqa: BLE001 - any failure to cross the process boundary: sent as text instead
        log.debug("worker exception %s cannot cross the process boundary (%s: %s); sending a RuntimeError with its "
                  "type, message and traceback", type(error).__name__, type(err).__name__, err)  # fmt: skip
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - even str() may fail on a broken exception
        message = "<str() of the exception failed>"
    notes = "\n".join(str(n) for n in getattr(error, "__notes__", []))
    name = f"{type(error).__module__}.{type(error).__qualname__}"
    return RuntimeError(f"{name}: {message} (the exception could not be passed between processes as it is)\n{notes}")


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _release(sock: socket.socket, key: int) -> None:
    """The consumer's mapping of memfd ``key`` is gone: the worker may reuse it."""
    try:
        sock.send(b"r" + _ID.pack(key))
    except OSError:
        pass  # the iteration is over (socket closed) or the worker exited: nothing to reuse


def _receive(sock: socket.socket, worker: int) -> TaskResult:
    try:
        msg, fds, _, _ = socket.recv_fds(sock, _MESSAGE.size, 1)
    except ConnectionResetError:
        msg, fds = b"", []
    if not msg or not fds:
        raise RuntimeError(
            f"pipeline reader worker {worker} exited without sending its result (killed, or out of memory?); "
            "see its stderr above, or run with worker_mode='thread' to debug in-process"
        )
    key, hlen, start, size = _MESSAGE.unpack(msg)
    try:
        mapping = _Mapping(fds[0], start + size, sock, key)
    except OSError:
        _release(sock, key)  # never mapped: the worker may reuse (or close) its memfd
        raise
    finally:
        os.close(fds[0])
    buffer = mapping.buffer()
    del mapping  # the buffer (and every batch viewing it) keeps the mapping alive
    try:
        meta, error = pickle.loads(buffer.slice(0, hlen).to_pybytes())  # noqa: S301 - from our own forked worker
    except Exception as err:  # noqa: BLE001 - a result that cannot be read is the worker's failure, said as such
        raise RuntimeError(f"pipeline reader worker {worker} sent a result that cannot be read: {type(err).__name__}: {err}") from err
    if error is not None:
        raise error
    index, cuts, bad_rows = meta
    # zero-copy: the batch's buffers point into the mapping, which lives as long as they do
    batch = pa.ipc.open_stream(buffer.slice(start, size)).read_next_batch() if size else None
    return TaskResult(index, batch, cuts, bad_rows)


def _worker_main(run: Callable[[Task], TaskResult], tasks: list[Task], socks: list[tuple[socket.socket, socket.socket]],
                 k: int, parent_pid: int, depth: int) -> None:  # fmt: skip
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the consumer, which closes our socket
    torch_module = sys.modules.get("torch")
    if torch_module is not None:  # a fork inherits torch's thread pool in a broken state: a parallel op in a map
        torch_module.set_num_threads(1)  # would hang forever (as torch's DataLoader workers, use one thread)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # never run the parent's handlers (e.g. save on preemption)
    for other in list(_OPEN):  # keep only our end, of this and of every other running iteration: EOF
        if other is not socks[k][1]:  # must reach whoever waits
            other.close()
    _OPEN.clear()
    channel = _WorkerChannel(socks[k][1], parent_pid, keep=depth + 2)
    for task in tasks:
        if not channel.wait_for_credit():
            return
        try:
            result, error = run(task), None
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            err.add_note(f"raised in pipeline reader worker {k} (pid {os.getpid()}), task {task.index}:\n{traceback.format_exc()}")
            result, error = None, err
        try:
            channel.send(result, error)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            return
        if error is not None:
            break
    channel.wait_for_close()


def process_results(run: Callable[[Task], TaskResult], tasks: list[Task], num_workers: int, depth: int) -> Iterator[TaskResult]:
    """Fork ``num_workers`` workers (worker k runs tasks k, k+W, ...); yield the results in task order."""
    ctx = mp.get_context("fork")
    socks = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(num_workers)]
    _OPEN.update(s for pair in socks for s in pair)
    procs = []
    try:
        for k in range(num_workers):
            proc = ctx.Process(target=_worker_main, args=(run, tasks[k::num_workers], socks, k, os.getpid(), depth),
                               name=f"recforge-read-{k}", daemon=True)  # fmt: skip
            proc.start()
            procs.append(proc)
        for _, child_end in socks:
            child_end.close()
            _OPEN.discard(child_end)
        # never more credits than a worker has tasks: a socket closed with unread credits resets its peer
        owed = [len(tasks[k::num_workers]) for k in range(num_workers)]
        for k, (parent_end, _) in enumerate(socks):
            for _ in range(min(depth, owed[k])):
                parent_end.send(b"c")
            owed[k] -= min(depth, owed[k])
        for i in range(len(tasks)):
            k = i % num_workers
            result = _receive(socks[k][0], k)
            if owed[k]:
                socks[k][0].send(b"c")
                owed[k] -= 1
            yield result
    finally:
        for parent_end, child_end in socks:
            _OPEN.discard(parent_end)
            _OPEN.discard(child_end)
            parent_end.close()
            child_end.close()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
