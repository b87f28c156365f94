"""The S3-Rec / P5 Amazon format: ``Beauty.txt`` sequences plus ``*_item2attributes.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from ._common import Converted, DataFormatError, build_events, build_items, pick_file, read_nonempty, read_sequences


def read_item_attributes(path: Path) -> pa.Table:
    """Read ``{"item_id": [attribute ids]}`` JSON into an items table.

    Args:
        path: the ``*_item2attributes.json`` file.

    Returns:
        Columns ``item_id`` int64 and ``attributes`` list<int64>, sorted by item_id.

    Raises:
        DataFormatError: on invalid JSON, a non-integer item ID or a non-integer attribute.
    """
    try:
        mapping = json.loads(read_nonempty(path))
    except json.JSONDecodeError as err:
        raise DataFormatError(path, f"invalid JSON ({err.msg}, column {err.colno})", err.lineno) from err
    if not isinstance(mapping, dict):
        raise DataFormatError(path, "expected a JSON object mapping item IDs to attribute lists")
    bad_key = next((k for k in mapping if not k.strip().lstrip("-").isdigit()), None)
    if bad_key is not None:
        raise DataFormatError(path, f"item ID {bad_key!r} is not an integer")
    try:
        attributes = pa.array(list(mapping.values()), pa.list_(pa.int64()))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:
        raise DataFormatError(path, f"attribute lists must hold integer IDs ({err})") from err
    return build_items(path, {"item_id": pa.array([int(k) for k in mapping], pa.int64()), "attributes": attributes})


def _attributes_file(txt: Path) -> Path | None:
    named = txt.with_name(f"{txt.stem}_item2attributes.json")
    if named.is_file():
        return named
    found = sorted(txt.parent.glob("*_item2attributes.json"))
    if len(found) > 1:
        raise DataFormatError(txt.parent, f"several *_item2attributes.json files and none named {named.name}",
                              hint="keep only the one that belongs to " + txt.name)
    return found[0] if found else None


def convert_amazon_s3rec(source: Path) -> Converted:
    """Convert the S3-Rec/P5 Amazon files (the ``.txt`` or its directory); timestamps are all null."""
    path = pick_file(source, ["*.txt"], "sequence file", exclude=r"readme")
    users, items = read_sequences(path)
    attrs = _attributes_file(path)
    return Converted(build_events(users, items), read_item_attributes(attrs) if attrs else None,
                     path.stem.lower(), path)
