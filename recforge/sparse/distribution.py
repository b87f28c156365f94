"""Phase 1 of a sharded lookup: a rank's IDs deduplicated and sent to their owners (``ShardedDynamicEmbedding.distribute``).

One sort-based local dedup with no host sync (``sorted_send``), one all-to-all of split sizes whose host
read is the sender's one sync (``exchange_splits``), then the (key, tag, occurrences, first part) rows'
all-to-all, started and not awaited: the ``DistributedIds`` handle that ``stage`` and ``lookup`` finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from recforge.sparse.ids import check_ids, raise_negative, unique_keys
from recforge.sparse.routing import DistributedIds

if TYPE_CHECKING:
    from recforge.sparse.sharded import ShardedDynamicEmbedding


def distribute(table: ShardedDynamicEmbedding, ids: Tensor | Sequence[Tensor], tags: Tensor | None = None, *,
               group: dist.ProcessGroup | None = None, standin: bool | None = None) -> DistributedIds:  # fmt: skip
    """``table.distribute``: local dedup and the all-to-all of unique IDs to their owners (started, not awaited)."""
    parts = bounds = None
    if isinstance(ids, (list, tuple)):
        if tags is not None:
            raise ValueError("ShardedDynamicEmbedding.distribute: a combined lookup (a list of id tensors) takes no tags")
        parts = [check_ids(t, negatives=False) for t in ids]
        flat = torch.cat([t.reshape(-1).to(table.device) for t in parts]) if parts else torch.zeros(0, dtype=torch.int64,
                                                                                                    device=table.device)  # fmt: skip
        bounds = [0]
        for t in parts:
            bounds.append(bounds[-1] + t.numel())
        shape, parts = flat.shape, [t.shape for t in parts]
    else:
        ids = check_ids(ids, negatives=False)  # negative IDs are caught at the split sizes' host sync
        flat, shape = ids.reshape(-1).to(table.device), ids.shape
    flat_tags = None if tags is None else tags.reshape(-1).to(table.device, torch.int64)
    if not table.collective:
        if parts is not None:
            raise ValueError("ShardedDynamicEmbedding.distribute: a combined lookup needs a process group (without one the "
                             "table is a plain DynamicEmbedding: look each tensor up with forward)")  # fmt: skip
        return DistributedIds(shape, ids=flat, tags=flat_tags, has_tags=tags is not None)
    group = group or table.group
    standin = table.standin_here if standin is None else standin
    if flat_tags is None:
        send, position, owner_counts, smallest = sorted_send(flat, table.world_size, table.owners, bounds)  # send: (u) -> (u, 4)
    else:
        keys, key_tags, inverse, occurrences = unique_keys(flat, flat_tags)
        owner = table.owners(keys, key_tags)  # (U,)
        order = torch.argsort(owner, stable=True)
        rows = torch.stack([keys[order], key_tags[order], occurrences[order], torch.zeros_like(keys)], 1)  # (U, 4)
        send = lambda u: rows  # noqa: E731
        position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))[inverse]
        owner_counts = torch.bincount(owner, minlength=table.world_size)
        smallest = keys.min().view(1) if keys.numel() else keys.new_zeros(1)
    send_splits, recv_splits, smallest = exchange_splits(owner_counts, smallest, table.world_size, group)
    if smallest < 0:
        raise_negative(flat)
    send = send(sum(send_splits))  # the distinct keys' rows, by owner
    if standin:
        send[:, 2] = 0  # (send is this call's own tensor)
    received = send.new_empty(sum(recv_splits), 4)
    work = dist.all_to_all_single(received, send, recv_splits, send_splits, group=group, async_op=True)
    return DistributedIds(shape, parts, bounds, has_tags=tags is not None, position=position, send_splits=send_splits,
                          recv_splits=recv_splits, received=received, work=work)  # fmt: skip


def sorted_send(flat: Tensor, world_size: int, owners: Callable[[Tensor, Tensor], Tensor], bounds: list[int] | None = None,
                ) -> tuple[Callable[[int], Tensor], Tensor, Tensor, Tensor]:  # fmt: skip
    """Local dedup without a host sync: (``send(U)``: the (U, 4) rows (key, 0, occurrences, first part) of the U
    distinct keys ordered by owner then key, each id's index among them (N,), distinct keys per owner (W,),
    smallest id (1,)). ``owners(keys, tags)``: each key's owning rank. ``bounds``: where each part of a combined
    lookup starts in ``flat``, then N (None or one part: all part 0). The rows are gathered only once U is known
    (the split sizes' sync): U, not N, of them.

    A stable sort puts each key's first occurrence first among its copies: its part is the lowest the key
    occurs in (parts are back to back in ``flat``), read for the U distinct keys only.
    """
    n, w = flat.numel(), world_size
    if n == 0:
        empty = flat.new_zeros(0)
        return lambda u: flat.new_zeros(0, 4), empty, flat.new_zeros(w), flat.new_zeros(1)
    several = bounds is not None and len(bounds) > 2
    sorted_ids, sort_order = torch.sort(flat, stable=several)
    start = torch.ones(n, dtype=torch.bool, device=flat.device)
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=start[1:])
    group = torch.cumsum(start, 0)
    group -= 1  # (N,) distinct-key index of each sorted id
    occurrences = torch.zeros(n, dtype=torch.int64, device=flat.device).index_add_(0, group, torch.ones_like(group))

    def rows(at: Tensor, occ: Tensor) -> Tensor:
        """(U, 4) send rows of the distinct keys whose first sorted ids are ``at`` and occurrences ``occ``."""
        out = torch.zeros(at.numel(), 4, dtype=torch.int64, device=flat.device)
        out[:, 0] = sorted_ids[at]
        out[:, 2] = occ
        if several:  # the part of each key's first occurrence: the part starts at or before it (no host copy)
            first = sort_order[at]
            for start_of_part in bounds[1:-1]:
                out[:, 3] += first >= start_of_part
        return out

    if w == 1:  # one owner: the send order is the sorted order, each id's row is its key's index
        position = torch.empty_like(group).index_copy_(0, sort_order, group)  # (N,) in the ids' order
        firsts = torch.zeros(n + 1, dtype=torch.int64, device=flat.device)  # [g]: key g's first sorted id; [N]: scratch
        firsts.scatter_(0, torch.where(start, group, n), torch.arange(n, device=flat.device))
        return (lambda u: rows(firsts[:u], occurrences[:u])), position, group[-1:] + 1, sorted_ids[:1]
    owner = torch.where(start, owners(sorted_ids, torch.zeros_like(sorted_ids)), w)  # (N,) repeats: past the ranks
    order = torch.argsort(owner, stable=True)  # distinct keys by owner (ascending keys within), then the repeats
    index_of = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=flat.device))  # sorted id -> its row in send
    first = torch.cummax(torch.where(start, torch.arange(n, device=flat.device), 0), 0).values  # its key's first sorted id
    position = torch.empty_like(order).index_copy_(0, sort_order, index_of[first])  # (N,) in the ids' order

    def send(u: int) -> Tensor:
        at = order[:u]  # the distinct keys' first sorted ids, by owner
        return rows(at, occurrences[group[at]])

    counts = torch.zeros(w + 1, dtype=torch.int64, device=flat.device).index_add_(0, owner, torch.ones_like(owner))
    return send, position, counts[:w], sorted_ids[:1]  # (index_add_: bincount syncs on CUDA)


def exchange_splits(send_counts: Tensor, smallest: Tensor, world_size: int, group: dist.ProcessGroup | None,
                    ) -> tuple[list[int], list[int], int]:  # fmt: skip
    """(keys this rank sends to each rank, keys it receives from each, ``smallest`` (1,)): one all-to-all
    of counts, one host sync."""
    w = world_size
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    facts = torch.cat([send_counts, recv_counts, smallest]).tolist()
    return facts[:w], facts[w : 2 * w], facts[-1]
