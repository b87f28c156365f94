"""Shared parsing helpers for the format converters: errors, file lookup, fast readers."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

_INT_RE = re.compile(r"-?\d+")
_SEPARATORS = {"\t": "tabs", ",": "commas", ";": "semicolons", "::": "'::'", "|": "'|'"}
_LABELS = {" ": "spaces", **_SEPARATORS}


class DataFormatError(ValueError):
    """A source file does not match its format.

    The message names the file, the 1-based line number when known, the problem and,
    where obvious, how to fix it. The parts are also kept as attributes.
    """

    def __init__(self, path: str | Path, problem: str, line: int | None = None, hint: str | None = None):
        self.path, self.problem, self.line, self.hint = Path(path), problem, line, hint
        where = f"{path}, line {line}" if line else f"{path}"
        super().__init__(f"{where}: {problem}" + (f" ({hint})" if hint else ""))


@dataclass
class Converted:
    """What a converter returns: canonical tables plus a short name and the main source file."""

    events: pa.Table
    items: pa.Table | None
    name: str
    path: Path
    users: pa.Table | None = None


def read_nonempty(path: Path) -> bytes:
    """Return the bytes of ``path``, raising ``DataFormatError`` if it is missing or blank."""
    if not path.is_file():
        raise DataFormatError(path, "file does not exist" if not path.exists() else "is not a file")
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    if not data.strip():
        raise DataFormatError(path, "file is empty", hint="re-download or re-export it")
    return data


def decode_text(data: bytes) -> str:
    """Decode UTF-8, falling back to latin-1 (the original GroupLens encoding)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def pick_file(source: Path, patterns: list[str], what: str, exclude: str | None = None) -> Path:
    """Resolve ``source`` (a file, or a directory holding exactly one match of ``patterns``)."""
    if source.is_file():
        return source
    found = sorted({p for pat in patterns for p in source.glob(pat) if p.is_file()})
    if exclude:
        found = [p for p in found if not re.match(exclude, p.name, re.IGNORECASE)]
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise DataFormatError(source, f"expected exactly one {what} ({' or '.join(patterns)}), found {names}",
                              hint="pass the file itself as the source" if found else None)
    return found[0]


def _separator_hint(line: str, expected: str) -> str | None:
    for sep, label in _SEPARATORS.items():
        if sep != expected and sep not in expected and sep in line:
            return f"the line seems to use {label} as separator; the format expects {_LABELS.get(expected, expected)}"
    return None


def diagnose(path: Path, data: bytes, sep: str, fields: list[tuple[str, str | None]], skip_rows: int = 0,
             first_row_hint: str | None = None, int_hint: str | None = None) -> None:
    """Scan ``data`` line by line and raise ``DataFormatError`` at the first bad line.

    The slow path behind the vectorised readers: it runs only after they fail, to say where.
    ``fields`` are ``(name, kind)`` with kind ``"int"``, ``"float"`` or ``"str"``, suffixed ``"?"``
    when the value may be empty, or ``None`` (not checked).
    """
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        line = raw.decode("utf-8", errors="replace").rstrip("\r")
        if lineno <= skip_rows or not line:  # pyarrow skips empty lines, not whitespace-only ones
            continue
        parts = line.split(sep)
        if len(parts) != len(fields):
            layout = sep.join(name for name, _ in fields)
            hint = _separator_hint(line, sep) or f"each line must look like {layout!r}"
            raise DataFormatError(path, f"expected {len(fields)} fields separated by {_LABELS.get(sep, repr(sep))},"
                                  f" found {len(parts)}", lineno, hint)
        for (name, kind), value in zip(fields, parts):
            value, optional = value.strip(), bool(kind) and kind.endswith("?")
            kind = kind and kind.rstrip("?")
            if kind and not value and not optional:
                raise DataFormatError(path, f"empty {name}", lineno)
            if not value:
                continue
            if kind == "int" and _INT_RE.fullmatch(value) and not -(2**63) <= int(value) < 2**63:
                raise DataFormatError(path, f"{name} {value} does not fit in a 64-bit integer", lineno)
            bad = (kind == "int" and not _INT_RE.fullmatch(value)) or (kind == "float" and not _is_float(value))
            if bad:
                noun = "an integer" if kind == "int" else "a number"
                hint = (first_row_hint if lineno == skip_rows + 1 else None) or _separator_hint(value, sep)
                raise DataFormatError(path, f"{name} {value!r} is not {noun}", lineno,
                                      hint or (int_hint if kind == "int" else None))


def _is_float(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


_ARROW = {"int": pa.int64(), "float": pa.float64(), "str": pa.string()}


def read_delimited(path: Path, data: bytes, sep: str, fields: list[tuple[str, str | None]], *,
                   skip_rows: int = 0, parse_data: bytes | None = None, parse_sep: str | None = None,
                   first_row_hint: str | None = None, int_hint: str | None = None) -> pa.Table:
    """Parse a headerless delimited file with pyarrow.csv; on any problem, report the line.

    Args:
        path: file name for messages.
        data: the file's bytes, as on disk (used for diagnosis).
        sep: the field separator as written in the file.
        fields: ``(name, kind)`` per field (kinds as in ``diagnose``); kind ``None`` columns are
            not converted or returned.
        skip_rows: leading lines to skip (a header).
        parse_data: bytes to parse instead of ``data`` (e.g. with ``::`` replaced).
        parse_sep: the one-character separator of ``parse_data``.
        first_row_hint: extra hint when the first data line is bad (e.g. a stray header).
        int_hint: extra hint for a non-integer value in an integer field.

    Returns:
        A table with the non-``None`` fields in file order; empty values only in ``"?"`` fields.
    """
    kept = {name: _ARROW[kind.rstrip("?")] for name, kind in fields if kind}
    required = [name for name, kind in fields if kind and not kind.endswith("?")]
    try:
        table = pcsv.read_csv(
            io.BytesIO(parse_data if parse_data is not None else data),
            read_options=pcsv.ReadOptions(column_names=[n for n, _ in fields], skip_rows=skip_rows,
                                          block_size=1 << 24),
            parse_options=pcsv.ParseOptions(delimiter=parse_sep or sep, quote_char=False),
            convert_options=pcsv.ConvertOptions(column_types=kept, include_columns=list(kept),
                                                null_values=[""], strings_can_be_null=True))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        diagnose(path, data, sep, fields, skip_rows, first_row_hint, int_hint)
        raise DataFormatError(path, f"cannot parse ({err})") from err
    if any(table[name].null_count for name in required):
        diagnose(path, data, sep, fields, skip_rows, first_row_hint, int_hint)
        raise DataFormatError(path, "some required fields are empty")
    return table


def read_sequences(path: Path, merge_users: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Read a ``user_id item_id item_id ...`` per-line file into flat (users, items) arrays.

    Items keep the file order; blank lines are skipped. Such a file has no timestamps, so a user
    on two lines has no defined order between them: refused (naming both lines) unless
    ``merge_users``, which joins the lines in file order.
    """
    data = read_nonempty(path)
    bad = re.search(rb"[^0-9 \t\r\n]", data)
    if bad:
        lineno = data.count(b"\n", 0, bad.start()) + 1
        start, end = data.rfind(b"\n", 0, bad.start()) + 1, data.find(b"\n", bad.start())
        line = data[start:end if end >= 0 else len(data)].decode("utf-8", "replace")
        token = next((t for t in line.split() if not re.fullmatch("[0-9]+", t)), line.strip())
        what = "user ID" if line.split()[:1] == [token] else "item ID"
        if re.fullmatch("-[0-9]+", token):
            raise DataFormatError(path, f"{what} {token} is negative", lineno, "IDs must be integers >= 0")
        hint = _separator_hint(token, " ") or "each line must be 'user_id item_id item_id ...' with integer IDs"
        raise DataFormatError(path, f"{what} {token!r} is not an integer", lineno, hint)
    users, counts, tokens, first_line = [], [], [], {}
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        parts = line.split()
        if len(parts) == 1:
            raise DataFormatError(path, f"user {parts[0].decode()} has no items", lineno,
                                  "each line must be 'user_id item_id item_id ...'")
        if parts:
            user = int(parts[0])
            if user in first_line and not merge_users:
                raise DataFormatError(path, f"user {parts[0].decode()} is listed twice (lines {first_line[user]} and "
                                      f"{lineno})", lineno, "each user's items belong on one line; pass --merge-users "
                                      "(merge_users=True) to join the lines in file order")  # fmt: skip
            first_line.setdefault(user, lineno)
            users.append(parts[0])
            counts.append(len(parts) - 1)
            tokens.extend(parts[1:])
    try:
        items = np.fromiter(map(int, tokens), dtype=np.int64, count=len(tokens))
        user_ids = np.fromiter(map(int, users), dtype=np.int64, count=len(users))
    except OverflowError as err:
        raise DataFormatError(path, "an ID does not fit in a 64-bit integer") from err
    return np.repeat(user_ids, counts), items


def check_ids(path: Path, table: pa.Table, columns: tuple[str, ...], lines: list[int] | None) -> None:
    """Raise ``DataFormatError`` at the first negative ID of ``columns`` (IDs must be >= 0)."""
    for name in columns:
        values = table[name].to_numpy()
        if len(values) and values.min() < 0:
            row = int(np.argmax(values < 0))
            raise DataFormatError(path, f"{name} {values[row]} is negative", lines[row] if lines else None,
                                  "IDs must be integers >= 0")  # fmt: skip


def build_events(user, item, timestamp=None, extra: dict | None = None) -> pa.Table:
    """Assemble the canonical events table, stably sorted by (user_id, timestamp).

    ``timestamp=None`` gives an all-null column and keeps file order within each user.
    """
    def int64(values):  # pa.array() would iterate a ChunkedArray in Python
        return values.cast(pa.int64()) if isinstance(values, pa.ChunkedArray) else pa.array(values, pa.int64())

    ts = pa.nulls(len(user), pa.int64()) if timestamp is None else int64(timestamp)
    table = pa.table({"user_id": int64(user), "item_id": int64(item), "timestamp": ts, **(extra or {})})
    keys = [("user_id", "ascending", "at_end")]
    if timestamp is not None:
        keys.append(("timestamp", "ascending", "at_end"))
    order = pc.sort_indices(table, sort_keys=keys)
    return table.take(order)


def build_items(path: Path, columns: dict[str, pa.Array], lines: list[int] | None = None, key: str = "item_id") -> pa.Table:
    """Assemble a feature table sorted by ``key``; duplicate IDs raise ``DataFormatError``."""
    table = pa.table(columns)
    ids = table.column(key).to_numpy()
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if len(dup):
        row = int(order[dup[0] + 1])
        what = key.removesuffix("_id")
        raise DataFormatError(path, f"{what} {ids[row]} is listed twice", lines[row] if lines else None)
    return table.take(pa.array(order))


def row_lines(data: bytes, skip_rows: int = 0) -> list[int]:
    """1-based line numbers of the non-empty data lines (row i of a parsed table is on line[i])."""
    return [i for i, line in enumerate(data.split(b"\n"), start=1) if i > skip_rows and line.rstrip(b"\r")]
