"""The table `hybridrec run` prints when the job ends: one row per figure of the run's summary (throughput,
quality, staleness, recoveries, the stream, publishing, each task), formatted as the report page formats them."""
from __future__ import annotations

import statistics

from hybridrec.core.layouts.summary import RunSummary, task_entries, task_row


def print_summary(summary: RunSummary) -> None:
    """The summary as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    from hybridrec.app.report.page import fmt_duration, fmt_int, fmt_rate, fmt_sig

    table = Table(title="hybridrec run", show_header=False)
    phases = summary.phases
    start_up = phases.first_step if phases else None
    rows = [("mode", summary.mode), ("steps (per NN worker)", fmt_int(summary.steps)),
            ("samples (all NN workers)", fmt_int(summary.samples)),
            ("train samples/s", fmt_rate(summary.samples_per_sec)),
            ("training time", fmt_duration(summary.train_wall_s)),
            ("wall time (start-up)", f"{fmt_duration(summary.wall_s)} ({fmt_duration(start_up)})"),
            ("eval AUC", fmt_sig(summary.auc)), ("oracle AUC", fmt_sig(summary.oracle_auc)),
            ("eval logloss", fmt_sig(summary.logloss)),
            ("eval calibration (mean prediction / rate)", fmt_sig(summary.calibration)),
            (f"progressive AUC (last {fmt_int(summary.progressive_samples)} samples)",
             fmt_sig(summary.progressive_auc)),
            ("staleness p50 / max", f"{summary.staleness.p50} / {summary.staleness.max}"),
            ("skipped batches / lost updates", f"{summary.skipped_batches} / {summary.lost_updates}"),
            ("run dir", summary.run_dir), ("report", summary.report)]
    if summary.batches_recovered or summary.updates_deduplicated:  # an embedding worker or PS restarted
        rows.insert(-2, ("recovered batches / deduplicated updates",
                         f"{fmt_int(summary.batches_recovered)} / {fmt_int(summary.updates_deduplicated)}"))
    held = fmt_int(summary.ps_rows) + (f" ({summary.ps_storage} weights)" if summary.ps_storage != "fp32" else "")
    rows.insert(-2, ("PS rows held at the end", held))
    for loss in summary.store_losses or []:  # a PS shard came back without its store: say what it cost
        rows.insert(-2, (f"[bold {'yellow' if loss.from_replica and not loss.lost else 'red'}]PS shard "
                         f"{loss.shard} lost its store[/]", loss.describe()))
    if summary.recoveries:  # processes the launcher restarted: how long each replacement took to work again
        timed = [r.seconds for r in summary.recoveries if r.seconds is not None]
        rows.insert(-2, ("restarts, back at work in", f"{len(summary.recoveries)}" + (
            f", {fmt_duration(statistics.median(timed))} (max {fmt_duration(max(timed))})" if timed else "")))
    if summary.lifecycle:  # admission or expiry did something: per table admitted / rejected / expired
        totals = [sum(getattr(t, f) for t in summary.lifecycle.values()) for f in ("admitted", "rejected", "expired")]
        rows.insert(-2, ("rows admitted / rejected / expired", " / ".join(fmt_int(n) for n in totals)))
    if summary.stream is not None:  # trained on data.stream
        st, lag = summary.stream, summary.stream.training_lag_s
        rows.insert(-2, ("stream: events / acknowledged through seq",
                         f"{fmt_int(st.events)} / {st.acknowledged_through}"
                         + (f" (over {st.loader_restarts + 1} data loader lives)" if st.loader_restarts else "")))
        if st.skipped_messages:
            rows.insert(-2, ("stream: messages skipped (their events)",
                             f"{fmt_int(st.skipped_messages)} ({fmt_int(st.skipped_events)})"))
        if lag is not None:
            rows.insert(-2, ("training lag p50 / p99 / max", f"{fmt_duration(lag.p50)} / {fmt_duration(lag.p99)} / "
                                                             f"{fmt_duration(lag.max)}"))
    if summary.publish is not None:
        p = summary.publish
        rows.insert(-2, ("versions published / full / skipped / failed",
                         f"{p.published} / {p.full} / {p.skipped} / {p.failed} (last v{p.last_version}, "
                         f"mean {fmt_duration(p.mean_s)}) in {p.directory}"))
    for task in task_entries(summary.model_dump()):
        rows.insert(-2, task_row(task, fmt_sig))
    for key, value in rows:
        table.add_row(key, str(value))
    Console().print(table)
