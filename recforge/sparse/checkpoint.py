"""Sparse checkpoints: full state (sharded safetensors + JSON manifest), delta and low-precision exports.

Full checkpoint directory (written atomically: temp dir + rename, ``recforge.io``)::

    sparse/
      manifest.json                                 format, per table: config, step, stats, files
      item.shard-00000-of-00002.safetensors         per-key tensors of the keys hashed to shard 0:
      item.shard-00001-of-00002.safetensors           keys, tags, rows, weight, state.*, counter.*, changed
      item.globals.safetensors                      free-row stack, RNG state, default row, candidates

A load restores rows at the same row numbers, so a resumed run admits, evicts and
updates exactly as the uninterrupted one would. Serving exports hold only keys, tags
and (fp32 | fp16 | row-wise int8 + per-row scale/offset) weights; a delta export holds
the rows changed and the keys evicted since the previous export.

Example:
    >>> save_sparse_checkpoint("ckpt/sparse", {"item": table}, num_shards=4)
    >>> load_sparse_checkpoint("ckpt/sparse", {"item": fresh_table})
    >>> export_rows("export/delta-0001", table, precision="int8", delta=True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from recforge.io import atomic_directory, atomic_write_json
from recforge.sparse.hash_table import mix
from recforge.sparse.ids import check_ids
from recforge.sparse.optim import initial_state
from recforge.sparse.table import DynamicEmbedding

FORMAT_VERSION = 1
PRECISIONS = ("fp32", "fp16", "int8")


def table_state(table: DynamicEmbedding) -> tuple[dict[str, Tensor], dict]:
    """Every tensor of ``table``'s state (on CPU) and its JSON metadata."""
    live = table.live_rows()
    weight, states = table.store.host_rows(live)
    per_key = {"keys": table.row_key[live], "tags": table.row_tag[live], "rows": live, "weight": weight,
               "changed": table.changed[live].to(torch.uint8)}  # fmt: skip
    per_key.update({f"state.{k}": v for k, v in states.items()})
    per_key.update({f"counter.{k}": v[live] for k, v in table.counters.tensors().items()})
    glob = {"free": table.free[: table.num_free], "generator": table.generator.get_state(), "default_row": table.default_row.detach()}
    if table.deleted is not None:  # tracked since an export (possibly none evicted yet)
        glob["deleted_keys"], glob["deleted_tags"] = _deleted(table)
    if table.cfg.admission.needs_candidates:
        keys, tags, slots = table.cand_index.items()
        glob.update({"cand.keys": keys, "cand.tags": tags, "cand.slots": slots})
        glob.update({f"cand.{k}": v[: table.cand_used] for k, v in table.cand.tensors().items()})
    meta = {"config": dataclasses.asdict(table.cfg), "step": table.step, "num_rows": table.num_rows,
            "num_free": table.num_free, "cand_used": getattr(table, "cand_used", 0), "stats": dict(table.stats)}  # fmt: skip
    tensors = {f"key.{k}": v for k, v in per_key.items()} | {f"global.{k}": v for k, v in glob.items()}
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, meta


def restore_generator(generator: torch.Generator, state: Tensor) -> None:
    """Set ``generator`` to a saved state. A state saved on another device type (CPU <-> CUDA: different
    generators, mt19937 vs Philox) cannot be set; the generator is then seeded from a hash of that
    state, so a table moved or restored across device types draws a fixed, reproducible stream."""
    state = state.cpu()
    if state.numel() == generator.get_state().numel():
        generator.set_state(state)
        return
    digest = hashlib.sha256(state.numpy().tobytes()).digest()
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def load_table_state(table: DynamicEmbedding, tensors: dict[str, Tensor], meta: dict) -> None:
    """Restore ``table`` (built with a compatible config) from ``table_state`` output."""
    saved_dim = meta["config"]["dim"]
    if saved_dim != table.dim or meta["config"]["optimizer"]["kind"] != table.cfg.optimizer.kind:
        raise ValueError(
            f"table {table.cfg.name!r}: checkpoint has dim {saved_dim} / optimizer {meta['config']['optimizer']['kind']}, "
            f"the table dim {table.dim} / {table.cfg.optimizer.kind}; build the table with the checkpoint's config"
        )
    dev = table.device
    t = {k: v.to(dev) for k, v in tensors.items() if k != "global.generator"}
    learned = table.default_row if isinstance(table.default_row, nn.Parameter) else None
    table._build(meta["num_rows"])
    if learned is not None:
        learned.data = t["global.default_row"].to(learned.device)
        table.default_row = learned
    else:
        table.default_row = t["global.default_row"]
    table.step = meta["step"]
    table.stats.update(meta["stats"])
    rows = t["key.rows"]
    table.index.insert(t["key.keys"], t["key.tags"], rows)
    table.row_key[rows], table.row_tag[rows] = t["key.keys"], t["key.tags"]
    table.changed[rows] = t["key.changed"].bool()
    for name, counter in table.counters.tensors().items():
        counter[rows] = t[f"key.counter.{name}"]
    states = {name[len("key.state.") :]: v for name, v in t.items() if name.startswith("key.state.")}
    table.store.write_rows(rows, t["key.weight"], states)
    table.num_free = meta["num_free"]
    table.free[: table.num_free] = t["global.free"]
    restore_generator(table.generator, tensors["global.generator"])
    if "global.deleted_keys" in t:
        table.deleted = [(t["global.deleted_keys"], t["global.deleted_tags"])]
    if table.cfg.admission.needs_candidates:
        table.cand_used = meta["cand_used"]
        table.cand_index.insert(t["global.cand.keys"], t["global.cand.tags"], t["global.cand.slots"])
        for name, counter in table.cand.tensors().items():
            counter[: table.cand_used] = t[f"global.cand.{name}"]


def module_tables(module: nn.Module) -> dict[str, DynamicEmbedding]:
    """Every ``DynamicEmbedding`` inside ``module``, by module path (what a training checkpoint saves)."""
    return {name or "table": m for name, m in module.named_modules() if isinstance(m, DynamicEmbedding)}


def write_sparse(directory: Path, tables: dict[str, DynamicEmbedding], num_shards: int = 1) -> dict:
    """Write ``tables`` into an existing ``directory`` (not atomic: see ``save_sparse_checkpoint``); return the manifest."""
    if num_shards <= 0:
        raise ValueError(f"num_shards={num_shards}: must be >= 1")
    directory = Path(directory)
    manifest: dict = {"format_version": FORMAT_VERSION, "num_shards": num_shards, "tables": {}}
    for name, table in tables.items():
        tensors, meta = table_state(table)
        shard = torch.remainder(mix(tensors["key.keys"], tensors["key.tags"]), num_shards)
        files = []
        for i in range(num_shards):
            mine = (shard == i).nonzero().squeeze(1)
            fname = f"{name}.shard-{i:05d}-of-{num_shards:05d}.safetensors"
            save_file({k: v[mine].contiguous() for k, v in tensors.items() if k.startswith("key.")}, directory / fname)
            files.append(fname)
        save_file({k: v for k, v in tensors.items() if k.startswith("global.")}, directory / f"{name}.globals.safetensors")
        manifest["tables"][name] = {**meta, "shards": files, "globals": f"{name}.globals.safetensors",
                                    "num_keys": int(tensors["key.keys"].numel())}  # fmt: skip
    atomic_write_json(directory / "manifest.json", manifest)
    return manifest


def save_sparse_checkpoint(path: str | Path, tables: dict[str, DynamicEmbedding], num_shards: int = 1) -> Path:
    """Write a full sparse checkpoint at ``path`` atomically (a failure leaves any previous one intact)."""
    with atomic_directory(Path(path)) as tmp:
        write_sparse(tmp, tables, num_shards)
    return Path(path)


def load_sparse_checkpoint(path: str | Path, tables: dict[str, DynamicEmbedding]) -> dict:
    """Restore each of ``tables`` from the checkpoint at ``path``; return its manifest."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise ValueError(f"{path} is not a sparse checkpoint (no manifest.json)")
    manifest = json.loads((path / "manifest.json").read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: sparse checkpoint format {manifest.get('format_version')} is not supported")
    missing = sorted(set(tables) - set(manifest["tables"]))
    if missing:
        raise ValueError(f"{path} has no state for tables {missing} (it holds {sorted(manifest['tables'])})")
    for name, table in tables.items():
        entry = manifest["tables"][name]
        shards = [load_file(path / f) for f in entry["shards"]]
        tensors = {k: torch.cat([s[k] for s in shards]) for k in shards[0]}
        tensors.update(load_file(path / entry["globals"]))
        load_table_state(table, tensors, entry)
    return manifest


def _deleted(table: DynamicEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, tags) evicted since the last export, concatenated (empty int64 tensors if none)."""
    parts = table.deleted or [(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))]
    return torch.cat([k.cpu() for k, _ in parts]), torch.cat([t.cpu() for _, t in parts])


def export_rows(path: str | Path, table: DynamicEmbedding, *, precision: str = "fp32", delta: bool = False) -> dict:
    """Export keys + weights for serving (atomically); ``delta`` only rows changed / keys evicted since the last export.

    ``int8`` stores per row ``q = round((w - offset) / scale) - 128`` with ``offset`` the row
    minimum and ``scale = (max - min) / 255``: reconstruction error <= scale / 2 per element.
    Every export (full or delta) starts a new delta period.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    live = table.live_rows()
    rows = live[table.changed[live]] if delta else live
    weight = table.store.host_rows(rows)[0].float()
    out = {"keys": table.row_key[rows], "tags": table.row_tag[rows]}
    if precision == "fp32":
        out["weight"] = weight
    elif precision == "fp16":
        out["weight"] = weight.half()
    else:
        lo, hi = weight.amin(1), weight.amax(1)  # (R,) each
        scale = ((hi - lo) / 255).clamp(min=1e-12)
        out["weight"] = (torch.round((weight - lo[:, None]) / scale[:, None]) - 128).to(torch.int8)
        out["scale"], out["offset"] = scale, lo
    if delta and table.deleted:
        out["deleted_keys"], out["deleted_tags"] = _deleted(table)
    meta = {"format_version": FORMAT_VERSION, "table": table.cfg.name, "dim": table.dim, "step": table.step,
            "precision": precision, "delta": delta, "num_rows": int(rows.numel()),
            "num_deleted": int(out["deleted_keys"].numel()) if "deleted_keys" in out else 0}  # fmt: skip
    with atomic_directory(Path(path)) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in out.items()}, tmp / "rows.safetensors")
        atomic_write_json(tmp / "manifest.json", meta)
    table.changed.zero_()
    table.deleted = []
    return meta


def load_export(path: str | Path) -> dict[str, Tensor]:
    """Read an ``export_rows`` directory: keys, tags, float32 weight (dequantised), deleted_keys/tags if any."""
    path = Path(path)
    meta = json.loads((path / "manifest.json").read_text())
    t = load_file(path / "rows.safetensors")
    if meta["precision"] == "int8":
        t["weight"] = (t["weight"].float() + 128) * t.pop("scale")[:, None] + t.pop("offset")[:, None]
    t["weight"] = t["weight"].float()
    return t


def warm_start(table: DynamicEmbedding, weight: Tensor | nn.Embedding, ids: Tensor | None = None, tag: int = 0) -> None:
    """Put dense rows into ``table``: row ``i`` of ``weight`` becomes ID ``ids[i]`` (default ``i``), bypassing admission.

    Existing IDs are overwritten and their optimizer state reset.
    """
    weight = weight.weight.detach() if isinstance(weight, nn.Embedding) else weight.detach()
    ids = torch.arange(weight.shape[0]) if ids is None else check_ids(ids, "warm_start ids")
    if ids.numel() != weight.shape[0] or torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"warm_start: need one distinct id per weight row ({weight.shape[0]}), got {ids.numel()} ids")
    ids = ids.to(table.device)
    tags = torch.full_like(ids, tag)
    rows = table.index.lookup(ids, tags)
    new = (rows < 0).nonzero().squeeze(1)
    fresh = table._allocate(new.numel())
    if fresh.numel() < new.numel():
        raise ValueError(f"warm_start: table {table.cfg.name!r} has room for {fresh.numel()} of {new.numel()} new rows; raise max_rows")
    table.index.insert(ids[new], tags[new], fresh)
    rows[new] = fresh
    table.row_key[rows], table.row_tag[rows] = ids, tags
    table.counters.reset(rows)
    states = {name: torch.full((rows.numel(), *shape), initial_state(table.cfg.optimizer, name), dtype=dt)
              for name, (shape, dt) in table.store.spec.items()}  # fmt: skip
    table.store.write_rows(rows, weight.to(table.device, torch.float32), states)
    table.changed[rows] = True


def to_dense(table: DynamicEmbedding, ids: Tensor, tag: int = 0) -> Tensor:
    """(len(ids), dim) rows of ``ids``; IDs without a row read the table's default."""
    ids = check_ids(ids, "to_dense ids").to(table.device)
    rows = table.index.lookup(ids, torch.full_like(ids, tag))
    found = rows >= 0
    out = table.default_row.detach().expand(ids.numel(), table.dim).clone()
    out[found] = table.store.host_rows(rows[found])[0]
    return out


def to_embedding(table: DynamicEmbedding, num_embeddings: int, tag: int = 0) -> nn.Embedding:
    """An ``nn.Embedding`` whose row ``i`` is ID ``i`` of ``table`` (IDs 0..num_embeddings-1)."""
    dense = to_dense(table, torch.arange(num_embeddings), tag)
    return nn.Embedding.from_pretrained(dense.cpu(), freeze=False)

