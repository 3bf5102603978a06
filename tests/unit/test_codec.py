"""Frame codec: round trip for every dtype, zero-copy decode, and rejection of malformed frames."""
import struct

import numpy as np
import pytest

from hybridrec.core.wire import codec
from hybridrec.core.wire.codec import DTYPES, FrameError
from tests.frame_bombs import bomb


@pytest.mark.parametrize("code", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(0,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 5)])
def test_round_trip_every_dtype(code, shape):
    dtype = DTYPES[code]
    rng = np.random.default_rng(code)
    arr = (rng.integers(0, 2, size=shape) if dtype.kind == "b" else rng.integers(-100, 100, size=shape)
           if dtype.kind == "i" else rng.integers(0, 200, size=shape) if dtype.kind == "u"
           else rng.standard_normal(size=shape)).astype(dtype)
    frame = codec.decode(codec.encode({"t": arr}, {"k": 1}))
    out = frame.tensors["t"]
    assert out.dtype == dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)
    assert frame.meta == {"k": 1}


def test_buffers_are_aligned_and_decode_without_copy():
    a = np.arange(1000, dtype=np.float32)
    b = np.arange(3, dtype=np.uint8)
    raw = codec.encode({"b": b, "a": a})
    frame = codec.decode(raw)
    for arr in frame.tensors.values():
        assert arr.base is not None and not arr.flags.owndata  # a view of the received bytes
        offset = arr.__array_interface__["data"][0] - np.frombuffer(raw, np.uint8).__array_interface__["data"][0]
        assert offset % codec.ALIGN == 0


def test_lz4_compressed_round_trip_is_smaller():
    ids = np.repeat(np.arange(10, dtype=np.uint16), 1000)
    raw = codec.encode({"p": ids}, compress={"p"})
    assert len(raw) < ids.nbytes / 10
    np.testing.assert_array_equal(codec.decode(raw, lz4={"p"}, lz4_bytes=ids.nbytes).tensors["p"], ids)


def test_a_frame_whose_entries_share_one_compressed_block_is_refused_before_decompressing():
    frame = bomb([f"p{i}" for i in range(16)], 256 << 20)
    assert len(frame) == 1_053_338  # the finding's frame, byte for byte in size
    with pytest.raises(codec.FrameError, match="'p0' and 'p1' share bytes of the frame"):
        codec.decode(frame, lz4={f"p{i}" for i in range(16)}, lz4_bytes=1 << 40)
    one = bomb(["p0"], 256 << 20)
    with pytest.raises(codec.FrameError, match="'p0' is lz4-compressed, which this frame's kind does not do"):
        codec.decode(one)  # the default: no tensor may be compressed
    with pytest.raises(codec.FrameError, match=r"decompress to 268435456 bytes, past this request's budget of 1000"):
        codec.decode(one, lz4={"p0"}, lz4_bytes=1000)


def test_repeated_names_are_refused():
    frame = bytearray(codec.encode({"ab": np.zeros(2, np.uint8), "cd": np.zeros(2, np.uint8)}))
    at = bytes(frame).index(b"cd")
    frame[at:at + 2] = b"ab"
    with pytest.raises(codec.FrameError, match=r"tensor names repeat: \['ab'\]"):
        codec.decode(bytes(frame))


def test_non_contiguous_and_big_endian_inputs():
    a = np.arange(20, dtype=">i8").reshape(4, 5)[:, ::2]
    out = codec.decode(codec.encode({"a": a})).tensors["a"]
    np.testing.assert_array_equal(out, a)


def test_unsupported_dtype_rejected_on_encode():
    with pytest.raises(ValueError, match="not supported"):
        codec.encode({"c": np.zeros(2, np.complex64)})


def _good():
    return codec.encode({"x": np.arange(16, dtype=np.float32), "i": np.arange(4, dtype=np.uint64)}, {"m": 2})


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:10], "shorter than its fixed header"),
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:4] + bytes([9]) + b[5:], "unsupported frame version"),
    (lambda b: b[:-8], "outside"),
])
def test_malformed_frames_raise_frame_error(mutate, message):
    with pytest.raises(FrameError, match=message):
        codec.decode(mutate(_good()))


def test_lying_shape_and_unknown_dtype():
    raw = bytearray(_good())
    fixed = struct.calcsize("<4sBBHII")
    entry = struct.Struct("<BBBBQQQ")
    name_len, dtype, cdc, ndim, off, stored, rawn = entry.unpack_from(raw, fixed)
    bad = bytearray(raw)
    entry.pack_into(bad, fixed, name_len, 99, cdc, ndim, off, stored, rawn)
    with pytest.raises(FrameError, match="unknown dtype"):
        codec.decode(bytes(bad))
    bad = bytearray(raw)
    struct.pack_into("<Q", bad, fixed + entry.size + name_len, 1 << 40)  # shape[0] lies
    with pytest.raises(FrameError, match="needs"):
        codec.decode(bytes(bad))


def test_oversized_frame_rejected():
    with pytest.raises(FrameError, match="exceeds"):
        codec.decode(_good(), max_bytes=64)


def test_frame_get_checks_dtype_and_rank():
    frame = codec.decode(_good())
    with pytest.raises(FrameError, match="dtype"):
        frame.get("x", np.float16)
    with pytest.raises(FrameError, match="dimensions"):
        frame.get("x", np.float32, 2)
    with pytest.raises(FrameError, match="no tensor"):
        frame.get("missing")
    with pytest.raises(FrameError, match="integer"):
        frame.meta_int("nope")


@pytest.mark.parametrize("meta, why", [
    (b"[" * 30_000 + b"]" * 30_000, "nested thousands deep"),
    (b'{"a": ' + b"9" * 5000 + b"}", "an integer of 5,000 digits"),
])
def test_meta_that_python_cannot_parse_is_a_frame_error(meta, why):
    """On 3b8ae06 these escaped as RecursionError and ValueError (answered INTERNAL)."""
    frame = struct.pack("<4sBBHII", codec.MAGIC, codec.VERSION, 0, 0, 0, len(meta)) + meta
    with pytest.raises(FrameError, match="frame meta is not valid JSON"):
        codec.decode(frame, max_bytes=1 << 30)
