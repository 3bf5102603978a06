"""The run summary: what a training job reports when it ends (summary.json).

Built by NN worker rank 0 from every rank's counters (`services/nn_worker/results.py`),
completed by `hybridrec run`'s launcher (whole-run wall time, the services, the
report), and read by the CLI, the run report and the benchmarks. One typed
model so that writer and readers agree on every field; the JSON keeps these
field names.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from hybridrec.core.layouts.files import write_json_atomic


STREAM_FILE = "stream.json"
"""In the run's output directory: the data loader's account of a stream it trained on (`StreamSummary`); with
several data loaders, each writes `stream-<partition>.json` of the partition it consumes."""


class Lag(BaseModel):
    """Seconds from an event's time to a moment, over the events (weighted by samples)."""

    p50: float
    p99: float
    max: float


LAG_FLOOR_S = 1e-3
LAG_RATIO = 1.02
"""A lag histogram's buckets: bucket b holds lags in [LAG_FLOOR_S * LAG_RATIO**b, LAG_FLOOR_S * LAG_RATIO**(b+1))
(bucket 0 also every lag below); a percentile read from it is within 1 % of the exact one. Sparse: [bucket,
samples] pairs; a whole job's fits in a few hundred."""


def lag_bucket(seconds: float) -> int:
    return int(math.log(max(seconds, LAG_FLOOR_S) / LAG_FLOOR_S) / math.log(LAG_RATIO))


def lag_of(histogram: dict[int, int], low: float, high: float) -> Lag | None:
    """p50, p99 and max of a lag histogram (samples per bucket) whose smallest and largest lags are `low` and
    `high`: each percentile is its bucket's geometric middle, kept within [low, high]."""
    total = sum(histogram.values())
    if not total:
        return None
    buckets = sorted(histogram)
    cumulative = np.cumsum([histogram[b] for b in buckets]) / total

    def pick(q: float) -> float:
        b = buckets[min(int(np.searchsorted(cumulative, q)), len(buckets) - 1)]
        return min(max(LAG_FLOOR_S * LAG_RATIO ** (b + 0.5), low), high)

    return Lag(p50=pick(0.5), p99=pick(0.99), max=high)


class StreamSummary(BaseModel):
    """What the data loader read from `data.stream` (services/dataloader/stream.py), written by it to
    `<output.dir>/stream.json` as training goes and merged into the summary at the end of `hybridrec run`."""

    events: int
    """Samples read from the stream and trained."""
    first_seq: int
    """The first stream sequence this job read."""
    acknowledged_through: int
    """The last stream sequence acknowledged: every sample of every message up to it was trained."""
    training_lag_s: Lag | None = None
    """From each message's event time to the moment the data loader learnt its samples were trained (a
    batch's confirmation comes with the rank's next batch, so this errs long by up to a batch interval), over
    the whole job: a restarted loader goes on with its predecessor's account. Percentiles from
    `lag_histogram`, within 1 %; with several partitions, of their histograms added up."""
    lag_histogram: list[list[int]] | None = None
    """Samples per lag bucket, [bucket, samples] pairs (`LAG_RATIO`): what `training_lag_s` is read from, and
    what accounts of partitions and of a restarted loader's lives add up."""
    lag_min_s: float | None = None
    """The smallest lag (the largest is `training_lag_s.max`)."""
    loader_restarts: int = 0
    """How many times the data loader (of this partition) was started again during the job: each went on with
    its predecessor's account."""
    skipped_messages: int = 0
    """Messages skipped whole, counted and acknowledged: a format, payload or schema the config cannot read
    (`data.bad_lines: skip`)."""
    skipped_events: int = 0
    """The events those messages held (where their payload could be counted)."""
    dead_letter: str | None = None
    """The subject every skipped message was copied to (`data.stream.dead_letter`); None: none skipped."""
    partition: int | None = None
    """With several data loaders: the partition of the subject (`<subject>.<partition>`) this account is of."""
    partitions: list["StreamSummary"] | None = None
    """With several data loaders: each partition's own account; then `events` sums them, `first_seq` is the
    smallest and `acknowledged_through` the largest stream sequence of theirs (each consumer acknowledges
    the messages of its own partition only)."""

    def write(self, output_dir: str | Path, **state: Any) -> None:
        """`stream.json` (`stream-<partition>.json`) in `output_dir`, with `state` beside the summary's keys: what
        a restarted data loader needs to go on with the account (services/dataloader/stream.py), which `read`
        leaves out."""
        unset = {key for key in ("partition", "partitions") if getattr(self, key) is None}
        write_json_atomic(self.path(output_dir, self.partition), {**self.model_dump(mode="json", exclude=unset),
                                                                  **state}, indent=None)

    @staticmethod
    def path(output_dir: str | Path, partition: int | None) -> Path:
        return Path(output_dir) / (STREAM_FILE if partition is None else f"stream-{partition}.json")

    @classmethod
    def read(cls, output_dir: str | Path) -> "StreamSummary | None":
        """The account in `output_dir`: stream.json, or every partition's merged."""
        path = Path(output_dir) / STREAM_FILE
        if path.is_file():
            return cls.model_validate_json(path.read_text())
        parts = sorted((cls.model_validate_json(p.read_text()) for p in Path(output_dir).glob("stream-*.json")),
                       key=lambda part: part.partition or 0)
        return cls.merge(parts) if parts else None

    @classmethod
    def merge(cls, parts: list["StreamSummary"]) -> "StreamSummary":
        lags = [part.training_lag_s for part in parts if part.training_lag_s is not None]
        histogram: dict[int, int] = {}
        for part in parts:
            for bucket, samples in part.lag_histogram or []:
                histogram[bucket] = histogram.get(bucket, 0) + samples
        lag = None
        if lags and all(p.lag_histogram is not None for p in parts if p.training_lag_s is not None):
            low = min(p.lag_min_s if p.lag_min_s is not None else p.training_lag_s.p50 for p in parts
                      if p.training_lag_s is not None)
            lag = lag_of(histogram, low, max(g.max for g in lags))
        elif lags:  # accounts without histograms: each percentile the largest of the partitions' (a bound)
            lag = Lag(p50=max(g.p50 for g in lags), p99=max(g.p99 for g in lags), max=max(g.max for g in lags))
        return cls(events=sum(part.events for part in parts), first_seq=min(part.first_seq for part in parts),
                   lag_histogram=sorted([b, n] for b, n in histogram.items()) or None,
                   loader_restarts=sum(part.loader_restarts for part in parts),
                   skipped_messages=sum(part.skipped_messages for part in parts),
                   skipped_events=sum(part.skipped_events for part in parts),
                   dead_letter=next((part.dead_letter for part in parts if part.dead_letter), None),
                   acknowledged_through=max(part.acknowledged_through for part in parts), training_lag_s=lag,
                   partitions=parts)


class Staleness(BaseModel):
    """How many earlier batches had unapplied updates when each batch's embeddings were looked up."""

    p50: int = 0
    """Median staleness."""
    max: int = 0
    """Largest staleness seen (never above training.staleness)."""
    histogram: list[int] = Field(default_factory=list)
    """Lookups per staleness value 0..bound."""

    @classmethod
    def from_histogram(cls, hist: list[int]) -> "Staleness":
        counts = np.asarray(hist, dtype=np.int64)
        if counts.sum() == 0:
            return cls(histogram=list(hist))
        cdf = np.cumsum(counts) / counts.sum()
        return cls(p50=int(np.searchsorted(cdf, 0.5)), max=int(np.nonzero(counts)[0].max()), histogram=list(hist))


SUMMARY_FILE = "summary.json"
"""In a run directory (output.dir): the `RunSummary`, written by NN worker rank 0 and completed by the launcher."""
SERVICES_FILE = "services.json"
"""In a run directory: every replica of the run (`ServiceInfo`), kept current across restarts."""


class ServiceInfo(BaseModel):
    """One replica of a service as the launcher (or the testbed) ran it: a row of services.json."""

    name: str
    """Service kind (embedding_ps, embedding_worker, nn_worker, dataloader)."""
    replica: int
    pid: int | None = None
    grpc: str
    """gRPC address."""
    metrics: str | None = None
    """Prometheus address."""
    restarts: int = 0
    """Times it was restarted in place (or with its group)."""
    host: str | None = None
    """Testbed only: the host (network namespace) it ran in."""
    namespace: str | None = None
    """Testbed only: that host's network namespace."""


class Recovery(BaseModel):
    """A process the launcher restarted, and how long its replacement took to be at work again."""

    service: str
    replica: int
    exit_code: int
    """How the lost process ended: negative, the signal that killed it; 75, it stopped because a peer was lost."""
    action: str
    """What the launcher did: replace (rejoin the peers), restart (in place), group (from the checkpoint)."""
    down_at: float
    """Unix time the launcher saw the process gone (it looks ten times a second)."""
    seconds: float | None = None
    """From `down_at` to the replacement's first piece of work; None: not at work again before the run ended."""
    what: str | None = None
    """That first piece of work: a training step (NN worker), a lookup served (PS), a batch delivered
    (data loader, embedding worker)."""


def write_services(run_dir: Path, services: list[ServiceInfo]) -> None:
    """run_dir/services.json, replaced whole (a dashboard polling it never reads half a file)."""
    write_json_atomic(Path(run_dir) / SERVICES_FILE, [s.model_dump(mode="json") for s in services])


def read_services(run_dir: Path) -> list[ServiceInfo] | None:
    """run_dir/services.json, or None where the run wrote none."""
    path = Path(run_dir) / SERVICES_FILE
    if not path.is_file():
        return None
    return [ServiceInfo.model_validate(row) for row in json.loads(path.read_text())]


class StoreLoss(BaseModel):
    """A life of a PS shard that lost its store (services/embedding_ps/lives.py), and what that cost."""

    shard: int
    life: str
    """The lost life's id (a 64-bit integer, as text: JSON readers lose precision above 2**53)."""
    restored_step: int
    """Step of the checkpoint its successor restored; -1: there was none, the successor started empty."""
    acknowledged: int
    """Updates that life acknowledged to the embedding workers."""
    applied_at_checkpoint: int
    """Of those, the ones applied when the restored checkpoint was written (0: it is older than the life)."""
    lost: int
    """acknowledged - applied_at_checkpoint: updates the shard had acknowledged and no longer holds."""
    from_replica: bool = False
    """Its successor copied the shard's backup (ps.replicas: 2) instead of a checkpoint; `applied_at_checkpoint`
    is then what the backup held of the lost life."""

    def describe(self) -> str:
        return describe_store_loss(self.restored_step, self.from_replica, f"{self.lost:,}")


def describe_store_loss(restored_step: float | None, from_replica: bool, lost: str) -> str:
    """What a shard's lost store cost, in words (the CLI's end table and the report say the same)."""
    if from_replica:
        restored = "copied back from its backup"
    elif restored_step is not None and restored_step >= 0:
        restored = f"restored from the step-{int(restored_step)} checkpoint"
    else:
        restored = "no checkpoint yet: started empty"
    return f"{restored}; {lost} acknowledged updates lost"


class PublishSummary(BaseModel):
    """Live model versions NN worker rank 0 published during the run (publish.* in the config)."""

    published: int = 0
    """Versions completed (manifest written)."""
    full: int = 0
    """Of those, full snapshots (the rest are deltas)."""
    skipped: int = 0
    """Intervals skipped because the previous version was still being written."""
    failed: int = 0
    """Versions abandoned after an error (logged; the next one is a full snapshot)."""
    last_version: int | None = None
    """Number of the newest version published."""
    last_step: int | None = None
    """Training step of the newest version published."""
    mean_s: float | None = None
    """Mean seconds per version, from the dense copy to the manifest."""
    max_s: float | None = None
    """Slowest version, seconds."""
    mean_delta_rows: float | None = None
    """Mean embedding rows written per delta version (all shards and widths)."""
    mean_full_rows: float | None = None
    """Mean embedding rows written per full snapshot."""
    directory: str | None = None
    """The versions directory (publish.dir)."""


class TableLifecycle(BaseModel):
    """One table's embedding lifecycle over the run (ps.lifecycle), summed over the PS shards."""

    admitted: int = 0
    """Rows created for the table's IDs (an ID expired or evicted and seen again counts again)."""
    rejected: int = 0
    """Training lookups of an ID without a row that did not create one: fewer than admit_after
    occurrences yet, or not drawn by admit_probability."""
    expired: int = 0
    """Rows removed because they were not updated within the table's TTL."""
    dropped_gradients: int = 0
    """Gradients of IDs without a row (not admitted, expired or evicted), dropped by the PS."""


class DiskTierSummary(BaseModel):
    """The PS stores' two tiers at the end of the run (ps.tier), summed over shards and widths."""

    memory_rows: int
    """Rows in the stores' memory."""
    memory_bytes: int
    """Bytes of the stores' memory files."""
    disk_rows: int
    """Records on the disk tiers (a row in memory may have an older record there)."""
    disk_bytes: int
    """Bytes of those records."""
    memory_hit_rate: float | None
    """IDs of training lookups found in memory, over all of them (None: no training lookup)."""
    fills: int
    """Rows training lookups read back from disk instead of initialising them."""
    writebacks: int
    """Rows memory evicted to disk."""
    overflows: int
    """Rows evicted when a disk tier was full (ps.tier.capacity too small): the only rows a tier forgets."""
    disk_updates: int
    """Gradients applied to rows on disk (evicted between their lookup and their update)."""


class Phases(BaseModel):
    """Where the run's time went: seconds since launch (t = 0) of each phase boundary, on the launcher's clock.

    Start-up runs from 0 to first_step, training to end_of_training, evaluation to end_of_eval,
    shutdown to end. None: the run did not get there (or it was not observed)."""

    first_step: float | None = None
    """The first training step of any NN worker (each reports how long it has trained)."""
    end_of_training: float | None = None
    """The last NN worker's end of training."""
    end_of_eval: float | None = None
    """The NN workers exited: evaluation done, summary written."""
    end: float | None = None
    """Every service stopped."""


def task_entries(summary: dict) -> list[dict]:
    """The tasks a run's table and report list (a `RunSummary` as a dict, perhaps from an older or partial
    file): every task of a multi-task run, or a regression task alone from the top-level fields (a binary task
    alone is the table's own AUC rows); none otherwise."""
    tasks = summary.get("tasks") if isinstance(summary.get("tasks"), list) else []
    if not tasks and summary.get("rmse") is not None:
        tasks = [{"kind": "regression", **{k: summary.get(k) for k in ("rmse", "oracle_rmse", "mae")}}]
    return [t for t in tasks if isinstance(t, dict)]


def task_row(task: dict, fmt: Callable[[Any], str]) -> tuple[str, str]:
    """A task's eval results as one (label, value) row of the CLI's table and the report, by its kind: AUC,
    oracle AUC, log loss and calibration, or RMSE, oracle RMSE and MAE. `task`: a `TaskMetrics` as a dict."""
    name = f"task {task.get('name')}: " if task.get("name") else ""
    if task.get("kind") == "regression":
        return (f"{name}eval RMSE / oracle / MAE",
                f"{fmt(task.get('rmse'))} / {fmt(task.get('oracle_rmse'))} / {fmt(task.get('mae'))}")
    return (f"{name}eval AUC / oracle / logloss / calibration",
            f"{fmt(task.get('auc'))} / {fmt(task.get('oracle_auc'))} / {fmt(task.get('logloss'))} / "
            f"{fmt(task.get('calibration'))}")


class TaskMetrics(BaseModel):
    """Eval metrics of one task (one label column) of a multi-task model."""

    name: str
    """The label column."""
    kind: str = "binary"
    """binary (AUC, log loss) or regression (RMSE, MAE): `data.labels`' kind of the task."""
    auc: float | None = None
    """Eval AUC of the task's predictions (None with one class only, and for a regression task)."""
    logloss: float | None = None
    """Eval log loss of the task's predictions."""
    calibration: float | None = None
    """A binary task: the eval file's mean predicted probability over its rate of positives (both weighted by
    the samples' weights, when there are): 1 is calibrated. None without positives."""
    rmse: float | None = None
    """A regression task: eval root mean squared error (weighted by the samples' weights, when there are)."""
    mae: float | None = None
    """A regression task: eval mean absolute error."""
    oracle_auc: float | None = None
    """AUC of the planted model's true probabilities of this task, when the data says so."""
    oracle_rmse: float | None = None
    """A regression task: RMSE of the planted model's true mean, when the data says so."""
    progressive_auc: float | None = None
    """Progressive validation of this task over the run's window (as the summary's `progressive_auc`)."""
    progressive_logloss: float | None = None


class RunSummary(BaseModel):
    """Results of one training job."""

    model_config = ConfigDict(extra="forbid")

    mode: str
    """Training mode (hybrid, sync, async, shadow)."""
    nn_workers: int
    """Ranks of the dense group."""
    steps: int
    """Training steps per NN worker."""
    samples: int
    """Training samples of all ranks together."""
    train_wall_s: float
    """Seconds from the first training step to the end of training (longest rank)."""
    samples_per_sec: float
    """samples / train_wall_s."""
    mean_train_loss: float
    lost_updates: int
    """Embedding updates lost: training batches whose update never reached the PS (what the embedding workers
    still held, looked up but not applied, at the end of the run: they keep such a batch until its update is
    applied, so this counts pushes that failed for good and pushes lost with an NN worker that died; when an
    embedding worker did not answer at the end, the NN workers' own count of failed pushes), plus the updates
    PS shards had acknowledged and then lost with their store (`store_losses`)."""
    skipped_batches: int
    """Training batches whose embeddings were lost (an embedding worker lost its buffer directory; a
    restarted one re-attaches to it and loses nothing)."""
    skipped_eval_batches: int
    nonfinite_steps: int = 0
    """Training steps (per NN worker: the ranks decide alike) whose loss or gradients were NaN or infinite, which
    updated nothing: not the dense model, not a PS row (`training.on_nonfinite: skip`)."""
    batches_recovered: int | None = None
    """Buffered batches that restarted embedding workers re-attached and served (all workers, all
    restarts); None when a worker did not answer at the end of the run."""
    updates_deduplicated: int | None = None
    """Re-sent embedding updates the PS shards acknowledged without applying them again (they had applied
    them before the sender restarted); None when a shard did not answer at the end of the run."""
    ps_rows: int | None = None
    """Embedding rows the PS shards held at the end of the run (every shard and width); None when a shard
    did not answer."""
    ps_storage: str = "fp32"
    """How the PS stores held the weights (ps.storage: fp32, or 16-bit fp16 / bf16)."""
    progressive_auc: float | None = None
    """Progressive validation: AUC of the last `progressive_samples` training samples' predictions, each made
    before the step that trained on it (every rank's window; `training.progressive_window`). The online
    metric: with a stream, no held-out file keeps up. Computed from a histogram of the predictions' logits
    (services/nn_worker/progressive.py): within `progressive_auc_bound` of the exact AUC of the window."""
    progressive_auc_bound: float | None = None
    """The largest difference between `progressive_auc` and the window's exact AUC that its bucketing allows."""
    progressive_logloss: float | None = None
    """Mean log loss of the same window's predictions (exact)."""
    progressive_samples: int = 0
    shards_restored: int = 0
    """Times a PS shard came back without its store in a job that had trained it (a lost host) and restored its
    part of the newest checkpoint (or, with none yet, started empty) before serving (`store_losses`)."""
    store_losses: list[StoreLoss] | None = None
    """Each store a PS shard lost during the run, and the updates lost with it (None: none)."""
    lifecycle: dict[int, TableLifecycle] | None = None
    """Per table (feature group) with any activity: rows admitted, rejected and expired, gradients dropped
    (docs/architecture.md#embedding-lifecycle); None when a shard did not answer."""
    disk_tier: DiskTierSummary | None = None
    """Both tiers of the PS stores with ps.tier (None: no disk tier, or a shard did not answer)."""
    staleness: Staleness
    exposed_wait_per_step_s: float | None = None
    """Mean seconds per training step (over steps and ranks) an NN worker's step loop waited for
    communication: a batch's embeddings, and in sync mode its gradient push and the barrier."""
    compute_per_step_s: float | None = None
    """Mean seconds per training step on the compute thread (pooling, forward, backward, dense
    AllReduce, optimizer step)."""
    compute_cpu_s: float | None = None
    """CPU seconds the NN workers' compute threads spent in training steps, all ranks together: the model's
    own cost as it ran (embedding pooling, MLP, optimizer), against which the rest of a run's CPU is
    overhead (benchmarks/modes.py's accounting)."""
    eval_samples: int
    auc: float | None
    """Eval AUC on the held-out files (None without eval data or with one class only)."""
    logloss: float | None
    calibration: float | None = None
    """The first task's eval calibration: mean predicted probability over the rate of positives (1: calibrated)."""
    rmse: float | None = None
    """A regression first task: eval RMSE (`auc` and `logloss` are then None)."""
    mae: float | None = None
    """A regression first task: eval MAE."""
    oracle_auc: float | None = None
    """AUC of the planted model's true probabilities on the eval file, when the data says so."""
    oracle_rmse: float | None = None
    """A regression first task: RMSE of the planted model's true mean on the eval file, when the data says so."""
    tasks: list[TaskMetrics] | None = None
    """Multi-task models (several data.labels): every task's eval metrics; `auc`, `logloss` and `oracle_auc`
    above are the first task's. None with one task."""
    train_started_at: float | None = None
    """Unix time of the first training step of any NN worker (this incarnation: not before a resume)."""
    train_ended_at: float | None = None
    """Unix time the last NN worker finished training."""
    wall_s: float
    """NN worker: seconds since it started; launcher: seconds of the whole run, start-up included."""
    data: dict[str, Any] = Field(default_factory=dict)
    """The data loader's counters per phase (rows, bad lines, dropped rows)."""
    checkpoint: str | None = None
    """The final job checkpoint (checkpoint.final): what `hybridrec export` reads. None without one."""
    checkpoint_s: float | None = None
    """Seconds the final checkpoint took (dense state, every PS shard's dump, manifest); None when the
    checkpoint of the last step was written before (an interval one, or the one a restarted job resumed from)."""
    publish: PublishSummary | None = None
    """Live versions published during the run (None: publishing off)."""
    stream: StreamSummary | None = None
    """Training from `data.stream`: events, acknowledgements and training lag (`hybridrec run` merges it)."""
    services: list[ServiceInfo] | None = None
    """Launcher only: every replica it ran."""
    recoveries: list[Recovery] | None = None
    """Launcher only: every process it restarted, and the seconds until the replacement was at work."""
    run_dir: str | None = None
    """Launcher only: where logs, report and results are."""
    report: str | None = None
    """Launcher only: path of report.html."""
    phases: Phases | None = None
    """Launcher only: the phase boundaries (start-up, training, evaluation, shutdown)."""

    def task_metrics(self) -> dict[str, float]:
        """Every task's eval metrics as metric values: `eval_auc_<task>`, `eval_logloss_<task>` and
        `eval_calibration_<task>`, or `eval_rmse_<task>` and `eval_mae_<task>` for a regression task."""
        out: dict[str, float] = {}
        for task in self.tasks or [TaskMetrics(name="", auc=self.auc, logloss=self.logloss,
                                               calibration=self.calibration, rmse=self.rmse, mae=self.mae)]:
            suffix = "".join(c if c.isalnum() else "_" for c in task.name)
            for key, value in (("eval_auc", task.auc), ("eval_logloss", task.logloss),
                               ("eval_calibration", task.calibration), ("eval_rmse", task.rmse),
                               ("eval_mae", task.mae)):
                if value is not None:
                    out[f"{key}_{suffix}" if suffix else key] = float(value)
        return out

    def write(self, path: Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, self.model_dump(mode="json"))

    @classmethod
    def read(cls, path: Path) -> "RunSummary":
        return cls.model_validate_json(Path(path).read_text())

    @classmethod
    def of_run(cls, run_dir: Path) -> "RunSummary":
        """The summary of the run in `run_dir` (its SUMMARY_FILE)."""
        return cls.read(Path(run_dir) / SUMMARY_FILE)
