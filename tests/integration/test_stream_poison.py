"""A stream of good events with poison messages of every kind between them, through a real nats-server
(services/dataloader/stream.py): an IPC body that does not parse, string offsets past their buffer, a compressed
body that expands past the memory bound, a column missing, a column of the wrong type — and messages that must
train though a loader of 3b8ae06 died on them: uint64 IDs of 2**63 and more, integer labels, NaN dense values
under `data.non_finite: skip`. Every good event is trained once, every bad message is counted, acknowledged and
copied to the dead-letter subject with its reason, every NaN row counted, and the data loader never restarts.

HYBRIDREC_POISON_EVENTS sets the good events (100,000 by default, the issue's figure)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrec.core.layouts.event_stream import ARROW, DEAD_REASON, DEAD_SEQ, encode_arrow, headers
from tests.integration.test_stream import (MULTITASK, STREAM, SUBJECT, _consumer, _events_read,  # noqa: F401
                                           _multitask_config, _run, broker, nats_server)

pytestmark = pytest.mark.integration

GOOD = int(os.environ.get("HYBRIDREC_POISON_EVENTS", "100000"))
ROWS = 100  # a message's rows
EVERY = 25  # good messages between two special ones
POISON = ("not IPC", "offsets past the buffer", "decompression bomb", "a column missing", "a column of the wrong type")
MUST_TRAIN = ("uint64 IDs", "integer labels", "NaN dense values")
NAN_ROWS = 10  # of a NaN message's rows


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> Path:
    from hybridrec.app.data.synth_parquet import synthesize_multitask

    out = tmp_path_factory.mktemp("poison")
    synthesize_multitask(out, rows=GOOD, eval_rows=5_000, seed=8)
    return out


def _special(kind: str, table: pa.Table) -> bytes:
    """A message of `kind` made from 100 good rows."""
    if kind == "not IPC":
        return b"\xff\xff\xff\xff\x10\x00\x00\x00" + b"not an arrow stream" * 5
    if kind == "offsets past the buffer":  # pyarrow refuses to build one: a good message, its bytes changed
        items = pa.array([f"i{i:04d}" for i in range(ROWS)])  # offsets 0, 5, 10, ...: found in the body
        payload = bytearray(encode_arrow(table.set_column(table.schema.get_field_index("item_id"), "item_id", items)))
        offsets = np.arange(0, 5 * ROWS + 1, 5, dtype=np.int32)
        at = bytes(payload).index(offsets.tobytes())
        offsets[40:] += 1 << 20  # an interior offset a megabyte past the data
        payload[at:at + offsets.nbytes] = offsets.tobytes()
        return bytes(payload)
    if kind == "decompression bomb":  # 10M zeros: 80 MB decoded, a few hundred kB on the wire
        pad = pa.table({"pad": pa.array(np.zeros(10_000_000, np.int64))})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, pad.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as writer:
            writer.write_table(pad)
        return sink.getvalue().to_pybytes()
    if kind == "a column missing":
        return encode_arrow(table.drop_columns(["tags"]))
    if kind == "a column of the wrong type":
        return encode_arrow(table.set_column(table.schema.get_field_index("d0"), "d0",
                                             pa.array([str(v) for v in table.column("d0").to_pylist()])))
    if kind == "uint64 IDs":
        column = table.column("user_id")
        users = column.fill_null(0).to_numpy().view(np.uint64) | np.uint64(1 << 63)
        mask = column.is_null().to_numpy(zero_copy_only=False)
        return encode_arrow(table.set_column(table.schema.get_field_index("user_id"), "user_id",
                                             pa.array(users, pa.uint64(), mask=mask)))
    if kind == "integer labels":
        for name in ("click", "conversion"):
            table = table.set_column(table.schema.get_field_index(name), name, pa.compute.cast(table.column(name),
                                                                                                pa.int64()))
        return encode_arrow(table)
    assert kind == "NaN dense values"
    d1 = table.column("d1").to_numpy().astype(np.float64)
    d1[::ROWS // NAN_ROWS] = np.nan
    return encode_arrow(table.set_column(table.schema.get_field_index("d1"), "d1", pa.array(d1)))


def _publish(url: str, source: Path) -> dict:
    """Publish the good rows, ROWS a message, with a special message after every EVERY good ones (the kinds in
    turn); every message's events numbered on. Returns what was published: event ranges by kind, and the stream
    sequence of each poison message."""
    from hybridrec.app.run.broker import create_stream
    from hybridrec.app.data.replay import _arrow_messages
    from hybridrec.core.config import StreamConfig, load_config
    from services.dataloader.parquet import ParquetSpec

    spec = ParquetSpec.from_config(load_config(MULTITASK, [f"data.train=[{source}]"]))
    table = pq.read_table(source, columns=spec.columns)
    kinds = POISON + MUST_TRAIN
    published = {"good": [], "poison": [], "must_train": {kind: [] for kind in MUST_TRAIN}, "events": 0}

    async def run():
        import nats

        await create_stream(url, StreamConfig())
        nc = await nats.connect(url)
        js = nc.jetstream()
        event = special = 0
        for m, (payload, count) in enumerate(_arrow_messages((source,), tuple(spec.columns), ROWS, None)):
            ack = await js.publish(SUBJECT, payload, headers=headers(event, 1.0, ARROW))
            published["good"].append((event, count))
            event += count
            if (m + 1) % EVERY == 0:
                kind = kinds[special % len(kinds)]
                special += 1
                chunk = table.slice(m * ROWS, ROWS)
                ack = await js.publish(SUBJECT, _special(kind, chunk), headers=headers(event, 1.0, ARROW))
                if kind in POISON:
                    published["poison"].append(ack.seq)
                else:
                    published["must_train"][kind].append((event, ROWS))
                event += ROWS
        published["events"] = event
        published["last_seq"] = ack.seq
        await nc.close()

    asyncio.run(run())
    return published


def _dead_letters(url: str) -> list[tuple[int, str]]:
    """(the message's stream sequence, the reason) of every copy on the dead-letter subject."""
    async def ask():
        import nats

        nc = await nats.connect(url)
        js = nc.jetstream()
        name = await js.find_stream_name_by_subject(f"{SUBJECT}.dead")
        state = (await js.stream_info(name)).state
        out = []
        for seq in range(state.first_seq, state.last_seq + 1):
            msg = await js.get_msg(name, seq)
            out.append((int(msg.headers[DEAD_SEQ]), msg.headers[DEAD_REASON]))
        await nc.close()
        return out

    return asyncio.run(ask())


def test_poison_messages_are_counted_acknowledged_and_dead_lettered_and_every_good_event_trains_once(
        tmp_path, events, broker):
    published = _publish(broker, events / "train.parquet")
    poison = published["poison"]
    assert len(poison) >= len(POISON)
    config = _multitask_config(tmp_path, events, broker, until=published["events"], non_finite="skip")
    result = _run(config, tmp_path / "run")

    nan_messages = len(published["must_train"]["NaN dense values"])
    must_train = sum(n for runs in published["must_train"].values() for _, n in runs)
    assert result["samples"] == GOOD + must_train - NAN_ROWS * nan_messages, result["samples"]
    train = result["data"]["train"]
    assert train["bad_messages"] == len(poison) and train["non_finite_rows"] == NAN_ROWS * nan_messages, train
    assert train["non_finite_by_file"] == {SUBJECT: NAN_ROWS * nan_messages}
    stream = result["stream"]
    assert stream["skipped_messages"] == len(poison) and stream["dead_letter"] == f"{SUBJECT}.dead", stream
    assert stream["loader_restarts"] == 0, stream
    restarts = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert all(n == 0 for n in restarts.values()), restarts  # the data loader never died, nor anything else
    last = published["last_seq"]
    assert _consumer(broker)[:2] == (last, 0)  # every message acknowledged, the poison with the rest
    dead = _dead_letters(broker)
    assert sorted(seq for seq, _ in dead) == sorted(poison)  # each poison message copied once, with its reason
    reasons = " | ".join(reason for _, reason in dead)
    for expected in ("not a valid Arrow IPC stream", "past the bound of", "no column 'tags'",
                     "a dense column must be float, integer, decimal or boolean, not string"):
        assert expected in reasons, reasons
    seen = np.zeros(published["events"], np.int64)
    for first, n in _events_read(tmp_path / "run"):
        seen[first:first + n] += 1
    for first, n in published["good"]:
        assert (seen[first:first + n] == 1).all(), (first, n)  # every good event trained exactly once
    for kind, runs in published["must_train"].items():
        for first, n in runs:
            trained = seen[first:first + n]
            if kind == "NaN dense values":
                assert trained.sum() == n - NAN_ROWS and (trained[::ROWS // NAN_ROWS] == 0).all()
            else:
                assert (trained == 1).all(), kind
    assert seen.max() == 1
    assert result["lost_updates"] == 0 and all(t["auc"] > 0.55 for t in result["tasks"]), result["tasks"]
