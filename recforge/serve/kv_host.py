"""Host-memory pages of the KV-cache pool's host tier: a slab of fixed-size pages, reused, never reallocated.

The host tier holds pages of the same shape as the device tier's (``kv_pool.py``)::

    chunk c (one allocation, pinned on CUDA)   times  (n_c, block_size)              int64
                                               keys   (n_c, layers, block_size, H, Dqk)
                                               values (n_c, layers, block_size, H, Dv)
    page id p -> chunk p // per_chunk, row p % per_chunk

Chunks are allocated when the pool is made (``PoolConfig.host_prealloc``, the default: nothing is
allocated on the serving thread), or else as the tier first fills, and kept: an evicted
user's pages are copied into free rows, a dropped or promoted user's rows go back to the free list.
Nothing is allocated per eviction. Pinned chunks are powers of two bytes (the size PyTorch's pinned
allocator rounds every request up to), so the bytes counted are the bytes held.

Every copy is issued on the caller's current stream, ``non_blocking``: device -> host copies of an
evicted user's pages and host -> device copies of a promoted one's are ordered with the passes
that read or overwrite those device pages, and with each other (a row freed by a promotion and
reused by a later eviction is overwritten only after it was read). Nothing here reads a page on
the CPU, so nothing waits for a copy.
"""

from __future__ import annotations

import heapq
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 2**20  # largest single allocation of the slab


class HostPages:
    """The host tier's pages; see the module docstring.

    Args:
        page_shapes: ((layers, block_size, H, Dqk), (layers, block_size, H, Dv)) of one page's keys and values.
        dtype: of keys and values.
        pin: allocate page-locked memory (a CUDA device tier), so copies run asynchronously.
    """

    def __init__(self, page_shapes: tuple[tuple[int, ...], tuple[int, ...]], dtype: torch.dtype, pin: bool) -> None:
        self.key_shape, self.value_shape = page_shapes
        self.block_size = self.key_shape[1]
        self.dtype, self.pin = dtype, pin
        elem = torch.empty((), dtype=dtype).element_size()
        self._times_bytes = self.block_size * 8
        self._key_bytes = _numel(self.key_shape) * elem
        self._value_bytes = _numel(self.value_shape) * elem
        self.page_bytes = self._times_bytes + self._key_bytes + self._value_bytes
        self.per_chunk = max(1, CHUNK_BYTES // self.page_bytes)
        self.chunks: list[tuple[Tensor, Tensor, Tensor]] = []  # (times, keys, values) of each chunk
        self.free: list[int] = []  # a heap: the lowest ids first, so a user's pages tend to be consecutive
        self.allocated_bytes = 0

    @property
    def num_pages(self) -> int:
        return sum(times.shape[0] for times, _, _ in self.chunks)

    def grow(self, max_bytes: int) -> bool:
        """Allocate one more chunk of at most ``max_bytes``; False when not even one page fits."""
        cap = min(max(CHUNK_BYTES, self.page_bytes), max_bytes)  # a chunk holds at least one page
        if self.pin and cap > 0:  # the pinned allocator rounds every request up to a power of two: ask for one
            cap = 1 << (cap.bit_length() - 1)
            if cap < self.page_bytes and cap << 1 <= max_bytes:  # a page past a power of two: the next one up
                cap <<= 1
        rows = cap // self.page_bytes
        if rows < 1:
            return False
        nbytes = cap if self.pin else rows * self.page_bytes
        try:
            raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        except RuntimeError as err:  # page-locked memory refused (limits, fragmentation): the tier stops growing
            log.warning("KV cache host tier: cannot allocate %d MiB more (%s); evicted users are dropped", nbytes >> 20, err)
            return False
        a, b = rows * self._times_bytes, rows * (self._times_bytes + self._key_bytes)
        times = raw[:a].view(torch.int64).view(rows, self.block_size)
        keys = raw[a:b].view(self.dtype).view(rows, *self.key_shape)
        values = raw[b : b + rows * self._value_bytes].view(self.dtype).view(rows, *self.value_shape)
        base = len(self.chunks) * self.per_chunk
        self.chunks.append((times, keys, values))
        for page in range(base, base + rows):
            heapq.heappush(self.free, page)
        self.allocated_bytes += nbytes
        return True

    def take(self, count: int) -> list[int]:
        """``count`` free pages (the caller made sure there are enough)."""
        return [heapq.heappop(self.free) for _ in range(count)]

    def release(self, pages: list[int]) -> None:
        for page in pages:
            heapq.heappush(self.free, page)

    def store(self, pages: list[int], times: Tensor, keys: Tensor, values: Tensor, blocks: list[int]) -> None:
        """Copy device pages ``blocks`` of ``(times, keys, values)`` into host ``pages`` (asynchronously)."""
        for src, dst, n in _runs(blocks, pages, self.per_chunk):
            host = self.chunks[dst // self.per_chunk]
            row = dst % self.per_chunk
            for h, d in zip(host, (times, keys, values)):
                h[row : row + n].copy_(d[src : src + n], non_blocking=True)

    def load(self, pages: list[int], times: Tensor, keys: Tensor, values: Tensor, blocks: list[int]) -> None:
        """Copy host ``pages`` into device pages ``blocks`` of ``(times, keys, values)`` (asynchronously)."""
        for src, dst, n in _runs(pages, blocks, self.per_chunk):
            host = self.chunks[src // self.per_chunk]
            row = src % self.per_chunk
            for h, d in zip(host, (times, keys, values)):
                d[dst : dst + n].copy_(h[row : row + n], non_blocking=True)


def _runs(src: list[int], dst: list[int], per_chunk: int):
    """(src start, dst start, length) of maximal runs where both ids are consecutive and no host chunk
    boundary is crossed (``per_chunk``: host ids per chunk; checking both sides is harmless)."""
    i = 0
    while i < len(src):
        j = i + 1
        while (j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1
               and src[j] % per_chunk and dst[j] % per_chunk):  # fmt: skip
            j += 1
        yield src[i], dst[i], j - i
        i = j


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


__all__ = ["CHUNK_BYTES", "HostPages"]
