"""IdHashTable against a Python dict on random IDs (huge values, tags, deletes, growth)."""

from __future__ import annotations

import pytest
import torch

from recforge.sparse.hash_table import IdHashTable


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_dict_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    table, ref = IdHashTable(8), {}
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


def test_same_key_different_tag_is_a_different_entry() -> None:
    table = IdHashTable(16)
    table.insert(torch.tensor([7, 7]), torch.tensor([0, 1]), torch.tensor([10, 11]))
    assert table.lookup(torch.tensor([7, 7, 7]), torch.tensor([1, 0, 2])).tolist() == [11, 10, -1]


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
