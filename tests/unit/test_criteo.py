"""Unit tests of the Criteo TSV reader (services/dataloader/tsv.py)."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest

from services.dataloader.tsv import (
    GROUP_SHIFT,
    NUM_DENSE,
    NUM_SPARSE,
    BadLinePolicy,
    CriteoFormatError,
    hash_token,
    read_criteo,
)


def make_line(label="1", ints=None, cats=None) -> str:
    ints = [str(i) for i in range(NUM_DENSE)] if ints is None else ints
    cats = [f"{k:08x}" for k in range(NUM_SPARSE)] if cats is None else cats
    return "\t".join([label, *ints, *cats])


LINE_A = make_line("1", ["5", "-3", "", "0", "12"] + [""] * 7 + ["7"],
                   ["68fd1e64"] * 25 + [""])
LINE_B = make_line("0", ["1"] * NUM_DENSE, ["abc"] * 13 + [""] * 13)
LINE_C = make_line("1")


def concat(chunks):
    return {
        "labels": np.concatenate([c.labels for c in chunks]),
        "dense": np.concatenate([c.dense for c in chunks]),
        "ids": np.concatenate([c.ids for c in chunks]),
        "present": np.concatenate([c.present for c in chunks]),
    }


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.tsv"
    path.write_text(LINE_A + "\n" + LINE_B + "\n" + LINE_C)  # no final newline
    return path


def check_small(chunks):
    got = concat(chunks)
    np.testing.assert_array_equal(got["labels"], [1, 0, 1])
    assert got["labels"].dtype == np.float32 and got["dense"].dtype == np.float32
    assert got["ids"].dtype == np.uint64 and got["present"].dtype == np.bool_
    want_a = np.zeros(NUM_DENSE, np.float32)
    want_a[0], want_a[4], want_a[12] = math.log1p(5), math.log1p(12), math.log1p(7)
    np.testing.assert_allclose(got["dense"][0], want_a, rtol=1e-6)  # -3 and empty -> 0
    np.testing.assert_allclose(got["dense"][1], np.full(NUM_DENSE, math.log1p(1)), rtol=1e-6)
    np.testing.assert_allclose(got["dense"][2], np.log1p(np.arange(NUM_DENSE)), rtol=1e-6)
    assert got["present"][0].tolist() == [True] * 25 + [False]
    assert got["present"][1].tolist() == [True] * 13 + [False] * 13
    assert got["ids"][0, 0] == hash_token("68fd1e64", 0)
    assert got["ids"][0, 7] == hash_token("68fd1e64", 7)
    assert got["ids"][0, 25] == 25 << GROUP_SHIFT  # reserved 'missing' id of group 25
    assert got["ids"][2, 3] == hash_token("00000003", 3)


def test_parse_plain_file(small_file):
    chunks = list(read_criteo(small_file))
    assert len(chunks) == 1
    assert chunks[0].first_line == 1 and chunks[0].num_bad_lines == 0
    assert chunks[0].end_offset == small_file.stat().st_size
    assert chunks[0].path == str(small_file)
    check_small(chunks)


def test_parse_gzip_and_crlf(tmp_path, small_file):
    gz = tmp_path / "small.tsv.gz"
    gz.write_bytes(gzip.compress(small_file.read_bytes()))
    check_small(list(read_criteo(gz)))
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(small_file.read_bytes().replace(b"\n", b"\r\n"))
    check_small(list(read_criteo(crlf, bad_lines="error")))


def test_multi_member_gzip(tmp_path):
    gz = tmp_path / "multi.tsv.gz"
    gz.write_bytes(gzip.compress((LINE_A + "\n").encode()) + gzip.compress(LINE_B.encode()))
    assert len(concat(list(read_criteo(gz)))["labels"]) == 2


BAD_LINES = [
    ("wrong field count", make_line() + "\textra", "expected 40 tab-separated fields, got 41"),
    ("too few fields", "\t".join(["1"] * 39), "expected 40 tab-separated fields, got 39"),
    ("empty line", "", "expected 40 tab-separated fields, got 1"),
    ("bad label", make_line("2"), "label must be 0 or 1"),
    ("empty label", make_line(""), "label must be 0 or 1"),
    ("non-integer", make_line(ints=["1", "x7"] + ["0"] * 11), "column I2 is not an integer"),
    ("float", make_line(ints=["1.5"] + ["0"] * 12), "column I1 is not an integer"),
    ("sign alone", make_line(ints=["-"] + ["0"] * 12), "column I1 is not an integer"),
    ("NUL byte", make_line(cats=["ab\x00cd"] * NUM_SPARSE), "column C1 contains a NUL"),
]


@pytest.mark.parametrize("name,bad,message", BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_bad_line_skip_and_error(tmp_path, name, bad, message):
    path = tmp_path / "data.tsv"
    path.write_text("\n".join([LINE_A, LINE_B, bad, LINE_C]) + "\n")
    chunks = list(read_criteo(path, bad_lines=BadLinePolicy.SKIP))
    assert sum(c.num_bad_lines for c in chunks) == 1
    np.testing.assert_array_equal(concat(chunks)["labels"], [1, 0, 1])
    with pytest.raises(CriteoFormatError) as exc:
        list(read_criteo(path, bad_lines=BadLinePolicy.ERROR))
    assert str(exc.value).startswith(f"{path}:3: {message}")


def test_binary_garbage(tmp_path):
    rng = np.random.default_rng(1)
    garbage = rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()
    path = tmp_path / "garbage.tsv"
    path.write_bytes(LINE_A.encode() + b"\n" + garbage + b"\n" + LINE_B.encode() + b"\n")
    chunks = list(read_criteo(path))
    assert len(concat(chunks)["labels"]) == 2
    assert sum(c.num_bad_lines for c in chunks) == garbage.count(b"\n") + 1
    with pytest.raises(CriteoFormatError, match=rf"^{path}:2: "):
        list(read_criteo(path, bad_lines="error"))


def test_truncated_gzip(tmp_path, caplog):
    lines = [LINE_A, LINE_B, LINE_C] * 2000
    full = gzip.compress(("\n".join(lines) + "\n").encode())
    path = tmp_path / "cut.tsv.gz"
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(CriteoFormatError, match=rf"^{path}:\d+: gzip stream is truncated"):
        list(read_criteo(path, bad_lines="error"))
    chunks = list(read_criteo(path, chunk_rows=1000))
    num_rows = len(concat(chunks)["labels"])
    assert 0 < num_rows < len(lines)
    assert sum(c.num_bad_lines for c in chunks) == 1  # the damaged tail
    assert "truncated" in caplog.text
    np.testing.assert_array_equal(concat(chunks)["labels"], [1, 0, 1] * (num_rows // 3)
                                  + [1, 0, 1][: num_rows % 3])


def test_not_gzip(tmp_path):
    path = tmp_path / "fake.tsv.gz"
    path.write_text(LINE_A)
    with pytest.raises(CriteoFormatError, match="not a valid gzip stream"):
        list(read_criteo(path))


def test_missing_file(tmp_path):
    path = tmp_path / "nope" / "train.tsv"
    with pytest.raises(FileNotFoundError, match=str(path)):
        read_criteo(path)  # raised at call time, before iteration


def test_argument_checks(small_file):
    with pytest.raises(ValueError, match="groups must have 26"):
        read_criteo(small_file, groups=[0] * 3)
    with pytest.raises(ValueError, match=r"groups\[2\]"):
        read_criteo(small_file, groups=[0, 1, 256] + [0] * 23)
    with pytest.raises(ValueError, match="chunk_rows"):
        read_criteo(small_file, chunk_rows=0)


def test_group_bits(tmp_path):
    path = tmp_path / "same.tsv"
    path.write_text(make_line(cats=["deadbeef"] * NUM_SPARSE) + "\n")
    groups = [200 + k % 3 for k in range(NUM_SPARSE)]
    ids = next(read_criteo(path, groups=groups)).ids[0]
    np.testing.assert_array_equal(ids >> np.uint64(GROUP_SHIFT), groups)
    low = ids & np.uint64((1 << GROUP_SHIFT) - 1)
    assert len(set(low.tolist())) == 1  # same token -> same hash ...
    assert len(set(ids.tolist())) == 3  # ... but a different id in each group
    default_ids = next(read_criteo(path)).ids[0]
    assert len(set(default_ids.tolist())) == NUM_SPARSE
    np.testing.assert_array_equal(default_ids >> np.uint64(GROUP_SHIFT), np.arange(NUM_SPARSE))


def test_hash_spreads_tokens():
    ids = np.array([hash_token(f"{k:08x}", 0) for k in range(20000)], dtype=np.uint64)
    assert len(np.unique(ids)) == len(ids)
    assert (ids >> np.uint64(GROUP_SHIFT) == 0).all()
    top_bits = (ids >> np.uint64(GROUP_SHIFT - 4)) & np.uint64(15)  # used for sharding
    counts = np.bincount(top_bits.astype(np.int64), minlength=16)
    assert counts.min() > 20000 / 16 * 0.85


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_chunking_and_resume(tmp_path, gz, chunk_rows):
    rng = np.random.default_rng(0)
    lines = []
    for i in range(300):
        ints = [str(v) if v % 5 else "" for v in rng.integers(-5, 100000, NUM_DENSE)]
        cats = [f"{v:08x}" if v % 7 else "" for v in rng.integers(0, 2**32, NUM_SPARSE)]
        lines.append(make_line(str(i % 2), ints, cats))
    lines[100] = "garbage"
    text = ("\n".join(lines) + "\n").encode()
    path = tmp_path / ("data.tsv.gz" if gz else "data.tsv")
    path.write_bytes(gzip.compress(text) if gz else text)

    one_pass = list(read_criteo(path, chunk_rows=10_000))
    assert len(one_pass) == 1 and one_pass[0].num_bad_lines == 1
    chunks = list(read_criteo(path, chunk_rows=chunk_rows, block_bytes=1000))
    assert all(len(c) == chunk_rows for c in chunks[:-1])
    assert sum(c.num_bad_lines for c in chunks) == 1
    for key, want in concat(one_pass).items():
        np.testing.assert_array_equal(concat(chunks)[key], want)
    # first_line / end_offset / end_line agree with the text
    offsets = np.cumsum([len(line) + 1 for line in lines])
    row_lines = [i + 1 for i in range(len(lines)) if i != 100]
    start = 0
    for c in chunks:
        assert c.first_line == row_lines[start]
        start += len(c)
        assert c.end_line == (row_lines[start - 1] + 1 if c is not chunks[-1] else len(lines) + 1)
        assert c.end_offset == offsets[c.end_line - 2]

    # resume after every chunk, with and without start_line
    for k, c in enumerate(chunks[:-1]):
        rest = list(read_criteo(path, chunk_rows=chunk_rows, start_offset=c.end_offset,
                                start_line=c.end_line))
        counted = list(read_criteo(path, chunk_rows=chunk_rows, start_offset=c.end_offset))
        assert [r.first_line for r in rest] == [r.first_line for r in chunks[k + 1:]]
        assert [r.first_line for r in counted] == [r.first_line for r in chunks[k + 1:]]
        for key in ("labels", "ids", "dense", "present"):
            np.testing.assert_array_equal(concat(chunks[: k + 1] + rest)[key],
                                          concat(one_pass)[key])


def test_first_line_skips_leading_bad_lines(tmp_path):
    path = tmp_path / "lead.tsv"
    path.write_text("\n".join(["x", "y", LINE_A, LINE_B]) + "\n")
    (chunk,) = read_criteo(path)
    assert chunk.first_line == 3 and chunk.num_bad_lines == 2 and chunk.end_line == 5


def test_only_bad_lines_gives_empty_chunk(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("x\ny\n")
    (chunk,) = read_criteo(path)
    assert len(chunk) == 0 and chunk.num_bad_lines == 2 and chunk.first_line == 1
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    assert list(read_criteo(empty)) == []


@pytest.mark.parametrize("gz", [False, True])
def test_overlong_line(tmp_path, gz):
    """A line with no newline for megabytes is dropped without being carried whole."""
    from services.dataloader import tsv as criteo

    text = (LINE_A + "\n" + "x" * (3 * criteo.MAX_LINE_BYTES) + "\n" + LINE_B + "\n").encode()
    path = tmp_path / ("long.tsv.gz" if gz else "long.tsv")
    path.write_bytes(gzip.compress(text) if gz else text)
    chunks = list(read_criteo(path, block_bytes=1 << 16))
    assert sum(c.num_bad_lines for c in chunks) == 1
    np.testing.assert_array_equal(concat(chunks)["labels"], [1, 0])
    assert chunks[-1].end_offset == len(text) and chunks[-1].end_line == 4
    with pytest.raises(CriteoFormatError, match=rf"^{path}:2: line longer than"):  # never parsed
        list(read_criteo(path, bad_lines="error", block_bytes=1 << 16))
    tail = tmp_path / "tail.tsv"  # the file ends inside the overlong line
    tail.write_bytes(text[: len(LINE_A) + 1 + 2 * criteo.MAX_LINE_BYTES])
    chunks = list(read_criteo(tail, block_bytes=1 << 16))
    assert sum(c.num_bad_lines for c in chunks) == 1 and len(concat(chunks)["labels"]) == 1
