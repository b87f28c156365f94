"""Alibaba UserBehavior (Taobao) CSV without header: ``user,item,category,behavior,timestamp``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from ._common import Converted, build_events, build_items, check_ids, pick_file, read_delimited, read_nonempty, row_lines

_FIELDS = [("user_id", "int"), ("item_id", "int"), ("category", "int"), ("behavior", "str"), ("timestamp", "int")]


def convert_taobao(source: Path) -> Converted:
    """Convert a UserBehavior CSV (the file, or a directory holding one ``.csv``).

    ``behavior`` (pv/cart/fav/buy) becomes the ``action`` column; events are stably sorted by
    (user_id, timestamp). items.parquet has one row per item with the ``category`` of the item's
    first event in file order.
    """
    path = pick_file(source, ["*.csv"], "UserBehavior CSV file")
    data = read_nonempty(path)
    table = read_delimited(path, data, ",", _FIELDS, first_row_hint="the file must have no header row: remove it")
    check_ids(path, table, ("user_id", "item_id"), row_lines(data))
    item_ids = table["item_id"].to_numpy()
    _, first = np.unique(item_ids, return_index=True)
    items = build_items(path, {"item_id": pa.array(item_ids[first], pa.int64()),
                               "category": pa.array(table["category"].to_numpy()[first], pa.int64())})
    events = build_events(table["user_id"], table["item_id"], table["timestamp"],
                          {"action": table["behavior"]})
    return Converted(events, items, path.stem, path)
