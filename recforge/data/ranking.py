"""Ranking samples: histories with action signals, contextual features, candidates as targets.

One ranking sample is one user and one fixed period (``period_seconds``): the user's
impressions in that period are the *targets* (candidates), and the sequence is::

    | contextual: one token per user feature | history: the user's events before the | targets: the period's |
    | (full attention among themselves)      | period's last impression (causal)      | impressions            |

Every event of the period is also a history token (its action is the signal later
impressions learn from), so the mask carries per-token timestamps: an impression sees
only history events strictly before its own timestamp, contextual tokens always, other
impressions never. One forward pass scores all of a period's impressions without any of
them seeing the future (seeds 002/003: "fixed-period aggregated samples").

Action signals on history tokens (``action_encoding``):

- ``sum``: one token per event, ``item embedding + action embedding`` (length L).
- ``interleave``: an item token then an action token per event, as in the HSTU paper
  (length 2L, so attention costs 4x). RESULTS.md compares the two on ML-100K.

Labels come from ``tasks``: ``"like:rating>=4"`` (binary, threshold), ``"buy:action==buy"``
(binary, equality) or ``"rating:rating"`` (regression on the raw column).

Splits are per user in time order: each user's last ``test_fraction`` of events are test
impressions, the ``valid_fraction`` before them validation, the rest training. Validation
and test impressions see all earlier events, including earlier impressions of their own
split, as a model serving in real time would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from recforge.data.arrow import pc  # pyarrow.compute, imported on first use
from recforge.data.collate import ACTION_ENCODINGS, RankingCollate, RankingRows
from recforge.data.dataset import Dataset
from recforge.jagged.batch import JaggedBatch
from recforge.jagged.index import offsets_from_lengths, range_index

SPLITS = {"train": 0, "valid": 1, "test": 2}
_TASK_RE = re.compile(r"^\s*(?P<name>[A-Za-z_][\w-]*)\s*:\s*(?P<column>[A-Za-z_]\w*)\s*(?:(?P<op>>=|==)\s*(?P<value>\S+))?\s*$")


@dataclass(frozen=True)
class Task:
    """One prediction task: a label derived from one events column.

    Attributes:
        name: the task's name in metrics and heads ("like").
        column: the events column the label comes from ("rating", "action").
        kind: "binary" (BCE, AUC/GAUC) or "regression" (MSE, RMSE).
        op: ">=" (numeric threshold) or "==" (equality) for binary tasks, None for regression.
        value: the threshold or the value compared with.
    """

    name: str
    column: str
    kind: str
    op: str | None = None
    value: str | None = None

    @staticmethod
    def parse(spec: str) -> Task:
        """``"like:rating>=4"`` | ``"buy:action==buy"`` | ``"rating:rating"`` -> Task."""
        m = _TASK_RE.match(spec)
        if m is None:
            raise ValueError(
                f"task {spec!r}: expected NAME:COLUMN>=NUMBER, NAME:COLUMN==VALUE or NAME:COLUMN (regression), "
                "e.g. 'like:rating>=4'"
            )
        op = m.group("op")
        if op == ">=":
            try:
                float(m.group("value"))
            except ValueError:
                raise ValueError(f"task {spec!r}: {m.group('value')!r} is not a number") from None
        return Task(m.group("name"), m.group("column"), "binary" if op else "regression", op, m.group("value"))

    def labels(self, events: pa.Table) -> np.ndarray:
        """(E,) float32 labels; NaN where the column is null."""
        if self.column not in events.column_names:
            have = ", ".join(c for c in events.column_names if c not in ("user_id", "item_id", "timestamp"))
            raise ValueError(f"task {self.name!r}: events have no column {self.column!r} (label columns: {have or 'none'})")
        col = events.column(self.column)
        if self.op == "==":
            target = pa.scalar(self.value).cast(col.type) if pa.types.is_string(col.type) else pa.scalar(float(self.value))
            out = pc.equal(col if pa.types.is_string(col.type) else col.cast(pa.float64()), target)
            out = out.cast(pa.float32())
        else:
            if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
                raise ValueError(f"task {self.name!r}: column {self.column!r} is {col.type}; use NAME:COLUMN==VALUE")
            out = col.cast(pa.float32())
            if self.op == ">=":
                out = pc.greater_equal(out, pa.scalar(float(self.value), pa.float32())).cast(pa.float32())
        return out.to_numpy(zero_copy_only=False).astype(np.float32)


@dataclass
class RankingSamples:
    """One split's samples: sample s is user ``user[s]`` with targets ``events[offsets[s]:offsets[s+1]]``."""

    user: torch.Tensor  # (S,) int64 user row
    offsets: torch.Tensor  # (S+1,) int64 into events
    events: torch.Tensor  # (sum,) int64 event rows, ascending within a sample

    def __len__(self) -> int:
        return self.user.numel()

    @property
    def num_targets(self) -> int:
        return self.events.numel()


def _vocab(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct non-null values -> ids 1..V (0 is reserved for none); returns (ids per value, distinct)."""
    distinct, inverse = np.unique(values, return_inverse=True)
    return inverse.astype(np.int64) + 1, distinct


def _column_codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[str]]:
    """Map a scalar or list column to ids: (rows, width) int64 codes (0 = none or null) and the
    vocabulary (code c is ``values[c - 1]``, values as strings)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = pc.list_flatten(col)
        width = int(lengths.max()) if lengths.size else 0
    else:
        lengths = np.ones(len(col), dtype=np.int64)
        flat, width = col, 1
    flat = flat.cast(pa.string())
    valid = ~np.asarray(flat.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    values = np.asarray(flat.fill_null("").to_numpy(zero_copy_only=False), dtype=object).astype(str)
    codes = np.zeros(len(values), dtype=np.int64)
    distinct = np.zeros(0, dtype=str)
    if valid.any():
        codes[valid], distinct = _vocab(values[valid])
    out = np.zeros((len(col), max(width, 1)), dtype=np.int64)
    rows = np.repeat(np.arange(len(col)), lengths)
    cols = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows, cols] = codes
    return out, distinct.tolist()


class RankingData:
    """A dataset prepared for ranking: event arrays, task labels, per-user splits, feature vocabularies.

    Example:
        >>> data = RankingData.from_dataset(load_dataset("data/ml-100k"), ["like:rating>=4", "rating:rating"],
        ...                                 action_column="rating", user_features=["user_id", "age", "gender"])
        >>> samples = data.samples("train", period_seconds=86400, max_targets=32)
        >>> batch = data.batch(samples, torch.arange(64), max_seq_len=256)
    """

    def __init__(
        self,
        *,
        user_starts: np.ndarray,
        items: np.ndarray,
        actions: np.ndarray,
        timestamps: np.ndarray,
        labels: np.ndarray,
        split: np.ndarray,
        context: np.ndarray,
        item_features: np.ndarray,
        tasks: list[Task],
        num_items: int,
        num_actions: int,
        num_context_values: int,
        num_item_feature_values: int,
        oracle: np.ndarray | None = None,
        vocab: dict | None = None,
    ):
        self.user_starts = torch.from_numpy(user_starts)
        self.event_user = torch.repeat_interleave(
            torch.arange(len(user_starts) - 1), self.user_starts[1:] - self.user_starts[:-1]
        )
        self.items = torch.from_numpy(items)
        self.actions = torch.from_numpy(actions)
        self.timestamps = torch.from_numpy(timestamps)
        self.labels = torch.from_numpy(labels)
        self.split = torch.from_numpy(split)
        self.context = torch.from_numpy(context)
        self.item_features = torch.from_numpy(item_features)
        self.tasks = tasks
        self.num_items = num_items
        self.num_actions = num_actions
        self.num_context_values = num_context_values
        self.num_item_feature_values = num_item_feature_values
        self.oracle = None if oracle is None else torch.from_numpy(oracle)
        # raw value -> id maps a serving engine needs: item code c is vocab["item_ids"][c - 1], action
        # code a is vocab["actions"][a - 1], a user feature's value v has id offset + 1 + index(v)
        self.vocab = vocab or {}

    @property
    def num_users(self) -> int:
        return len(self.user_starts) - 1

    @property
    def num_contextual(self) -> int:
        return self.context.shape[1]

    @classmethod
    def from_dataset(
        cls,
        ds: Dataset,
        tasks: list[str],
        *,
        action_column: str = "",
        user_features: list[str] | tuple[str, ...] = (),
        item_features: list[str] | tuple[str, ...] = (),
        valid_fraction: float = 0.1,
        test_fraction: float = 0.1,
    ) -> RankingData:
        """Build ranking arrays from a canonical dataset.

        Args:
            ds: the dataset (events sorted by user, then time).
            tasks: task specs, see :class:`Task`.
            action_column: events column whose values become the history's action signal
                ("" for none); numbers and strings both work.
            user_features: columns of ``users.parquet`` (or ``user_id`` itself) that become
                contextual tokens.
            item_features: columns of ``items.parquet`` (scalar or list) summed into item tokens.
            valid_fraction, test_fraction: per-user fractions of the latest events.
        """
        if not ds.has_timestamps:
            raise ValueError(f"{ds.meta.get('name')}: ranking samples need event timestamps; this dataset has none")
        if not tasks:
            raise ValueError("ranking needs at least one task, e.g. 'like:rating>=4'")
        fraction_check(valid_fraction, test_fraction)
        events = ds.events
        parsed = [Task.parse(t) for t in tasks]
        if len({t.name for t in parsed}) != len(parsed):
            raise ValueError(f"task names must be distinct: {[t.name for t in parsed]}")
        users = events.column("user_id").to_numpy()
        starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]]) if len(users) else np.zeros(0, np.int64)
        user_starts = np.r_[starts, len(users)].astype(np.int64)
        lengths = np.diff(user_starts)
        ts = events.column("timestamp")
        if ts.null_count:
            raise ValueError(f"{ts.null_count} events have no timestamp; drop them before building ranking samples")
        item_codes, item_distinct = _vocab(events.column("item_id").to_numpy())
        actions, num_actions, action_values = np.zeros(len(users), np.int64), 0, []
        if action_column:
            if action_column not in events.column_names:
                raise ValueError(f"ranking.action_column: events have no column {action_column!r}")
            codes, action_values = _column_codes(events.column(action_column))
            actions, num_actions = codes[:, 0], len(action_values)
        labels = np.stack([t.labels(events) for t in parsed], axis=1)
        oracle = None
        oracle_cols = [f"p_{t.column}" for t in parsed]
        if all(c in events.column_names for c in oracle_cols):
            oracle = np.stack([events.column(c).to_numpy().astype(np.float32) for c in oracle_cols], axis=1)
        # per-user time split: the last test_fraction of each user's events are test, then valid
        n_test = np.ceil(lengths * test_fraction).astype(np.int64)
        n_valid = np.ceil(lengths * valid_fraction).astype(np.int64)
        pos_from_end = np.repeat(user_starts[1:], lengths) - np.arange(len(users)) - 1  # 0 = a user's last event
        owner = np.repeat(np.arange(len(lengths)), lengths)
        split = np.where(pos_from_end < n_test[owner], 2, np.where(pos_from_end < (n_test + n_valid)[owner], 1, 0))
        # contextual tokens: one per user feature, ids offset so features share one vocabulary
        user_rows = users[starts] if len(users) else users
        context_cols, vocab_size, context_vocab = [], 0, {}
        for name in user_features:
            if name == "user_id":
                codes, values = _column_codes(pa.array(user_rows))
            else:
                if ds.users is None or name not in ds.users.column_names:
                    have = ds.users.column_names[1:] if ds.users is not None else []
                    raise ValueError(f"ranking.user_features: no user feature {name!r} (available: user_id, {', '.join(have)})")
                order = pc.index_in(pa.array(user_rows), ds.users.column("user_id")).to_numpy(zero_copy_only=False)
                col = ds.users.column(name).combine_chunks()
                valid = ~np.isnan(order.astype(np.float64))
                taken = col.take(pa.array(np.where(valid, order, 0).astype(np.int64)))
                codes, values = _column_codes(pc.if_else(pa.array(valid), taken, pa.nulls(len(taken), taken.type)))
                if codes.shape[1] != 1:
                    raise ValueError(f"ranking.user_features: {name!r} is a list column; contextual features must be scalars")
            context_cols.append(np.where(codes[:, 0] > 0, codes[:, 0] + vocab_size, 0))
            context_vocab[name] = {"offset": vocab_size, "values": values}
            vocab_size += len(values)
        context = np.stack(context_cols, axis=1) if context_cols else np.zeros((len(lengths), 0), np.int64)
        # item side features: (num_items + 1, F) ids in one shared vocabulary, row 0 = padding
        feats, feat_vocab = [np.zeros((len(item_distinct) + 1, 0), np.int64)], 0
        for name in item_features:
            if ds.items is None or name not in ds.items.column_names:
                have = ds.items.column_names[1:] if ds.items is not None else []
                raise ValueError(f"ranking.item_features: no item feature {name!r} (available: {', '.join(have) or 'none'})")
            order = pc.index_in(pa.array(item_distinct), ds.items.column("item_id")).to_numpy(zero_copy_only=False)
            valid = ~np.isnan(order.astype(np.float64))
            col = ds.items.column(name).combine_chunks().take(pa.array(np.where(valid, order, 0).astype(np.int64)))
            codes, values = _column_codes(col)
            codes[~valid] = 0
            table = np.zeros((len(item_distinct) + 1, codes.shape[1]), np.int64)
            table[1:] = np.where(codes > 0, codes + feat_vocab, 0)
            feats.append(table)
            feat_vocab += len(values)
        return cls(
            user_starts=user_starts,
            items=item_codes,
            actions=actions,
            timestamps=ts.to_numpy().astype(np.int64),
            labels=labels,
            split=split.astype(np.int8),
            context=context,
            item_features=np.concatenate(feats, axis=1),
            tasks=parsed,
            num_items=len(item_distinct),
            num_actions=num_actions,
            num_context_values=vocab_size,
            num_item_feature_values=feat_vocab,
            oracle=oracle,
            vocab={
                "item_ids": item_distinct.tolist(),
                "action_column": action_column,
                "actions": action_values,
                "user_features": context_vocab,
            },
        )

    def samples(self, split: str, period_seconds: int, max_targets: int) -> RankingSamples:
        """Group a split's impressions into (user, period) samples of at most ``max_targets`` targets."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: expected one of {tuple(SPLITS)}")
        if period_seconds <= 0 or max_targets <= 0:
            raise ValueError("period_seconds and max_targets must be > 0")
        events = torch.nonzero(self.split == SPLITS[split]).flatten()  # ascending: by user, then time
        if events.numel() == 0:
            return RankingSamples(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), events)
        user = self.event_user[events]
        period = torch.div(self.timestamps[events], period_seconds, rounding_mode="floor")
        new_group = torch.ones(events.numel(), dtype=torch.bool)
        new_group[1:] = (user[1:] != user[:-1]) | (period[1:] != period[:-1])
        group = torch.cumsum(new_group.long(), 0) - 1
        group_start = torch.nonzero(new_group).flatten()
        rank_in_group = torch.arange(events.numel()) - group_start[group]
        starts = torch.nonzero(new_group | ((rank_in_group % max_targets) == 0)).flatten()
        offsets = torch.cat([starts, torch.tensor([events.numel()])])
        return RankingSamples(user[starts], offsets, events)

    def window(
        self, samples: RankingSamples, ids: torch.Tensor, max_seq_len: int, per_event: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(target start, target count, history start, history count) per sample ``ids``.

        The history is the user's latest events before the sample's last target that fit in
        ``max_seq_len`` after the contextual tokens and the targets (``per_event`` tokens each).
        """
        c = self.num_contextual
        t_start, t_count = samples.offsets[ids], samples.offsets[ids + 1] - samples.offsets[ids]
        if ids.numel() and int(t_count.max()) + c >= max_seq_len:
            raise ValueError(
                f"max_seq_len={max_seq_len} leaves no room for history after {c} contextual tokens and "
                f"{int(t_count.max())} targets; raise data.max_seq_len or lower ranking.max_targets"
            )
        last_target = samples.events[samples.offsets[ids + 1] - 1]
        budget = (max_seq_len - c - t_count) // per_event
        h_start = torch.maximum(self.user_starts[samples.user[ids]], last_target - budget)
        return t_start, t_count, h_start, last_target - h_start

    def gather(self, samples: RankingSamples, ids: torch.Tensor, max_seq_len: int,
               action_encoding: str = "sum") -> tuple[RankingRows, torch.Tensor]:  # fmt: skip
        """Samples ``ids`` as ``RankingRows`` (the events that fit ``max_seq_len``, see ``window``) and
        the (N,) event rows of their targets. Vectorised: no per-sample loop."""
        if action_encoding not in ACTION_ENCODINGS:
            raise ValueError(f"action_encoding={action_encoding!r}: expected one of {ACTION_ENCODINGS}")
        ids = ids.to(torch.int64)
        t_start, t_count, h_start, h_count = self.window(samples, ids, max_seq_len, 2 if action_encoding == "interleave" else 1)
        target_events = samples.events[range_index(t_start, t_count)[0]]
        hist_events, _ = range_index(h_start, h_count)
        rows = RankingRows(h_count, t_count, self.items[hist_events], self.timestamps[hist_events], self.actions[hist_events],
                           self.items[target_events], self.timestamps[target_events], self.context[samples.user[ids]])  # fmt: skip
        return rows, target_events

    def rows(self, samples: RankingSamples, ids: torch.Tensor, max_seq_len: int, action_encoding: str = "sum") -> pa.Table:
        """Samples ``ids`` as ranking rows (``recforge.data.collate.RankingCollate``'s columns), one per sample.

        Columns: ``sample`` (the id), ``context_<i>`` per contextual feature, ``history_item_ids``,
        ``history_timestamps``, ``history_actions``, ``target_item_ids``, ``target_timestamps``,
        ``target_tasks`` (K labels per target, NaN = missing), ``target_users``, ``target_events``
        (event rows), ``num_tokens``. ``rows_collate`` turns them into ``batch``'s layout.
        """
        g, events = self.gather(samples, ids, max_seq_len, action_encoding)
        h_off = pa.array(offsets_from_lengths(g.history_lengths).numpy())
        t_off = pa.array(offsets_from_lengths(g.target_lengths).numpy())

        def lists(offsets: pa.Array, values: torch.Tensor) -> pa.Array:
            return pa.LargeListArray.from_arrays(offsets, pa.array(values.numpy()))

        tasks = pa.FixedSizeListArray.from_arrays(pa.array(self.labels[events].flatten().numpy()), len(self.tasks))
        per_event = 2 if action_encoding == "interleave" else 1
        columns = {"sample": pa.array(ids.to(torch.int64).numpy())}
        columns.update({f"context_{i}": pa.array(g.context[:, i].numpy()) for i in range(self.num_contextual)})
        columns.update({
            "history_item_ids": lists(h_off, g.history_item_ids),
            "history_timestamps": lists(h_off, g.history_timestamps),
            "history_actions": lists(h_off, g.history_actions),
            "target_item_ids": lists(t_off, g.target_item_ids),
            "target_timestamps": lists(t_off, g.target_timestamps),
            "target_tasks": pa.LargeListArray.from_arrays(t_off, tasks),
            "target_users": lists(t_off, self.event_user[events]),
            "target_events": lists(t_off, events),
            "num_tokens": pa.array((self.num_contextual + per_event * g.history_lengths + g.target_lengths).numpy()),
        })  # fmt: skip
        return pa.table(columns)

    def batch(
        self, samples: RankingSamples, ids: torch.Tensor, max_seq_len: int, action_encoding: str = "sum"
    ) -> JaggedBatch:
        """Assemble samples ``ids`` into one jagged batch: ``gather`` then ``RankingRows.layout``, the layout
        ``rows`` + ``rows_collate`` give too (vectorised; no per-sample loop).

        Features: ``item_ids`` (0 on contextual and action tokens), ``actions`` (0 on contextual,
        item and target tokens), ``context_ids`` (non-zero on contextual tokens only),
        ``timestamps``. Labels: ``tasks`` (N, K) float (NaN = missing), ``users`` (N,),
        ``events`` (N,) event rows, N = total targets. The mask: contextual prefix, causal
        history, targets with timestamp visibility.
        """
        rows, events = self.gather(samples, ids, max_seq_len, action_encoding)
        batch = rows.layout(action_encoding, max_seq_len)
        batch.labels = {"tasks": self.labels[events], "users": self.event_user[events], "events": events}
        return batch


def rows_collate(num_contextual: int, max_seq_len: int, action_encoding: str = "sum",
                 dense: dict[str, str] | None = None) -> RankingCollate:  # fmt: skip
    """The ``RankingCollate`` of ``RankingData.rows`` with ``num_contextual`` context columns: labels
    ``tasks`` (N, K), ``users``, ``events``; ``dense`` as ``RankingCollate.dense`` (none by default)."""
    return RankingCollate(("tasks", "users", "events"), action_column="actions",
                          context_columns=tuple(f"context_{i}" for i in range(num_contextual)),
                          max_seq_len=max_seq_len, action_encoding=action_encoding, dense=dense or {})  # fmt: skip


def fraction_check(valid_fraction: float, test_fraction: float) -> None:
    """Raise ValueError unless 0 <= valid, 0 < test and valid + test < 1."""
    if not (0 <= valid_fraction < 1 and 0 < test_fraction < 1 and valid_fraction + test_fraction < 1):
        raise ValueError(
            f"valid_fraction={valid_fraction}, test_fraction={test_fraction}: need 0 <= valid, 0 < test, valid + test < 1"
        )
