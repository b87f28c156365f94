"""Ranking model: no future leakage, non-sequential baseline, heads, slices (its losses: tests/train/test_losses.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from recforge.data.dataset import Dataset
from recforge.data.ranking import RankingData
from recforge.data.synthetic import SyntheticConfig, generate_impressions
from recforge.env import TRUSTED_SLICE_MODULES
from recforge.models import HSTUConfig, HSTUEncoder, register_slice
from recforge.models.ranking import (
    HEADS,
    CandidateTower,
    ContextCross,
    ContextPool,
    ItemOnly,
    MultiTaskMLP,
    RankingModel,
    RankingPrefix,
    TargetHistoryPool,
    load_slice,
    load_slices,
    save_slices,
    visible_history,
)
from recforge.models.slices import build_slice

DIM = 16
MAX_LEN = 64


@pytest.fixture(scope="module")
def data() -> RankingData:
    cfg = SyntheticConfig(num_users=40, num_items=80, num_clusters=4, mean_seq_len=25, max_seq_len=60, seed=3)
    events, items = generate_impressions(cfg)
    ds = Dataset(events, items, {"name": "synthetic", "has_timestamps": True})
    return RankingData.from_dataset(
        ds, ["click:click>=1", "like:like>=1"], action_column="action", user_features=["user_id"],
        item_features=["cluster"], valid_fraction=0.1, test_fraction=0.3,
    )  # fmt: skip


def _model(data: RankingData, kind: str = "hstu", seed: int = 0) -> RankingModel:
    torch.manual_seed(seed)
    prefix = RankingPrefix(
        data.num_items, data.num_actions, data.num_context_values, DIM, data.item_features.shape[1],
        data.num_item_feature_values,
    )  # fmt: skip
    prefix.item_features.copy_(data.item_features)
    if kind.startswith("hstu"):
        attn_norm = "visible_mean" if kind == "hstu-vmean" else "layernorm"
        hstu = HSTUConfig(dim=DIM, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0, max_seq_len=MAX_LEN, attn_norm=attn_norm)
        encoder = HSTUEncoder(hstu)
        for block in encoder.blocks:  # non-zero relative biases, so they are exercised too
            nn.init.normal_(block.pos_weights, std=0.5)
            nn.init.normal_(block.time_weights, std=0.5)
    elif kind == "item":
        encoder = ItemOnly(DIM)
    else:
        encoder = ContextPool(DIM, hidden=32)
    if kind == "hstu-din":
        encoder = TargetHistoryPool.wrap(encoder, DIM, hidden=8, recency_buckets=4)
        nn.init.normal_(encoder.recency.weight, std=0.5)  # zero at init; exercise it
    if kind == "hstu-cross":
        encoder = ContextCross.wrap(encoder, DIM, hidden=16)
    postfix = MultiTaskMLP(DIM, 2, hidden=32)
    if kind == "hstu-tower":
        postfix = CandidateTower.wrap(postfix, MultiTaskMLP(DIM, 2, hidden=16), weight=0.3)
    return RankingModel(prefix, encoder, postfix).eval()


def _multi_target_batch(data: RankingData, encoding: str):
    samples = data.samples("test", 7 * 86400, 16)
    ids = torch.nonzero(samples.offsets[1:] - samples.offsets[:-1] >= 3).flatten()[:6]
    assert ids.numel() >= 3, "fixture should yield samples with several targets"
    return data.batch(samples, ids, MAX_LEN, encoding)


def _clone(batch):
    """Same batch with fresh feature tensors (the mask, timestamps included, is shared)."""
    features = {k: v.clone() for k, v in batch.features.items()}
    return batch.__class__(batch.seq_offsets, features, batch.max_seq_len, labels=batch.labels, mask=batch.mask)


@pytest.mark.parametrize(("encoding", "kind"), [("sum", "hstu"), ("interleave", "hstu"), ("sum", "hstu-vmean"), ("sum", "hstu-din"), ("sum", "hstu-tower"), ("sum", "hstu-cross")],)
def test_no_future_information_reaches_a_candidate(data: RankingData, encoding: str, kind: str) -> None:
    """Changing events at or after a candidate's time, or another candidate, leaves its score unchanged;
    changing an earlier event does change it."""
    model = _model(data, kind)
    batch = _multi_target_batch(data, encoding)
    with torch.no_grad():
        base = model(batch)
    offsets, nt = batch.seq_offsets, batch.mask.num_targets
    ts = batch.features["timestamps"]
    first_target_rows = torch.cumsum(nt, 0) - nt  # label row of each sequence's first target
    gen = torch.Generator().manual_seed(0)
    for b in range(nt.numel()):
        end = int(offsets[b + 1])
        t0 = end - int(nt[b])  # token of the first target
        row = int(first_target_rows[b])
        hist = torch.arange(int(offsets[b]) + data.num_contextual, t0)
        later = hist[ts[hist] >= ts[t0]]
        earlier = hist[ts[hist] < ts[t0]]

        changed = _clone(batch)
        changed.features["item_ids"][later] = torch.randint(1, data.num_items + 1, (later.numel(),), generator=gen)
        changed.features["actions"][later] = torch.randint(1, data.num_actions + 1, (later.numel(),), generator=gen)
        changed.features["item_ids"][t0 + 1 : end] = torch.randint(1, data.num_items + 1, (end - t0 - 1,), generator=gen)
        with torch.no_grad():
            out = model(changed)
        torch.testing.assert_close(out[row], base[row], rtol=0, atol=1e-6)

        if earlier.numel():
            control = _clone(batch)
            flip = earlier[-1:]
            control.features["item_ids"][flip] = control.features["item_ids"][flip] % data.num_items + 1
            control.features["actions"][flip] = control.features["actions"][flip] % data.num_actions + 1
            with torch.no_grad():
                assert (model(control)[row] - base[row]).abs().max() > 1e-6


@pytest.mark.parametrize("kind", ["dlrm", "item"])
def test_baselines_ignore_what_they_do_not_model(data: RankingData, kind: str) -> None:
    """dlrm: the history never changes a score, the user does; item: only the candidate does."""
    model = _model(data, kind)
    batch = _multi_target_batch(data, "sum")
    with torch.no_grad():
        base = model(batch)
        changed = _clone(batch)
        is_hist = (changed.features["item_ids"] > 0) & (changed.features["actions"] > 0)
        changed.features["item_ids"][is_hist] = 1
        torch.testing.assert_close(model(changed), base, rtol=0, atol=0)
        changed.features["context_ids"][changed.features["context_ids"] > 0] = 1
        if kind == "dlrm":
            assert (model(changed) - base).abs().max() > 1e-6  # the user matters
            return
        torch.testing.assert_close(model(changed), base, rtol=0, atol=0)
        targets = RankingModel.split_inputs(batch)[2]
        changed.features["item_ids"][targets] = changed.features["item_ids"][targets] % data.num_items + 1
        assert (model(changed) - base).abs().max() > 1e-6  # the candidate matters


@pytest.mark.parametrize("head", sorted(HEADS))
def test_heads_shapes_and_gradients(head: str) -> None:
    module = HEADS[head](dim=DIM, num_tasks=3)
    x = torch.randn(7, DIM, requires_grad=True)
    out = module(x)
    assert out.shape == (7, 3)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@register_slice  # loading a saved model builds only trusted classes
class CustomPrefix(nn.Module):
    """A user-written prefix: only item ids, no side features."""

    def __init__(self, num_items: int, dim: int) -> None:
        super().__init__()
        self.num_items, self.dim = num_items, dim
        self.emb = nn.Embedding(num_items + 1, dim)

    def slice_config(self) -> dict:
        return {"num_items": self.num_items, "dim": self.dim}

    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.emb(features["item_ids"])


@pytest.mark.parametrize("kind", ["hstu", "dlrm", "custom", "hstu-vmean", "hstu-din", "hstu-tower", "hstu-cross"])
def test_slices_round_trip(tmp_path: Path, data: RankingData, kind: str) -> None:
    model = _model(data, "hstu" if kind == "custom" else kind)
    if kind == "custom":
        model = RankingModel(CustomPrefix(data.num_items, DIM), model.encoder, model.postfix).eval()
    batch = _multi_target_batch(data, "sum")
    out = save_slices(model, tmp_path / "model", tasks=[{"name": "click"}, {"name": "like"}])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["slices"] == ["prefix", "encoder", "postfix"] and manifest["tasks"][1]["name"] == "like"
    for name in manifest["slices"]:
        assert (out / name / "model.safetensors").is_file() and (out / name / "config.json").is_file()
    loaded, _ = load_slices(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch), model(batch), rtol=0, atol=0)
    # each slice loads on its own, e.g. the prefix for a serving engine's token cache
    prefix = load_slice(out / "prefix")
    torch.testing.assert_close(prefix(batch.features), model.prefix(batch.features))


def test_slices_saved_before_the_module_split_still_load(tmp_path: Path, data: RankingData) -> None:
    """Heads and encoders moved out of recforge/models/ranking.py; exports that name them there load."""
    model = _model(data, "hstu-tower")
    out = save_slices(model, tmp_path / "model")
    config_path = out / "postfix" / "config.json"
    config = json.loads(config_path.read_text())
    assert config["class"] == "recforge.models.ranking_heads:CandidateTower"
    old = json.dumps(config).replace("recforge.models.ranking_heads:", "recforge.models.ranking:")
    config_path.write_text(old)
    loaded, _ = load_slices(out)
    batch = _multi_target_batch(data, "sum")
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch), model(batch), rtol=0, atol=0)


def test_slices_reject_modules_without_config_and_bad_dirs(tmp_path: Path, data: RankingData) -> None:
    model = _model(data)
    broken = RankingModel(nn.Identity(), model.encoder, model.postfix)
    with pytest.raises(TypeError, match="slice_config"):
        save_slices(broken, tmp_path / "m")
    assert not (tmp_path / "m").exists()  # nothing half-written
    with pytest.raises(ValueError, match="manifest.json"):
        load_slices(tmp_path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"class": "recforge.models.hstu:HSTUConfig", "kwargs": {}}))
    with pytest.raises(ValueError, match="not an nn.Module"):
        load_slice(tmp_path / "x")


def test_slices_build_only_trusted_classes(tmp_path: Path, monkeypatch) -> None:
    """A config.json naming a class outside recforge, not registered and not in a listed module, is
    refused before its module is imported."""
    monkeypatch.delenv(TRUSTED_SLICE_MODULES, raising=False)
    modules_before = set(sys.modules)
    (tmp_path / "x").mkdir()
    config = tmp_path / "x" / "config.json"
    for class_path in ("os:system", "antigravity:geohash", "recforge_probe_not_installed:Module", "recforge_x.y:Z"):
        config.write_text(json.dumps({"class": class_path, "kwargs": {}}))
        with pytest.raises(ValueError, match="not trusted.*register_slice"):
            load_slice(tmp_path / "x")
    assert "antigravity" not in sys.modules  # refused before the import (it would open a browser)
    # a trusted module's attributes lead only to its own classes, not into modules it imported
    for class_path in ("recforge.models.slices:nn.Linear", "recforge.models.hstu:torch.onnx.X", "recforge.models.hstu:HSTUBlock.x"):
        config.write_text(json.dumps({"class": class_path, "kwargs": {}}))
        with pytest.raises(ValueError, match="not an nn.Module|cannot be imported"):
            load_slice(tmp_path / "x")
    assert "torch.onnx" not in sys.modules or "torch.onnx" in modules_before
    linear = {"class": "torch.nn.modules.linear:Linear", "kwargs": {"in_features": 3, "out_features": 2}}
    config.write_text(json.dumps(linear))
    with pytest.raises(ValueError, match="not trusted"):
        load_slice(tmp_path / "x")
    monkeypatch.setenv(TRUSTED_SLICE_MODULES, "numpy, torch.nn")  # a listed package trusts its submodules
    assert isinstance(build_slice(linear["class"], linear["kwargs"]), nn.Linear)
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_slice(dict)


def test_split_inputs_requires_targets(data: RankingData) -> None:
    batch = _multi_target_batch(data, "sum")
    batch.mask = type(batch.mask)()
    with pytest.raises(ValueError, match="num_targets"):
        _model(data)(batch)


@pytest.mark.parametrize("encoding", ["sum", "interleave"])
def test_visible_history_matches_the_dense_mask(data: RankingData, encoding: str) -> None:
    """Each target's visible history is exactly the history keys the reference mask lets it see."""
    batch = _multi_target_batch(data, encoding)
    hist, visible, targets = visible_history(batch.seq_offsets, batch.mask)
    dense = batch.mask.dense(batch.seq_offsets, batch.max_seq_len)  # (B, N, N)
    starts = batch.seq_offsets[:-1]
    nt, c = batch.mask.num_targets, batch.mask.num_contextual
    for n, t in enumerate(targets.tolist()):
        b = int(torch.searchsorted(batch.seq_offsets, t, right=True)) - 1
        i = t - int(starts[b])
        lo, hi = int(c[b]), int(batch.seq_offsets[b + 1] - starts[b] - nt[b])  # history positions
        want = {int(starts[b]) + j for j in range(lo, hi) if dense[b, i, j]}
        assert set(hist[n][visible[n]].tolist()) == want
        assert bool((hist[n][visible[n]].diff() > 0).all())  # in time order: recency counts from the end


def test_visible_mean_divides_by_visible_keys() -> None:
    """attn_norm=visible_mean: a query seeing n keys with equal values gets their mean, whatever max_seq_len is."""
    from recforge.jagged.mask import AttentionMask

    for max_len in (8, 64):
        cfg = HSTUConfig(dim=4, num_blocks=1, num_heads=1, dqk=2, dv=4, dropout=0.0, max_seq_len=max_len, attn_norm="visible_mean")
        block = HSTUEncoder(cfg).blocks[0]
        captured = {}
        block.out.register_forward_hook(lambda m, i, o, captured=captured: captured.__setitem__("gated", i[0]))
        with torch.no_grad():
            block.uvqk.weight.zero_()
            block.uvqk.bias.fill_(1.0)  # u = v = q = k = silu(1) on every token
            x = torch.randn(5, 4)
            block(x, torch.tensor([0, 5]), 5, AttentionMask(causal=True), None)
        s1 = torch.nn.functional.silu(torch.tensor(1.0))
        score = torch.nn.functional.silu(2 * s1 * s1)  # q . k over dqk = 2, no biases
        torch.testing.assert_close(captured["gated"], torch.full((5, 4), float(score * s1 * s1)), rtol=1e-5, atol=1e-6)


def test_candidate_tower_mixes_a_sequence_tower_and_a_candidate_only_tower(data: RankingData) -> None:
    """The score is (1 - w) main + w candidate; the candidate tower reads only the candidate's own embedding."""
    model = _model(data, "hstu-tower")
    batch = _multi_target_batch(data, "sum")
    with torch.no_grad():
        x = model.postfix_inputs(batch)  # (N, 2 * DIM)
        main, candidate = model.postfix.parts(x)
        torch.testing.assert_close(model(batch), 0.7 * main + 0.3 * candidate)
        features, _, targets = model.split_inputs(batch)
        torch.testing.assert_close(candidate, model.postfix.candidate(model.prefix(features)[targets]))
        changed = _clone(batch)
        hist = torch.arange(int(batch.seq_offsets[0]) + data.num_contextual, int(batch.seq_offsets[1] - batch.mask.num_targets[0]))
        changed.features["actions"][hist] = changed.features["actions"][hist] % data.num_actions + 1
        main2, candidate2 = model.postfix.parts(model.postfix_inputs(changed))
    torch.testing.assert_close(candidate2, candidate)  # the history never reaches the candidate tower
    assert (main2 - main).abs().max() > 1e-6
