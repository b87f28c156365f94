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
    bad_key = next((k for k in mapping if not k.strip().isdigit()), None)
    if bad_key is not None and bad_key.strip().startswith("-") and bad_key.strip()[1:].isdigit():
        raise DataFormatError(path, f"item ID {bad_key.strip()} is negative", hint="IDs must be integers >= 0")
    if bad_key is not None:
        raise DataFormatError(path, f"item ID {bad_key!r} is not an integer")
    try:
        attributes = pa.array(list(mapping.values()), pa.list_(pa.int64()))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:
        raise DataFormatError(path, f"attribute lists must hold integer IDs ({err})") from err
    return build_items(path, {"item_id": pa.array([int(k) for k in mapping], pa.int64()), "attributes": attributes})


def _attributes_file(txt: Path) -> Path | None:
    """``NAME_item2attributes.json`` beside ``NAME.txt``; another dataset's attributes file there is refused,
    not joined (S3-Rec's data folder holds several datasets whose item IDs all start at 1)."""
    named = txt.with_name(f"{txt.stem}_item2attributes.json")
    if named.is_file():
        return named
    others = sorted(p.name for p in txt.parent.glob("*_item2attributes.json"))
    if others:
        raise DataFormatError(txt.parent, f"{', '.join(others)} belong(s) to another dataset than {txt.name} (its "
                              f"attributes would be {named.name}); they are not joined",
                              hint=f"rename the file to {named.name} if it describes these items, else move it "
                              "away")  # fmt: skip
    return None


def convert_amazon_s3rec(source: Path, merge_users: bool = False) -> Converted:
    """Convert the S3-Rec/P5 Amazon files (the ``.txt`` or its directory); timestamps are all null.

    A user on several lines is refused unless ``merge_users`` (see ``read_sequences``)."""
    path = pick_file(source, ["*.txt"], "sequence file", exclude=r"readme")
    users, items = read_sequences(path, merge_users)
    attrs = _attributes_file(path)
    return Converted(build_events(users, items), read_item_attributes(attrs) if attrs else None,
                     path.stem.lower(), path)
