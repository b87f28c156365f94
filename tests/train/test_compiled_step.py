"""``train.compile``: the compiled step trains like the eager one (GPU), is off on CPU, and the
training log carries tokens/s, TFLOP/s and (on a known GPU) MFU."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from recforge.config import RunConfig, config_from_dict
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train import retrieval


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = SyntheticConfig(num_users=64, num_items=80, num_clusters=5, mean_seq_len=24, min_seq_len=3, max_seq_len=60, seed=3)
    return write_synthetic(tmp_path_factory.mktemp("compiled") / "synth", config)


def _cfg(out: Path, data: Path, *overrides: str) -> RunConfig:
    raw = {
        "name": "run",
        "data": {"path": str(data), "protocol": "paper", "max_seq_len": 50},
        "model": {"kind": "hstu", "dim": 32, "num_blocks": 2, "num_heads": 2, "dqk": 16, "dv": 16, "dropout": 0.0},
        "loss": {"negatives": "full", "temperature": 0.05},
        "train": {"epochs": 2, "batch_size": 16, "eval_every": 1, "output_dir": str(out / "{name}"), "device": "cpu",
                  "seed": 5, "log_every": 2},
        "eval": {"ks": [1, 10], "batch_size": 16},
    }  # fmt: skip
    return config_from_dict(raw, list(overrides))


def _losses(cfg: RunConfig, steps: int) -> list[float]:
    s = retrieval.setup(cfg)
    samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
    order = samples[torch.randperm(samples.shape[0], generator=torch.Generator().manual_seed(1))]
    bs = cfg.train.batch_size
    assert steps * bs <= samples.shape[0], f"{samples.shape[0]} samples make fewer than {steps} full batches"
    return [retrieval._train_step(s, s.seqs.training_batch(order[i * bs : (i + 1) * bs], cfg.data.max_seq_len))[0]
            for i in range(steps)]  # fmt: skip


def test_compile_is_off_on_cpu(tmp_path: Path, data_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="recforge.train.compiled"):
        compiled = _losses(_cfg(tmp_path, data_dir, "train.compile=default"), 3)
    assert "train.compile=default is off for this run" in caplog.text
    assert compiled == _losses(_cfg(tmp_path, data_dir), 3)  # the eager step, bit for bit


def test_log_rows_carry_throughput(tmp_path: Path, data_dir: Path) -> None:
    cfg = _cfg(tmp_path, data_dir, "train.epochs=1", "train.peak_tflops=0.5")
    retrieval.train(cfg, progress=False)
    rows = [json.loads(line) for line in (cfg.run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    rated = [r for r in rows if "tokens_per_s" in r]
    assert rated and all(r["step"] % 2 == 0 or r is rows[-1] for r in rated)
    assert all(r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / 0.5) for r in rated)


@pytest.mark.parametrize("chunk_size", [0, 16])
def test_one_traced_graph_for_every_batch_size(tmp_path: Path, data_dir: Path, chunk_size: int) -> None:
    """Dynamo traces the objective (model + loss) once for batches of every size: no graph breaks, no shape
    specialisation (the chunked full softmax's loop is computed whole under compile; the capability and cache
    checks trace as constants). Each new size recompiled before: a compile per CUDA-graph bucket on the GPU."""
    from torch._dynamo.testing import CompileCounter

    from recforge.train.compiled import compile_dynamic

    torch._dynamo.reset()
    cfg = _cfg(tmp_path, data_dir, f"loss.chunk_size={chunk_size}", "model.kernel=pytorch", "model.dropout=0.2")
    s = retrieval.setup(cfg)
    counter = CompileCounter()
    compile_dynamic(s.runner.objective, backend=counter)  # as train.compile does, tracing only
    samples = s.seqs.training_samples(s.holdout, cfg.data.max_seq_len, cfg.data.train_windows)
    tokens = []
    for users in (16, 11, 7):  # every batch over the chunk size: the chunked path without compile
        batch = s.seqs.training_batch(samples[:users], cfg.data.max_seq_len)
        tokens.append(batch.labels["next_item"].numel())
        loss, _ = retrieval._train_step(s, batch)
        assert math.isfinite(loss)
    assert len(set(tokens)) == 3 and min(tokens) > 16, tokens
    assert counter.frame_count == 1, f"{counter.frame_count} graphs traced for token counts {tokens}"


class _FloatAttributes(torch.nn.Module):
    """Python float attributes read in forward (an embedding scale, a norm's eps) as the models have them."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.linear, self.scale = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 8), 8**0.5

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.linear(self.embedding(ids) * self.scale)
        with torch.autocast("cpu", enabled=False):  # as the loss does under bf16 autocast
            return torch.nn.functional.layer_norm(x.float(), (8,), eps=1e-5).sum()


def test_compile_dynamic_traces_once_and_its_graph_is_cacheable() -> None:
    """Floats are constants (no restarted trace to specialise them: one compile attempt per graph), and a graph
    with an autocast region passes AOTAutograd's cacheability check (the cache is what a second process reuses)."""
    import torch._inductor.config

    # PyTorch's defaults, restored after by the config modules' own patch (pytest's monkeypatch restores a config
    # entry it did not find in the module's __dict__ by deleting it, which hides it from every later test)
    with torch._dynamo.config.patch(specialize_float=False), \
            torch._inductor.config.patch(unsafe_marked_cacheable_functions={}):  # fmt: skip
        _check_compile_dynamic_traces_once_and_is_cacheable()


def _check_compile_dynamic_traces_once_and_is_cacheable() -> None:
    from torch._dynamo.utils import compile_times
    from torch._functorch._aot_autograd.autograd_cache import check_node_safe

    from recforge.train.compiled import compile_dynamic

    torch._dynamo.reset()
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    module = _FloatAttributes()
    compile_dynamic(module, backend=backend)
    for size in (7, 9, 12):
        module(torch.randint(0, 50, (size,))).backward()
    attempts = [line for line in compile_times(repr="str", aggregate=True).splitlines() if "compile_attempt" in line]
    assert len(graphs) == 1 and len(attempts) == 1, (len(graphs), attempts)
    autocast_nodes = [n for n in graphs[0].graph.nodes if "autocast" in str(n.target)]
    assert autocast_nodes
    for node in graphs[0].graph.nodes:
        check_node_safe(node)  # raises BypassAOTAutogradCache for a node the cache refuses


@pytest.mark.gpu
@pytest.mark.parametrize(("precision", "tol"), [("float32", 2e-3), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_compiled_step_matches_eager(tmp_path: Path, data_dir: Path, cuda_device, precision: str, tol: float,
                                     mode: str) -> None:  # fmt: skip
    """Four steps of the compiled step (Inductor, Triton attention as a custom op, fused AdamW) give the
    eager step's losses within ``tol`` (fused kernels sum in another order; no dropout, full softmax)."""
    torch._dynamo.reset()
    base = ("train.device=cuda", f"train.precision={precision}", "model.kernel=triton")
    eager = _losses(_cfg(tmp_path, data_dir, *base), 4)  # 64 users, one sample each: 4 batches of 16
    compiled = _losses(_cfg(tmp_path, data_dir, *base, f"train.compile={mode}"), 4)
    assert eager[0] > 0
    for step, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert abs(a - b) <= tol * abs(b), f"step {step + 1}: compiled {a} vs eager {b}"


@pytest.mark.gpu
def test_compiled_training_run_logs_mfu(tmp_path: Path, data_dir: Path, cuda_device) -> None:
    cfg = _cfg(tmp_path, data_dir, "train.device=cuda", "train.compile=default", "train.precision=bfloat16",
               "train.peak_tflops=989")  # fmt: skip
    summary = retrieval.train(cfg, progress=False)
    assert summary["hr@10"] > 0
    rows = [json.loads(line) for line in (cfg.run_dir / "train_log.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] < 1 for r in rows if "tokens_per_s" in r)


def _input_dims(fn, *args) -> dict[str, tuple[str, ...]]:
    """Each tensor argument's dims (by name) as dynamo traced ``fn`` under ``dynamic=True``: "int" (static) or
    "SymInt"."""
    seen: dict[str, tuple[str, ...]] = {}
    torch._dynamo.reset()  # nothing compiled earlier (another test's graph of the same code) is reused

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and isinstance(value, torch.Tensor):
                seen[node.name.strip("_").removeprefix("l_")] = tuple(type(size).__name__ for size in value.shape)
        return gm.forward

    torch.compile(fn, backend=backend, dynamic=True)(*args)
    return seen


@pytest.mark.parametrize("negatives", ["shared", "per_position"])
def test_the_negatives_count_is_static_in_the_compiled_step(negatives: str) -> None:
    """mark_static_dims: under dynamic shapes the sampled negatives' count K is a constant of the graph (Inductor
    then specialises the loss's reductions over K), while the positions T stay symbolic."""
    from recforge.train.compiled import mark_static_dims
    from recforge.train.losses import draw_negatives

    T, K = int(torch.randint(20, 40, ())), int(torch.randint(5, 15, ()))
    targets = torch.randint(1, 100, (T,))
    draws = draw_negatives(targets, 100, negatives=negatives, num_negatives=K, chunk_size=8)
    user = torch.randn(T, 4)

    def scores(user, ids, rows):
        return user.sum(1, keepdim=True) * ids.float() + rows.float() if rows is not None else user[:, :1] * ids.float()

    def dims(draws):
        return _input_dims(scores, user, draws.ids, draws.rows)

    before = dims(draws)
    mark_static_dims(draws)
    after = dims(draws)
    static_k = ("int",) if negatives == "shared" else ("SymInt", "int")
    assert after["ids"] == static_k and before["ids"] == ("SymInt",) * len(static_k)
    assert after["user"] == ("SymInt", "SymInt")  # the positions: symbolic
    if negatives == "per_position":
        assert after["rows"] == ("SymInt", "int") and before["rows"] == ("SymInt", "SymInt")


def test_chunked_shared_columns_with_in_batch_ones_stay_symbolic() -> None:
    """The chunked loss's ``shared`` columns hold the in-batch targets too (their count follows the batch): not
    marked; nor is anything that is not a ``SampledNegatives``."""
    from recforge.train.compiled import mark_static_dims
    from recforge.train.losses import draw_negatives

    targets = torch.randint(1, 100, (30,))
    draws = draw_negatives(targets, 100, negatives="shared", num_negatives=7, in_batch_negatives=True, chunk_size=8)
    mark_static_dims(draws)
    mark_static_dims(targets)  # no-op
    assert _input_dims(lambda shared: shared * 2, draws.shared)["shared"] == ("SymInt",)
    alone = draw_negatives(targets, 100, negatives="shared", num_negatives=7, chunk_size=8)
    mark_static_dims(alone)
    assert _input_dims(lambda shared: shared * 2, alone.shared)["shared"] == ("int",)


def test_the_compiled_step_marks_its_draws(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """StepRunner calls mark_static_dims on each micro-batch's draws when its objective is compiled (CUDA only, so
    compilation is faked here), and never when it is not."""
    from recforge.train import step as step_mod
    from recforge.train.losses import SampledNegatives

    seen: list[object] = []
    monkeypatch.setattr(step_mod, "mark_static_dims", seen.append)
    cfg = _cfg(tmp_path, data_dir, "loss.negatives=shared", "loss.num_negatives=16")
    _losses(cfg, 2)
    assert seen == []  # eager: nothing marked
    monkeypatch.setattr(step_mod, "is_compiled", lambda module: True)
    _losses(cfg, 2)
    assert len(seen) == 2 and all(isinstance(d, SampledNegatives) and d.ids.shape == (16,) for d in seen)
