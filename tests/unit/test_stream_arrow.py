"""Stream messages in the training data's own columns (hybridrec/core/layouts/event_stream.py,
services/dataloader/stream.py):
an Arrow record batch of the multi-task data trains exactly as the Parquet file's rows do (the same reader
code: hashing, max_len, absent values, two labels); a bad row keeps the other rows' event ids; a message the
config cannot read is counted, skipped and acknowledged, or stops the loader naming subject, message and
column. TSV messages are what they were."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrec.app.data.replay import _arrow_messages
from hybridrec.app.data.synth_parquet import synthesize_multitask
from hybridrec.core.config import StreamConfig, load_config
from hybridrec.core.layouts.event_stream import (ARROW, EVENT_ID, EVENT_TIME, FORMAT, TSV, EventFormatError,
                                    encode_arrow,
                                    events_in, headers, read_format)
from services.dataloader import parquet
from services.dataloader.batching import Position, ReadCounters
from services.dataloader.stream import BadMessage, Message, MessageReader, StreamAccount, iter_train_batches
from tests.conftest import REPO
from tests.unit.test_stream_partitions import Source

ROWS_PER_MESSAGE = 100
BATCH = 512


@pytest.fixture(scope="module")
def multitask(tmp_path_factory):
    out = tmp_path_factory.mktemp("multitask")
    synthesize_multitask(out, rows=3_000, eval_rows=1_000, seed=4)
    return out


def _config(data, **overrides):
    sets = [f"data.train=[{data / 'train.parquet'}]", f"training.batch_size={BATCH}"]
    sets += [f"{k}={v}" for k, v in overrides.items()]
    return load_config(REPO / "examples" / "multitask_parquet.yaml", sets)


class Account(StreamAccount):
    """The account, keeping each batch's (event time, samples, first event id) runs."""

    def __init__(self, source):
        super().__init__(source)
        self.noted: list[tuple[Position, list]] = []

    def note_batch(self, position, parts):
        self.noted.append((position, parts))
        super().note_batch(position, parts)


def _read(messages: list[Message], config, until: int):
    source = Source(messages)
    account, counters = Account(source), ReadCounters()
    batches = list(iter_train_batches(source, account, StreamConfig(subject="s", until_event=until, linger_s=0.01),
                                      start=Position(), batch_size=BATCH, reader=MessageReader(config, source.subject),
                                      counters=counters))
    return batches, account, counters


def _messages(data, config) -> list[Message]:
    spec = parquet.ParquetSpec.from_config(config)
    out, event = [], 0
    for seq, (payload, count) in enumerate(_arrow_messages((data / "train.parquet",), tuple(spec.columns),
                                                           ROWS_PER_MESSAGE, None), start=1):
        out.append(Message(seq, payload, event, 1000.0 + seq, ARROW))
        event += count
    return out


def test_an_arrow_message_stream_gives_the_parquet_files_batches(multitask):
    config = _config(multitask)
    batches, account, counters = _read(_messages(multitask, config), config, until=3_000)
    spec = parquet.ParquetSpec.from_config(config)
    files = list(parquet.iter_train_batches([str(multitask / "train.parquet")], spec, epochs=1, batch_size=BATCH,
                                            bad_lines="skip", counters=ReadCounters()))
    assert [len(rows) for rows, _ in batches] == [len(rows) for rows, _ in files] == [512] * 5 + [440]
    for (a, _), (b, _) in zip(batches, files):
        assert a.labels.shape == (len(a), 2)  # click and conversion
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.dense, b.dense)
        assert a.sparse("train").encode() == b.sparse("train").encode()  # the bytes the embedding worker gets
    assert counters.rows == 3_000 and counters.truncated_rows > 0 and counters.bad_messages == 0
    # Every event in exactly one batch, by id, with its message's event time.
    runs = [(first, n) for _, parts in account.noted for _, n, first in parts]
    assert sum(n for _, n in runs) == 3_000 and sorted(runs) == runs and runs[0][0] == 0
    assert all(a + m == b for (a, m), (b, _) in zip(runs, runs[1:]))
    assert account.read_through == 30


def test_a_bad_row_is_skipped_and_the_others_keep_their_event_ids(multitask):
    config = _config(multitask)
    spec = parquet.ParquetSpec.from_config(config)
    table = pq.read_table(multitask / "train.parquet", columns=spec.columns).slice(0, 10)
    click = table.column("click").to_pylist()
    click[3] = None  # a null label: a bad row, as in a Parquet file
    table = table.set_column(0, "click", pa.array(click, pa.int8()))
    batches, account, counters = _read([Message(1, encode_arrow(table), 500, 7.0, ARROW)], config, until=510)
    assert [len(rows) for rows, _ in batches] == [9] and counters.bad_lines == 1
    assert account.noted[0][1] == [(7.0, 3, 500), (7.0, 6, 504)]  # events 500-502 and 504-509


def test_a_message_the_config_cannot_read_is_counted_skipped_and_acknowledged(multitask):
    config = _config(multitask)
    spec = parquet.ParquetSpec.from_config(config)
    table = pq.read_table(multitask / "train.parquet", columns=spec.columns).slice(0, 100)
    bad = {
        "a column missing": encode_arrow(table.drop_columns(["tags"])),
        "a column of the wrong type": encode_arrow(table.set_column(2, "d0", pa.array([str(i) for i in range(100)]))),
        "not Arrow": b"\x01\x02 not an IPC stream",
    }
    good = encode_arrow(table)
    messages = [Message(1, good, 0, 1.0, ARROW)]
    for i, payload in enumerate(bad.values()):
        messages.append(Message(2 + i, payload, 100 * (i + 1), 1.0, ARROW))
    messages.append(Message(5, good, 400, 1.0, "avro"))  # a format nobody knows
    messages.append(Message(6, b"1\t2\t3\n", 500, 1.0, TSV))  # TSV, for features that are not Criteo columns
    messages.append(Message(7, good, 501, 1.0, ARROW))
    batches, account, counters = _read(messages, config, until=601)
    assert sum(len(rows) for rows, _ in batches) == 200 and counters.bad_messages == 5
    assert account.read_through == 7 and batches[-1][1] == Position(0, 0, 7, 1)
    assert sorted(account._skipped.items()) == [(2, 100), (3, 100), (4, None), (5, None), (6, 1)]
    assert [seq for seq, _ in account.source.dead_letters] == [2, 3, 4, 5, 6]  # each copied, with its reason
    assert "no column 'tags'" in account.source.dead_letters[0][1]
    assert account.summary().dead_letter == "s.1.dead" and account.summary().skipped_messages == 5

    with pytest.raises(BadMessage, match=r"subject s.1, message 2: features.3 \(tags\).column: no column 'tags'"):
        _read(messages, _config(multitask, **{"data.bad_lines": "error"}), until=601)
    with pytest.raises(BadMessage, match=r"subject s.1, message 3: data.dense_columns \(d0\): a dense column must be "
                                         r"float, integer, decimal or boolean, not string"):
        _read(messages[:1] + messages[2:], _config(multitask, **{"data.bad_lines": "error"}), until=601)
    with pytest.raises(BadMessage, match=r"subject s.1, message 5: header Hybridrec-Format is 'avro'"):
        _read(messages[:1] + messages[4:], _config(multitask, **{"data.bad_lines": "error"}), until=601)


def test_tsv_messages_are_what_they_were():
    assert headers(5, 1.5) == {EVENT_ID: "5", EVENT_TIME: "1.5"}  # no format header: TSV byte for byte
    assert headers(5, 1.5, ARROW) == {EVENT_ID: "5", EVENT_TIME: "1.5", FORMAT: "arrow"}
    assert read_format(None) == read_format({EVENT_ID: "1"}) == TSV and read_format({FORMAT: "arrow"}) == ARROW
    with pytest.raises(EventFormatError, match="'csv' is not a format"):
        read_format({FORMAT: "csv"})
    assert events_in(TSV, b"a\nb\nc") == events_in(TSV, b"a\nb\nc\n") == 3
    assert events_in(ARROW, encode_arrow(pa.table({"x": [1, 2]}))) == 2
