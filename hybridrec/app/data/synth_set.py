"""The data set `hybridrec data synth` writes: the format chosen (tsv: synth.py's Criteo-format files; parquet:
synth_parquet.py's multi-task set), the options that only one format takes refused for the other, and the lines
the command prints (where it wrote, the oracle's figures, the planted drift). A refused option or a bad value
is a ValueError whose message the CLI prints."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class SynthOptions:
    """The options of `hybridrec data synth`, as given (see its --help)."""

    out: Path
    rows: int
    eval_rows: Optional[int] = None
    seed: int = 0
    gzip: bool = False
    format: str = "tsv"
    drift_at: Optional[int] = None
    drift_slot: Optional[int] = None
    drift_ids: int = 8
    drift_shift: float = 1.5
    ids: Optional[float] = None
    tail_share: Optional[float] = None
    negative_rate: Optional[float] = None


def write(options: SynthOptions) -> list[str]:
    """Write the data set; the lines to print."""
    started = time.monotonic()
    if options.format == "parquet":
        return _parquet(options, started)
    if options.format != "tsv":
        raise ValueError(f"--format: {options.format!r} is not tsv or parquet")
    if options.negative_rate is not None:
        raise ValueError("--negative-rate: for the parquet data set (--format parquet), whose files have a weight "
                         "column")
    return _tsv(options, started)


def _parquet(o: SynthOptions, started: float) -> list[str]:
    from hybridrec.app.data.synth_parquet import Drift, synthesize_multitask

    if o.drift_slot is not None:
        raise ValueError("--drift-slot: the parquet data set drifts items (item_id); a slot is for tsv")
    if o.ids is not None:
        raise ValueError("--ids: for the tsv data set (its large slots); convert it with `hybridrec data to-parquet`")
    if o.negative_rate is not None and not 0 < o.negative_rate <= 1:  # NaN fails too
        raise ValueError(f"--negative-rate: {o.negative_rate} is not in (0, 1]: the share of negative training rows "
                         f"kept")
    drift = None if o.drift_at is None else Drift(at_row=o.drift_at, ids=o.drift_ids, shift=o.drift_shift)
    result = synthesize_multitask(o.out, rows=o.rows, eval_rows=o.eval_rows, seed=o.seed, drift=drift,
                                  negative_rate=o.negative_rate)
    oracles = ", ".join(f"{task} {auc:.4f}" for task, auc in result.oracle_auc.items())
    watch = result.extra["tasks"]["watch_time"]
    lines = [f"wrote {o.out} in {time.monotonic() - started:.1f} s; oracle AUC {oracles}; watch_time oracle "
             f"RMSE {watch['oracle_rmse']:.3f} (the mean's {watch['mean_rmse']:.3f})"]
    if o.negative_rate is not None:
        lines.append(f"negatives down-sampled to {o.negative_rate:g} at weight {1 / o.negative_rate:g}: "
                     f"{result.extra['train_rows_written']:,} of {o.rows:,} training rows written")
    if drift is not None:
        lines.append(_drift_line(result.extra["drift"], o.drift_at, o.drift_shift))
    return lines


def _tsv(o: SynthOptions, started: float) -> list[str]:
    from hybridrec.app.data.synth import Drift, synthesize

    drift = None if o.drift_at is None else Drift(at_row=o.drift_at, slot=o.drift_slot, ids=o.drift_ids,
                                                  shift=o.drift_shift)
    summary = synthesize(o.out, rows=o.rows, eval_rows=o.eval_rows, seed=o.seed, gzip=o.gzip, drift=drift,
                         ids=None if o.ids is None else int(o.ids), tail_share=o.tail_share)
    lines = [f"wrote {o.out} in {time.monotonic() - started:.1f} s; oracle AUC {summary.oracle_auc:.4f}"]
    if o.ids is not None:
        tail = summary.extra["ids"]
        lines.append(f"about {int(o.ids):,} distinct IDs: {tail['head_distinct_ids']:,} planted, the rest rare IDs "
                     f"({tail['tail_share']:.1%} of the occurrences of slots {tail['tail_slots']})")
    if drift is not None:
        lines.append(_drift_line(summary.extra["drift"], o.drift_at, o.drift_shift))
    return lines


def _drift_line(planted: dict, at: int, shift: float) -> str:
    return (f"drift from row {at}: {planted['column']} IDs {', '.join(planted['ids'])} "
            f"(rows holding them: {planted['share_of_rows']:.1%}) add {shift:+g} to their logit; "
            f"probe rows in {planted['probe_file']}")
