"""Layouts that cross no network: what one process of an NN worker writes into a shared-memory slot for the
other (services/nn_worker/receiver/link.py moves the slots; this module says what is in them).

Frames that cross a network are `hybridrec.core.wire.frames`'s: every decoder there treats its input as untrusted. A
slot is written by a sibling process that checked its input already, so its layout is made for the reader's
speed — a table of int64s and aligned arrays, no names, no JSON — and its decoder checks only that every
array lies within the buffer with the dtype and rank its role allows.

One layout lives here, `CheckedEmbeddings`: a lookup's answer as the receiver process checked it for its
trainer (`training.receiver`). The other things a slot carries are frames: a data loader's dense batch or end
of phase as it came, the trainer's `Gradients`, a forwarded call's request.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from hybridrec.core.wire import codec
from hybridrec.core.wire.codec import FrameError
from hybridrec.core.wire.compress import Fp16Rows
from hybridrec.core.wire.frames import EmbeddingArrays

MAGIC = int.from_bytes(b"HRCHECK1", "little")
HEAD = struct.Struct("<qqq")  # magic, batch_size, arrays
ENTRY = 6  # int64s per array: role, key (width or feature), dtype, offset, rows, columns
ROLES = ("positions", "bag lengths", "rows", "norms", "first elements", "first rows", "sequence rows",
         "sequence lengths")  # for errors
POS, LENGTHS, ROWS, NORM, START, BASE, SEQ, SEQ_LENGTHS = range(len(ROLES))
DTYPES = (np.dtype(np.uint16), np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.int64))
KINDS = (  # per role: the dtypes (indices in DTYPES) it may have, and whether it is 2-D
    ((0,), False), ((0,), True), ((1, 2), True), ((2,), False), ((3,), False), ((3,), False), ((3,), True),
    ((3,), False))
MAX_ARRAYS = 4096
_TABLES: dict[int, struct.Struct] = {}


@dataclass
class CheckedEmbeddings:
    """A batch's `Embeddings` frame as an NN worker's receiver process checked it (`Pooler.check`) for its
    trainer: the frame's arrays as the embedding worker sent them (`EmbeddingArrays`: positions, bag lengths,
    rows fp16 with their norms or float32), beside what pooling derives from its bag structure
    (`hybridrec.core.model.pooling.BatchEmbeddings`: each feature's first element and first row, the sequences' padded
    rows), computed in the receiver, so that the trainer's event loop only makes views.

    Laid out as a table of int64s (magic, batch size, how many arrays, then per array its role, key, dtype,
    offset, rows and columns) and the arrays after it, each 64-byte aligned."""

    arrays: EmbeddingArrays
    batch_size: int
    start: np.ndarray  # int64 (features + 1,): each feature's first element
    base: np.ndarray  # int64 (features,): each feature's first row within its width's rows
    sequences: dict[int, tuple[np.ndarray, np.ndarray]]  # feature -> (int64 (batch, max_len), int64 (batch,))

    def _entries(self) -> list[tuple[int, int, np.ndarray]]:
        """(role, key, array) of every array, in the order they are laid out."""
        a = self.arrays
        entries = [(POS, 0, a.pos), (LENGTHS, 0, a.lengths)]
        for dim, rows in a.rows.items():
            entries.append((ROWS, dim, rows))
            if dim in a.norms:
                entries.append((NORM, dim, a.norms[dim]))
        entries += [(START, 0, self.start), (BASE, 0, self.base)]
        for feature, (index, lengths) in self.sequences.items():
            entries += [(SEQ, feature, index), (SEQ_LENGTHS, feature, lengths)]
        return entries

    def encode_into(self, allocate: Callable[[int], memoryview]) -> int:
        """The layout, written into the buffer `allocate(nbytes)` returns (the trainer's slot); its length.
        Each array is copied once, as it came."""
        entries = self._entries()
        offset = codec.align(HEAD.size + 8 * ENTRY * len(entries))
        table = [MAGIC, self.batch_size, len(entries)]
        for role, key, array in entries:
            code = next(i for i, dtype in enumerate(DTYPES) if dtype == array.dtype)
            table += [role, key, code, offset, array.shape[0], array.shape[1] if array.ndim == 2 else 0]
            offset += codec.align(array.nbytes)
        out = np.frombuffer(allocate(offset), np.uint8)
        head = np.array(table, np.int64).view(np.uint8)
        out[:head.size] = head
        for (_, _, array), at in zip(entries, table[3 + 3::ENTRY]):
            out[at:at + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return offset

    @classmethod
    def decode(cls, buf: bytes | memoryview, sequences: Iterable[int]) -> "CheckedEmbeddings":
        """`sequences`: the indices of the job's sequence features (each must be there)."""
        size = len(buf) if isinstance(buf, bytes) else memoryview(buf).nbytes
        if size < HEAD.size:
            raise FrameError(f"checked embeddings of {size} bytes are shorter than their head")
        magic, batch_size, count = HEAD.unpack_from(buf)
        if magic != MAGIC or not 0 < count <= MAX_ARRAYS:
            raise FrameError(f"not checked embeddings (magic {magic:#x}, {count} arrays)")
        head = HEAD.size + 8 * ENTRY * count
        if head > size:
            raise FrameError(f"checked embeddings' table of {count} arrays overruns their {size} bytes")
        table_struct = _TABLES.get(count) or _TABLES.setdefault(count, struct.Struct(f"<{ENTRY * count}q"))
        table = table_struct.unpack_from(buf, HEAD.size)
        found: dict[tuple[int, int], np.ndarray] = {}
        rows: dict[int, np.ndarray] = {}
        norms: dict[int, np.ndarray] = {}
        for i in range(0, len(table), ENTRY):
            role, key, code, offset, count_rows, columns = table[i:i + ENTRY]
            if not (0 <= role <= SEQ_LENGTHS and 0 <= code < len(DTYPES)):
                raise FrameError(f"checked embeddings: array {i // ENTRY} has role {role}, dtype {code}")
            codes, two_d = KINDS[role]
            dtype = DTYPES[code]
            elements = count_rows * columns if two_d else count_rows
            if (code not in codes or count_rows < 0 or columns < 0 or offset < head or offset % codec.ALIGN
                    or offset + elements * dtype.itemsize > size):
                raise FrameError(f"checked embeddings: {ROLES[role]} array ({dtype}, {count_rows} x {columns} "
                                 f"at {offset}) is not one within their {size} bytes")
            array = np.frombuffer(buf, dtype, elements, offset)
            if two_d:
                array = array.reshape(count_rows, columns)
            if role == ROWS:
                rows[key] = array
            elif role == NORM:
                norms[key] = array
            else:
                found[role, key] = array
        try:
            seqs = {f: (found[SEQ, f], found[SEQ_LENGTHS, f]) for f in sequences}
            arrays = EmbeddingArrays(found[POS, 0], found[LENGTHS, 0], rows, norms)
            return cls(arrays, batch_size, found[START, 0], found[BASE, 0], seqs)
        except KeyError as exc:
            raise FrameError(f"checked embeddings lack their {ROLES[exc.args[0][0]]} array") from None

    def bags(self, dims: Iterable[int], kappa: float) -> tuple[dict[int, "np.ndarray | Fp16Rows"], np.ndarray,
                                                               np.ndarray]:
        """(rows per width, positions, lengths): views of the arrays, not checked again."""
        a = self.arrays
        rows: dict[int, np.ndarray | Fp16Rows] = {}
        for dim in dims:
            if dim not in a.rows:
                raise FrameError(f"checked embeddings lack their rows of width {dim}")
            values = a.rows[dim]
            if values.dtype != np.float16:
                rows[dim] = values
            elif dim in a.norms:
                rows[dim] = Fp16Rows(values, a.norms[dim], kappa)
            else:
                raise FrameError(f"checked embeddings lack the norms of their fp16 rows of width {dim}")
        return rows, a.pos, a.lengths

