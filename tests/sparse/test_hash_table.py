"""Both (tag, key) indexes (IdHashTable, SortedIdIndex) against a Python dict on random IDs (huge values, tags, deletes, growth)."""

from __future__ import annotations

import pytest
import torch

from recforge.sparse.hash_table import IdHashTable
from recforge.sparse.sorted_index import SortedIdIndex, index_kind, make_index

KINDS = ["hash", "sorted"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_dict_reference(seed: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    table, ref = make_index(8, "cpu", kind), {}
    for it in range(12):
        high = 2**63 - 1 if it % 2 else 300  # huge IDs and dense small ones (many collisions/duplicates)
        keys = torch.randint(0, high, (400,), generator=gen, dtype=torch.int64)
        tags = torch.randint(0, 3, (400,), generator=gen)
        pairs = list(dict.fromkeys(zip(keys.tolist(), tags.tolist(), strict=True)))
        k = torch.tensor([p[0] for p in pairs])
        t = torch.tensor([p[1] for p in pairs])
        found = table.lookup(k, t)
        assert found.tolist() == [ref.get(p, -1) for p in pairs]
        new = found < 0
        values = torch.arange(len(ref), len(ref) + int(new.sum())) + 1000 * it
        table.insert(k[new], t[new], values)
        ref.update(zip([p for p, n in zip(pairs, new.tolist(), strict=True) if n], values.tolist(), strict=True))
        if it % 3 == 2:  # delete a random third
            gone = [p for i, p in enumerate(ref) if i % 3 == 0]
            assert table.delete(torch.tensor([p[0] for p in gone]), torch.tensor([p[1] for p in gone])) == len(gone)
            for p in gone:
                del ref[p]
        assert table.size == len(ref)
    keys, tags, values = table.items()
    assert dict(zip(zip(keys.tolist(), tags.tolist(), strict=True), values.tolist(), strict=True)) == ref


@pytest.mark.parametrize("kind", KINDS)
def test_same_key_different_tag_is_a_different_entry(kind: str) -> None:
    table = make_index(16, "cpu", kind)
    table.insert(torch.tensor([7, 7]), torch.tensor([0, 1]), torch.tensor([10, 11]))
    assert table.lookup(torch.tensor([7, 7, 7]), torch.tensor([1, 0, 2])).tolist() == [11, 10, -1]
    table.insert(torch.tensor([7, 3]), torch.tensor([2, 1]), torch.tensor([12, 13]))  # a third tag of 7
    assert table.lookup(torch.tensor([7, 7, 7, 3, 3]), torch.tensor([1, 0, 2, 1, 0])).tolist() == [11, 10, 12, 13, -1]
    assert table.lookup(torch.tensor([7, 9]), None).tolist() == [10, -1]  # tags=None: tag 0


@pytest.mark.parametrize("kind", KINDS)
def test_untagged_calls_match_zero_tags(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    table, ref = make_index(8, "cpu", kind), {}
    for it in range(6):
        keys = torch.randint(0, 2**63 - 1 if it % 2 else 50, (64,), generator=gen).unique()
        found = table.lookup(keys, None)
        assert found.tolist() == [ref.get(k, -1) for k in keys.tolist()]
        assert torch.equal(found, table.lookup(keys, torch.zeros_like(keys)))
        new = keys[found < 0]
        table.insert(new, None, new % 1000)
        ref.update({k: k % 1000 for k in new.tolist()})
        gone = keys[::4]
        assert table.delete(gone, None) == sum(k in ref for k in gone.tolist())
        for k in gone.tolist():
            ref.pop(k, None)
    assert table.size == len(ref)


def test_sorted_index_stays_sorted_and_picks_by_device() -> None:
    index = SortedIdIndex()
    index.insert(torch.tensor([9, 2, 2**62, 5]), torch.tensor([0, 1, 0, 0]), torch.arange(4))
    index.insert(torch.tensor([2, 6, 0]), torch.tensor([0, 0, 3]), torch.arange(4, 7))
    keys, tags, _ = index.items()
    assert keys.tolist() == [0, 2, 2, 5, 6, 9, 2**62] and tags.tolist() == [3, 0, 1, 0, 0, 0, 0]
    assert index_kind("cpu") == "hash" and index_kind("cuda") == "sorted" and index_kind("cuda", "hash") == "hash"
    assert isinstance(make_index(16, "cpu"), IdHashTable) and isinstance(make_index(16, "cpu", "sorted"), SortedIdIndex)
    with pytest.raises(ValueError, match="index kind"):
        make_index(16, "cpu", "btree")


def test_tombstones_are_reused_and_rehash_keeps_entries() -> None:
    table = IdHashTable(16)
    for round_ in range(50):  # churn: insert 8, delete them; tombstones must not fill the table
        keys = torch.arange(8) + 8 * round_
        table.insert(keys, torch.zeros(8, dtype=torch.int64), keys)
        table.delete(keys, torch.zeros(8, dtype=torch.int64))
    assert table.size == 0 and table.num_slots <= 64
    keys = torch.randint(0, 2**62, (5000,)).unique()
    table.insert(keys, torch.zeros_like(keys), keys * 0 + 1)
    assert bool((table.lookup(keys, torch.zeros_like(keys)) == 1).all())
    assert table.size / table.num_slots <= 0.5


def test_long_probe_chains_across_windows_and_tombstones() -> None:
    """Keys sharing one home slot make a probe chain several lookup windows long (``_WINDOW``), with tombstones in it."""
    from recforge.sparse.hash_table import _WINDOW, mix

    table = IdHashTable(64)  # 128 slots: 64 keys fit under the load limit
    mask = table.num_slots - 1
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    candidates = torch.randint(0, 2**62, (200_000,), generator=gen)
    home = mix(candidates, None) & mask
    slot = int(home[0])
    same = candidates[home == slot].unique()
    assert same.numel() >= 3 * _WINDOW + 4, "not enough colliding keys drawn"
    stored, absent = same[: 3 * _WINDOW], same[3 * _WINDOW : 3 * _WINDOW + 4]
    table.insert(stored, None, torch.arange(stored.numel()))
    assert table.lookup(stored, None).tolist() == list(range(stored.numel()))
    assert table.lookup(absent, None).tolist() == [-1] * absent.numel()
    gone = stored[1::3]  # tombstones all along the chain
    assert table.delete(gone, None) == gone.numel()
    kept = torch.ones(stored.numel(), dtype=torch.bool)
    kept[1::3] = False
    assert table.lookup(stored, None).tolist() == [i if k else -1 for i, k in enumerate(kept.tolist())]
    table.insert(absent, None, torch.arange(100, 100 + absent.numel()))  # into the tombstones
    assert table.lookup(absent, None).tolist() == list(range(100, 100 + absent.numel()))
    assert table.lookup(stored[kept], None).tolist() == torch.arange(stored.numel())[kept].tolist()
