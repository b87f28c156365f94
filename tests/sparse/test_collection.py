"""EmbeddingCollection: table merging, jagged and pooled features, TorchRec KJT input."""

from __future__ import annotations

import pytest
import torch

from recforge.sparse import EmbeddingCollection, FeatureConfig, JaggedIds, SparseOptimConfig, SparseOptimizer, TableConfig

D = 4


def _collection() -> EmbeddingCollection:
    opt = SparseOptimConfig(kind="sgd", lr=1.0)
    return EmbeddingCollection(
        [TableConfig("item", dim=D, optimizer=opt), TableConfig("category", dim=D, optimizer=opt), TableConfig("user", dim=8)],
        [FeatureConfig("history", "item"), FeatureConfig("target", "item", pooling="sum"),
         FeatureConfig("cats", "category", pooling="mean"), FeatureConfig("user", "user", pooling="sum")],
    )  # fmt: skip


def test_equal_tables_merge_and_keys_are_namespaced() -> None:
    coll = _collection()
    assert sorted(coll.tables) == ["item+category", "user"]
    out = coll({"history": JaggedIds(torch.tensor([7, 7, 9]), torch.tensor([0, 2, 3])),
                "cats": JaggedIds(torch.tensor([7]), torch.tensor([0, 1, 1]))})  # fmt: skip
    table, item_tag = coll.table_of("item")
    _, cat_tag = coll.table_of("category")
    assert (item_tag, cat_tag) == (0, 1) and table.num_live == 3  # item 7, item 9, category 7
    assert not torch.equal(out["history"][0], out["cats"][0])
    assert table.stats["lookups"] == 1  # both features in one lookup


def test_jagged_and_pooled_shapes_and_values() -> None:
    coll = _collection()
    values, offsets = torch.tensor([3, 5, 5, 8]), torch.tensor([0, 3, 3, 4])
    out = coll({"history": JaggedIds(values, offsets), "target": JaggedIds(values, offsets), "cats": JaggedIds(values, offsets)})
    assert out["history"].shape == (4, D) and out["target"].shape == (3, D) and out["cats"].shape == (3, D)
    torch.testing.assert_close(out["target"][0], out["history"][:3].sum(0))
    torch.testing.assert_close(out["target"][1], torch.zeros(D))  # empty bag
    cats_rows = coll.table_of("category")[0](torch.tensor([3, 5, 5]), torch.ones(3, dtype=torch.int64))
    torch.testing.assert_close(out["cats"][0], cats_rows.mean(0))


def test_pooled_gradient_reaches_rows_once_per_step() -> None:
    coll = _collection()
    opt = SparseOptimizer([coll])
    assert len(opt.tables) == 2
    out = coll({"history": JaggedIds(torch.tensor([1, 1]), torch.tensor([0, 2])), "target": JaggedIds(torch.tensor([1]), torch.tensor([0, 1]))})
    table = coll.table_of("item")[0]
    before = table.store.weight[0].clone()
    (out["history"].sum() + out["target"].sum()).backward()
    opt.step()
    torch.testing.assert_close(table.store.weight[0], before - 3.0)  # 3 occurrences, lr 1


def test_bad_features_raise() -> None:
    coll = _collection()
    with pytest.raises(ValueError, match="unknown features"):
        coll({"nope": JaggedIds(torch.tensor([1]), torch.tensor([0, 1]))})
    with pytest.raises(ValueError, match="offsets must start at 0"):
        JaggedIds(torch.tensor([1, 2]), torch.tensor([0, 1])).validate()
    with pytest.raises(ValueError, match="not among"):
        EmbeddingCollection([TableConfig("a", dim=D)], [FeatureConfig("f", "b")])


def test_keyed_jagged_tensor_input() -> None:
    jagged = pytest.importorskip("torchrec.sparse.jagged_tensor", reason="torchrec is not installed (optional extra 'torchrec')")
    kjt = jagged.KeyedJaggedTensor.from_offsets_sync(
        keys=["history", "cats"], values=torch.tensor([3, 5, 5, 8, 2]), offsets=torch.tensor([0, 3, 4, 4, 5])
    )
    coll = _collection()
    out = coll(kjt)
    expected = _collection()({"history": JaggedIds(torch.tensor([3, 5, 5, 8]), torch.tensor([0, 3, 4])),
                              "cats": JaggedIds(torch.tensor([2]), torch.tensor([0, 0, 1]))})  # fmt: skip
    assert out["history"].shape == (4, D) and out["cats"].shape == (2, D)
    torch.testing.assert_close(out["history"], expected["history"])
    torch.testing.assert_close(out["cats"], expected["cats"])
