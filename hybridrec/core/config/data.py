"""Where the training and evaluation data come from: files, or a stream."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from hybridrec.core.config.section import Section


def _plain_subject(subject: str) -> str:
    tokens = subject.split(".")
    if not subject or any(not t or t in ("*", ">") or any(c.isspace() for c in t) for t in tokens):
        raise ValueError(f"{subject!r} is not a subject to consume: dot-separated tokens, no wildcards or spaces")
    return subject


class StreamConfig(Section):
    """Training events from a NATS JetStream stream instead of files (services/dataloader/stream.py): each
    message holds one or more samples, as Criteo TSV lines or as an Arrow record batch in the training data's
    own columns (labels, dense columns, scalar and list features, read as from Parquet), with an event id and an
    event time in its headers (`hybridrec data replay` publishes a TSV or Parquet file that way). With
    `data.format: parquet` (features that are not Criteo columns) the messages must be Arrow batches."""

    url: str | None = None
    """nats://HOST:PORT of the broker. None: `hybridrec run` starts a local nats-server (-js) for the run."""
    subject: str = "hybridrec.events"
    """The subject the events are published on. With several data loaders (`cluster.dataloader`) it is
    partitioned, one partition per loader: loader l reads `<subject>.<l>` (`hybridrec data replay --partitions
    L`; the stream holds `<subject>.*`)."""
    stream: str = "HYBRIDREC_EVENTS"
    """The JetStream stream holding `subject` (`hybridrec data replay` creates it; training refuses a stream
    that does not exist or does not hold the subject)."""
    durable: str = "hybridrec-trainer"
    """The durable consumer: a new job with the same name goes on after the last message its predecessor had
    acknowledged (every sample in it trained). With several data loaders, loader l's is `<durable>-<l>`."""
    until_event: Annotated[int, Field(ge=0)] | None = None
    """End training with the message that holds event id `until_event - 1` (all of it), or before the first
    message past it (`hybridrec data replay` numbers a file's lines from 0, so the line count trains the whole
    file). None: at `for_s`, or when stopped. An event id, not a count: a restarted loader ends where the
    first would have. With several data loaders it is the job's end on every partition: a partition also ends
    at the replay's end marker past it (services/dataloader/stream.py)."""
    for_s: Annotated[float, Field(gt=0)] | None = None
    """End training after this many seconds of reading the stream (None: at `max_events`, or when stopped)."""
    linger_s: Annotated[float, Field(gt=0)] = 0.5
    """A batch that is not full after this long goes out smaller: bounds how long an event waits to train."""
    fetch: Annotated[int, Field(gt=0, le=10_000)] = 256
    """Messages per pull request."""
    dead_letter: str | None = None
    """The subject a message the data loader cannot read is copied to (payload and headers, with the reason in
    its `Hybridrec-Dead-Reason` header), before the message is acknowledged, for the user to inspect. None:
    `<subject>.dead`. A stream that holds it keeps the copies; where none does, the loader creates one
    (`<stream>_DEAD`, at most 1 GiB, oldest dropped first)."""
    max_message_bytes: Annotated[int, Field(gt=0)] = 64 << 20
    """The most bytes an Arrow message may take once decoded (its compressed buffers at their declared
    size): a message past it is a bad message, refused before anything is decompressed."""

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        if url is not None:
            scheme, sep, rest = url.partition("://")
            host, colon, port = rest.rpartition(":")
            if scheme != "nats" or not sep or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{url!r} is not a NATS URL: expected nats://HOST:PORT")
        return url

    @field_validator("subject")
    @classmethod
    def _subject(cls, subject: str) -> str:
        return _plain_subject(subject)

    @field_validator("dead_letter")
    @classmethod
    def _dead_letter(cls, subject: str | None) -> str | None:
        return None if subject is None else _plain_subject(subject)

    def dead_letter_subject(self) -> str:
        """Where unreadable messages are copied: `dead_letter`, or `<subject>.dead`."""
        return self.dead_letter or f"{self.subject}.dead"


DenseTransform = Literal["none", "log1p"]
"""How a dense column's stored value becomes the model's input: `log1p` is log1p(max(x, 0)), what the TSV
reader applies to Criteo's integer columns; `none` is the value as stored."""


class TaskConfig(Section):
    """One task of the model: its label column, its kind and its loss. A `data.labels` entry given as a plain
    column name is a binary task."""

    name: str = Field(min_length=1)
    """The label column."""
    kind: Literal["binary", "regression"] = "binary"
    """binary: a 0/1 label, trained with log loss, evaluated by AUC and log loss, served as a probability (the
    sigmoid of the model's output); regression: a finite real label (a watch time, a dwell time), trained with
    `loss`, evaluated by RMSE and MAE, served as the model's output itself."""
    loss: Literal["bce", "mse", "huber"] | None = None
    """The task's loss: bce for binary tasks (the only one they take), mse (default) or huber for regression."""
    huber_delta: Annotated[float, Field(gt=0)] = 1.0
    """huber: where the loss turns from squared to linear, in the label's units."""
    offset: float = 0.0
    """regression: the task's value is offset + scale x the model's output, trained and served so. Set them to
    about the label's mean and spread (a watch time of mean 30 minutes: 30 and 30): a model's output starts
    near 0, and a head that must first walk to 30 trains for hundreds of steps on its bias alone."""
    scale: Annotated[float, Field(gt=0)] = 1.0
    """regression: see `offset`."""

    @model_validator(mode="after")
    def _loss_fits_kind(self) -> "TaskConfig":
        if self.kind == "binary" and self.loss not in (None, "bce"):
            raise ValueError(f"loss: {self.loss} is a regression loss; a binary task trains with bce")
        if self.kind == "binary" and (self.offset, self.scale) != (0.0, 1.0):
            raise ValueError("offset, scale: a binary task answers the sigmoid of its output; they are for "
                             "regression tasks")
        if self.kind == "regression" and self.loss == "bce":
            raise ValueError("loss: bce needs 0/1 labels; a regression task trains with mse or huber")
        return self

    @property
    def binary(self) -> bool:
        return self.kind == "binary"

    @property
    def loss_name(self) -> str:
        """The loss, its default filled in."""
        return self.loss or ("bce" if self.binary else "mse")


class DataConfig(Section):
    """The dataset: Criteo TSV or Parquet files, or their prepared form (`hybridrec data prepare`), or a stream."""

    train: list[str] = Field(default_factory=list)
    """Training files (Criteo TSV, optionally .gz, or Parquet), or directories written by `hybridrec data
    prepare` (memory-mapped, nothing parsed; all entries one kind or the other). Empty with `stream`."""
    stream: StreamConfig | None = None
    """Train on a NATS JetStream stream of events instead of `train` files (TSV rows or Arrow record batches of
    the configured columns)."""
    eval: list[str] = Field(default_factory=list)
    """Held-out files evaluated after training (or prepared directories, as `train`)."""
    oracle: str | None = None
    """oracle.json written by `hybridrec data synth`; its oracle_auc (per task: `tasks`) goes into the summary."""
    format: Literal["tsv", "parquet"] = "tsv"
    """tsv: Criteo TSV (one label, I1..I13, C1..C26); parquet: columns named by `labels`, `dense_columns` and
    each feature's column, read one row group at a time (services/dataloader/parquet.py). Prepared directories
    keep their source's format: it is part of the schema they are checked against."""
    labels: list[str | TaskConfig] = Field(default_factory=lambda: ["label"], min_length=1)
    """Label columns, one task each (the model returns one output per task): a column name (a binary task), or
    a `TaskConfig` mapping (`{name: watch_time, kind: regression, loss: huber}`). TSV: exactly one, binary
    (the first field)."""
    weight_column: str | None = None
    """Parquet (and Arrow stream messages): a column of sample weights (finite, >= 0), each sample's weight in
    the training loss and in the eval metrics (a negative down-sampled to a tenth weighted 10 keeps the model
    calibrated). None: every sample weighs 1."""
    dense_columns: list[str] | None = None
    """Parquet: the float columns of the dense features, num_dense of them (None: I1..I<num_dense>)."""
    dense_transform: DenseTransform | dict[str, DenseTransform] | None = None
    """Parquet (and Arrow stream messages): how each dense column's value becomes the model's input, for every
    column or per column (a mapping from column to transform; a column it leaves out is `none`). `log1p`:
    log1p(max(x, 0)), as the TSV reader computes its integer columns, which is what raw counts need (the same
    rows as TSV and as Parquet then train the same model); `none`: as stored. None: `none`. TSV: `log1p`
    always (None or `log1p`)."""
    non_finite: Literal["error", "skip"] = "error"
    """A row whose dense value is NaN or infinite (Spark and numpy write NaN, not null; a float64 past float32's
    range; a TSV integer of 309 digits): stop naming the file and row (line) and the column, or skip the row
    and count it (`non_finite_rows` in the summary's `data`, per file under `non_finite_by_file`). Null (an
    empty TSV field) is not NaN: it reads 0.0."""
    bad_lines: Literal["skip", "error"] = "skip"
    """Malformed lines (TSV) and rows with a null or non-0/1 label (Parquet): skip and count them, or stop
    naming the file and line (TSV) or row (Parquet)."""
    chunk_rows: Annotated[int, Field(gt=0)] = 65536
    """Rows the data loader parses per chunk."""

    @property
    def tasks(self) -> list[TaskConfig]:
        """Every `labels` entry as a `TaskConfig` (a plain column name: a binary task)."""
        return [t if isinstance(t, TaskConfig) else TaskConfig(name=t) for t in self.labels]

    @property
    def label_names(self) -> list[str]:
        """The label columns, in task order."""
        return [t.name for t in self.tasks]

    @model_validator(mode="after")
    def _one_source(self) -> "DataConfig":
        if self.stream is None and not self.train:
            raise ValueError("data.train: list the training files, or set data.stream to train on a stream")
        if self.stream is not None and self.train:
            raise ValueError("data.train and data.stream: train on files or on a stream, not both")
        return self
