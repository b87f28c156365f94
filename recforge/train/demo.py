"""Recipe: `recforge demo` — synthetic data -> small HSTU -> evaluation vs popularity -> sample recommendations.

Needs no files: the built-in generator (recforge.data.synthetic) makes a catalogue with
taste clusters, power-law popularity, drifting interests and series structure.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch

from recforge.checkpoint import find_checkpoint, load_checkpoint
from recforge.config import RunConfig, config_from_dict
from recforge.data.dataset import load_dataset
from recforge.data.sequences import UserSequences
from recforge.data.synthetic import SyntheticConfig, write_synthetic
from recforge.train.evaluate import evaluate_ranking, popularity_scorer
from recforge.train.report import write_report
from recforge.train.retrieval import setup, train

DEMO_MODEL = {"kind": "hstu", "dim": 64, "num_blocks": 2, "num_heads": 2, "dqk": 32, "dv": 32, "dropout": 0.1}


def demo_config(out_dir: Path, minutes: float, overrides: list[str] | None = None) -> RunConfig:
    raw = {
        "name": "demo",
        "data": {"path": str(out_dir / "data"), "protocol": "paper", "max_seq_len": 100},
        "model": DEMO_MODEL,
        "loss": {"negatives": "shared", "num_negatives": 512, "temperature": 0.05},
        "train": {
            "epochs": 40, "batch_size": 64, "eval_every": 10, "output_dir": str(out_dir / "{name}"),
            "max_minutes": minutes, "threads": 0,
        },
        "eval": {"ks": [1, 10, 50, 200]},
    }  # fmt: skip
    return config_from_dict(raw, overrides, "recforge demo")


def _titles(items, ids) -> list[str]:
    table = items.filter(pc.is_in(items.column("item_id"), value_set=pa.array(ids)))
    by_id = dict(zip(table.column("item_id").to_pylist(), table.column("title").to_pylist(), strict=True))
    return [by_id.get(i, str(i)) for i in ids]


def run_demo(out_dir: str | Path = "runs/demo", *, minutes: float = 2.0, overrides: list[str] | None = None, progress: bool = True) -> dict:
    """Generate data, train, evaluate against popularity, print recommendations. Returns both metric dicts."""
    out_dir = Path(out_dir)
    cfg = demo_config(out_dir, minutes, overrides)
    print(f"[1/4] generating synthetic data in {out_dir / 'data'}")
    write_synthetic(out_dir / "data", SyntheticConfig(), overwrite=True)
    if cfg.run_dir.exists():
        shutil.rmtree(cfg.run_dir)
    model_name = cfg.model.kind.upper() if cfg.model.kind == "hstu" else "SASRec"
    print(f"[2/4] training a {cfg.model.num_blocks}-block {model_name} (d={cfg.model.dim}) for up to {minutes:g} min -> {cfg.run_dir}")
    model_metrics = train(cfg, progress=progress)
    print("[3/4] evaluating against the most-popular baseline (leave-one-out, all items, seen items excluded)")
    dataset = load_dataset(cfg.data.path)
    seqs = UserSequences.from_dataset(dataset)
    pop_metrics, _ = evaluate_ranking(
        seqs, popularity_scorer(seqs.item_counts(1)), target_from_end=1,
        max_seq_len=cfg.data.max_seq_len, ks=cfg.eval.ks, batch_size=cfg.eval.batch_size,
    )  # fmt: skip
    keys = ["hr@10", "ndcg@10", "hr@50", "ndcg@50", "mrr"]
    print(f"\n  {'model':<12}" + "".join(f"{k:>10}" for k in keys))
    for name, m in (("popularity", pop_metrics), (model_name, model_metrics)):
        print(f"  {name:<12}" + "".join(f"{m[k]:>10.4f}" for k in keys))
    print(f"\n[4/4] top-10 recommendations for user {int(seqs.user_ids[0])}")
    _show_user(cfg, seqs, dataset)
    print(f"\nrun report (plots, tables, config; open in a browser): {write_report(cfg.run_dir)}")
    return {"model": model_metrics, "popularity": pop_metrics}


def _show_user(cfg, seqs: UserSequences, dataset, user: int = 0, k: int = 10) -> None:
    s = setup(cfg)
    load_checkpoint(find_checkpoint(cfg.run_dir), s.model, device=s.device)
    s.model.eval()
    batch = seqs.eval_batch(torch.tensor([user]), cfg.data.max_seq_len, target_from_end=1)
    with torch.no_grad():
        scores = (s.model.last_token_vectors(batch.inputs.to(s.device)) @ s.model.item_vectors().T)[0].cpu()
    scores[0] = float("-inf")
    scores[batch.seen_index] = float("-inf")
    top = torch.topk(scores, k).indices
    history = seqs.item_vocab[batch.seen_index[-8:].numpy()].tolist()
    target = int(seqs.item_vocab[int(batch.targets[0])])
    recs = seqs.item_vocab[top.numpy()].tolist()
    print("  recent history: " + " -> ".join(_titles(dataset.items, history)))
    print(f"  held-out next item: {_titles(dataset.items, [target])[0]}")
    for rank, (item, title) in enumerate(zip(recs, _titles(dataset.items, recs), strict=True), 1):
        mark = "  <- the held-out item" if item == target else ""
        print(f"  {rank:>2}. {title}{mark}")
