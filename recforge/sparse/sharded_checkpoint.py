"""Sharded checkpoints of ``ShardedDynamicEmbedding`` tables: one file per rank, one manifest, any world size back.

Directory (on a file system every rank sees; it appears whole or not at all)::

    ckpt/
      manifest.json                             world size, owner hash, plan, per table: config + each rank's meta
      item.rank-00000-of-00004.safetensors      rank 0's shard: key.* (keys, tags, rows, weight, state.*,
      item.rank-00001-of-00004.safetensors        counter.*, changed) and global.* (free stack, RNG, default row,
      ...                                         admission candidates): ``checkpoint.table_state`` of the shard

Saving is collective: rank 0 makes a temporary directory and broadcasts its name, every rank
writes its files (each atomically), a barrier, rank 0 writes the manifest and renames the
directory into place, a barrier. Loading on the same world size and placement restores every
shard exactly (row numbers, free stack, RNG: training continues as if uninterrupted). On another
world size (or plan) every rank reads each saved shard and keeps the rows it now owns
(``owner_of``): IDs, weights, optimizer state, policy counters and admission candidates move
to their new owner; rows are renumbered, stats restart at 0. ``load_merged`` restores plain
one-process tables from all shards (``recforge eval`` of a torchrun checkpoint);
``export_sharded_checkpoint`` writes that merge in the single-process format
(``checkpoint.save_sparse_checkpoint``).

Example:
    >>> tables = sharded_tables(model)                                # {"embedding.item": ShardedDynamicEmbedding}
    >>> save_sharded_checkpoint("run/sparse-step-100", tables, plan)  # on every rank
    >>> load_sharded_checkpoint("run/sparse-step-100", tables)        # any world size
    >>> load_merged("run/sparse-step-100", {"embedding.item": DynamicEmbedding(cfg)})  # one process, no group
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor

from recforge.io import atomic_file, atomic_write_json, make_temp_dir
from recforge.sparse.checkpoint import FORMAT_VERSION as SINGLE_FORMAT_VERSION
from recforge.sparse.checkpoint import load_table_state, save_sparse_checkpoint, table_state
from recforge.sparse.optim import SparseOptimConfig
from recforge.sparse.planner import ShardingPlan, TablePlacement, row_bytes
from recforge.sparse.policies import AdmissionConfig, EvictionConfig, RowCounters, eviction_scores
from recforge.sparse.routing import shard_config
from recforge.sparse.sharded import ShardedDynamicEmbedding
from recforge.sparse.table import DynamicEmbedding
from recforge.sparse.table_config import TableConfig

log = logging.getLogger(__name__)
FORMAT = "recforge.sparse.sharded"
FORMAT_VERSION = 1
OWNER_HASH = "f(f(id + tag * 0x9E3779B97F4A7C15)) mod world_size, f = the splitmix64 finaliser (recforge.sparse.sharded.owner_of)"


def _file(name: str, rank: int, world_size: int) -> str:
    return f"{name}.rank-{rank:05d}-of-{world_size:05d}.safetensors"


def _plan_of(tables: dict[str, ShardedDynamicEmbedding], world_size: int) -> ShardingPlan:
    plan = ShardingPlan(world_size)
    for name, t in tables.items():
        rows = t.cfg.max_rows or t.cfg.capacity
        kind, ranks = ("row_wise", list(range(world_size))) if t.owner_rank is None else ("table_wise", [t.owner_rank])
        plan.tables[name] = TablePlacement(kind, ranks, rows, rows * row_bytes(t.cfg))
    return plan


def save_sharded_checkpoint(path: str | Path, tables: dict[str, ShardedDynamicEmbedding], plan: ShardingPlan | None = None) -> Path:
    """Write every rank's shards of ``tables`` and one manifest at ``path`` (a collective: call on every rank)."""
    path = Path(path)
    if not tables:
        raise ValueError("save_sharded_checkpoint: no tables given (pass {name: ShardedDynamicEmbedding}, e.g. sharded_tables(model))")
    some = next(iter(tables.values()))
    rank, world, group = some.rank, some.world_size, some.group
    collective = some.collective
    tmp_box = [None]
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_box[0] = str(make_temp_dir(path))  # the umask applies (tempfile.mkdtemp would make it owner-only)
    if collective:
        dist.broadcast_object_list(tmp_box, src=dist.get_global_rank(group, 0), group=group)
    tmp = Path(tmp_box[0])
    metas = {}
    for name, table in tables.items():
        tensors, meta = table_state(table.shard)
        with atomic_file(tmp / _file(name, rank, world)) as out:
            save_file(tensors, out)
        metas[name] = {**meta, "file": _file(name, rank, world)}
    gathered = [None] * world
    if collective:
        dist.all_gather_object(gathered, metas, group=group)  # also the barrier: every file is written
    else:
        gathered = [metas]
    if rank == 0:
        plan = plan or _plan_of(tables, world)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "world_size": world, "owner_hash": OWNER_HASH,
                    "plan": plan.to_dict(), "tables": {}}  # fmt: skip
        for name, table in tables.items():
            manifest["tables"][name] = {"config": dataclasses.asdict(table.cfg), "owner_rank": table.owner_rank,
                                        "step": table.step, "ranks": [g[name] for g in gathered]}  # fmt: skip
        atomic_write_json(tmp / "manifest.json", manifest)
        if path.exists():  # as recforge.io.atomic_directory: the old copy goes aside, then the new one in
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    if collective:
        dist.barrier(group=group)
    return path


def read_manifest(path: str | Path) -> dict:
    """The manifest of a sharded checkpoint, or of a single-process one (``checkpoint.save_sparse_checkpoint``,
    marked ``"format": "single"`` here); ``ValueError`` if ``path`` is neither."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise ValueError(f"{path} is not a sparse checkpoint (no manifest.json)")
    manifest = json.loads((path / "manifest.json").read_text())
    if "format" not in manifest and manifest.get("format_version") == SINGLE_FORMAT_VERSION and "num_shards" in manifest:
        return {**manifest, "format": "single"}
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {manifest.get('format')!r} v{manifest.get('format_version')} is neither a "
                         f"{FORMAT!r} v{FORMAT_VERSION} nor a single-process sparse checkpoint")  # fmt: skip
    return manifest


def _saved_files(manifest: dict, entry: dict) -> list[list[str]]:
    """The files of each saved shard of a table; the single-process format keeps its globals in one more file."""
    if manifest["format"] == "single":
        return [[f, entry["globals"]] if i == 0 else [f] for i, f in enumerate(entry["shards"])]
    return [[meta["file"]] for meta in entry["ranks"]]


def table_config(data: dict) -> TableConfig:
    """A ``TableConfig`` from its ``dataclasses.asdict`` form (as manifests store it)."""
    nested = {"admission": AdmissionConfig, "eviction": EvictionConfig, "optimizer": SparseOptimConfig}
    return TableConfig(**{k: nested[k](**v) if k in nested else v for k, v in data.items()})


def _matching_manifest(path: Path, tables: dict) -> dict:
    """The checkpoint's manifest, after checking it holds every table with the same dim and optimizer."""
    manifest = read_manifest(path)
    missing = sorted(set(tables) - set(manifest["tables"]))
    if missing:
        raise ValueError(f"{path} has no state for tables {missing} (it holds {sorted(manifest['tables'])})")
    for name, table in tables.items():
        saved = manifest["tables"][name]["config"]
        if saved["dim"] != table.dim or saved["optimizer"]["kind"] != table.cfg.optimizer.kind:
            raise ValueError(f"table {name!r}: checkpoint has dim {saved['dim']} / optimizer "
                             f"{saved['optimizer']['kind']}, the table {table.dim} / {table.cfg.optimizer.kind}; "
                             "build the table with the checkpoint's config")  # fmt: skip
    return manifest


def load_sharded_checkpoint(path: str | Path, tables: dict[str, ShardedDynamicEmbedding]) -> dict:
    """Restore ``tables`` (on every rank) from a sharded checkpoint saved on any world size, or from a
    single-process sparse checkpoint (its rows re-routed to their owners); return its manifest."""
    path = Path(path)
    manifest = _matching_manifest(path, tables)
    for name, table in tables.items():
        entry = manifest["tables"][name]
        same_layout = manifest.get("world_size") == table.world_size and entry.get("owner_rank") == table.owner_rank
        if same_layout and manifest["format"] == FORMAT:
            meta = entry["ranks"][table.rank]
            load_table_state(table.shard, load_file(path / meta["file"]), meta)
        else:
            reroute(path, _saved_files(manifest, entry), entry["step"], table.shard, lambda k, t, tb=table: tb.owners(k, t) == tb.rank)
            log.info("table %r: resharded from %s to %d rank(s); this rank holds %d rows", name,
                     manifest.get("world_size", "one process"), table.world_size, table.num_live)  # fmt: skip
    return manifest


def reroute(path: Path, files: list[list[str]], step: int, shard: DynamicEmbedding, owns, limit: int | None = None) -> None:
    """Fill ``shard`` with the saved rows for which ``owns(keys, tags)`` is true, read from every saved shard
    (``files``: per shard, its files; one shard in memory at a time).

    ``limit`` (default: the shard's ``max_rows``; 0: none): when more saved rows route here than that (a full
    table resharded: hash ownership is not even, and shard limits are rounded up), the lowest-priority surplus
    rows under the table's eviction policy are dropped, and a warning says how many.
    """
    per_key: dict[str, list[Tensor]] = {}
    cand: dict[str, list[Tensor]] = {}
    globals0 = None
    for names in files:
        saved = {k: v for name in names for k, v in load_file(path / name).items()}
        globals0 = globals0 or {k: v for k, v in saved.items() if k.startswith("global.")}
        mine = owns(saved["key.keys"].to(shard.device), saved["key.tags"].to(shard.device)).cpu()
        for k, v in saved.items():
            if k.startswith("key."):
                per_key.setdefault(k, []).append(v[mine])
        if "global.deleted_keys" in saved:
            gone = owns(saved["global.deleted_keys"].to(shard.device), saved["global.deleted_tags"].to(shard.device)).cpu()
            for k in ("deleted_keys", "deleted_tags"):
                cand.setdefault(k, []).append(saved[f"global.{k}"][gone])
        if "global.cand.keys" in saved:  # admission candidates: their counters are indexed by slot
            ck, ct, slots = saved["global.cand.keys"], saved["global.cand.tags"], saved["global.cand.slots"]
            keep = owns(ck.to(shard.device), ct.to(shard.device)).cpu()
            cand.setdefault("cand.keys", []).append(ck[keep])
            cand.setdefault("cand.tags", []).append(ct[keep])
            for name in ("count", "last_step", "last_time", "show", "click"):
                cand.setdefault(f"cand.{name}", []).append(saved[f"global.cand.{name}"][slots[keep]])
    tensors = {k: torch.cat(v) for k, v in per_key.items()}
    cfg = shard.cfg
    limit = cfg.max_rows if limit is None else limit
    if limit and tensors["key.keys"].numel() > limit:
        tensors, dropped = _evict_surplus(tensors, limit, step, shard)
        if "deleted_keys" in cand:  # deletions are tracked (for delta exports): these rows are gone too
            cand["deleted_keys"].append(dropped["key.keys"])
            cand["deleted_tags"].append(dropped["key.tags"])
    n = tensors["key.keys"].numel()
    num_rows = max(cfg.capacity, n)
    tensors["key.rows"] = torch.arange(n)
    tensors["global.free"] = torch.arange(num_rows - 1, n - 1, -1)  # rows n, n+1, ... are taken next
    tensors["global.generator"] = shard.generator.get_state()  # this shard's own stream, as built
    tensors["global.default_row"] = globals0["global.default_row"]
    if "deleted_keys" in cand:
        tensors["global.deleted_keys"], tensors["global.deleted_tags"] = torch.cat(cand["deleted_keys"]), torch.cat(cand["deleted_tags"])
    cand_used = 0
    if cfg.admission.needs_candidates and "cand.keys" in cand:
        ck = torch.cat(cand["cand.keys"])
        cand_used = ck.numel() if ck.numel() <= cfg.admission.max_candidates else 0  # over the tracker's size: start over
        keep = slice(0, cand_used)
        tensors["global.cand.keys"], tensors["global.cand.tags"] = ck[keep], torch.cat(cand["cand.tags"])[keep]
        tensors["global.cand.slots"] = torch.arange(cand_used)
        for name in ("count", "last_step", "last_time", "show", "click"):
            tensors[f"global.cand.{name}"] = torch.cat(cand[f"cand.{name}"])[keep]
    meta = {"config": dataclasses.asdict(cfg), "step": step, "num_rows": num_rows, "num_free": num_rows - n,
            "cand_used": cand_used, "stats": {}}  # fmt: skip
    load_table_state(shard, tensors, meta)


def _evict_surplus(tensors: dict[str, Tensor], limit: int, step: int,
                   shard: DynamicEmbedding) -> tuple[dict[str, Tensor], dict[str, Tensor]]:  # fmt: skip
    """(kept, dropped): the ``limit`` saved rows the table's eviction policy ranks highest (LRU/LFU/...;
    ``none``: the most looked-up) and the others, dropped with a warning."""
    cfg, n = shard.cfg, tensors["key.keys"].numel()
    counters = RowCounters(**{name: tensors[f"key.counter.{name}"] for name in RowCounters.zeros(0, "cpu").tensors()})
    rows = torch.arange(n)
    policy = cfg.eviction if cfg.eviction.kind != "none" else dataclasses.replace(cfg.eviction, kind="lfu")
    norms = tensors["key.weight"].float().norm(dim=1) if policy.kind == "l2" else None
    scores = eviction_scores(policy, counters, rows, step, shard.clock(), norms)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.topk(scores, limit, largest=True).indices] = True  # saved order kept
    log.warning("table %r: %d saved rows route to this shard, which holds at most %d (max_rows / world size, rounded "
                "up); the %d lowest-priority rows under eviction %r are dropped. Raise max_rows to keep them all",
                cfg.name, n, limit, n - limit, policy.kind)  # fmt: skip
    return {k: v[keep] for k, v in tensors.items()}, {k: v[~keep] for k, v in tensors.items()}


def load_merged(path: str | Path, tables: dict[str, DynamicEmbedding]) -> dict:
    """Restore plain (one-process) ``tables`` from a sharded checkpoint: every saved shard's rows merged
    (what ``recforge eval`` does with a checkpoint written under torchrun); return its manifest.

    Every saved row is kept, even when the shards together hold a few more than ``max_rows`` (each
    shard's limit is ``max_rows / world size`` rounded up).
    """
    path = Path(path)
    manifest = _matching_manifest(path, tables)
    for name, table in tables.items():
        entry = manifest["tables"][name]
        reroute(path, _saved_files(manifest, entry), entry["step"], table, lambda k, t: torch.ones_like(k, dtype=torch.bool),
                limit=0)  # fmt: skip
    return manifest


def export_sharded_checkpoint(path: str | Path, out: str | Path, num_shards: int = 1) -> Path:
    """Merge a sharded checkpoint into the single-process sparse checkpoint format at ``out`` (one process, no group).

    The tables come back as ``DynamicEmbedding``s with their full configs, loadable by
    ``load_sparse_checkpoint``. (Training checkpoints need no export: ``recforge eval`` and
    ``recforge.checkpoint.load_checkpoint`` read ``sparse_sharded/`` directly, see ``load_merged``.)
    """
    path = Path(path)
    manifest = read_manifest(path)
    tables = {name: DynamicEmbedding(shard_config(table_config(entry["config"]), 1)) for name, entry in manifest["tables"].items()}
    load_merged(path, tables)
    return save_sparse_checkpoint(out, tables, num_shards)
