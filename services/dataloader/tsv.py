"""Criteo TSV reader: files in, CriteoChunks out. Runs in the data loader process.

One sample per line, tab-separated: a 0/1 label, 13 integer columns (I1..I13,
may be negative or empty) and 26 categorical columns (C1..C26, usually 8 hex
digits, may be empty). Plain or gzip-compressed (multi-member gzip works).

The reader feeds a distributed trainer from a small machine, so the per-line
work happens in one numba kernel over the raw bytes of a large block: Python
touches a block (megabytes) at a time, never a line or a field. The partial
last line of a block is carried over to the next one.

This module is the file side: gzip/plain block iteration, resume offsets,
line numbers, bad-line policy and error messages naming file and line. The
kernels (and the token hash) live in ``hybridrec/core/layouts/criteo_kernels.py`` (shared
with the inference service), the column counts in ``hybridrec/core/layouts/criteo_format.py``
(shared with the data generator and the CLI); their public names are
re-exported here, so ``from services.dataloader.tsv import
NUM_SPARSE, hash_token`` keeps working.
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass
from enum import Enum
from typing import Iterator, Sequence

import numpy as np

from hybridrec.core.layouts.criteo_format import NUM_DENSE, NUM_FIELDS, NUM_SPARSE  # re-exported: see __all__
from hybridrec.core.wire.ids import GROUP_SHIFT, MAX_GROUPS
from hybridrec.core.layouts.criteo_kernels import HASH_MASK, hash_token  # re-exported: see __all__
from hybridrec.core.layouts.criteo_kernels import _OK, _parse_lines, error_text

__all__ = [
    "BadLinePolicy", "CriteoChunk", "CriteoFormatError", "DEFAULT_BLOCK_BYTES", "GROUP_SHIFT",
    "HASH_MASK", "MAX_GROUP", "MAX_LINE_BYTES", "NUM_DENSE", "NUM_FIELDS", "NUM_SPARSE",
    "hash_token", "is_gzip", "read_criteo",
]

MAX_GROUP = MAX_GROUPS - 1
DEFAULT_BLOCK_BYTES = 4 << 20
MAX_LINE_BYTES = 1 << 20
"""A longer line is bad (and bounds the bytes carried from block to block)."""
_GZIP_READ_BYTES = 1 << 20

_log = logging.getLogger(__name__)


class BadLinePolicy(str, Enum):
    """What the reader does with a line that is not a valid sample (`data.bad_lines`), or with a row holding a
    value that is not finite (`data.non_finite`)."""

    SKIP = "skip"  # count it in CriteoChunk.num_bad_lines (num_nonfinite) and drop it
    ERROR = "error"  # raise CriteoFormatError naming file:line


class CriteoFormatError(ValueError):
    """A line (or the gzip stream) does not follow the Criteo format."""


@dataclass
class CriteoChunk:
    """Up to ``chunk_rows`` consecutive valid samples of one file."""

    labels: np.ndarray
    """float32 (n,): 0.0 or 1.0."""
    dense: np.ndarray
    """float32 (n, 13): log1p(max(x, 0)); an empty field reads as 0."""
    ids: np.ndarray
    """uint64 (n, 26): hashed tokens, feature group in the top 8 bits. An empty
    field reads as its group's reserved id ``group << 56`` (no token hashes to
    it), so a consumer may mask it out with ``present`` or learn a 'missing'
    embedding."""
    present: np.ndarray
    """bool (n, 26): False where the categorical field was empty."""
    path: str
    first_line: int
    """1-based line number of the chunk's first row (of its first line when
    the chunk holds only bad lines)."""
    end_offset: int
    """Byte offset in the uncompressed stream just after the chunk: pass it
    as ``start_offset`` (and ``end_line`` as ``start_line``) to resume."""
    num_bad_lines: int
    """Bad lines skipped inside this chunk (a truncated gzip tail counts as one)."""
    end_line: int = 0
    """1-based number of the first line after the chunk."""
    num_nonfinite: int = 0
    """Lines skipped inside this chunk for a value that is not finite (`data.non_finite: skip`)."""

    def __len__(self) -> int:
        return int(self.labels.shape[0])


# ---------------------------------------------------------------- streams


class _GzipTruncated(Exception):
    """The compressed input ended inside a gzip member."""


def is_gzip(path: str | os.PathLike) -> bool:
    """Whether the reader decompresses `path`: gzip magic bytes, or a .gz name."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b" or path.endswith(".gz")


def _iter_blocks(path: str, start_offset: int, block_bytes: int, end_offset: int | None = None) -> Iterator[bytes]:
    """Yield the uncompressed stream from ``start_offset`` (up to ``end_offset``, plain files only) in large
    blocks.

    gzip is decoded with zlib directly (not gzip.GzipFile) so that a
    truncated file still yields every byte that could be decoded before
    the damage, then raises _GzipTruncated.
    """
    with open(path, "rb") as f:
        magic = f.read(2)
        f.seek(0)
        if magic != b"\x1f\x8b" and not path.endswith(".gz"):
            f.seek(start_offset)
            left = None if end_offset is None else max(0, end_offset - start_offset)
            while (left is None or left > 0) and (block := f.read(block_bytes if left is None
                                                                  else min(block_bytes, left))):
                if left is not None:
                    left -= len(block)
                yield block
            return
        if end_offset is not None:
            raise ValueError(f"{path}: a gzip file is read whole (no end offset)")
        skip = start_offset
        dec = zlib.decompressobj(wbits=31)
        member_has_input = False
        pending: list[bytes] = []
        num_pending = 0
        raw = b""
        while raw or (raw := f.read(_GZIP_READ_BYTES)):
            try:  # max_length bounds memory however well the input compresses
                out = dec.decompress(raw, block_bytes)
            except zlib.error as exc:
                raise CriteoFormatError(f"{path}: not a valid gzip stream ({exc})") from exc
            member_has_input = True
            if dec.eof:  # next member of a multi-member file, if any
                raw = dec.unused_data
                dec = zlib.decompressobj(wbits=31)
                member_has_input = False
            else:
                raw = dec.unconsumed_tail
            if skip:
                cut = min(skip, len(out))
                out, skip = out[cut:], skip - cut
            if out:
                pending.append(out)
                num_pending += len(out)
            if num_pending >= block_bytes:
                yield b"".join(pending)
                pending, num_pending = [], 0
        tail = dec.flush()[skip:]
        if tail:
            pending.append(tail)
        if pending:
            yield b"".join(pending)
        if member_has_input and not dec.eof:
            raise _GzipTruncated()


def _drop_through_newline(blocks: Iterator[bytes], head: bytes) -> tuple[int, bytes | None]:
    """Skip an overlong line: (bytes dropped, what follows its newline or None at EOF)."""
    num_dropped = 0
    block = head
    while (cut := block.find(b"\n")) < 0:
        num_dropped += len(block)
        try:
            block = next(blocks)
        except (StopIteration, _GzipTruncated):
            return num_dropped, None
    return num_dropped + cut + 1, block[cut + 1:]


def _count_lines_before(path: str, offset: int) -> int:
    """Line number (1-based) of the line starting at ``offset``."""
    num_newlines = 0
    seen = 0
    try:
        for block in _iter_blocks(path, 0, DEFAULT_BLOCK_BYTES):
            take = min(len(block), offset - seen)
            num_newlines += block.count(b"\n", 0, take)
            seen += take
            if seen >= offset:
                break
    except _GzipTruncated:
        pass
    return num_newlines + 1


# ---------------------------------------------------------------- reader


def _group_prefixes(groups: Sequence[int] | None) -> np.ndarray:
    if groups is None:
        groups = range(NUM_SPARSE)
    groups = list(groups)
    if len(groups) != NUM_SPARSE:
        raise ValueError(f"groups must have {NUM_SPARSE} entries (one per C column), got {len(groups)}")
    for i, g in enumerate(groups):
        if not isinstance(g, (int, np.integer)) or not 0 <= g <= MAX_GROUP:
            raise ValueError(f"groups[{i}] = {g!r}: a feature group must be an int in [0, {MAX_GROUP}]")
    return np.array([int(g) << GROUP_SHIFT for g in groups], dtype=np.uint64)


def _error_message(path: str, line_no: int, line: bytes, code: int, detail: int) -> str:
    return f"{path}:{line_no}: {error_text(line, code, detail)}"


def read_criteo(
    path: str | os.PathLike,
    *,
    groups: Sequence[int] | None = None,
    chunk_rows: int = 65536,
    bad_lines: BadLinePolicy | str = BadLinePolicy.SKIP,
    start_offset: int = 0,
    start_line: int | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    end_offset: int | None = None,
    non_finite: BadLinePolicy | str = BadLinePolicy.ERROR,
) -> Iterator[CriteoChunk]:
    """Read a Criteo TSV (or .gz) file as CriteoChunks of ``chunk_rows`` rows.

    ``groups[i]`` is the feature group of column C(i+1) (default i).
    ``start_offset`` is an ``end_offset`` of an earlier chunk; ``start_line``
    is that chunk's ``end_line`` -- if left out the reader counts the lines
    before ``start_offset`` (exact, but reads the prefix once). ``end_offset``
    (plain files only) ends the data there, as if the file ended: a line
    start, so that the byte ranges of several data loaders (splits.py) hold
    whole lines.

    A line with an integer too long for a float64 (309 digits or more: not
    finite) follows ``non_finite``: skipped and counted in ``num_nonfinite``,
    or CriteoFormatError naming file:line.

    A truncated gzip stream raises CriteoFormatError under ERROR; under SKIP
    the rows decoded before the damage are returned, the damaged tail counts
    as one bad line, a warning is logged and the file ends there -- a data
    loader streaming many files keeps going rather than dying on one.

    Arguments are checked (and a missing file reported) when called, not on
    the first ``next()``.
    """
    path_str = os.fspath(path)
    if not os.path.isfile(path_str):
        raise FileNotFoundError(2, f"Criteo data file not found: {path_str}", path_str)
    policy = BadLinePolicy(bad_lines)
    group_hi = _group_prefixes(groups)
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    if start_offset < 0:
        raise ValueError(f"start_offset must be >= 0, got {start_offset}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    if end_offset is not None and (end_offset < start_offset or is_gzip(path_str)):
        raise ValueError(f"end_offset {end_offset}: must be >= start_offset {start_offset}, in a plain file")
    if start_line is None:
        start_line = _count_lines_before(path_str, start_offset) if start_offset else 1
    return _read(path_str, group_hi, chunk_rows, policy, start_offset, start_line, block_bytes, end_offset,
                 BadLinePolicy(non_finite) is BadLinePolicy.ERROR)


def _read(path: str, group_hi: np.ndarray, chunk_rows: int, policy: BadLinePolicy, start_offset: int,
          start_line: int, block_bytes: int, end_offset: int | None, stop_on_nonfinite: bool) -> Iterator[CriteoChunk]:
    stop_on_bad = policy is BadLinePolicy.ERROR
    stream_pos = start_offset  # uncompressed offset of data[0]
    line_no = start_line  # line number of data[0]'s line
    carry = b""
    blocks = _iter_blocks(path, start_offset, block_bytes, end_offset)
    truncated = False

    def new_chunk():
        return (np.empty(chunk_rows, np.float32), np.empty((chunk_rows, NUM_DENSE), np.float32),
                np.empty((chunk_rows, NUM_SPARSE), np.uint64),
                np.empty((chunk_rows, NUM_SPARSE), np.bool_))

    def emit(arrays, num_rows, first_line, end_offset, num_bad, end_line, num_nonfinite):
        # a short last chunk is copied so that it does not pin full-size arrays
        labels, dense, ids, present = (
            a[:num_rows] if num_rows == chunk_rows else a[:num_rows].copy() for a in arrays)
        return CriteoChunk(labels=labels, dense=dense, ids=ids, present=present, path=path,
                           first_line=first_line, end_offset=end_offset,
                           num_bad_lines=num_bad, end_line=end_line, num_nonfinite=num_nonfinite)

    arrays = new_chunk()
    # first_row_no: line number of the chunk's first row; first_any: of its
    # first consumed line (used when the chunk ends up holding only bad lines)
    filled, chunk_bad, chunk_nonfinite, first_row_no, first_any = 0, 0, 0, -1, -1
    while True:
        try:
            block = next(blocks)
            eof = False
        except StopIteration:
            block, eof = b"", True
        except _GzipTruncated:
            block, eof, truncated = b"", True, True
        data = carry + block if carry else block
        buf = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        while True:
            (new_pos, num_rows, num_lines, num_bad, num_nonfinite, first_row, code,
             detail) = _parse_lines(buf, pos, len(buf), eof and not truncated, group_hi,
                                    *arrays, filled, chunk_rows - filled, stop_on_bad, stop_on_nonfinite)
            if code != _OK:
                bad_no = line_no + num_lines
                end = data.find(b"\n", new_pos)
                line = data[new_pos:end if end >= 0 else len(data)]
                raise CriteoFormatError(_error_message(path, bad_no, line, code, detail))
            if first_any < 0 and num_lines:
                first_any = line_no
            if first_row_no < 0 and num_rows:
                first_row_no = line_no + first_row
            filled += num_rows
            chunk_bad += num_bad
            chunk_nonfinite += num_nonfinite
            line_no += num_lines
            pos = new_pos
            if filled < chunk_rows:
                break
            yield emit(arrays, filled, first_row_no, stream_pos + pos, chunk_bad, line_no, chunk_nonfinite)
            arrays = new_chunk()
            filled, chunk_bad, chunk_nonfinite, first_row_no, first_any = 0, 0, 0, -1, -1
        carry = data[pos:]
        stream_pos += pos
        if eof:
            break
        if len(carry) > MAX_LINE_BYTES:  # no newline in sight: garbage, not a sample
            if stop_on_bad:
                raise CriteoFormatError(f"{path}:{line_no}: line longer than {MAX_LINE_BYTES} bytes")
            chunk_bad += 1
            first_any = line_no if first_any < 0 else first_any
            line_no += 1
            num_dropped, carry = _drop_through_newline(blocks, carry)
            stream_pos += num_dropped
            if carry is None:  # the file ends inside the line
                carry = b""
                break
    if truncated:
        if stop_on_bad:
            raise CriteoFormatError(
                f"{path}:{line_no}: gzip stream is truncated (file ends inside a compressed "
                f"member after {stream_pos + len(carry)} uncompressed bytes)")
        _log.warning("%s:%d: gzip stream is truncated; skipping the rest of the file",
                     path, line_no)
        chunk_bad += 1
        if first_any < 0:
            first_any = line_no
    if filled or chunk_bad or chunk_nonfinite:
        first_line = first_row_no if first_row_no >= 0 else first_any
        yield emit(arrays, filled, first_line, stream_pos, chunk_bad, line_no, chunk_nonfinite)


def parse_lines(data: bytes, *, where: str, groups: Sequence[int] | None = None,
                bad_lines: BadLinePolicy | str = BadLinePolicy.SKIP,
                non_finite: BadLinePolicy | str = BadLinePolicy.ERROR) -> CriteoChunk:
    """Every line of `data`, whole lines in memory (a stream message), as one chunk. `where` names the data in
    an error ("subject S, message N"), with the line number in it."""
    policy = BadLinePolicy(bad_lines)
    n = data.count(b"\n") + 1
    arrays = (np.empty(n, np.float32), np.empty((n, NUM_DENSE), np.float32), np.empty((n, NUM_SPARSE), np.uint64),
              np.empty((n, NUM_SPARSE), np.bool_))
    buf = np.frombuffer(data, dtype=np.uint8)
    new_pos, num_rows, num_lines, num_bad, num_nonfinite, _, code, detail = _parse_lines(
        buf, 0, len(buf), True, _group_prefixes(groups), *arrays, 0, n, policy is BadLinePolicy.ERROR,
        BadLinePolicy(non_finite) is BadLinePolicy.ERROR)
    if code != _OK:
        end = data.find(b"\n", new_pos)
        raise CriteoFormatError(_error_message(where, num_lines + 1, data[new_pos:end if end >= 0 else len(data)],
                                               code, detail))
    labels, dense, ids, present = (a[:num_rows] for a in arrays)
    return CriteoChunk(labels=labels, dense=dense, ids=ids, present=present, path=where, first_line=1,
                       end_offset=len(data), num_bad_lines=num_bad, end_line=num_lines + 1,
                       num_nonfinite=num_nonfinite)


def warm_up() -> None:
    """Compile (or load from numba's cache) the parser and the batch deduplication now, not inside the first
    batch's wait (the fork server calls it once for every data loader)."""
    from hybridrec.core.wire.dedup import unique_segments

    line = b"\t".join([b"1", *[b"1"] * NUM_DENSE, *[b"68fd1e64"] * NUM_SPARSE])
    parse_lines(line, where="the warm-up line")
    unique_segments(np.array([3, 1, 3], np.uint64), np.array([0, 2, 3], np.int64))
