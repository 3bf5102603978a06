"""One `TrainingSource` for every kind of training data (services/dataloader/sources.py): the source chosen for
the config is the reader of what the config names (TSV, Parquet, prepared directories, a stream), each behind
the same `batches(start, counters)`, and yields the data's own rows, resuming exactly after a position."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrec.core.config import ConfigError, from_dict
from hybridrec.core.layouts.criteo_format import DENSE_COLUMNS, SPARSE_COLUMNS, feature_columns
from services.dataloader import batching, parquet, prepared
from services.dataloader.batching import Position, ReadCounters
from services.dataloader.prepared_write import prepare
from services.dataloader.sources import TrainingSource, training_source
from services.dataloader.stream import Message, StreamSource
from tests.unit.test_stream_partitions import Source

ROWS, BATCH = 2_500, 400


@pytest.fixture(scope="module")
def data(small_data, tmp_path_factory) -> Path:
    """The first ROWS lines of the small data as TSV, as Parquet (row groups that batches span) and prepared."""
    out = tmp_path_factory.mktemp("source")
    lines = (small_data / "train.tsv").read_text().splitlines(keepends=True)[:ROWS]
    (out / "train.tsv").write_text("".join(lines))
    _to_parquet(lines, out / "train.parquet", row_group_rows=700)
    prepare([out / "train.tsv"], out / "train.prep", _config(out / "train.tsv"))
    return out


def _to_parquet(lines: list[str], path: Path, row_group_rows: int) -> None:
    """The lines' samples in the Parquet schema the reader maps (label, I1..I13 as float32 log1p(max(x, 0)),
    C1..C26 as strings; an empty field absent)."""
    fields = [line.rstrip("\n").split("\t") for line in lines]
    columns = {"label": pa.array([int(f[0]) for f in fields], pa.int8())}
    for j, name in enumerate(DENSE_COLUMNS, start=1):
        columns[name] = pa.array(np.log1p(np.maximum([float(f[j] or 0) for f in fields], 0)), pa.float32())
    for j, name in enumerate(SPARSE_COLUMNS, start=1 + len(DENSE_COLUMNS)):
        columns[name] = pa.array([f[j] for f in fields], pa.string())
    pq.write_table(pa.table(columns), path, row_group_size=row_group_rows)


def _config(train: Path, **data):
    return from_dict({"data": {"train": [str(train)], "eval": [], **data},
                      "training": {"batch_size": BATCH, "epochs": 1}})


def _labels(data: Path) -> np.ndarray:
    """The training file's labels, read from its lines: what every reader must give, in order."""
    return np.array([float(line.split("\t", 1)[0]) for line in (data / "train.tsv").read_text().splitlines()])


def _read(source: TrainingSource, start: Position = Position()):
    counters = ReadCounters()
    return list(source.batches(start, counters)), counters


def _same(a, b):
    assert [len(r) for r, _ in a] == [len(r) for r, _ in b]
    for (ra, pa_), (rb, pb) in zip(a, b):
        np.testing.assert_array_equal(ra.labels, rb.labels)
        np.testing.assert_array_equal(ra.dense, rb.dense)
        assert ra.sparse("train").encode() == rb.sparse("train").encode()
        assert pa_ == pb


@pytest.mark.parametrize("kind", ["tsv", "parquet", "prepared"])
def test_each_file_kind_is_read_through_the_one_protocol(data, kind):
    config = {"tsv": _config(data / "train.tsv"),
              "parquet": _config(data / "train.parquet", format="parquet"),
              "prepared": _config(data / "train.prep")}[kind]
    source = training_source(config)
    assert isinstance(source, TrainingSource) and source.kind == kind
    assert source.on_trained is None and not source.waits_after_evaluation  # files: nothing to acknowledge
    batches, counters = _read(source)
    assert [len(r) for r, _ in batches] == [BATCH] * (ROWS // BATCH) + [ROWS % BATCH]
    np.testing.assert_array_equal(np.concatenate([r.labels for r, _ in batches]), _labels(data))
    assert counters.rows == ROWS
    # exactly after a position, as a restarted loader reads on
    rest, _ = _read(source, batches[2][1])
    _same(rest, batches[3:])


def test_the_sources_give_what_their_readers_gave(data):
    """Each source's batches are its module's `iter_train_batches` ones, called as the loader called them."""
    tsv_config = _config(data / "train.tsv")
    columns, groups = feature_columns(tsv_config.features)
    tsv = list(batching.iter_train_batches([str(data / "train.tsv")], epochs=1, batch_size=BATCH, columns=columns,
                                           groups=groups, bad_lines=tsv_config.data.bad_lines,
                                           counters=ReadCounters()))
    _same(_read(training_source(tsv_config))[0], tsv)
    par_config = _config(data / "train.parquet", format="parquet")
    par = list(parquet.iter_train_batches([str(data / "train.parquet")], parquet.ParquetSpec.from_config(par_config),
                                          epochs=1, batch_size=BATCH, bad_lines=par_config.data.bad_lines,
                                          counters=ReadCounters()))
    assert pq.ParquetFile(data / "train.parquet").metadata.num_row_groups == 4  # batches span row groups
    _same(_read(training_source(par_config))[0], par)
    prep_config = _config(data / "train.prep")
    prep = list(prepared.iter_train_batches([str(data / "train.prep")], prep_config, counters=ReadCounters()))
    _same(_read(training_source(prep_config))[0], prep)
    # the same samples, whichever form they are kept in
    for a, b in zip(tsv, prep):
        np.testing.assert_array_equal(a[0].labels, b[0].labels)


def test_several_loaders_each_read_their_split_through_the_source(data):
    config = from_dict({"data": {"train": [str(data / "train.tsv")], "eval": []},
                        "training": {"batch_size": BATCH, "epochs": 1},
                        "cluster": {"dataloader": ["127.0.0.1:0", "127.0.0.1:0"]}})
    sources = [training_source(config, loader) for loader in range(2)]
    assert all(s.waits_after_evaluation for s in sources)  # files with several loaders wait for the ranks
    labels = np.concatenate([r.labels for s in sources for r, _ in _read(s)[0]])
    np.testing.assert_array_equal(labels, _labels(data))


def _stream_config(data: Path, **stream):
    return from_dict({"data": {"train": [], "eval": [], "stream": {"subject": "s", "linger_s": 0.01, **stream}},
                      "training": {"batch_size": BATCH}})


def test_a_stream_is_chosen_for_data_stream(data):
    with pytest.raises(ConfigError, match=r"data.stream.url: no broker named"):
        training_source(_stream_config(data))
    source = training_source(_stream_config(data, url="nats://127.0.0.1:1"))  # no connection until `open`
    try:
        assert isinstance(source, StreamSource) and isinstance(source, TrainingSource) and source.kind == "stream"
        assert source.on_trained is not None and not source.waits_after_evaluation
    finally:
        source.close()


def test_a_streams_batches_come_through_the_one_protocol(data):
    """The stream's reader behind `batches`, over messages of the file's lines (no broker): the file's rows."""
    lines = (data / "train.tsv").read_bytes().splitlines(keepends=True)
    messages = [Message(m + 1, b"".join(lines[i:i + 100]), i, 0.0) for m, i in enumerate(range(0, ROWS, 100))]
    events = Source(messages)
    source = StreamSource(_stream_config(data, until_event=ROWS), events=events)
    batches, counters = _read(source)
    files, _ = _read(training_source(_config(data / "train.tsv")))
    assert [len(r) for r, _ in batches] == [len(r) for r, _ in files]
    for (a, _), (b, _) in zip(batches, files):
        np.testing.assert_array_equal(a.labels, b.labels)
        assert a.sparse("train").encode() == b.sparse("train").encode()
    assert counters.rows == ROWS and batches[-1][1] == Position(0, 0, len(messages), 1)
    source.on_trained([p for _, p in batches])  # all trained: every message acknowledged through the source
    assert events.acknowledged == len(messages)
