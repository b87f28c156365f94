"""MovieLens converters: the ml-1m per-user sequence file and the original GroupLens ``.dat`` files."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa

from ._common import (Converted, DataFormatError, build_events, build_items, check_ids, decode_text, read_delimited,
                      read_nonempty, read_sequences, row_lines)

SEQUENCES_FILE = "ml-1m_user_sequences.txt"
_RATINGS_FIELDS = [("user_id", "int"), ("item_id", "int"), ("rating", "float"), ("timestamp", "int")]


def read_movies(path: Path) -> pa.Table:
    """Read a GroupLens ``movies.dat`` (``MovieID::Title::Genres``, latin-1) into an items table.

    Args:
        path: the ``movies.dat`` file.

    Returns:
        Columns ``item_id`` int64, ``title`` string and ``genres`` list<string>, sorted by item_id.

    Raises:
        DataFormatError: on a bad separator, a missing field or a non-integer movie ID.
    """
    ids, titles, genres, lines = [], [], [], []
    for lineno, line in enumerate(decode_text(read_nonempty(path)).split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        parts = line.split("::")
        if len(parts) < 3:
            problem = f"expected 3 fields separated by '::', found {len(parts)}"
            raise DataFormatError(path, problem, lineno, "each line must look like 'MovieID::Title::Genre|Genre'")
        if not parts[0].strip().isdigit():
            negative = parts[0].strip().startswith("-") and parts[0].strip()[1:].isdigit()
            raise DataFormatError(path, f"movie ID {parts[0].strip()} is negative" if negative else
                                  f"movie ID {parts[0]!r} is not an integer", lineno)  # fmt: skip
        ids.append(int(parts[0]))
        titles.append("::".join(parts[1:-1]))
        genres.append([g for g in parts[-1].strip().split("|") if g])
        lines.append(lineno)
    return build_items(path, {"item_id": pa.array(ids, pa.int64()), "title": pa.array(titles, pa.string()),
                              "genres": pa.array(genres, pa.list_(pa.string()))}, lines)


def _movies_beside(path: Path) -> pa.Table | None:
    movies = path.parent / "movies.dat"
    return read_movies(movies) if movies.is_file() else None


def convert_ml1m(source: Path, merge_users: bool = False) -> Converted:
    """Convert ``ml-1m_user_sequences.txt`` (file or its directory); timestamps are all null.

    Items keep the file order within each user; ``movies.dat`` beside it becomes items.parquet.
    A user on several lines is refused unless ``merge_users`` (see ``read_sequences``).
    """
    path = source / SEQUENCES_FILE if source.is_dir() else source
    if not path.is_file():
        hint = "use the 'grouplens' format for ratings.dat" if (source / "ratings.dat").is_file() else None
        raise DataFormatError(source, f"no {SEQUENCES_FILE} here",
                              hint=hint or f"pass {SEQUENCES_FILE} or the directory holding it")
    users, items = read_sequences(path, merge_users)
    return Converted(build_events(users, items), _movies_beside(path), "ml-1m", path)


def convert_grouplens(source: Path) -> Converted:
    """Convert a GroupLens directory (``ratings.dat`` plus optional ``movies.dat``) or ratings file.

    Events are stably sorted by (user_id, timestamp) and carry a float32 ``rating``.
    """
    path = source / "ratings.dat" if source.is_dir() else source
    data = read_nonempty(path)
    lineno, first = next((i, line) for i, line in enumerate(io.BytesIO(data), start=1) if line.strip())
    if b"::" not in first:
        found = next((label for sep, label in ((b"\t", "tabs"), (b",", "commas"), (b";", "semicolons"))
                      if sep in first), "no '::'")
        raise DataFormatError(path, f"bad separator: found {found}, expected '::'", lineno,
                              "GroupLens ratings.dat lines look like 'UserID::MovieID::Rating::Timestamp'")
    table = read_delimited(path, data, "::", _RATINGS_FIELDS, parse_data=data.replace(b"::", b"\x1f"),
                           parse_sep="\x1f")
    check_ids(path, table, ("user_id", "item_id"), row_lines(data))
    events = build_events(table["user_id"], table["item_id"], table["timestamp"],
                          {"rating": table["rating"].cast(pa.float32())})
    name = path.parent.name or "grouplens"
    return Converted(events, _movies_beside(path), name, path)
