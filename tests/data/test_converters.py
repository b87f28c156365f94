"""Tests for recforge.data.converters: each format on hand-written fixtures, bad inputs, real data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from recforge.data.converters import FORMATS, DataFormatError, default_data_root, format_names, prepare
from recforge.data.dataset import load_dataset

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def rows(table: pa.Table, *cols: str) -> list[tuple]:
    return list(zip(*(table.column(c).to_pylist() for c in cols)))


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if ".tmp" in p.name]


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# --- registry -----------------------------------------------------------------------------------------


def test_format_names_and_registry():
    assert format_names() == ["ml-1m", "grouplens", "amazon-s3rec", "recbole", "taobao"]
    assert all(FORMATS[name].description for name in format_names())


def test_unknown_format_lists_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown data format 'movielens'.*ml-1m, grouplens, amazon-s3rec"):
        prepare("movielens", FIXTURES / "ml-1m", tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_default_data_root(monkeypatch, tmp_path):
    monkeypatch.setenv("RECFORGE_DATA", str(tmp_path))
    assert default_data_root() == tmp_path
    monkeypatch.delenv("RECFORGE_DATA")
    repo = Path(__file__).resolve().parents[2]
    assert default_data_root() == (repo.parent / "shared" / "data").resolve()


# --- formats on fixtures ------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["ml-1m", "ml-1m/ml-1m_user_sequences.txt"])
def test_ml1m(tmp_path, source):
    ds = load_dataset(prepare("ml-1m", FIXTURES / source, tmp_path / "out"))
    ev = ds.events
    assert ev.schema == pa.schema([("user_id", pa.int64()), ("item_id", pa.int64()), ("timestamp", pa.int64())])
    assert rows(ev, "user_id", "item_id") == [(1, 10), (1, 11), (1, 10), (1, 12), (2, 12), (3, 30), (3, 10), (3, 20)]
    assert ev.column("timestamp").null_count == ev.num_rows
    assert ds.meta["has_timestamps"] is False and ds.meta["name"] == "ml-1m"
    assert ds.meta["num_users"] == 3 and ds.meta["num_items"] == 5
    assert ds.items.schema == pa.schema([("item_id", pa.int64()), ("title", pa.string()),
                                         ("genres", pa.list_(pa.string()))])
    assert ds.items.to_pylist()[:2] == [
        {"item_id": 10, "title": "Crème de la Crème (1999)", "genres": ["Comedy", "Romance"]},
        {"item_id": 11, "title": "Señor Spielfilm: Teil 2 (2001)", "genres": ["Drama"]},
    ]
    assert ds.items.column("item_id").to_pylist() == [10, 11, 12, 20, 30]
    assert ds.items.column("genres").to_pylist()[-1] == []


def test_ml1m_without_movies_has_no_items(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(FIXTURES / "ml-1m" / "ml-1m_user_sequences.txt", src)
    out = prepare("ml-1m", src, tmp_path / "out")
    assert not (out / "items.parquet").exists()
    assert load_dataset(out).items is None


def test_grouplens_stable_sort_by_user_then_time(tmp_path):
    ds = load_dataset(prepare("grouplens", FIXTURES / "grouplens", tmp_path / "out"))
    lines = (FIXTURES / "grouplens" / "ratings.dat").read_text().split()
    source = [tuple(int(x) for x in line.split("::")) for line in lines]
    expected = sorted(source, key=lambda r: (r[0], r[3]))  # Python's sort is stable: ties keep file order
    assert rows(ds.events, "user_id", "item_id", "rating", "timestamp") == expected
    user1 = rows(ds.events.filter(pc.equal(ds.events["user_id"], 1)), "item_id", "timestamp")
    assert user1 == [(15, 978000000), (13, 978299999), (11, 978300100), (10, 978300760), (12, 978300760),
                     (14, 978300760), (16, 978500000)]
    assert ds.events.schema.field("rating").type == pa.float32()
    assert ds.events.schema.field("timestamp").type == pa.int64()
    assert ds.meta["has_timestamps"] is True and ds.meta["label_columns"] == ["rating"]
    assert ds.meta["name"] == "grouplens"
    assert ds.items.num_rows == 7 and ds.items.column("title").to_pylist()[1] == "Señor Spielfilm (2001)"
    assert ds.items.column("genres").to_pylist()[5] == ["Horror", "Sci-Fi"]


@pytest.mark.parametrize("source", ["amazon", "amazon/Toy.txt"])
def test_amazon_s3rec(tmp_path, source):
    ds = load_dataset(prepare("amazon-s3rec", FIXTURES / source, tmp_path / "out"))
    assert rows(ds.events, "user_id", "item_id") == [
        (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, 6), (2, 4), (2, 2), (2, 7), (2, 1),
        (3, 4), (3, 8), (3, 9), (3, 2), (3, 5)]
    assert ds.events.column("timestamp").null_count == 15 and ds.meta["name"] == "toy"
    assert ds.items.schema == pa.schema([("item_id", pa.int64()), ("attributes", pa.list_(pa.int64()))])
    assert ds.items.to_pylist()[:4] == [{"item_id": 1, "attributes": [4]}, {"item_id": 2, "attributes": [5, 6]},
                                        {"item_id": 3, "attributes": []}, {"item_id": 4, "attributes": [1, 2, 3]}]


def test_recbole(tmp_path):
    ds = load_dataset(prepare("recbole", FIXTURES / "recbole", tmp_path / "out"))
    ev = ds.events
    assert ev.column_names == ["user_id", "item_id", "timestamp", "rating", "weight"]
    assert ev.schema.field("rating").type == pa.float32() and ev.schema.field("weight").type == pa.float32()
    assert rows(ev, "user_id", "item_id", "timestamp", "rating", "weight") == [
        (5, 101, 881250900, 4.0, 1.0), (5, 100, 881250900, 1.0, 0.25),  # 881250900.7 floors; tie keeps order
        (7, 102, 881250000, 5.0, None), (7, 100, 881250949, 3.0, 0.5), (7, 103, 881250949, 2.0, 2.0)]
    assert ds.meta["name"] == "toy" and ds.meta["label_columns"] == ["rating", "weight"]
    items = ds.items
    assert items.schema == pa.schema([("item_id", pa.int64()), ("movie_title", pa.list_(pa.string())),
                                      ("release_year", pa.string()), ("class", pa.list_(pa.string())),
                                      ("score", pa.float64())])
    assert items.to_pylist() == [
        {"item_id": 100, "movie_title": ["Toy", "Story"], "release_year": "1995",
         "class": ["Animation", "Children's", "Comedy"], "score": 8.0},
        {"item_id": 101, "movie_title": ["Golden", "Eye"], "release_year": "1995",
         "class": ["Action", "Thriller"], "score": 7.5},
        {"item_id": 102, "movie_title": ["Four", "Rooms"], "release_year": "1995", "class": ["Thriller"],
         "score": 6.25},
        {"item_id": 103, "movie_title": ["Untitled"], "release_year": None, "class": None, "score": None},
    ]
    assert ds.users.to_pylist() == [
        {"user_id": 5, "age": "24", "gender": "M", "occupation": "technician"},
        {"user_id": 7, "age": "53", "gender": "F", "occupation": "other"},
    ]
    assert ds.meta["user_feature_columns"] == ["age", "gender", "occupation"]


def test_recbole_duplicate_user_is_rejected(tmp_path):
    src = tmp_path / "src"
    write(src / "x.inter", "user_id:token\titem_id:token\n5\t2\n")
    write(src / "x.user", "user_id:token\tage:token\n5\t20\n5\t30\n")
    with pytest.raises(DataFormatError, match="user 5 is listed twice"):
        prepare("recbole", src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_recbole_inter_file_without_timestamp_or_item_file(tmp_path):
    inter = write(tmp_path / "src" / "x.inter", "item_id:token\tuser_id:token\n5\t2\n6\t1\n7\t2\n")
    ds = load_dataset(prepare("recbole", inter, tmp_path / "out"))
    assert rows(ds.events, "user_id", "item_id") == [(1, 6), (2, 5), (2, 7)]
    assert ds.events.column("timestamp").null_count == 3 and ds.items is None and ds.users is None


def test_taobao(tmp_path):
    ds = load_dataset(prepare("taobao", FIXTURES / "taobao", tmp_path / "out"))
    assert ds.events.schema.field("action").type == pa.string()
    assert rows(ds.events, "user_id", "item_id", "timestamp", "action") == [
        (1, 500, 1511500000, "cart"), (1, 501, 1511561733, "pv"), (1, 503, 1511561733, "fav"),
        (1, 500, 1511600000, "buy"), (2, 501, 1511540000, "pv"), (2, 500, 1511544070, "pv"),
        (2, 502, 1511544070, "buy")]
    assert ds.meta["has_actions"] is True and ds.meta["label_columns"] == []
    assert ds.items.to_pylist() == [{"item_id": 500, "category": 90}, {"item_id": 501, "category": 91},
                                    {"item_id": 502, "category": 92}, {"item_id": 503, "category": 91}]


@pytest.mark.parametrize("fmt, subdir", [("ml-1m", "ml-1m"), ("grouplens", "grouplens"), ("amazon-s3rec", "amazon"),
                                         ("recbole", "recbole"), ("taobao", "taobao")])
def test_crlf_and_bom_give_the_same_dataset(tmp_path, fmt, subdir):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / subdir, src)
    for path in src.iterdir():
        bom = b"" if path.suffix == ".json" else b"\xef\xbb\xbf"
        path.write_bytes(bom + path.read_bytes().replace(b"\n", b"\r\n"))
    plain = load_dataset(prepare(fmt, FIXTURES / subdir, tmp_path / "plain"))
    crlf = load_dataset(prepare(fmt, src, tmp_path / "crlf"))
    assert crlf.events.equals(plain.events)
    assert (crlf.items is None and plain.items is None) or crlf.items.equals(plain.items)


# --- overwrite ----------------------------------------------------------------------------------------


def test_overwrite(tmp_path):
    out = prepare("taobao", FIXTURES / "taobao", tmp_path / "out")
    with pytest.raises(ValueError, match="already exists"):
        prepare("ml-1m", FIXTURES / "ml-1m", out)
    assert load_dataset(out).meta["name"] == "UserBehavior"
    prepare("ml-1m", FIXTURES / "ml-1m", out, overwrite=True)
    assert load_dataset(out).meta["name"] == "ml-1m"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_overwrite_keeps_old_dataset(tmp_path):
    out = prepare("taobao", FIXTURES / "taobao", tmp_path / "out")
    bad = write(tmp_path / "bad.csv", "1,2,3,pv,10\nx,2,3,pv,11\n")
    with pytest.raises(DataFormatError, match="line 2"):
        prepare("taobao", bad, out, overwrite=True)
    assert load_dataset(out).meta["name"] == "UserBehavior"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv", "out"]


# --- bad inputs ---------------------------------------------------------------------------------------

BAD_INPUTS = {
    # id: (format, {relative file: content}, source (relative), expected message fragments)
    "missing-path": ("ml-1m", {}, "nowhere/ml-1m_user_sequences.txt", ["nowhere", "path does not exist"]),
    "ml1m-missing-file": ("ml-1m", {"d/other.txt": "1 2\n"}, "d", ["ml-1m_user_sequences.txt"]),
    "ml1m-empty": ("ml-1m", {"d/ml-1m_user_sequences.txt": "\n \n"}, "d", ["ml-1m_user_sequences.txt", "empty"]),
    "ml1m-non-int-user": ("ml-1m", {"s.txt": "1 2 3\n2 4\nu12 5 6\n"}, "s.txt",
                          ["s.txt", "line 3", "user ID 'u12' is not an integer"]),
    "ml1m-non-int-item": ("ml-1m", {"s.txt": "1 2 3\n2 4 x7\n"}, "s.txt", ["s.txt", "line 2", "item ID 'x7'"]),
    "ml1m-commas": ("ml-1m", {"s.txt": "1 2 3\n2,4,5\n"}, "s.txt", ["line 2", "'2,4,5' is not an integer", "commas"]),
    "ml1m-no-items": ("ml-1m", {"s.txt": "1 2 3\n\n2\n"}, "s.txt", ["s.txt", "line 3", "user 2 has no items"]),
    "movies-bad-line": ("ml-1m", {"d/ml-1m_user_sequences.txt": "1 2\n", "d/movies.dat": "2::A (1990)::Drama\n3\tB\n"},
                        "d", ["movies.dat", "line 2", "expected 3 fields separated by '::'"]),
    "movies-duplicate": ("ml-1m", {"d/ml-1m_user_sequences.txt": "1 2\n",
                                   "d/movies.dat": "2::A::Drama\n3::B::Drama\n2::C::Drama\n"},
                         "d", ["movies.dat", "line 3", "item 2 is listed twice"]),
    "grouplens-empty": ("grouplens", {"d/ratings.dat": ""}, "d", ["ratings.dat", "empty"]),
    "grouplens-no-ratings": ("grouplens", {"d/movies.dat": "1::A::B\n"}, "d", ["ratings.dat", "does not exist"]),
    "grouplens-tabs": ("grouplens", {"d/ratings.dat": "1\t2\t3\t4\n"}, "d",
                       ["ratings.dat", "line 1", "bad separator: found tabs, expected '::'"]),
    "grouplens-commas": ("grouplens", {"d/ratings.dat": "\n1,2,3,4\n"}, "d",
                         ["ratings.dat", "line 2", "found commas, expected '::'"]),
    "grouplens-field-count": ("grouplens", {"d/ratings.dat": "1::2::3::4\n1::3::4::5\n1::4::5\n"}, "d",
                              ["ratings.dat", "line 3", "expected 4 fields separated by '::', found 3"]),
    "grouplens-mixed-sep": ("grouplens", {"d/ratings.dat": "1::2::3::4\n1\t3\t4\t5\n"}, "d",
                            ["line 2", "found 1", "tabs"]),
    "grouplens-non-int": ("grouplens", {"d/ratings.dat": "1::2::3::4\nu12::3::4::5\n"}, "d",
                          ["ratings.dat", "line 2", "user_id 'u12' is not an integer"]),
    "grouplens-bad-rating": ("grouplens", {"d/ratings.dat": "1::2::3::4\n1::3::five::5\n"}, "d",
                             ["line 2", "rating 'five' is not a number"]),
    "amazon-two-txt": ("amazon-s3rec", {"d/A.txt": "1 2\n", "d/B.txt": "1 2\n"}, "d", ["A.txt, B.txt"]),
    "amazon-bad-json": ("amazon-s3rec", {"d/A.txt": "1 2\n", "d/A_item2attributes.json": '{"2": [1],\n "3": [2'},
                        "d", ["A_item2attributes.json", "line 2", "invalid JSON"]),
    "amazon-bad-attr": ("amazon-s3rec", {"d/A.txt": "1 2\n", "d/A_item2attributes.json": '{"2": ["x"]}'},
                        "d", ["A_item2attributes.json", "integer"]),
    "amazon-bad-item-key": ("amazon-s3rec", {"d/A.txt": "1 2\n", "d/A_item2attributes.json": '{"B00X": [1]}'},
                            "d", ["A_item2attributes.json", "item ID 'B00X' is not an integer"]),
    "recbole-empty": ("recbole", {"d/x.inter": ""}, "d", ["x.inter", "empty"]),
    "recbole-header-only": ("recbole", {"d/x.inter": "user_id:token\titem_id:token\n"}, "d",
                            ["x.inter", "header but no rows"]),
    "recbole-no-item-id": ("recbole", {"d/x.inter": "user_id:token\trating:float\n1\t2\n"}, "d",
                           ["x.inter", "line 1", "missing required column 'item_id'"]),
    "recbole-untyped-header": ("recbole", {"d/x.inter": "user_id\titem_id\n1\t2\n"}, "d",
                               ["x.inter", "line 1", "header field 'user_id' needs a type"]),
    "recbole-comma-header": ("recbole", {"d/x.inter": "user_id:token,item_id:token\n1,2\n"}, "d",
                             ["x.inter", "line 1", "bad separator", "tab"]),
    "recbole-non-int": ("recbole", {"d/x.inter": "user_id:token\titem_id:token\n1\t2\nu12\t3\n"}, "d",
                        ["x.inter", "line 3", "user_id 'u12' is not an integer", "remap them to integers"]),
    "recbole-field-count": ("recbole", {"d/x.inter": "user_id:token\titem_id:token\n1\t2\n1\t2\t3\n"}, "d",
                            ["x.inter", "line 3", "expected 2 fields separated by tabs, found 3"]),
    "recbole-item-non-int": ("recbole", {"d/x.inter": "user_id:token\titem_id:token\n1\t2\n",
                                         "d/x.item": "item_id:token\ttitle:token_seq\n2\tA b\nB0X\tC\n"},
                             "d", ["x.item", "line 3", "item_id 'B0X' is not an integer"]),
    "taobao-empty": ("taobao", {"u.csv": ""}, "u.csv", ["u.csv", "empty"]),
    "taobao-header": ("taobao", {"u.csv": "user,item,category,behavior,timestamp\n1,2,3,pv,4\n"}, "u.csv",
                      ["u.csv", "line 1", "user_id 'user' is not an integer", "no header"]),
    "taobao-non-int": ("taobao", {"u.csv": "1,2,3,pv,4\nu12,2,3,pv,4\n"}, "u.csv",
                       ["u.csv", "line 2", "user_id 'u12' is not an integer"]),
    "taobao-field-count": ("taobao", {"u.csv": "1,2,3,pv,4\n1,2,3,pv\n"}, "u.csv",
                           ["u.csv", "line 2", "expected 5 fields separated by commas, found 4"]),
    "taobao-empty-behavior": ("taobao", {"u.csv": "1,2,3,pv,4\n1,2,3,,5\n"}, "u.csv",
                              ["u.csv", "line 2", "empty behavior"]),
    "taobao-blank-line": ("taobao", {"u.csv": "1,2,3,pv,4\n\n   \n1,2,3,pv,5\n"}, "u.csv",
                          ["u.csv", "line 3", "expected 5 fields separated by commas, found 1"]),
    "taobao-two-csv": ("taobao", {"a.csv": "1,2,3,pv,4\n", "b.csv": "1,2,3,pv,4\n"}, ".", ["a.csv, b.csv"]),
    "taobao-no-csv": ("taobao", {"a.txt": "1,2,3,pv,4\n"}, ".", ["found none"]),
    "recbole-no-user-id": ("recbole", {"d/x.inter": "item_id:token\ttimestamp:float\n1\t2\n"}, "d",
                           ["x.inter", "line 1", "missing required column 'user_id'"]),
    "recbole-item-no-item-id": ("recbole", {"d/x.inter": "user_id:token\titem_id:token\n1\t2\n",
                                            "d/x.item": "movie:token\n2\n"},
                                "d", ["x.item", "line 1", "missing required column 'item_id'"]),
    "recbole-item-duplicate": ("recbole", {"d/x.inter": "user_id:token\titem_id:token\n1\t2\n",
                                           "d/x.item": "item_id:token\ttitle:token\n2\tA\n\n3\tB\n2\tC\n"},
                               "d", ["x.item", "line 5", "item 2 is listed twice"]),
    "taobao-tabs": ("taobao", {"u.csv": "1\t2\t3\tpv\t4\n"}, "u.csv", ["u.csv", "line 1", "tabs"]),
    # the same user on two lines of a sequence file (no timestamps to order them): refused by default
    "ml1m-user-twice": ("ml-1m", {"s.txt": "1 2 3\n2 4\n1 5 6\n"}, "s.txt",
                        ["s.txt", "line 3", "user 1 is listed twice (lines 1 and 3)", "--merge-users"]),
    "amazon-user-twice": ("amazon-s3rec", {"d/A.txt": "7 2\n7 3\n"}, "d", ["A.txt", "line 2", "user 7 is listed twice"]),
    # another dataset's attributes file in the folder is not joined
    "amazon-foreign-attributes": ("amazon-s3rec", {"d/Beauty.txt": "1 2\n", "d/Sports_item2attributes.json": '{"2": [1]}'},
                                  "d", ["Sports_item2attributes.json", "another dataset than Beauty.txt",
                                        "Beauty_item2attributes.json"]),
    # negative IDs are reported as negative, with the line
    "ml1m-negative-user": ("ml-1m", {"s.txt": "1 2 3\n-4 5 6\n"}, "s.txt", ["s.txt", "line 2", "user ID -4 is negative"]),
    "ml1m-negative-item": ("ml-1m", {"s.txt": "1 2 -3\n"}, "s.txt", ["line 1", "item ID -3 is negative"]),
    "movies-negative": ("ml-1m", {"d/ml-1m_user_sequences.txt": "1 2\n", "d/movies.dat": "2::A::Drama\n-3::B::Drama\n"},
                        "d", ["movies.dat", "line 2", "movie ID -3 is negative"]),
    "grouplens-negative": ("grouplens", {"d/ratings.dat": "1::2::3::4\n\n1::-3::4::5\n"}, "d",
                           ["ratings.dat", "line 3", "item_id -3 is negative"]),
    "taobao-negative": ("taobao", {"u.csv": "1,2,3,pv,4\n-1,2,3,pv,4\n"}, "u.csv", ["u.csv", "line 2", "user_id -1 is negative"]),
    "recbole-negative": ("recbole", {"d/x.inter": "user_id:token\titem_id:token\n1\t2\n1\t-2\n"}, "d",
                         ["x.inter", "line 3", "item_id -2 is negative"]),
    "recbole-item-negative": ("recbole", {"d/x.inter": "user_id:token\titem_id:token\n1\t2\n",
                                          "d/x.item": "item_id:token\ttitle:token\n2\tA\n-3\tB\n"},
                              "d", ["x.item", "line 3", "item_id -3 is negative"]),
    "amazon-negative-item-key": ("amazon-s3rec", {"d/A.txt": "1 2\n", "d/A_item2attributes.json": '{"-2": [1]}'},
                                 "d", ["A_item2attributes.json", "item ID -2 is negative"]),
    # an out-of-range timestamp names the file and line
    "recbole-timestamp-range": ("recbole", {"d/x.inter": "user_id:token\titem_id:token\ttimestamp:float\n1\t2\t5\n"
                                                         "1\t3\t1e300\n"}, "d",
                                ["x.inter", "line 3", "timestamp 1e+300 is out of range"]),
    "grouplens-timestamp-range": ("grouplens", {"d/ratings.dat": "1::2::3::4\n1::3::4::99999999999999999999\n"}, "d",
                                  ["ratings.dat", "line 2", "timestamp 99999999999999999999 does not fit"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input(tmp_path, case):
    fmt, files, source, fragments = BAD_INPUTS[case]
    for name, content in files.items():
        write(tmp_path / "src" / name, content)
    out = tmp_path / "out"
    with pytest.raises(DataFormatError) as info:
        prepare(fmt, tmp_path / "src" / source, out)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert_nothing_left(out)


def test_error_attributes(tmp_path):
    path = write(tmp_path / "s.txt", "1 2\n3 x\n")
    with pytest.raises(DataFormatError) as info:
        prepare("ml-1m", path, tmp_path / "out")
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.path, err.line) == (path, 2) and "item ID 'x'" in err.problem


# --- real data (skipped when /work/shared/data is absent) ---------------------------------------------

REAL = {
    "ml-1m": ("ml-1m", "ml-1m", 6040, 3706, 1_000_209, 3883, False),
    "amazon-s3rec": ("amazon-s3rec", "amazon-beauty", 22363, 12101, 198_502, 12101, False),
    "recbole": ("recbole", "ml-100k", 943, 1682, 100_000, 1682, True),
    "taobao": ("taobao", "taobao-sample", 43, 3276, 4321, 3276, True),
}


@pytest.mark.parametrize("case", list(REAL), ids=list(REAL))
def test_real_data(tmp_path, case):
    fmt, subdir, users, items, events, item_rows, has_ts = REAL[case]
    source = default_data_root() / subdir
    if not source.is_dir():
        pytest.skip(f"real data not found at {source} (set RECFORGE_DATA to the shared data directory)")
    ds = load_dataset(prepare(fmt, source, tmp_path / "out"))
    meta = ds.meta
    assert (meta["num_users"], meta["num_items"], meta["num_events"]) == (users, items, events)
    assert ds.items.num_rows == item_rows and meta["has_timestamps"] is has_ts
    assert json.loads((tmp_path / "out" / "dataset.json").read_text()) == meta
    if fmt == "taobao":
        counts = dict(zip(*pc.value_counts(ds.events["action"]).flatten()))
        assert {k.as_py(): v.as_py() for k, v in counts.items()} == {"pv": 3926, "cart": 190, "fav": 128, "buy": 77}
    if fmt == "amazon-s3rec":
        assert len(pc.unique(pc.list_flatten(ds.items["attributes"]))) == 637


def test_merge_users_joins_a_users_lines_in_file_order(tmp_path):
    path = write(tmp_path / "s.txt", "1 2 3\n2 4\n1 5 6\n")
    ds = load_dataset(prepare("ml-1m", path, tmp_path / "out", merge_users=True))
    assert rows(ds.events, "user_id", "item_id") == [(1, 2), (1, 3), (1, 5), (1, 6), (2, 4)]
    with pytest.raises(ValueError, match="--merge-users applies to the sequence formats"):
        prepare("taobao", FIXTURES / "taobao", tmp_path / "out2", merge_users=True)


def test_overwrite_refuses_a_folder_with_other_files(tmp_path):
    out = prepare("taobao", FIXTURES / "taobao", tmp_path / "out")
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(ValueError, match=r"notes\.txt.*would delete them"):
        prepare("taobao", FIXTURES / "taobao", out, overwrite=True)
    assert (out / "notes.txt").read_text() == "my notes" and load_dataset(out).meta["name"] == "UserBehavior"
    (out / "notes.txt").unlink()
    prepare("ml-1m", FIXTURES / "ml-1m", out, overwrite=True)
    assert load_dataset(out).meta["name"] == "ml-1m"
