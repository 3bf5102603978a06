"""A BYTES tensor as one buffer and its elements' offsets, made without a Python object per element.

The Open Inference Protocol sends a BYTES tensor's raw contents as elements
each prefixed by its 4-byte little-endian length (gRPC's
`raw_input_contents`, REST's binary data). Splitting that into a list of
`bytes` and joining it again for the hashing kernel cost a Python loop
iteration per element: about half a millisecond for a 512-row request of
Criteo lines. Here one compiled pass checks the prefixes and packs the
elements; the decoders (`services/inference/inputs.py`) hash and parse
straight from the buffer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hybridrec.core.runtime.kernel_cache import njit

_OK, _E_PREFIX, _E_PAST_END = 0, 1, 2


class ByteElements:
    """Element i is `data[offsets[i]:offsets[i + 1]]`."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data = data  # uint8
        self.offsets = offsets  # int64, one more than the elements

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    def __getitem__(self, i: int) -> bytes:
        return self.data[self.offsets[i]:self.offsets[i + 1]].tobytes()

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @staticmethod
    def of(items: Sequence[bytes]) -> "ByteElements":
        """The elements of a list (typed contents, JSON strings)."""
        offsets = np.zeros(len(items) + 1, np.int64)
        if items:
            np.cumsum([len(v) for v in items], out=offsets[1:])
        return ByteElements(np.frombuffer(b"".join(items), np.uint8), offsets)

    @staticmethod
    def from_prefixed(raw: bytes, name: str) -> "ByteElements":
        """The elements of raw contents: each a 4-byte little-endian length, then that many bytes; ValueError
        naming input `name` where a prefix or an element runs past the end."""
        buf = np.frombuffer(raw, np.uint8)
        data = np.empty(buf.shape[0], np.uint8)
        offsets = np.empty(buf.shape[0] // 4 + 1, np.int64)
        count, code, detail = _split(buf, data, offsets)
        if code == _E_PREFIX:
            raise ValueError(f"input {name!r}: raw BYTES contents end inside an element's length prefix")
        if code == _E_PAST_END:
            raise ValueError(f"input {name!r}: a raw BYTES element of {detail} bytes runs past the end")
        return ByteElements(data[:offsets[count]], offsets[:count + 1])


@njit(cache=True, nogil=True)
def _split(buf, data, offsets):
    """Pack the length-prefixed elements of `buf` into `data`, their bounds into `offsets`: (count, error code,
    the length that ran past the end)."""
    pos, count, n = 0, 0, buf.shape[0]
    offsets[0] = 0
    while pos < n:
        if pos + 4 > n:
            return count, _E_PREFIX, 0
        length = (np.int64(buf[pos]) | (np.int64(buf[pos + 1]) << 8) | (np.int64(buf[pos + 2]) << 16)
                  | (np.int64(buf[pos + 3]) << 24))
        pos += 4
        if pos + length > n:
            return count, _E_PAST_END, length
        start = offsets[count]
        data[start:start + length] = buf[pos:pos + length]
        count += 1
        offsets[count] = start + length
        pos += length
    return count, _OK, 0
