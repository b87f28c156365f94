"""The generative recipe end to end on tiny synthetic data: sid fit -> train -> resume -> eval -> retrieve."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from recforge.cli import main
from recforge.config import ConfigError, load_config
from recforge.data.dataset import load_dataset, write_dataset
from recforge.data.sid_sequences import eval_samples, history_windows, seen_mask, transition_samples
from recforge.data.sids import read_sids
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train import generative
from recforge.train.sid_fit import add_items

TINY = ["model.dim=16", "model.num_blocks=1", "generative.decoder_blocks=1", "model.num_heads=2", "model.ffn_dim=32",
        "optim.warmup_steps=0", "train.batch_size=64", "train.threads=1", "eval.batch_size=64", "data.max_seq_len=10"]  # fmt: skip


@pytest.fixture(scope="module")
def sid_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = write_synthetic(tmp_path_factory.mktemp("gen") / "data", SyntheticConfig(num_users=60, num_items=40, seed=0, mean_seq_len=12, max_seq_len=30))
    assert main(["sid", "fit", str(data), "--out", str(data / "sids"), "--codebook-size", "8", "--levels", "2"]) == 0
    return data


def _config(tmp_path: Path, data: Path) -> Path:
    path = tmp_path / "gen.yaml"
    path.write_text(Path("configs/beauty-sid-tiger.yaml").read_text())
    return path


def _args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    return [f"data.path={data}", f"generative.sids={data / 'sids'}", f"train.output_dir={tmp_path / 'run'}", *TINY, *extra]


def test_sid_fit_writes_unique_sids_for_every_item(sid_data: Path) -> None:
    sids = read_sids(sid_data / "sids")
    assert sids.num_levels == 3 and len(sids.item_ids) == 40
    assert torch.unique(sids.codes, dim=0).shape[0] == 40  # the collision digit makes them unique
    assert sids.meta["stats"]["codebook_usage"][0] > 0.5


def test_windows_cover_every_training_transition(sid_data: Path) -> None:
    from recforge.data.sequences import UserSequences

    seqs = UserSequences.from_dataset(load_dataset(sid_data))
    samples = transition_samples(seqs, holdout=2)
    assert samples.shape[0] == int((seqs.lengths - 3).clamp_min(0).sum())
    items, mask, targets = history_windows(seqs, samples[:5], max_items=3)
    user = int(samples[0, 0])
    full = seqs.item_ids[seqs.offsets[user] : seqs.offsets[user + 1]]
    end = int(samples[0, 1])
    assert targets[0] == full[end - 1]
    assert items[0][mask[0]].tolist() == full[max(0, end - 4) : end - 1].tolist()
    ev = eval_samples(seqs, torch.tensor([user]), target_from_end=1)
    seen = seen_mask(seqs, ev)
    assert seen[0, full[:-1]].all() and int(seen[0, 1:].sum()) == len(set(full[:-1].tolist()))


def _exhaustive_scores(s, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, (B, N) total SID log-probability of every item), one digit at a time, no search."""
    history, mask, rows, targets = generative._inputs(s, samples)
    with torch.no_grad():
        memory = s.model.start(history, mask, rows)
        codes = s.item_codes[1:]  # (N, L) every item
        total = torch.zeros(targets.numel(), codes.shape[0])
        for t in range(codes.shape[1]):
            prefix = codes[None, :, :t].expand(targets.numel(), -1, -1)
            total += s.model.next_token_logprobs(memory, prefix).gather(2, codes[None, :, t, None].expand(targets.numel(), -1, 1))[..., 0]
    return targets, total


def test_evaluation_equals_exhaustive_item_ranking(tmp_path: Path, sid_data: Path) -> None:
    """With a beam over every SID, the generated list ranks all unseen items by SID log-probability."""
    cfg = load_config(_config(tmp_path, sid_data), _args(tmp_path, sid_data, "generative.beam=40", "eval.ks=[1,5,10]"))
    s = generative.setup(cfg)
    s.model.eval()
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1)[:16], 1)
    ranks = generative.generated_ranks(s, samples, k=40)
    targets, total = _exhaustive_scores(s, samples)
    seen = seen_mask(s.seqs, samples)[:, 1:]
    for b in range(targets.numel()):
        t = int(targets[b]) - 1
        others = ~seen[b]
        others[t] = False
        assert int(ranks[b]) == int((total[b][others] > total[b, t]).sum())


def test_items_sharing_the_targets_sid_rank_ahead_of_it(tmp_path: Path, sid_data: Path) -> None:
    """Without the collision level several items share a SID (equal scores): ties count against the target,
    as the ID models' protocol counts them, so a collision never inflates a hit."""
    sids = sid_data / "sids-shared"
    assert main(["sid", "fit", str(sid_data), "--out", str(sids), "--codebook-size", "4", "--levels", "2",
                 "--no-collision-level", "--overwrite"]) == 0  # fmt: skip
    cfg = load_config(_config(tmp_path, sid_data), _args(tmp_path, sid_data, f"generative.sids={sids}",
                                                         "generative.beam=16", "eval.ks=[1,5,10]"))  # fmt: skip
    s = generative.setup(cfg, sids)
    assert s.trie.max_items_per_leaf > 1
    s.model.eval()
    samples = eval_samples(s.seqs, s.seqs.evaluable_users(1)[:16], 1)
    ranks = generative.generated_ranks(s, samples, k=40)
    targets, total = _exhaustive_scores(s, samples)
    seen = seen_mask(s.seqs, samples)[:, 1:]
    checked = 0
    for b in range(targets.numel()):
        t = int(targets[b]) - 1
        others = ~seen[b]
        others[t] = False
        expected = int((total[b][others] >= total[b, t]).sum())  # an equal score (the same SID) ranks ahead
        if expected < 40 and int(ranks[b]) < 40:
            assert int(ranks[b]) == expected
            checked += 1
    assert checked > 0


def test_train_resume_eval_and_retrieve(tmp_path: Path, sid_data: Path, capsys: pytest.CaptureFixture) -> None:
    config = _config(tmp_path, sid_data)
    args = _args(tmp_path, sid_data, "train.epochs=2", "train.eval_every=1", "generative.beam=10", "eval.ks=[1,5,10]",
                 "optim.schedule=constant")  # the schedule's length would depend on max_steps
    assert main(["--no-progress", "train", str(config), *args, "train.max_steps=5"]) == 0
    assert main(["--no-progress", "train", str(config), *args, "--resume"]) == 0
    resumed_dir = json.loads((tmp_path / "run/checkpoints/latest.json").read_text())["step_dir"]
    resumed = load_file(tmp_path / "run/checkpoints" / resumed_dir / "model.safetensors")
    straight = tmp_path / "straight"
    assert main(["--no-progress", "train", str(config), *args, f"train.output_dir={straight}"]) == 0
    latest = json.loads((straight / "checkpoints/latest.json").read_text())["step_dir"]
    assert latest == resumed_dir
    for name, value in load_file(straight / "checkpoints" / latest / "model.safetensors").items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
    capsys.readouterr()
    assert main(["eval", str(straight)]) == 0
    result = json.loads((straight / "eval.json").read_text())
    assert result["split"] == "test" and result["num_users"] == 60 and 0.0 <= result["ndcg@10"] <= result["hr@10"] <= 1.0
    assert "hr@10" in capsys.readouterr().out
    wider = generative.evaluate_run(straight, overrides=["generative.beam=40", "eval.ks=[10,40]"])
    assert wider["beam"] == 40 and wider["hr@40"] >= wider["hr@10"] == pytest.approx(result["hr@10"], abs=0.1)

    from recforge.generate import Retriever

    retriever = Retriever.from_run(straight, device="cpu")
    raw = load_dataset(sid_data).events.column("item_id").to_pylist()
    (items, scores), (restricted, _) = retriever.retrieve([raw[:5], raw[5:6]], k=5, beam=10,
                                                          allowed_items=[None, raw[10:13]])  # fmt: skip
    assert len(items) == 5 and scores == sorted(scores, reverse=True)
    assert set(restricted) <= set(raw[10:13]) and restricted
    with pytest.raises(ValueError, match="unknown item IDs"):
        retriever.retrieve([[10**9]], k=5, beam=10)
    # an item coded after training is retrievable without retraining (cold start through its SID)
    assert add_items(straight / "sids", _grown(tmp_path, sid_data))["added"] == 1
    fresh = Retriever.from_run(straight, device="cpu")
    ((items, _),) = fresh.retrieve([raw[:5]], k=5, beam=10, allowed_items=[[5000]])
    assert items == [5000]
    ((items, _),) = fresh.retrieve([raw[:5] + [5000]], k=5, beam=10, allowed_items=[[5000]])  # read in a history,
    assert items == []  # and then excluded from the result, as evaluation excludes history items
    ((items, _),) = fresh.retrieve([raw[:5] + [5000]], k=5, beam=10, allowed_items=[[5000]], exclude_history=False)
    assert items == [5000]


def test_sid_add_codes_new_items_without_recoding(tmp_path: Path, sid_data: Path) -> None:
    dataset = load_dataset(sid_data)
    extra = pa.table({"item_id": pa.array([1001, 1002], pa.int64()), "cluster": [3, 3],
                      "cluster_name": ["Neon Jazz", "Neon Jazz"], "title": ["Neon Jazz #99", "Neon Jazz #98"],
                      "popularity_rank": [1, 2]})  # fmt: skip
    items = pa.concat_tables([dataset.items.select(extra.column_names).cast(extra.schema), extra])
    grown = write_dataset(tmp_path / "grown", dataset.events, items, name="grown", source="test")
    sid_dir = tmp_path / "sids"  # 16 x 16 codes: room in the collision level for the new items
    assert main(["sid", "fit", str(sid_data), "--out", str(sid_dir), "--codebook-size", "16", "--levels", "2"]) == 0
    before = read_sids(sid_dir)
    assert add_items(sid_dir, grown)["added"] == 2
    after = read_sids(sid_dir)
    assert torch.equal(after.codes[:40], before.codes) and after.codes.shape[0] == 42
    assert torch.unique(after.codes, dim=0).shape[0] == 42
    assert add_items(sid_dir, grown)["added"] == 0


def test_config_errors_name_the_fix(tmp_path: Path, sid_data: Path) -> None:
    config = _config(tmp_path, sid_data)
    with pytest.raises(ConfigError, match="generative.beam"):
        load_config(config, _args(tmp_path, sid_data, "generative.beam=5"))
    with pytest.raises(ConfigError, match="supports tiger"):
        load_config(config, _args(tmp_path, sid_data, "model.kind=hstu"))
    with pytest.raises(ConfigError, match="use recipe: generative"):
        load_config(config, _args(tmp_path, sid_data, "recipe=retrieval"))
    missing = _args(tmp_path, sid_data, f"generative.sids={tmp_path / 'nope'}", "train.max_steps=1")
    assert main(["--no-progress", "train", str(config), *missing]) == 2


@pytest.mark.gpu
def test_gpu_retrieve_matches_cpu_and_decodes_without_host_sync(tmp_path: Path, sid_data: Path, cuda_device: torch.device) -> None:
    from recforge.generate import RetrieveRequest, Retriever, beam_search

    config = _config(tmp_path, sid_data)
    args = _args(tmp_path, sid_data, "train.epochs=1", "generative.beam=10", "eval.ks=[1,5,10]", "train.device=cpu")
    assert main(["--no-progress", "train", str(config), *args]) == 0
    cpu = Retriever.from_run(tmp_path / "run", device="cpu")
    gpu = Retriever.from_run(tmp_path / "run", device="cuda")
    raw = load_dataset(sid_data).events.column("item_id").to_pylist()
    histories = [raw[i : i + 7] for i in range(0, 56, 7)]
    allowed = [None, raw[:20]] * 4
    want = cpu.retrieve(histories, k=10, beam=32, allowed_items=allowed)
    got = gpu.retrieve(histories, k=10, beam=32, allowed_items=allowed)
    for (items_cpu, scores_cpu), (items_gpu, scores_gpu) in zip(want, got, strict=True):
        assert items_cpu == items_gpu
        # CUDA matmuls run in TF32 (train.runtime): scores agree to ~1e-3, the items exactly
        torch.testing.assert_close(torch.tensor(scores_gpu), torch.tensor(scores_cpu), rtol=2e-3, atol=2e-3)
    codes, mask, _ = gpu.history_batch([gpu.encode(RetrieveRequest(h)) for h in histories])
    with torch.no_grad():
        memory = gpu.model.start(codes, mask)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            beam_search(lambda c: gpu.model.next_token_logprobs(memory, c), gpu.trie, batch_size=len(histories), beam=32)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_sid_fit_from_a_retrieval_runs_item_embeddings(tmp_path: Path, sid_data: Path, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "sasrec"
    assert main(["--no-progress", "train", "configs/beauty-sasrec.yaml", f"data.path={sid_data}", f"train.output_dir={run}",
                 "train.epochs=1", "model.dim=16", "model.ffn_dim=16", "train.threads=1"]) == 0  # fmt: skip
    out = tmp_path / "sids-collab"
    assert main(["sid", "fit", str(sid_data), "--out", str(out), "--source", f"run:{run}", "--codebook-size", "8",
                 "--levels", "2", "--method", "rqvae", "--rqvae-epochs", "3"]) == 0  # fmt: skip
    sids = read_sids(out)
    assert sids.meta["source"] == f"run:{run}" and sids.meta["embedding_dim"] == 16 and len(sids.item_ids) == 40
    assert "collision rate" in capsys.readouterr().out
    with pytest.raises(ValueError, match="collaborative embeddings"):
        add_items(out, _grown(tmp_path, sid_data))


def _grown(tmp_path: Path, data: Path) -> Path:
    dataset = load_dataset(data)
    extra = dataset.items.slice(0, 1).set_column(0, "item_id", pa.array([5000], pa.int64()))
    return write_dataset(tmp_path / "grown2", dataset.events, pa.concat_tables([dataset.items, extra]), name="g", source="t")


def test_decoder_only_hstu_trains_and_evaluates(tmp_path: Path, sid_data: Path) -> None:
    config = _config(tmp_path, sid_data)
    args = _args(tmp_path, sid_data, "model.kind=sid_hstu", "model.kernel=pytorch", "train.epochs=1",
                 "generative.beam=10", "eval.ks=[1,5,10]")  # fmt: skip
    assert main(["--no-progress", "train", str(config), *args]) == 0
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert result["model"] == "sid_hstu" and result["num_users"] == 60 and 0.0 <= result["hr@10"] <= 1.0


def test_sid_fit_from_an_embedding_column(tmp_path: Path, sid_data: Path, capsys: pytest.CaptureFixture) -> None:
    dataset = load_dataset(sid_data)
    ids = dataset.items.column("item_id").to_pylist()
    g = torch.Generator().manual_seed(0)
    vectors = torch.randn(len(ids), 6, generator=g).tolist()
    items = pa.table({"item_id": pa.array(ids, pa.int64()), "embedding": pa.array(vectors, pa.list_(pa.float32()))})
    data = write_dataset(tmp_path / "emb", dataset.events, items, name="emb", source="test")
    assert main(["sid", "fit", str(data), "--out", str(tmp_path / "s"), "--source", "embedding", "--codebook-size", "4"]) == 0
    sids = read_sids(tmp_path / "s")
    assert sids.meta["embedding_dim"] == 6 and torch.unique(sids.codes, dim=0).shape[0] == len(ids)
    assert main(["sid", "fit", str(sid_data), "--out", str(tmp_path / "t"), "--source", "embedding"]) == 2
    assert "has no 'embedding' column" in capsys.readouterr().err


def test_a_new_run_takes_the_configured_sids_and_a_resume_refuses_other_ones(tmp_path: Path, sid_data: Path) -> None:
    other = sid_data / "sids-other"
    assert main(["sid", "fit", str(sid_data), "--out", str(other), "--codebook-size", "4", "--levels", "2",
                 "--overwrite"]) == 0  # fmt: skip
    run_dir = tmp_path / "run"
    first = load_config(_config(tmp_path, sid_data), _args(tmp_path, sid_data))
    generative._copy_sids(first, run_dir, resume=False)  # an attempt that died before its first checkpoint
    changed = load_config(_config(tmp_path, sid_data), _args(tmp_path, sid_data, f"generative.sids={other}"))
    generative._copy_sids(changed, run_dir, resume=False)
    assert torch.equal(read_sids(run_dir / "sids").codes, read_sids(other).codes)
    with pytest.raises(ValueError, match="other SIDs than the ones"):
        generative._copy_sids(first, run_dir, resume=True)
    assert generative._copy_sids(changed, run_dir, resume=True) == run_dir / "sids"
