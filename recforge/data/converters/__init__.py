"""Convert public recommendation data sets into the canonical layout (see ``recforge.data.dataset``).

Each format has one module; ``FORMATS`` maps format names to them and ``prepare`` runs one and
writes the result atomically::

    from recforge.data.converters import prepare, default_data_root
    prepare("ml-1m", default_data_root() / "ml-1m", "data/ml-1m")

Parse errors raise ``DataFormatError`` (a ``ValueError``) naming the file, the line and the
problem; nothing is written at ``out`` when a conversion fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recforge.env import data_dir

from recforge.io import check_replaceable

from ..dataset import DATASET_FILES, write_dataset
from ._common import Converted, DataFormatError
from .amazon import convert_amazon_s3rec
from .movielens import convert_grouplens, convert_ml1m
from .recbole import convert_recbole
from .taobao import convert_taobao

__all__ = ["FORMATS", "DataFormatError", "Format", "default_data_root", "format_names", "prepare"]


@dataclass(frozen=True)
class Format:
    """A registered source format.

    Attributes:
        name: the name used on the command line.
        description: one line for help texts.
        convert: reads a source path and returns the canonical tables.
    """

    name: str
    description: str
    convert: Callable[..., Converted]
    sequences: bool = False  # one line per user and no timestamps: takes ``merge_users``


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("ml-1m", "MovieLens-1M ml-1m_user_sequences.txt (+ movies.dat); no timestamps", convert_ml1m,
               sequences=True),
        Format("grouplens", "GroupLens ratings.dat (UserID::MovieID::Rating::Timestamp) + movies.dat",
               convert_grouplens),
        Format("amazon-s3rec", "S3-Rec/P5 Amazon NAME.txt sequences (+ NAME_item2attributes.json)",
               convert_amazon_s3rec, sequences=True),
        Format("recbole", "RecBole atomic files NAME.inter (+ NAME.item), tab-separated typed headers",
               convert_recbole),
        Format("taobao", "Alibaba UserBehavior CSV: user,item,category,behavior,timestamp", convert_taobao),
    )
}


def format_names() -> list[str]:
    """Return the registered format names, in registry order (for CLI help and choices)."""
    return list(FORMATS)


def default_data_root() -> Path:
    """Return where real data sets live: ``$RECFORGE_DATA``, else ``shared/data`` beside the recforge
    checkout (``<checkout>/../shared/data``, whatever the working directory).

    The path is returned whether or not it exists; callers decide what absence means. An installed
    (not checked-out) recforge has no checkout to be beside: then ``$RECFORGE_DATA`` is required.
    """
    env = data_dir()
    if env:
        return Path(env).expanduser().resolve()
    repo = Path(__file__).resolve().parents[3]
    if not (repo / "pyproject.toml").is_file():
        raise ValueError("no data directory: set RECFORGE_DATA to the folder holding the datasets, or pass SOURCE")
    return (repo.parent / "shared" / "data").resolve()


def prepare(fmt: str, source: str | Path, out: str | Path, *, overwrite: bool = False, merge_users: bool = False) -> Path:
    """Convert ``source`` in format ``fmt`` and write a canonical dataset directory at ``out``.

    Args:
        fmt: a name from ``format_names()``.
        source: the source file or directory (what each format accepts is in its description).
        out: the dataset directory to create.
        overwrite: replace ``out`` if it exists (only once the conversion has succeeded; refused
            when ``out`` holds files a dataset does not, which replacing it would delete).
        merge_users: sequence formats (ml-1m, amazon-s3rec): join the lines of a user listed more
            than once, in file order (default: refuse, naming both lines). Formats with timestamps
            order every user's events by time, wherever they are in the file.

    Returns:
        The output directory.

    Raises:
        ValueError: for an unknown format, or when ``out`` exists and ``overwrite`` is false.
        DataFormatError: when the source is missing or malformed; ``out`` is then left untouched.
    """
    spec = FORMATS.get(fmt)
    if spec is None:
        raise ValueError(f"unknown data format {fmt!r}; known formats: {', '.join(FORMATS)}")
    src, out = Path(source).expanduser(), Path(out).expanduser()
    if not src.exists():
        raise DataFormatError(src, "path does not exist", hint=f"point to the {fmt} file or its directory")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; pass --overwrite to replace it")
    check_replaceable(out, DATASET_FILES, "recforge dataset")  # before the conversion (minutes), not only when writing
    if merge_users and not spec.sequences:
        sequence_formats = ", ".join(f for f, s in FORMATS.items() if s.sequences)
        raise ValueError(f"--merge-users applies to the sequence formats ({sequence_formats}); "
                         f"{fmt} orders each user's events by timestamp wherever they are in the file")  # fmt: skip
    converted = spec.convert(src, merge_users=merge_users) if spec.sequences else spec.convert(src)
    return write_dataset(out, converted.events, converted.items, name=converted.name,
                         source=f"{fmt}:{converted.path.resolve()}", overwrite=overwrite, users=converted.users)
