"""Every data-plane frame: round trip through its encoder and decoder, and rejection of malformed input."""
from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hybridrec.core.wire import codec, frames
from hybridrec.core.wire.codec import FrameError
from hybridrec.core.wire.compress import ValueCodec
from hybridrec.core.wire.jagged import KeyedBags
from hybridrec.core.wire.frames import (Applied, BatchRef, Consumed, DenseBatch, Embeddings, EndOfPhase,
                              Gradients, PSLookup, PSRows, PSUpdate, Received, ShardPull, ShardRows, SparseBatch,
                              decode_nn_batch, make_batch_ref, update_id)

REPO = Path(__file__).resolve().parents[2]
VALUES = ValueCodec(fp16=True, kappa=1024.0)
WIDTHS = [8, 8, 4]  # three features, two widths


def embeddings(batch: int = 5) -> Embeddings:
    """Three features of two widths, one ID a sample each."""
    rng = np.random.default_rng(0)
    counts = np.array([3, 2, 4], np.int32)
    lengths = np.ones((3, batch), np.uint16)
    pos = np.concatenate([rng.integers(0, c, batch) for c in counts]).astype(np.uint16)
    rows = {8: rng.standard_normal((5, 8)).astype(np.float32), 4: rng.standard_normal((4, 4)).astype(np.float32)}
    return Embeddings(KeyedBags(pos, lengths), counts, rows)


# (valid frame bytes, decoder) for every kind; the decoders take their receiver-side context.
def _cases() -> dict[str, tuple[bytes, callable]]:
    ids = np.arange(1, 11, dtype=np.uint64)
    cols = np.stack([ids, ids[::-1]], axis=1)
    emb = embeddings()
    return {
        "SparseBatch": (SparseBatch.from_columns(cols, np.ones_like(cols, bool), phase="train").encode(),
                        lambda b: SparseBatch.decode(b, 2)),
        "BatchRef": (BatchRef(7 << 56 | 3).encode(), BatchRef.decode),
        "DenseBatch": (DenseBatch(5, np.ones((4, 3), np.float32), np.zeros(4, np.float32), "train", 2, (0, 1, 2, 3))
                       .encode(), lambda b: decode_nn_batch(b, 3)),
        "EndOfPhase": (EndOfPhase("eval", {"rows": 10}).encode(), lambda b: decode_nn_batch(b, 3)),
        "Embeddings": (emb.encode(VALUES), lambda b: Embeddings.decode(b, VALUES, WIDTHS, 5)),
        "Gradients": (Gradients(9, {8: np.ones((5, 8), np.float32), 4: np.ones((4, 4), np.float32)}).encode(VALUES),
                      lambda b: Gradients.decode(b, VALUES, lambda ref: {8: 5, 4: 4})),
        "Applied": (Applied(12).encode(), Applied.decode),
        "Consumed": (Consumed("eval", 41).encode(), Consumed.decode),
        "Received": (Received({"train": 9, "eval": -1}, frozenset({"train"}), [(7, (0, 0, 4096, 12), 300),
                                                                             (9, (1, 0, 0, 1), 400)],
                              past_training=True).encode(),
                     Received.decode),
        "PSLookup": (PSLookup({8: ids, 4: ids[:3]}, train=True).encode(), lambda b: PSLookup.decode(b, [4, 8])),
        "PSRows": (PSRows({8: np.ones((10, 8), np.float32)}).encode(VALUES),
                   lambda b: PSRows.decode(b, VALUES, {8: 10})),
        "PSUpdate": (PSUpdate({8: ids}, {8: np.ones((10, 8), np.float32)}, update_id(7 << 56 | 3, 99)).encode(VALUES),
                     lambda b: PSUpdate.decode(b, VALUES, [8])),
        "ShardRows": (ShardRows(1, (1 << 64) - 3, 42, {8: (ids, np.ones((10, 16), np.float32))}, update_id=77, page=2,
                                pages=3, uids=ids[:4], copy_id=(1 << 63) - 1).encode(),
                      lambda b: ShardRows.decode(b, {8: 16, 4: 5})),
        "ShardPull": (ShardPull(1, "backup", 2, life=(1 << 64) - 3, job="run-7", copy_id=5).encode(), ShardPull.decode),
    }


def test_every_frame_kind_has_a_case():
    assert set(_cases()) == {cls.__name__ for cls in frames.FRAMES}


def test_round_trips():
    cases = _cases()
    sb = cases["SparseBatch"][1](cases["SparseBatch"][0])
    assert sb.batch_size == 10 and sb.phase == "train"
    np.testing.assert_array_equal(sb.ids(1).values, np.arange(10, 0, -1, dtype=np.uint64))
    assert cases["BatchRef"][1](cases["BatchRef"][0]).batch_ref == 7 << 56 | 3
    db = cases["DenseBatch"][1](cases["DenseBatch"][0])
    assert isinstance(db, DenseBatch) and db.dense.shape == (4, 3) and db.seq == 2 and db.position == (0, 1, 2, 3)
    end = cases["EndOfPhase"][1](cases["EndOfPhase"][0])
    assert isinstance(end, EndOfPhase) and end.phase == "eval" and end.meta == {"rows": 10}
    emb, sent = cases["Embeddings"][1](cases["Embeddings"][0]), embeddings()
    np.testing.assert_array_equal(emb.bags.values, sent.bags.values)
    for dim in (4, 8):  # κ-scaled fp16: about 11 bits of relative precision per vector
        np.testing.assert_allclose(emb.rows[dim], sent.rows[dim], rtol=0, atol=4e-3 * np.abs(sent.rows[dim]).max())
    grads = cases["Gradients"][1](cases["Gradients"][0])
    assert grads.batch_ref == 9 and grads.grads[4].shape == (4, 4)
    assert cases["Applied"][1](cases["Applied"][0]).applied == 12
    assert cases["Consumed"][1](cases["Consumed"][0]) == Consumed("eval", 41)
    received = cases["Received"][1](cases["Received"][0])
    assert received.through == {"train": 9, "eval": -1} and received.ended == {"train"}
    assert received.marks == [(7, (0, 0, 4096, 12), 300), (9, (1, 0, 0, 1), 400)] and received.past_training
    assert Received.decode(Received().encode()) == Received()
    lookup = cases["PSLookup"][1](cases["PSLookup"][0])
    assert lookup.train and sorted(lookup.ids) == [4, 8] and lookup.ids[4].tolist() == [1, 2, 3]
    assert cases["PSRows"][1](cases["PSRows"][0]).rows[8].shape == (10, 8)
    update = cases["PSUpdate"][1](cases["PSUpdate"][0])
    np.testing.assert_allclose(update.grads[8], 1.0, rtol=1e-3)
    assert update.update_id == update_id(7 << 56 | 3, 99)
    assert Gradients.batch_ref_of(cases["Gradients"][0]) == 9


def test_float32_values_when_fp16_is_off():
    plain = ValueCodec(fp16=False)
    rows = np.random.default_rng(1).standard_normal((10, 8)).astype(np.float32)
    back = PSRows.decode(PSRows({8: rows}).encode(plain), plain, {8: 10})
    np.testing.assert_array_equal(back.rows[8], rows)


def assert_truncations_refused(raw: bytes, decode) -> None:
    """Every prefix of `raw` (40 of them) is refused with ValueError."""
    for cut in range(0, len(raw), max(1, len(raw) // 40)):
        with pytest.raises(ValueError):
            decode(raw[:cut])


def assert_mutations_decode_or_refuse(raw: bytes, decode, seed) -> None:
    """2,000 random mutations of `raw`: `decode` either returns or raises ValueError, nothing else."""
    rng = random.Random(seed)
    for _ in range(2000):
        buf = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        try:
            decode(bytes(buf))
        except ValueError:
            pass


@pytest.mark.parametrize("kind", sorted(_cases()))
def test_truncated_frames_are_refused(kind):
    assert_truncations_refused(*_cases()[kind])


@pytest.mark.parametrize("kind", sorted(_cases()))
def test_mutated_frames_decode_or_raise_value_error(kind):
    """A decoder either returns a frame or raises ValueError, nothing else."""
    assert_mutations_decode_or_refuse(*_cases()[kind], seed=kind)


def test_oversized_frame_is_refused():
    with pytest.raises(FrameError, match="exceeds"):
        codec.decode(b"\0" * 64, max_bytes=32)


def test_inconsistent_frames_are_refused():
    ids = np.arange(1, 11, dtype=np.uint64)
    # wrong dtype: IDs as int64
    with pytest.raises(FrameError, match="dtype"):
        PSLookup.decode(codec.encode({"ids.8": ids.astype(np.int64)}), [8])
    # a width the receiver does not keep
    with pytest.raises(FrameError, match="width"):
        PSLookup.decode(PSLookup({16: ids}).encode(), [8])
    # gradients for fewer rows than IDs, and duplicate IDs in an update
    with pytest.raises(FrameError, match="shape"):
        PSUpdate.decode(PSUpdate({8: ids}, {8: np.ones((9, 8), np.float32)}, 1).encode(VALUES), VALUES, [8])
    with pytest.raises(FrameError, match="unique"):
        PSUpdate.decode(PSUpdate({8: np.ones(3, np.uint64)}, {8: np.ones((3, 8), np.float32)}, 1).encode(VALUES),
                        VALUES, [8])
    # an update without its id, or with one that is no non-zero uint64
    for bad in (0, -1, 1 << 64, True, "7", None):
        with pytest.raises(FrameError, match="update_id"):
            PSUpdate.decode(PSUpdate({8: ids}, {8: np.ones((10, 8), np.float32)}, bad).encode(VALUES), VALUES, [8])
    # a batch_ref that is no uint64
    with pytest.raises(FrameError, match="batch_ref"):
        Gradients.batch_ref_of(Gradients(1 << 64, {}).encode(VALUES))
    with pytest.raises(FrameError, match="batch_ref"):
        BatchRef.decode(BatchRef(-1).encode())
    # an embedding frame whose positions point past its feature's rows
    emb = embeddings()
    emb.bags.values[0] = 3
    with pytest.raises(FrameError, match="position"):
        Embeddings.decode(emb.encode(VALUES), VALUES, WIDTHS, 5)
    # rows missing for a width
    emb = embeddings()
    emb.rows = {8: emb.rows[8]}
    with pytest.raises(FrameError, match="rows"):
        Embeddings.decode(emb.encode(VALUES), VALUES, WIDTHS, 5)
    # a batch of another size than the dense half says
    with pytest.raises(FrameError, match="features of a batch"):
        Embeddings.decode(embeddings().encode(VALUES), VALUES, WIDTHS, 6)
    # gradients of the wrong row count for the batch
    with pytest.raises(FrameError, match="shape"):
        Gradients.decode(Gradients(1, {8: np.ones((4, 8), np.float32), 4: np.ones((4, 4), np.float32)})
                         .encode(VALUES), VALUES, lambda ref: {8: 5, 4: 4})
    # a dense batch of other widths, tasks, length or loader; a codec frame that is no end of phase; a bad end
    batch = DenseBatch(1, np.ones((4, 3), np.float32), np.ones(4, np.float32), loader=1).encode()
    with pytest.raises(FrameError, match="do not form a batch with 5 dense features"):
        decode_nn_batch(batch, 5, loaders=2)
    with pytest.raises(FrameError, match=r"labels of 1 column\(s\), not the job's 2"):
        decode_nn_batch(batch, 3, label_columns=2, loaders=2)
    with pytest.raises(FrameError, match="takes 128 bytes, not 124"):
        decode_nn_batch(batch[:-4], 3, loaders=2)
    with pytest.raises(FrameError, match="loader 1 is not one of the 1 data loaders"):
        decode_nn_batch(batch, 3)
    with pytest.raises(FrameError, match="neither"):
        decode_nn_batch(codec.encode({"dense": np.ones((4, 3), np.float32), "labels": np.ones(4, np.float32)},
                                     {"batch_ref": 1}), 3)
    with pytest.raises(ValueError, match="phase"):
        DenseBatch(1, np.ones((2, 3), np.float32), np.ones(2, np.float32), "test").encode()
    with pytest.raises(FrameError, match="end_of"):
        decode_nn_batch(codec.encode(meta={"end_of": "later"}), 3)


def test_update_ids_are_stable_distinct_and_never_zero():
    """One batch's update id is the same in every re-send; a worker's batches never share one; 0 (the PS's
    empty slot) never occurs, even for the batch_ref that equals the nonce but for its top byte."""
    nonce = (3 ^ 0xFF) << 56 | 0x1234_5678_9ABC  # a worker of replica 3 draws its nonce so
    refs = [make_batch_ref(3, 77, seq) for seq in range(100_000)]
    ids = [update_id(ref, nonce) for ref in refs]
    assert ids == [update_id(ref, nonce) for ref in refs]
    assert len(set(ids)) == len(ids) and 0 not in ids and all(0 < i < 1 << 64 for i in ids)
    assert update_id(nonce & ((1 << 56) - 1) | 3 << 56, nonce) != 0
    other = (4 ^ 0xFF) << 56 | 0x9E37_79B9_7F4A  # worker 4's nonce: its ids are apart from worker 3's
    assert not set(ids) & {update_id(make_batch_ref(4, 77, seq), other) for seq in range(100_000)}


def test_no_frame_key_is_spelled_outside_the_frames_module():
    """The tensor and meta keys of data-plane frames appear only in hybridrec/core/wire/frames.py (prepared data's
    `ids.npy` is a file name, not a key)."""
    keys = r"""["'](ids|rows|grads?)\.(?!npy)|f["'](ids|rows|grads?)\.\{|["'](batch_ref|end_of|counts|lengths|update_id)["']"""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    offenders = []
    for path in tracked:
        if path in ("hybridrec/core/wire/frames.py", "tests/unit/test_frames.py") or not (REPO / path).exists():
            continue
        for n, line in enumerate((REPO / path).read_text().splitlines(), 1):
            if re.search(keys, line):
                offenders.append(f"{path}:{n}: {line.strip()}")
    assert not offenders, "frame keys outside hybridrec/core/wire/frames.py:\n" + "\n".join(offenders)


def test_proto_comments_name_existing_frames():
    """Each data-plane RPC in the proto names the frames-module classes of its request and reply."""
    proto = (REPO / "protos" / "hybridrec.proto").read_text()
    names = {cls.__name__ for cls in frames.FRAMES}
    for match in re.finditer(r"rpc (\w+)\(Frame\) returns \(Frame\)", proto):
        above = proto[:match.start()].rstrip(" ").splitlines()
        comment_lines = []
        while above and above[-1].strip().startswith("//"):
            comment_lines.append(above.pop())
        comment = "\n".join(comment_lines)
        mentioned = set(re.findall(r"frames\.(\w+)", comment))
        assert mentioned and mentioned <= names, f"rpc {match.group(1)}: comment names {mentioned}"


def test_architecture_doc_describes_every_frame():
    """docs/architecture.md's frame table has one row per frame kind of hybridrec/core/wire/frames.py."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    rows = set(re.findall(r"^\| (\w+) \|", doc, flags=re.M))
    assert {cls.__name__ for cls in frames.FRAMES} <= rows, rows


def test_shard_rows_and_pulls_round_trip_and_refuse_what_does_not_fit():
    cases = _cases()
    rows = cases["ShardRows"][1](cases["ShardRows"][0])
    assert (rows.shard, rows.life, rows.seq, rows.update_id, rows.page, rows.pages) == (1, (1 << 64) - 3, 42, 77, 2, 3)
    np.testing.assert_array_equal(rows.rows[8][0], np.arange(1, 11, dtype=np.uint64))
    assert rows.rows[8][1].shape == (10, 16) and rows.uids.tolist() == [1, 2, 3, 4]
    pull = cases["ShardPull"][1](cases["ShardPull"][0])
    assert (pull.shard, pull.copy, pull.page, pull.life, pull.job) == (1, "backup", 2, (1 << 64) - 3, "run-7")
    ids = np.arange(1, 4, dtype=np.uint64)
    with pytest.raises(FrameError, match=r"values\.8 has shape"):  # a row without its optimizer state
        ShardRows.decode(ShardRows(0, 1, 1, {8: (ids, np.ones((3, 8), np.float32))}).encode(), {8: 16})
    with pytest.raises(FrameError, match="no embedding table of width"):  # a width this PS does not keep
        ShardRows.decode(ShardRows(0, 1, 1, {4: (ids, np.ones((3, 5), np.float32))}).encode(), {8: 16})
    with pytest.raises(FrameError, match="page"):
        ShardRows.decode(ShardRows(0, 1, 1, {}, page=3, pages=3).encode(), {8: 16})
    with pytest.raises(FrameError, match="copy must be one of"):
        ShardPull.decode(ShardPull(0, "primary").encode().replace(b'"primary"', b'"mirror!"'))
    with pytest.raises(FrameError, match="shard"):
        ShardPull.decode(codec.encode(meta={"shard": -1, "copy": "primary"}))
    with pytest.raises(FrameError, match="job"):
        ShardPull.decode(codec.encode(meta={"shard": 0, "copy": "primary", "job": 7}))


@pytest.mark.parametrize("tasks", [1, 3])
def test_a_dense_batch_crosses_whole(tasks):
    """The fixed-layout frame (`DenseBatch.encode`): every field and both arrays as sent, uint64 batch_ref and
    position fields at their limits, a negative stream index (an eval batch's)."""
    rng = np.random.default_rng(tasks)
    rows = 1000
    batch = DenseBatch(batch_ref=(1 << 64) - 3, dense=rng.standard_normal((rows, 13), dtype=np.float32),
                       labels=rng.random((rows, tasks) if tasks > 1 else rows, dtype=np.float32), phase="eval",
                       seq=-1 if tasks == 1 else 41, position=(3, 0, (1 << 64) - 1, 17)[:tasks + 1],
                       rows_before=123456789, loader=2)
    got = decode_nn_batch(batch.encode(), 13, label_columns=tasks, loaders=3)
    assert (got.batch_ref, got.phase, got.seq, got.position, got.rows_before, got.loader) == (
        batch.batch_ref, batch.phase, batch.seq, batch.position, batch.rows_before, batch.loader)
    np.testing.assert_array_equal(got.dense, batch.dense)
    np.testing.assert_array_equal(got.labels, batch.labels)
    assert got.labels.shape == batch.labels.shape


def test_a_position_beyond_64_bits_is_refused():
    batch = DenseBatch(1, np.zeros((1, 1), np.float32), np.zeros(1, np.float32), position=(1 << 64,))
    with pytest.raises(ValueError, match="64 bits"):
        batch.encode()
