"""Exactly-once pipeline state: which rows of each file the trainer has consumed this epoch.

The state is a bitmap per file (one bit per row), the epoch, the shuffle seed and a resume
counter. It is updated when the pipeline *hands a batch to the trainer* (rows still in
prefetch queues or shuffle buffers are not consumed), so saving it together with the
model after a step and restoring both after a crash replays every unconsumed row exactly
once and no consumed row again, whatever happened to the in-flight data.

Re-splitting: on every (re)start the unconsumed rows, in file/row order, are cut into
``world_size`` contiguous shares of equal size (±1 row), or of equal estimated tokens for
token-budget batches (see ``plan``), so a changed number of ranks still splits the remaining
work evenly. Ranks save their own states; ``merge`` ORs them
(rows consumed by any rank are consumed), which is also exact across several restarts
with different world sizes. A rank's own state knows only the rows that rank consumed: to
resume, always ``merge`` the states of all ranks of the interrupted run, even when the world
size is unchanged.

After a resume the shuffle order of the remaining rows is drawn from
``(seed, epoch, resumes)``: a different but equally random order; exactly-once does not
depend on replaying the old order.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass

import numpy as np

from recforge.data.parquet_source import ParquetSource, ReadUnit, decode_row_ids

STATE_VERSION = 1


def _pack(bits: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.packbits(bits).tobytes(), 6)).decode("ascii")


def _unpack(text: str, n: int) -> np.ndarray:
    raw = np.frombuffer(zlib.decompress(base64.b64decode(text)), np.uint8)
    return np.unpackbits(raw, count=n).astype(bool)


def _positions(free_rows: list[list[np.ndarray]], tokens: list[list[np.ndarray]] | None) -> tuple[list[list[np.ndarray]], float]:
    """Each unconsumed row's middle on the axis of cumulative weight (rows in file/row order), and the
    total weight. A row weighs 1, or its tokens (``tokens[f][g]``: per row, or one mean per row group)."""
    positions, seen = [], 0.0
    for f, per_group in enumerate(free_rows):
        out = []
        for g, free in enumerate(per_group):
            if tokens is None:
                w = np.ones(len(free))
            else:
                t = tokens[f][g]
                w = np.maximum(np.full(len(free), float(t)) if t.ndim == 0 else t[free], 1e-9)
            ends = seen + np.cumsum(w)
            out.append(ends - w / 2)
            seen = float(ends[-1]) if len(ends) else seen
        positions.append(out)
    return positions, seen


def _after_maps(column: str, lengths: np.ndarray, maps: tuple) -> np.ndarray:
    """Per-row ``lengths`` of ``column`` through the maps' declared effects (the last one picks one column)."""
    columns = {column: lengths}
    for fn in maps:
        columns = fn(dict(columns))
    (out,) = columns.values()
    out = np.asarray(out, np.float64)
    if out.shape != lengths.shape:
        raise ValueError(f"a map's token_lengths turned {lengths.shape} row lengths into {out.shape}: it must keep one length per row")
    return out


@dataclass
class PipelineState:
    """Rows consumed per file this epoch, plus what seeds the shuffle.

    Attributes:
        paths: the files, in source order (checked on load: a different file list is an error).
        consumed: per file, (rows,) bool; True = the trainer has received that row this epoch.
        epoch: epochs completed.
        seed: base shuffle seed.
        resumes: how many times this state was restored (varies the post-resume shuffle).
        share_done: this rank has read its whole share of the epoch (its next iteration starts
            a new epoch, even though other ranks' rows are not marked in this rank's state).
    """

    paths: list[str]
    consumed: list[np.ndarray]
    epoch: int = 0
    seed: int = 0
    resumes: int = 0
    share_done: bool = False

    @staticmethod
    def fresh(source: ParquetSource, seed: int = 0) -> PipelineState:
        return PipelineState(list(source.paths), [np.zeros(int(n), bool) for n in source.file_rows], seed=seed)

    # -- bookkeeping -------------------------------------------------------------------
    def mark(self, row_ids: np.ndarray) -> None:
        """Record rows as consumed (called when a batch is handed to the trainer)."""
        files, rows = decode_row_ids(row_ids)
        if len(files) and files[0] == files[-1] and (files == files[0]).all():  # the common case: one file
            self.consumed[int(files[0])][rows] = True
            return
        for f in np.flatnonzero(np.bincount(files)):  # the files present (few, small ints): no sort
            self.consumed[int(f)][rows[files == f]] = True

    @property
    def num_consumed(self) -> int:
        return int(sum(int(c.sum()) for c in self.consumed))

    @property
    def num_rows(self) -> int:
        return int(sum(len(c) for c in self.consumed))

    @property
    def complete(self) -> bool:
        return self.num_consumed == self.num_rows

    def next_epoch(self) -> None:
        """Start a new epoch: nothing consumed."""
        self.epoch += 1
        self.resumes = 0
        self.share_done = False
        for c in self.consumed:
            c[:] = False

    # -- splitting ---------------------------------------------------------------------
    def plan(self, source: ParquetSource, rank: int = 0, world_size: int = 1, token_column: str | None = None,
             token_maps: tuple = ()) -> tuple[list[ReadUnit], list[np.ndarray]]:  # fmt: skip
        """This rank's share of the unconsumed rows as read units, with a keep-mask per unit.

        Shares are contiguous runs of the unconsumed rows, in file/row order, of equal row counts
        (±1), or, with ``token_column``, of equal tokens: each row weighs its tokens, exactly for an
        integer column of per-row counts, or its row group's mean list length (from the Parquet
        footer) for a list column (``ParquetSource.row_tokens``). Token-budget batching then gives
        every rank about the same number of batches even when history lengths differ between files.
        ``token_maps`` (``Pipeline._token_maps``): the maps' declared effects on the lengths, applied in
        order to each row's length (read per row then, once per source); shares are then balanced on
        the lengths the batches are cut by, e.g. histories after truncation.

        Returns:
            (units, keep): ``keep[i]`` is a bool mask over unit i's rows (False = already consumed).
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        self.check(source)
        free_rows = [
            [np.flatnonzero(~self.consumed[f][first : first + n]) for first, n in zip(np.cumsum(rg) - rg, rg, strict=True)]
            for f, rg in enumerate(source.row_group_rows)
        ]
        tokens = None
        if token_column is not None:
            tokens = source.row_tokens(token_column, per_row=bool(token_maps))
            if token_maps:
                tokens = [[_after_maps(token_column, t, token_maps) for t in groups] for groups in tokens]
        positions, total = _positions(free_rows, tokens)
        if token_column is None:  # integer bounds on row counts: the historical even split (±1 row)
            remaining = int(total)
            lo, hi = remaining * rank // world_size, remaining * (rank + 1) // world_size
        else:
            lo = -np.inf if rank == 0 else total * rank / world_size
            hi = np.inf if rank == world_size - 1 else total * (rank + 1) / world_size
        units, keep = [], []
        for f in range(len(free_rows)):
            for g, (free, pos) in enumerate(zip(free_rows[f], positions[f], strict=True)):
                a, b = int(np.searchsorted(pos, lo)), int(np.searchsorted(pos, hi))  # rows whose middle is in [lo, hi)
                if a < b:
                    start, stop = int(free[a]), int(free[b - 1]) + 1
                    # the share's unconsumed rows inside [start, stop): consumed rows in between are dropped
                    mask = np.zeros(stop - start, bool)
                    mask[free[a:b] - start] = True
                    units.append(ReadUnit(f, g, start, stop))
                    keep.append(mask)
        return units, keep

    def check(self, source: ParquetSource) -> None:
        if len(source.paths) != len(self.paths) or any(
            len(c) != int(n) for c, n in zip(self.consumed, source.file_rows, strict=True)
        ):
            raise ValueError(
                f"pipeline state was saved for {len(self.paths)} files {self.paths[:3]}... with "
                f"{[len(c) for c in self.consumed][:3]}... rows; the source now has {source.paths[:3]}... "
                f"with {source.file_rows[:3].tolist()}... rows. Resume with the same files, or start a fresh state."
            )

    # -- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-serialisable form (bitmaps packed, zlib-compressed, base64)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "resumes": self.resumes,
            "share_done": self.share_done,
            "files": [{"path": p, "rows": len(c), "consumed": _pack(c)} for p, c in zip(self.paths, self.consumed, strict=True)],
        }

    @staticmethod
    def from_dict(payload: dict) -> PipelineState:
        """Restore a saved state; its ``resumes`` counter goes up by one."""
        if payload.get("version") != STATE_VERSION:
            raise ValueError(f"pipeline state version {payload.get('version')} is not supported (need {STATE_VERSION})")
        files = payload["files"]
        return PipelineState(
            [f["path"] for f in files],
            [_unpack(f["consumed"], int(f["rows"])) for f in files],
            epoch=int(payload["epoch"]),
            seed=int(payload["seed"]),
            resumes=int(payload["resumes"]) + 1,
            share_done=bool(payload.get("share_done", False)),
        )

    @staticmethod
    def merge(states: list[PipelineState]) -> PipelineState:
        """Combine the states of several ranks: a row is consumed if any rank consumed it.

        All states must be of the same epoch and files; the merged ``resumes`` is the max. A rank
        that already moved on to the next epoch has dropped its record of the previous one, so
        states of different epochs cannot be merged: checkpoint all ranks together (the training
        loop checkpoints at every epoch end, after all ranks have finished their shares).
        """
        if not states:
            raise ValueError("merge needs at least one state")
        epochs = {s.epoch for s in states}
        if len(epochs) != 1:
            raise ValueError(
                f"cannot merge pipeline states of different epochs {sorted(epochs)}: a rank started a new epoch "
                "before the others finished theirs; resume from a checkpoint that all ranks saved at the same step"
            )
        first = states[0]
        for s in states[1:]:
            if [len(c) for c in s.consumed] != [len(c) for c in first.consumed]:
                raise ValueError("cannot merge pipeline states saved for different files")
        consumed = [np.logical_or.reduce([s.consumed[i] for s in states]) for i in range(len(first.consumed))]
        return PipelineState(
            # share_done described a share of the old split; the merged rows are re-split, so it starts False
            list(first.paths), consumed, first.epoch, first.seed, max(s.resumes for s in states), share_done=False
        )
