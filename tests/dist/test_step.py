"""Unit tests of the distributed pieces in one process: config, batch splitting, micro-batch weighting, prefetch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recforge.config import ConfigError, config_from_dict
from recforge.train import retrieval
from recforge.train.distributed import DistContext, even_batches, split_budget
from recforge.train.inputs import StepInputs
from recforge.train.runtime import resolve_device
from tests.dist.test_torchrun import _raw, data_dir  # noqa: F401 - data_dir is a fixture


def test_dist_config_errors_are_collected_with_the_others(tmp_path: Path) -> None:
    raw = _raw(tmp_path, tmp_path)
    raw["dist"] = {"dense": "zero3", "grad_accum": 0, "backend": "mpi", "timeout_minutes": 0}
    raw["train"]["epochs"] = 0
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    for expected in ("dist.dense", "dist.grad_accum", "dist.backend", "dist.timeout_minutes", "train.epochs"):
        assert expected in str(err.value)
    assert config_from_dict(_raw(tmp_path, tmp_path)).dist.dense == "ddp"  # defaults that just work


def test_split_budget_per_rank_and_micro_batch(tmp_path: Path) -> None:
    cfg = config_from_dict(_raw(tmp_path, tmp_path, batch_size=24), ["dist.grad_accum=2"])
    assert split_budget(cfg, DistContext(rank=1, world_size=3)) == (4, 0)
    with pytest.raises(ValueError, match="multiple of 10"):
        split_budget(cfg, DistContext(rank=0, world_size=5))
    cfg = config_from_dict(_raw(tmp_path, tmp_path, loader="pipeline", token_budget=1000), ["dist.grad_accum=2"])
    assert split_budget(cfg, DistContext(rank=0, world_size=2)) == (12, 250)


@pytest.mark.parametrize(("n", "world", "batch", "expected"), [(10, 3, 2, 2), (10, 1, 4, 3), (0, 2, 4, 0), (7, 4, 2, 1)])
def test_even_batches_is_the_largest_share_s_count(n: int, world: int, batch: int, expected: int) -> None:
    counts = []
    for rank in range(world):
        ctx = DistContext(rank=rank, world_size=world)
        lo, hi = ctx.shard(n)
        assert -(-(hi - lo) // batch) <= even_batches(n, batch, ctx)
        counts.append(even_batches(n, batch, ctx))
    assert set(counts) == {expected}


def test_grad_accum_micro_batches_equal_one_batch(tmp_path: Path, data_dir: Path) -> None:  # noqa: F811
    """One step over 3 uneven micro-batches (weighted by their targets) equals one step over their union."""
    runs = {}
    for accum in (1, 3):
        cfg = config_from_dict(_raw(data_dir, tmp_path / str(accum)), [f"dist.grad_accum={accum}"])
        s = retrieval.setup(cfg)
        samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
        parts = torch.arange(10).tensor_split(accum)
        micro = [s.seqs.training_batch(samples[ids], cfg.data.max_seq_len) for ids in parts]
        result = s.runner(micro)
        runs[accum] = (float(result.loss), result.tokens, [p.detach().clone() for p in s.model.parameters()])
    assert runs[3][0] == pytest.approx(runs[1][0], rel=1e-5)
    assert runs[3][1] == runs[1][1]
    for a, b in zip(runs[1][2], runs[3][2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_no_rank_with_data_ends_the_epoch(tmp_path: Path, data_dir: Path) -> None:  # noqa: F811
    s = retrieval.setup(config_from_dict(_raw(data_dir, tmp_path)))
    assert s.runner([None]) is None


@pytest.mark.parametrize("prefetch", [False, True])
def test_step_inputs_carry_the_state_after_their_own_batches(prefetch: bool) -> None:
    """The prefetch thread runs a step ahead; each step still carries the source state right after its batches."""
    pulled = []

    def raw():
        for i in range(4):
            pulled.append(i)
            yield [torch.tensor([i])]

    class Batch:
        def __init__(self, ids):
            self.ids = ids

        def to(self, device, non_blocking=False):
            return self

    inputs = StepInputs(raw(), build=Batch, device=torch.device("cpu"), snapshot=lambda: {"pulled": len(pulled)},
                        prefetch=prefetch)  # fmt: skip
    seen = [next(inputs) for _ in range(3)]
    inputs.close()
    assert [int(item.micro[0].ids) for item in seen] == [0, 1, 2]
    assert [item.data_state["pulled"] for item in seen] == [1, 2, 3]
    assert np.all([set(item.times) == {"fetch_s", "build_s", "h2d_s"} for item in seen])


def test_batch_split_problems_are_config_errors_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun (WORLD_SIZE set) a global batch that does not split over ranks x grad_accum is reported
    with the other config errors when the config loads, not at the first step."""
    monkeypatch.setenv("WORLD_SIZE", "5")
    raw = _raw(tmp_path, tmp_path, batch_size=24, loader="pipeline")
    raw["train"]["epochs"] = 0
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw, ["dist.grad_accum=2"])
    assert "multiple of 10" in str(err.value) and "train.epochs" in str(err.value)
    monkeypatch.setenv("WORLD_SIZE", "3")
    config_from_dict(_raw(tmp_path, tmp_path, batch_size=24, loader="pipeline"), ["dist.grad_accum=2"])


def test_an_explicit_gpu_index_is_refused_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="every rank on that one GPU.*CUDA_VISIBLE_DEVICES"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("prefetch", [False, True])
def test_step_inputs_close_closes_the_raw_inputs(prefetch: bool) -> None:
    """``close`` ends the raw generator (whose ``finally`` stops a source's read-ahead thread) with or without prefetch."""
    closed = []

    def raw():
        try:
            while True:
                yield [None]
        finally:
            closed.append(True)

    inputs = StepInputs(raw(), build=lambda r: r, device=torch.device("cpu"), snapshot=None, prefetch=prefetch)
    next(inputs)
    inputs.close()
    assert closed == [True]


def test_fsdp2_shards_each_encoder_block_on_its_own(tmp_path: Path) -> None:
    """``dist.dense=fsdp2`` wraps every HSTU block in its own group (not only the root), tables excluded."""
    from recforge.models.builders import build_retrieval_model
    from recforge.train.distributed import fsdp_blocks

    cfg = config_from_dict(_raw(tmp_path, tmp_path), ["model.num_blocks=3"])
    model = build_retrieval_model(cfg.model, 50, 20, cfg.sparse)
    blocks = fsdp_blocks(model)
    assert len(blocks) == 3 and all(type(b).__name__ == "HSTUBlock" for b in blocks)


def test_ddp_searches_for_unused_parameters_only_when_some_are_unused() -> None:
    """The first-step probe finds parameters outside the loss's graph, and leaves the RNG as it found it."""
    import contextlib

    from recforge.train.distributed import Objective, unused_parameters

    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "dropout": torch.nn.Dropout(0.5), "spare": torch.nn.Linear(3, 1)})
    loss = lambda x: (model["used"](model["dropout"](x)).sum(),) * 2  # noqa: E731
    only_used = lambda x: (model["used"](x).sum() + model["spare"](x).sum(),) * 2  # noqa: E731
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    assert unused_parameters(Objective(model, loss), torch.ones(2, 3), DistContext(), contextlib.nullcontext)
    assert torch.equal(torch.rand(1), expected)  # the probe's dropout did not move the training RNG
    assert not unused_parameters(Objective(model, only_used), torch.ones(2, 3), DistContext(), contextlib.nullcontext)


def _first_step_without_data_worker(rank: int, world_size: int, data: str, out: str) -> None:
    cfg = config_from_dict(_raw(Path(data), Path(out) / str(rank)), ["model.embedding=dynamic", "sparse.optimizer=adam"])
    ctx = DistContext(rank, world_size, rank, initialized=True)
    s = retrieval.setup(cfg, ctx)
    samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
    batch = s.seqs.training_batch(samples[torch.arange(6)], cfg.data.max_seq_len)
    # rank 1 resumed at the end of its share: no batch on its first step (it used to raise, while rank 0 hung)
    result = s.runner([batch if rank == 0 else None])
    assert result is not None and result.tokens == batch.num_tokens
    stats = s.model.prefix.item_embedding.global_stats()
    assert stats["admitted"] == torch.unique(batch.features["item_ids"]).numel()  # the borrowed stand-in admitted nothing


def test_a_rank_without_any_batch_on_its_first_step_borrows_a_stand_in(tmp_path: Path, data_dir: Path) -> None:  # noqa: F811
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sparse"))
    from _dist import spawn

    spawn(_first_step_without_data_worker, 2, str(data_dir), str(tmp_path))


def test_one_process_skips_a_missing_micro_batch(tmp_path: Path, data_dir: Path) -> None:  # noqa: F811
    """grad_accum=2 with the epoch's last step holding one batch: the same model and tables as that batch alone
    (before, a weight-0 rerun of the batch still counted its IDs twice for the eviction policy)."""
    states = []
    for accum, micro_of in ((1, lambda b: [b]), (2, lambda b: [b, None])):
        cfg = config_from_dict(_raw(data_dir, tmp_path / str(accum)), [f"dist.grad_accum={accum}", "model.embedding=dynamic",
                                                                        "sparse.optimizer=adam"])  # fmt: skip
        s = retrieval.setup(cfg)
        samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
        s.runner(micro_of(s.seqs.training_batch(samples[torch.arange(8)], cfg.data.max_seq_len)))
        states.append({k: v.clone() for k, v in s.model.state_dict().items()} | {"stats": s.model.prefix.item_embedding.stats})
    assert states[0].pop("stats") == states[1].pop("stats")
    for key in states[0]:
        torch.testing.assert_close(states[1][key], states[0][key], rtol=0, atol=0, msg=key)
