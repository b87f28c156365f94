"""Whole-batch collation: an Arrow RecordBatch -> ``JaggedBatch``, zero-copy where Arrow allows.

Two collate functions, the only ones of recforge:

- ``JaggedCollate``: list columns that share one offsets layout become the batch's token features
  (their values buffers are shared with torch, not copied); scalar columns become dense
  per-sequence features or labels (retrieval samples, generic sequences).
- ``RankingCollate``: ranking rows (history and targets as separate list columns, contextual
  features as scalars) become the ranking layout: contextual tokens, history, targets, with the
  ``num_targets`` / timestamp mask (``RankingData.batch``, the ranking stream, compressed events).

The pipeline's ``__row_id__`` column becomes ``dense["row_ids"]``. No per-row Python anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from recforge.data.parquet_source import ROW_ID
from recforge.jagged.batch import JaggedBatch, readonly_tensor
from recforge.jagged.index import offsets_from_lengths
from recforge.jagged.mask import AttentionMask

ACTION_ENCODINGS = ("sum", "interleave")


def _tensor(col: pa.Array) -> torch.Tensor:
    if col.null_count:
        raise ValueError(f"cannot collate a column with {col.null_count} nulls; add RowRules(ids=...) to drop such rows")
    return readonly_tensor(col.to_numpy(zero_copy_only=False))


@dataclass(frozen=True)
class JaggedCollate:
    """Collate function: RecordBatch -> JaggedBatch.

    Attributes:
        jagged: list column -> token feature name (must produce ``item_ids``), e.g.
            ``{"item_ids": "item_ids", "timestamps": "timestamps"}``.
        dense: scalar column -> dense feature name.
        labels: column (scalar or list aligned with the tokens) -> label name.
        max_seq_len: upper bound recorded in the batch; computed per batch when None.

    Example:
        >>> collate = JaggedCollate(jagged={"item_ids": "item_ids"}, dense={"user_id": "user_id"})
        >>> batch = collate(record_batch)      # batch.dense["row_ids"] carries row identity
    """

    jagged: dict[str, str]
    dense: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    max_seq_len: int | None = None

    def __call__(self, rb: pa.RecordBatch) -> JaggedBatch:
        if "item_ids" not in self.jagged.values():
            raise ValueError(f"JaggedCollate.jagged must map some list column to 'item_ids', got {self.jagged}")
        batch = JaggedBatch.from_arrow({name: rb.column(col) for col, name in self.jagged.items()}, self.max_seq_len)
        for col, name in self.dense.items():
            batch.dense[name] = _tensor(rb.column(col))
        for col, name in self.labels.items():
            c = rb.column(col)
            if pa.types.is_list(c.type) or pa.types.is_large_list(c.type):
                off = c.offsets.to_numpy()
                c = c.values.slice(off[0], off[-1] - off[0])
            batch.labels[name] = _tensor(c)
        if ROW_ID in rb.schema.names:
            batch.dense["row_ids"] = _tensor(rb.column(ROW_ID))
        return batch


    def collate_slices(self, rb: pa.RecordBatch, cuts: np.ndarray) -> list[JaggedBatch]:
        """The batches ``[cuts[i], cuts[i+1])`` of ``rb``, each equal to ``self(rb.slice(...))``.

        Every column is converted to numpy once for all the batches; each batch is then numpy views
        (zero-copy) plus its rebased offsets, which costs a fraction of one ``__call__`` per batch.
        The pipeline uses it for the full batches of a worker task.
        """
        if "item_ids" not in self.jagged.values():
            raise ValueError(f"JaggedCollate.jagged must map some list column to 'item_ids', got {self.jagged}")
        offsets, lists = None, {}
        for col, name in self.jagged.items():
            offsets, lists[name] = self._list_values(rb, col, offsets)
        label_lists, label_rows = {}, {}
        for col, name in self.labels.items():
            if _is_list(rb.column(col).type):
                label_lists[name] = self._list_values(rb, col, None)
            else:
                label_rows[name] = _numpy(rb.column(col))
        dense = {name: _numpy(rb.column(col)) for col, name in self.dense.items()}
        if ROW_ID in rb.schema.names:
            dense["row_ids"] = _numpy(rb.column(ROW_ID))
        lengths = np.diff(offsets)
        out = []
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
            lo, hi = int(offsets[a]), int(offsets[b])
            max_len = self.max_seq_len if self.max_seq_len is not None else (int(lengths[a:b].max()) if b > a else 0)
            batch = JaggedBatch(torch.from_numpy(offsets[a : b + 1] - lo), {n: readonly_tensor(v[lo:hi]) for n, v in lists.items()}, max_len)
            batch.dense = {n: readonly_tensor(v[a:b]) for n, v in dense.items()}
            batch.labels = {n: readonly_tensor(v[a:b]) for n, v in label_rows.items()}
            for n, (off, v) in label_lists.items():
                batch.labels[n] = readonly_tensor(v[int(off[a]) : int(off[b])])
            out.append(batch)
        return out

    @staticmethod
    def _list_values(rb: pa.RecordBatch, col: str, offsets: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(offsets rebased to 0 as int64, the values they index) of list column ``col``; with ``offsets``,
        the column must have the same lengths."""
        c = rb.column(col)
        if c.null_count:
            raise ValueError(f"cannot collate a column with {c.null_count} nulls; add RowRules(ids=...) to drop such rows")
        off = c.offsets.to_numpy()
        values = c.values.slice(off[0], off[-1] - off[0]).to_numpy(zero_copy_only=False)
        off = off.astype(np.int64) - off[0]
        if offsets is not None and not np.array_equal(off, offsets):
            raise ValueError(f"list column {col!r} has different lengths from the others")
        return off, values


@dataclass(frozen=True)
class RankingCollate:
    """Ranking rows -> the ranking ``JaggedBatch``: per sequence, contextual tokens, history, targets.

    A row is one sample (a user and a period; see ``recforge.data.ranking``)::

        history_item_ids, history_timestamps   list<int64>  the history, oldest first
        history_<action_column>                list         its action signal (with ``action_column``)
        target_item_ids, target_timestamps     list<int64>  the candidates (impressions)
        target_<label>                         list         per ``label_columns`` entry
        <context column>                       int          per ``context_columns`` entry (coded, 0 = none)

    ``compress_events`` writes such rows from raw events; ``RankingData.rows`` builds them from its
    coded arrays (``RankingData.batch`` and the ranking stream collate them here).

    Features: ``item_ids`` (0 on contextual and action tokens), ``actions`` (the history's action
    signal; 0 elsewhere, and everywhere without ``action_column``), ``context_ids`` (the codes on
    contextual tokens, 0 elsewhere), ``timestamps`` (0 on contextual tokens). With
    ``action_encoding="interleave"`` each history event is an item token then an action token (both
    with the event's timestamp). Labels: ``labels[name]`` per target from ``target_<name>``, (N,), or
    (N, K) for a column of fixed-size lists. Dense: ``dense[name]`` from scalar column ``col`` per
    ``dense`` entry ``col -> name``, and ``row_ids``. Mask: contextual prefix, causal history,
    ``num_targets`` targets that see history events strictly before their own timestamp.

    Example:
        >>> collate = RankingCollate(("click",), action_column="action", context_columns=("user_code",))
        >>> batch = collate(record_batch)     # batch.labels["click"]: (N,), batch.mask.num_targets: (B,)
    """

    label_columns: tuple[str, ...] = ()
    action_column: str = ""
    context_columns: tuple[str, ...] = ()
    max_seq_len: int | None = None  # recorded in the batch; the longest sequence of the batch when None
    action_encoding: str = "sum"
    dense: dict[str, str] = field(default_factory=lambda: {"user_id": "user_id"})

    def __post_init__(self) -> None:
        if self.action_encoding not in ACTION_ENCODINGS:
            raise ValueError(f"action_encoding={self.action_encoding!r}: expected one of {ACTION_ENCODINGS}")

    def __call__(self, rb: pa.RecordBatch) -> JaggedBatch:
        return self.collate_slices(rb, np.array([0, rb.num_rows]))[0]

    def collate_slices(self, rb: pa.RecordBatch, cuts: np.ndarray) -> list[JaggedBatch]:
        """The batches ``[cuts[i], cuts[i+1])`` of ``rb``, each equal to ``self(rb.slice(...))``.

        Every column is converted once for all the batches (the pipeline's fused path for a worker
        task's full batches, as ``JaggedCollate.collate_slices``); each batch is then views plus its layout.
        """
        action = [f"history_{self.action_column}"] if self.action_column else []
        h_off, history = _lists(rb, ["history_item_ids", "history_timestamps", *action])
        t_off, targets = _lists(rb, ["target_item_ids", "target_timestamps", *[f"target_{n}" for n in self.label_columns]])
        context = [_tensor(rb.column(name)).to(torch.int64) for name in self.context_columns]
        context = torch.stack(context, dim=1) if context else torch.zeros(rb.num_rows, 0, dtype=torch.int64)  # (B, c)
        dense = {name: _tensor(rb.column(col)) for col, name in self.dense.items()}
        if ROW_ID in rb.schema.names:
            dense["row_ids"] = _tensor(rb.column(ROW_ID))
        h_len, t_len = h_off.diff(), t_off.diff()
        out = []
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
            hs, ts = slice(int(h_off[a]), int(h_off[b])), slice(int(t_off[a]), int(t_off[b]))
            rows = RankingRows(h_len[a:b], t_len[a:b], history[0][hs], history[1][hs], history[2][hs] if action else None,
                               targets[0][ts], targets[1][ts], context[a:b])  # fmt: skip
            batch = rows.layout(self.action_encoding, self.max_seq_len)
            batch.labels = {name: values[ts] for name, values in zip(self.label_columns, targets[2:], strict=True)}
            batch.dense = {name: values[a:b] for name, values in dense.items()}
            out.append(batch)
        return out


@dataclass
class RankingRows:
    """B ranking samples as flat tensors (``RankingCollate``'s row columns); ``layout`` is the one place
    the ranking batch layout is written (``RankingCollate`` and ``RankingData.batch`` both end here)."""

    history_lengths: torch.Tensor  # (B,) int64 history events per sample
    target_lengths: torch.Tensor  # (B,) int64 targets per sample
    history_item_ids: torch.Tensor  # (sum of history_lengths,)
    history_timestamps: torch.Tensor  # (sum of history_lengths,)
    history_actions: torch.Tensor | None  # (sum of history_lengths,) or None (no action signal)
    target_item_ids: torch.Tensor  # (sum of target_lengths,)
    target_timestamps: torch.Tensor  # (sum of target_lengths,)
    context: torch.Tensor  # (B, c) int64 contextual codes (0 = none)

    def layout(self, action_encoding: str = "sum", max_seq_len: int | None = None) -> JaggedBatch:
        """Per sample: c contextual tokens, the history (one token per event, or an item token then an
        action token with ``interleave``), the targets. Features, mask: see ``RankingCollate``."""
        if action_encoding not in ACTION_ENCODINGS:
            raise ValueError(f"action_encoding={action_encoding!r}: expected one of {ACTION_ENCODINGS}")
        per_event, (batch, c) = (2 if action_encoding == "interleave" else 1), self.context.shape
        h_len, t_len = self.history_lengths, self.target_lengths
        lengths = c + per_event * h_len + t_len
        offsets = offsets_from_lengths(lengths)
        h_pos = _positions(offsets[:-1] + c, h_len, per_event)  # each history event's item token
        t_pos = _positions(offsets[:-1] + c + per_event * h_len, t_len)
        total = int(offsets[-1])
        item_ids = torch.zeros(total, dtype=torch.int64)
        timestamps = torch.zeros(total, dtype=torch.int64)  # contextual tokens: features, not events: 0
        item_ids[h_pos], item_ids[t_pos] = self.history_item_ids, self.target_item_ids
        timestamps[h_pos], timestamps[t_pos] = self.history_timestamps, self.target_timestamps
        if per_event == 2:
            timestamps[h_pos + 1] = self.history_timestamps  # an event's action token keeps the event's time
        context_ids = torch.zeros(total, dtype=torch.int64)
        if c:
            context_ids[(offsets[:-1].view(-1, 1) + torch.arange(c)).flatten()] = self.context.flatten()
        acts = self.history_actions
        actions = torch.zeros(total, dtype=torch.int64 if acts is None else acts.dtype)
        if acts is not None:
            actions[h_pos + (per_event - 1)] = acts
        features = {"item_ids": item_ids, "actions": actions, "context_ids": context_ids, "timestamps": timestamps}
        mask = AttentionMask(causal=True, num_targets=t_len, num_contextual=torch.full((batch,), c, dtype=torch.int64),
                             timestamps=timestamps)  # fmt: skip
        max_len = max_seq_len if max_seq_len is not None else int(lengths.max()) if batch else 0
        return JaggedBatch(offsets, features, max_len, mask=mask)


def _lists(rb: pa.RecordBatch, names: list[str]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(offsets (B+1,) from 0, each column's values, flat) of list columns ``names`` with equal lengths;
    values that are fixed-size lists of K come back as (sum of lengths, K)."""
    offsets, out = None, []
    for name in names:
        if name not in rb.schema.names:
            raise ValueError(f"ranking rows need a column {name!r} (have {rb.schema.names})")
        col = rb.column(name)
        if col.null_count:
            raise ValueError(f"cannot collate column {name!r} with {col.null_count} nulls; drop or fill those rows")
        off = col.offsets.to_numpy()
        values = col.values.slice(off[0], off[-1] - off[0])
        off = off.astype(np.int64) - off[0]
        if offsets is None:
            offsets = off
        elif not np.array_equal(off, offsets):
            raise ValueError(f"list column {name!r} has different lengths from {names[0]!r} in some rows")
        if pa.types.is_fixed_size_list(values.type):
            out.append(_tensor(values.flatten()).reshape(-1, values.type.list_size))
        else:
            out.append(_tensor(values))
    return torch.from_numpy(offsets), out


def _positions(starts: torch.Tensor, counts: torch.Tensor, step: int = 1) -> torch.Tensor:
    """Token positions ``starts[b] + step * [0, counts[b])`` for every sequence b, concatenated."""
    firsts = offsets_from_lengths(counts)[:-1]
    return torch.repeat_interleave(starts - step * firsts, counts) + step * torch.arange(int(counts.sum()))


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _numpy(col: pa.Array) -> np.ndarray:
    if col.null_count:
        raise ValueError(f"cannot collate a column with {col.null_count} nulls; add RowRules(ids=...) to drop such rows")
    return col.to_numpy(zero_copy_only=False)


def row_ids_of(rb: pa.RecordBatch) -> np.ndarray:
    """The ``__row_id__`` values of a batch (raises when a transform dropped the column)."""
    if ROW_ID not in rb.schema.names:
        raise ValueError(
            f"a pipeline transform dropped the {ROW_ID!r} column (have {rb.schema.names}); map functions "
            "must keep it so every sample keeps its row identity"
        )
    return rb.column(ROW_ID).to_numpy()
