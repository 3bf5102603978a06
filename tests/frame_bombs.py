"""Frames that ask their receiver to allocate far more than they weigh (tests of hybridrec/core/wire/codec.py and of the
live services): table entries that all point at one lz4 block of zeros."""
from __future__ import annotations

import struct

import lz4.block
import numpy as np

from hybridrec.core.wire import codec

_FIXED = struct.Struct("<4sBBHII")
_ENTRY = struct.Struct("<BBBBQQQ")


def bomb(names: list[str], raw: int) -> bytes:
    """A frame whose tensors `names` (uint8, `raw` bytes each) all point at one lz4 block of `raw` zeros: with
    16 names and 256 MiB, 1,053,338 bytes on the wire asking for 4 GiB (3b8ae06's finding)."""
    block = lz4.block.compress(np.zeros(raw, np.uint8), store_size=False)

    def table(offset: int) -> bytes:
        return b"".join(_ENTRY.pack(len(n.encode()), 10, codec.CODEC_LZ4, 1, offset, len(block), raw) + n.encode()
                        + struct.pack("<Q", raw) for n in names)

    offset = codec.align(_FIXED.size + len(table(0)))
    head = _FIXED.pack(codec.MAGIC, codec.VERSION, 0, len(names), len(table(0)), 0) + table(offset)
    return head + b"\0" * (offset - len(head)) + block
