"""A trained generative (semantic-ID) run, as both the generative recipe and the Retriever read it.

A run directory holds ``config.yaml``, ``checkpoints/`` (``recforge.checkpoint``) and ``sids/`` (the
codes its model was trained on). This module builds the SID model a config names and loads it from a
run; it lives in ``generate`` so that serving retrieval does not import training code
(``recforge.train.generative`` builds its models with ``build_sid_model`` too).

Example:
    >>> run = load_sid_run("runs/beauty-sid-tiger", device=torch.device("cpu"))
    >>> run.model, run.sids.num_levels, run.cfg.data.max_seq_len
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from recforge.checkpoint import find_checkpoint, load_checkpoint, read_manifest
from recforge.config import RunConfig, load_config
from recforge.data.sids import META_FILE, SemanticIds, read_sids
from recforge.models.sid_hstu import SIDHSTU, SIDHSTUConfig
from recforge.models.sid_seq2seq import Seq2SeqConfig, SIDSeq2Seq


@dataclass
class SidRun:
    """What a trained generative run holds, loaded: its config, model (eval mode) and SIDs."""

    cfg: RunConfig
    model: SIDSeq2Seq | SIDHSTU
    sids: SemanticIds  # every item of RUN_DIR/sids (items coded after training included)
    checkpoint: Path
    manifest: dict


def sid_dir_of(cfg: RunConfig) -> Path:
    """The SID directory the config names (``generative.sids``; default ``DATA/sids``)."""
    return Path(cfg.generative.sids or Path(cfg.data.path) / "sids")


def build_sid_model(cfg: RunConfig, num_levels: int, vocab_size: int, num_items: int = 0) -> SIDSeq2Seq | SIDHSTU:
    """``model.kind``: tiger (encoder-decoder) or sid_hstu (decoder-only HSTU); same decoding interface.
    ``num_items``: the training catalogue's size, the rows of the item tables (``generative.item_id_embedding``,
    ``generative.dense_head``)."""
    m, g = cfg.model, cfg.generative
    if uses_item_table(cfg) and num_items < 1:
        raise ValueError("generative.item_id_embedding / dense_head need the training catalogue's size (num_items >= 1)")
    if m.kind == "sid_hstu":
        return SIDHSTU(SIDHSTUConfig(
            num_levels=num_levels, vocab_size=vocab_size, dim=m.dim, num_blocks=m.num_blocks, num_heads=m.num_heads,
            dropout=m.dropout, max_items=cfg.data.max_seq_len, kernel=m.kernel, relative_bias=m.relative_bias,
        ))  # fmt: skip
    return SIDSeq2Seq(Seq2SeqConfig(
        num_levels=num_levels, vocab_size=vocab_size, dim=m.dim, encoder_layers=m.num_blocks,
        decoder_layers=cfg.generative.decoder_blocks, num_heads=m.num_heads, ffn_dim=m.ffn_dim, dropout=m.dropout,
        max_items=cfg.data.max_seq_len, num_item_ids=num_items if g.item_id_embedding else 0,
        dense_items=num_items if g.dense_head else 0, dense_temperature=cfg.loss.temperature, item_dim=g.item_dim,
    ))  # fmt: skip


def uses_item_table(cfg: RunConfig) -> bool:
    """Whether the run's model has item tables over the training catalogue (item-ID input, dense head)."""
    return cfg.generative.item_id_embedding or cfg.generative.dense_head


def read_run(run_dir: str | Path, checkpoint: str = "auto", overrides: list[str] | None = None) -> tuple[RunConfig, Path]:
    """(config, checkpoint directory) of a generative run; ``checkpoint``: auto (best for clean runs, else
    latest), best, latest or a checkpoint directory. Raises ``ValueError`` saying what is missing."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} is not a recforge run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml", overrides)
    if checkpoint == "auto":
        checkpoint = "best" if cfg.data.protocol == "clean" else "latest"
    ckpt = find_checkpoint(run_dir, checkpoint) if checkpoint in ("best", "latest") else Path(checkpoint)
    if ckpt is None:
        raise ValueError(f"{run_dir} has no {checkpoint} checkpoint; train it first")
    if not (run_dir / "sids" / META_FILE).is_file():
        raise ValueError(f"{run_dir}/sids is missing: the run's semantic IDs are needed to decode its model")
    return cfg, ckpt


def load_sid_run(
    run_dir: str | Path, checkpoint: str = "auto", overrides: list[str] | None = None, *, device: torch.device
) -> SidRun:  # fmt: skip
    """The run's model with the checkpoint's weights, on ``device`` and in eval mode, and its SIDs."""
    cfg, ckpt = read_run(run_dir, checkpoint, overrides)
    sids = read_sids(Path(run_dir) / "sids")
    torch.manual_seed(cfg.train.seed)  # the same init as training; every weight is then overwritten
    # an item table has a row per training item: its size (and each row's raw ID) come with the checkpoint
    num_items = int(read_manifest(ckpt).get("num_items", 0)) if uses_item_table(cfg) else 0
    model = build_sid_model(cfg, sids.num_levels, sids.vocab_size, num_items).to(device)
    manifest = load_checkpoint(ckpt, model, device=device)
    return SidRun(cfg, model.eval(), sids, ckpt, manifest)
