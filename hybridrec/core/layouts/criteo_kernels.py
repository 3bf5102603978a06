"""Criteo line parser: numba kernels that turn raw TSV bytes into sample rows.

Runs in the data loader process, called by the reader in
``services/dataloader/tsv.py``, and in the inference service, which parses
the rows of a request with the same kernels so serving cannot drift from
training (and by ``hash_token`` in tests and tools). It holds only the
per-line work: no files, no offsets -- the kernels return error codes,
``error_text`` says what they mean, and the callers name the file and line
(or the request row).

Format: one sample per line, tab-separated: a 0/1 label, 13 integer columns
(I1..I13, may be negative or empty) and 26 categorical columns (C1..C26,
usually 8 hex digits, may be empty).

Categorical tokens are hashed (FNV-1a over the bytes, then a splitmix64
finaliser so that similar tokens spread over all 64 bits) and the feature
group is put in the top 8 bits: ``id = group << 56 | hash & (2**56 - 1)``.

Why a separate module, and why all kernels in it: numba's ``cache=True``
keys its on-disk cache on the source file of the function it compiled, not
on the functions or module constants that function uses. The njit functions
below call each other and read the constants defined here, so they must all
stay in this one file; a kernel or a constant moved elsewhere could be
changed without invalidating the cached machine code of its callers.
"""

from __future__ import annotations

import numpy as np

from hybridrec.core.layouts.criteo_format import NUM_DENSE, NUM_FIELDS, NUM_SPARSE
from hybridrec.core.wire.ids import GROUP_SHIFT, VALUE_MASK
from hybridrec.core.runtime.kernel_cache import njit

# numba's cache does not track hybridrec.core.wire.ids or hybridrec.core.layouts.criteo_format either: after
# changing the ID layout or the column counts there, delete
# __pycache__/criteo_kernels.*.nbi and .nbc.
HASH_MASK = VALUE_MASK

_TAB, _NL, _CR = 9, 10, 13
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_SM_M1 = np.uint64(0xBF58476D1CE4E5B9)
_SM_M2 = np.uint64(0x94D049BB133111EB)
_HASH_MASK_U64 = np.uint64(HASH_MASK)

# Kernel error codes; the Python side turns them into messages. _E_NONFINITE (an integer too long for a
# float64: 309 digits or more) is a policy of its own (data.non_finite), not a malformed line.
_OK, _E_FIELDS, _E_LABEL, _E_INT, _E_CTRL, _E_NONFINITE = 0, 1, 2, 3, 4, 5
_INF = np.inf


@njit(cache=True, nogil=True)
def _hash_field(buf, start, end):
    """56-bit hash of buf[start:end]; never 0 (0 marks an empty field)."""
    h = _FNV_OFFSET
    for q in range(start, end):
        h = (h ^ np.uint64(buf[q])) * _FNV_PRIME
    h = (h ^ (h >> np.uint64(30))) * _SM_M1
    h = (h ^ (h >> np.uint64(27))) * _SM_M2
    h = (h ^ (h >> np.uint64(31))) & _HASH_MASK_U64
    if h == np.uint64(0):
        h = np.uint64(1)
    return h


@njit(cache=True, nogil=True)
def _bad(buf, s, e, code, detail):
    """Report a wrong field count in preference to whatever it caused.

    Its callers pass `code` and `detail` as np.int64: a constant argument would have numba compile one
    signature per constant (five, a second of a cold start)."""
    num_fields = 1
    for q in range(s, e):
        if buf[q] == _TAB:
            num_fields += 1
    if num_fields != NUM_FIELDS:
        return _E_FIELDS, num_fields
    return code, detail


@njit(cache=True, nogil=True)
def _parse_line(buf, s, e, group_hi, labels, dense, ids, present, r):
    """Parse buf[s:e] (no newline) into row r. Returns (error code, detail)."""
    if e - s < 2 or buf[s + 1] != _TAB:
        return _bad(buf, s, e, np.int64(_E_LABEL), np.int64(0))
    c = buf[s]
    if c != 48 and c != 49:
        return _bad(buf, s, e, np.int64(_E_LABEL), np.int64(0))
    labels[r] = np.float32(c - 48)
    p = s + 2
    for j in range(NUM_DENSE):
        q = p
        neg = False
        if q < e and (buf[q] == 45 or buf[q] == 43):
            neg = buf[q] == 45
            q += 1
        num_digits = 0
        val = 0.0
        while q < e and buf[q] != _TAB:
            d = np.int64(buf[q]) - 48
            if d < 0 or d > 9:
                return _bad(buf, s, e, np.int64(_E_INT), np.int64(j))
            val = val * 10.0 + d
            num_digits += 1
            q += 1
        if num_digits == 0 and q > p:  # a sign alone
            return _bad(buf, s, e, np.int64(_E_INT), np.int64(j))
        if val == _INF:  # 309 digits or more: not a number the model can take, whatever its sign
            return _bad(buf, s, e, np.int64(_E_NONFINITE), np.int64(j))
        dense[r, j] = np.float32(0.0 if neg else np.log1p(val))
        if q >= e:
            return _bad(buf, s, e, np.int64(_E_FIELDS), np.int64(0))
        p = q + 1
    for k in range(NUM_SPARSE):
        q = p
        while q < e and buf[q] != _TAB:
            if buf[q] < 32:  # NUL or control byte: binary garbage
                return _bad(buf, s, e, np.int64(_E_CTRL), np.int64(k))
            q += 1
        if q == p:
            ids[r, k] = group_hi[k]
            present[r, k] = False
        else:
            ids[r, k] = group_hi[k] | _hash_field(buf, p, q)
            present[r, k] = True
        if k < NUM_SPARSE - 1:
            if q >= e:
                return _bad(buf, s, e, np.int64(_E_FIELDS), np.int64(0))
            p = q + 1
        elif q < e:
            return _bad(buf, s, e, np.int64(_E_FIELDS), np.int64(0))
    return _OK, 0


@njit(cache=True, nogil=True)
def _parse_lines(buf, pos, end, is_final, group_hi, labels, dense, ids, present,
                 row0, max_rows, stop_on_bad, stop_on_nonfinite):
    """Parse whole lines of buf[pos:end] into rows row0.. until max_rows rows.

    A line without a newline is parsed only when ``is_final`` (end of file);
    otherwise it is left for the caller to carry over. Returns
    (pos after the last consumed line, rows, lines consumed, bad lines,
    lines with a non-finite value, index among consumed lines of the first
    row or -1, error code, error detail) -- on an error with ``stop_on_bad``
    (a non-finite value: ``stop_on_nonfinite``) the returned pos is the
    start of the line, which is not consumed.
    """
    num_rows = 0
    num_lines = 0
    num_bad = 0
    num_nonfinite = 0
    first_row = -1
    while num_rows < max_rows and pos < end:
        le = pos
        while le < end and buf[le] != _NL:
            le += 1
        if le == end and not is_final:
            break
        nxt = le + 1 if le < end else end
        if le > pos and buf[le - 1] == _CR:
            le -= 1
        code, detail = _parse_line(buf, pos, le, group_hi, labels, dense, ids,
                                   present, row0 + num_rows)
        if code == _E_NONFINITE:
            if stop_on_nonfinite:
                return pos, num_rows, num_lines, num_bad, num_nonfinite, first_row, code, detail
            num_nonfinite += 1
        elif code != _OK:
            if stop_on_bad:
                return pos, num_rows, num_lines, num_bad, num_nonfinite, first_row, code, detail
            num_bad += 1
        else:
            if first_row < 0:
                first_row = num_lines
            num_rows += 1
        num_lines += 1
        pos = nxt
    return pos, num_rows, num_lines, num_bad, num_nonfinite, first_row, _OK, 0


@njit(cache=True, nogil=True)
def join_rows(data, offsets, out):
    """The inference service's `rows` (row i is data[offsets[i]:offsets[i + 1]], a line with or without its
    label) as newline-terminated lines with a label, as `_parse_lines` reads them, written to ``out`` (at
    least len(data) + 3 bytes a row); an unlabelled row gets label 0 (not used). Returns (bytes written, the
    first row that holds a line break or a number of tabs neither layout has or -1, whether any byte is not
    ASCII: the caller then checks the rows are UTF-8)."""
    w = 0
    ascii_only = True
    for i in range(offsets.shape[0] - 1):
        s, e = offsets[i], offsets[i + 1]
        tabs = 0
        for q in range(s, e):
            c = data[q]
            if c == _TAB:
                tabs += 1
            elif c == _NL or c == _CR:
                return w, i, not ascii_only
            elif c >= 128:
                ascii_only = False
        if tabs == NUM_FIELDS - 2:
            out[w] = 48
            out[w + 1] = _TAB
            w += 2
        elif tabs != NUM_FIELDS - 1:
            return w, i, not ascii_only
        for q in range(s, e):
            out[w] = data[q]
            w += 1
        out[w] = _NL
        w += 1
    return w, -1, not ascii_only


@njit(cache=True, nogil=True)
def hash_strings(data, offsets, group_hi, out, present):
    """IDs of an Arrow string column (its data bytes and int32/int64 offsets): string i is
    data[offsets[i]:offsets[i + 1]], hashed exactly as a TSV field, so a Criteo file converted to Parquet gives
    the same IDs. An empty string is absent (as an empty TSV field); ``present`` comes in holding the
    column's validity and goes out False for those too. Returns -1, or the first string whose offsets do not
    lie in order within ``data`` (nothing is read outside it: the caller refuses the column)."""
    size = data.shape[0]
    for i in range(out.shape[0]):
        s, e = offsets[i], offsets[i + 1]
        if s < 0 or e < s or e > size:
            return i
        if present[i] and e > s:
            out[i] = group_hi | _hash_field(data, s, e)
        else:
            out[i] = group_hi
            present[i] = False
    return -1


@njit(cache=True, nogil=True)
def hash_ints(values, group_hi, out):
    """IDs of integer tokens (a Parquet int64 ID column): splitmix64's finaliser, 56 bits, never 0."""
    for i in range(values.shape[0]):
        h = np.uint64(values[i])
        h = (h ^ (h >> np.uint64(30))) * _SM_M1
        h = (h ^ (h >> np.uint64(27))) * _SM_M2
        h = (h ^ (h >> np.uint64(31))) & _HASH_MASK_U64
        if h == np.uint64(0):
            h = np.uint64(1)
        out[i] = group_hi | h


def hash_token(token: bytes | str, group: int) -> int:
    """The id the reader gives ``token`` in feature ``group`` (for tests/tools)."""
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if not raw:
        return group << GROUP_SHIFT
    h = _hash_field(np.frombuffer(raw, dtype=np.uint8), 0, len(raw))
    return (group << GROUP_SHIFT) | int(h)


def error_text(line: bytes, code: int, detail: int) -> str:
    """What is wrong with ``line`` (no newline), given a kernel's error code and detail."""
    fields = line.rstrip(b"\r").split(b"\t")
    if code == _E_FIELDS:
        return f"expected {NUM_FIELDS} tab-separated fields, got {detail}"
    if code == _E_LABEL:
        return f"label must be 0 or 1, got {fields[0][:20]!r}"
    if code == _E_INT:
        return f"column I{detail + 1} is not an integer: {fields[1 + detail][:20]!r}"
    if code == _E_NONFINITE:
        return (f"column I{detail + 1} is not finite: an integer of {len(fields[1 + detail].lstrip(b'+-'))} digits "
                f"is past float64's range (data.non_finite: skip to skip such rows)")
    return f"column C{detail + 1} contains a NUL or control byte"
