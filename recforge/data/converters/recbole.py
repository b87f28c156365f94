"""RecBole atomic files: ``NAME.inter`` (required), ``NAME.item`` and ``NAME.user`` (optional), tab-separated, typed headers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ._common import (Converted, DataFormatError, build_events, build_items, check_ids, pick_file, read_delimited,
                      read_nonempty, row_lines)

TYPES = ("token", "token_seq", "float", "float_seq")
_ID_HINT = "RecBole token IDs must be integers to convert; remap them to integers first"


def parse_header(path: Path, data: bytes, required: tuple[str, ...]) -> list[tuple[str, str]]:
    """Parse a typed header line such as ``user_id:token<TAB>rating:float`` into (name, type) pairs.

    Raises:
        DataFormatError: on a missing type, an unknown type, a duplicate or a missing required field.
    """
    header = data.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r")
    if "\t" not in header and any(sep in header for sep in (",", " ", ";")):
        raise DataFormatError(path, "bad separator: the header is not tab-separated", 1,
                              "RecBole atomic files separate fields with tabs, e.g. 'user_id:token<TAB>item_id:token'")
    fields = []
    for spec in header.split("\t"):
        name, _, kind = spec.strip().rpartition(":")
        if not name or kind not in TYPES:
            raise DataFormatError(path, f"header field {spec!r} needs a type, one of {', '.join(TYPES)}", 1,
                                  "RecBole headers look like 'user_id:token'")
        if name in dict(fields):
            raise DataFormatError(path, f"header names field {name!r} twice", 1)
        fields.append((name, kind))
    missing = [name for name in required if name not in dict(fields)]
    if missing:
        found = ", ".join(name for name, _ in fields)
        raise DataFormatError(path, f"missing required column {missing[0]!r} (header has {found})", 1)
    if data.count(b"\n", 0, len(data.rstrip())) == 0:
        raise DataFormatError(path, "file has a header but no rows")
    return fields


def _inter_kind(name: str, kind: str) -> str | None:
    if name in ("user_id", "item_id"):
        return "int"
    return "float?" if name == "timestamp" or kind == "float" else None


def _read_inter(path: Path) -> pa.Table:
    data = read_nonempty(path)
    header = parse_header(path, data, ("user_id", "item_id"))
    fields = [(name, _inter_kind(name, kind)) for name, kind in header]
    table = read_delimited(path, data, "\t", fields, skip_rows=1, int_hint=_ID_HINT)
    check_ids(path, table, ("user_id", "item_id"), row_lines(data, skip_rows=1))
    timestamp = None
    if "timestamp" in table.column_names:
        seconds = np.floor(table["timestamp"].to_numpy(zero_copy_only=False))
        finite = np.isfinite(seconds)
        out_of_range = np.flatnonzero(finite & ((seconds < -(2.0**63)) | (seconds >= 2.0**63)))
        if len(out_of_range):
            row = int(out_of_range[0])
            raise DataFormatError(path, f"timestamp {table['timestamp'][row].as_py()!r} is out of range",
                                  row_lines(data, skip_rows=1)[row], "timestamps are unix seconds that fit a 64-bit "
                                  "integer")  # fmt: skip
        timestamp = pa.array(np.where(finite, seconds, 0), pa.int64(), mask=~finite)
    labels = {name: table[name].cast(pa.float32()) for name in table.column_names
              if name not in ("user_id", "item_id", "timestamp", "action")}
    return build_events(table["user_id"], table["item_id"], timestamp, labels)


def read_item_file(path: Path, key: str = "item_id") -> pa.Table:
    """Read a RecBole ``.item`` (or, with ``key="user_id"``, ``.user``) file into a feature table.

    The ``key`` column becomes int64, ``token`` string, ``token_seq`` list<string> (split on spaces),
    ``float`` float64 and ``float_seq`` list<float64>; empty values become null.

    Raises:
        DataFormatError: on a bad header, a non-integer ID or a duplicate ID.
    """
    data = read_nonempty(path)
    header = parse_header(path, data, (key,))
    kinds = {"token": "str?", "token_seq": "str?", "float": "float?", "float_seq": "str?"}
    fields = [(name, "int" if name == key else kinds[kind]) for name, kind in header]
    table = read_delimited(path, data, "\t", fields, skip_rows=1, int_hint=_ID_HINT)
    check_ids(path, table, (key,), row_lines(data, skip_rows=1))
    columns = {key: table[key]}
    for name, kind in header:
        col = table[name]
        if name == key:
            continue
        if kind.endswith("_seq"):
            col = pc.utf8_split_whitespace(col)
            if kind == "float_seq":
                try:
                    col = col.cast(pa.list_(pa.float64()))
                except pa.ArrowInvalid as err:
                    raise DataFormatError(path, f"field {name!r} holds a non-number ({err})") from err
        columns[name] = col
    return build_items(path, columns, row_lines(data, skip_rows=1), key=key)


def convert_recbole(source: Path) -> Converted:
    """Convert RecBole atomic files (a directory with one ``.inter``, or the ``.inter`` file).

    ``rating`` and any other float field become float32 label columns, ``timestamp`` (float seconds)
    becomes int64; other token fields of ``.inter`` are dropped. ``NAME.item`` beside it becomes
    items.parquet, ``NAME.user`` users.parquet.
    """
    path = pick_file(source, ["*.inter"], "RecBole .inter file")
    item_file, user_file = path.with_suffix(".item"), path.with_suffix(".user")
    items = read_item_file(item_file) if item_file.is_file() else None
    users = read_item_file(user_file, key="user_id") if user_file.is_file() else None
    return Converted(_read_inter(path), items, path.stem, path, users)
