"""Metrics move during a run, the run report renders in headless Chromium, the capacity planner is right."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.integration

# service -> metrics that must increase between two scrapes during training
MOVING = {
    "embedding_ps": ["hybridrec_embedding_ps_rows_looked_up_total", "hybridrec_embedding_ps_rows_updated_total"],
    "embedding_worker": ["hybridrec_embedding_worker_lookups_total", "hybridrec_embedding_worker_rows_updated_total"],
    "nn_worker": ["hybridrec_nn_worker_samples_total", "hybridrec_nn_worker_steps_total",
                  "hybridrec_staleness_batches_count"],
    "dataloader": ["hybridrec_dataloader_rows_sent_total"],
}
# The table's size grows in the first epoch only (later ones see the same IDs): present and positive, not moving
PRESENT = {
    "embedding_ps": ["hybridrec_embedding_ps_dim16_rows", "hybridrec_embedding_ps_dim16_capacity",
                     "hybridrec_embedding_ps_dim16_evictions_total",
                     "hybridrec_embedding_ps_dim16_admission_drops_total",
                     "hybridrec_embedding_ps_updates_deduplicated_total"],
    "embedding_worker": ["hybridrec_embedding_worker_buffered_batches",
                         "hybridrec_embedding_worker_batches_recovered_total"],
    "nn_worker": ["hybridrec_nn_worker_loss", "hybridrec_nn_worker_train_auc", "hybridrec_nn_worker_batches_in_flight",
                  "hybridrec_nn_worker_skipped_batches_total", "hybridrec_nn_worker_samples_per_sec"],
    "dataloader": ["hybridrec_dataloader_bad_lines_total"],
}


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Debian's chromium is needed for the report test (apt-get install chromium; .ci/run does it)"
    return path


def _all_moved(first: dict, second: dict) -> bool:
    return all(second[key].get(metric, 0) > first[key].get(metric, 0)
               for key in second if key in first for metric in MOVING[key[0]])


def test_metrics_move_and_report_renders(tmp_path, watched_run):
    """Every service's metrics, scraped while the shared run trained: each counter of MOVING grew between the
    first scrape and a later one (a loaded machine may stall a while), every gauge of PRESENT is there."""
    assert watched_run.returncode == 0, watched_run.stderr[-3000:]
    scrapes = watched_run.scrapes
    assert scrapes, "never saw every service's metrics during training"
    first = scrapes[0]
    second = next((later for later in scrapes[1:] if _all_moved(first, later)), scrapes[-1])
    for (name, replica), values in second.items():
        for metric in MOVING[name]:
            assert values.get(metric, 0) > first[(name, replica)].get(metric, 0), (name, replica, metric)
        for metric in PRESENT[name]:
            assert metric in values, (name, metric)
        if name == "embedding_ps":
            assert values["hybridrec_embedding_ps_dim16_rows"] > 0, (name, replica)
        rpc = "hybridrec_rpc_latency_seconds_count"
        if name != "dataloader":
            assert values.get(rpc, 0) > first[(name, replica)].get(rpc, 0), (name, rpc)

    summary = watched_run.summary
    run_dir = watched_run.run_dir
    assert all(s["metrics"] for s in summary["services"])
    report = Path(summary["report"])
    dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                          "--no-first-run", "--disable-background-networking", "--disable-component-update",
                          "--disable-sync", f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=5000",
                          "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120)
    match = re.search(r'data-rendered="(\d+)/(\d+)"', dom.stdout)
    assert match, dom.stdout[:2000] + dom.stderr[-2000:]
    assert match.group(1) == match.group(2) == "4"
    for png in ("loss_auc", "throughput", "staleness", "resources"):
        assert (run_dir / f"{png}.png").stat().st_size > 5000


def _planned_and_allocated(tmp_path: Path, job: dict) -> tuple[dict, int]:
    """`hybridrec plan --config` of a one-shard job, and the bytes its PS's store files take once it serves."""
    import asyncio
    import tempfile

    import yaml

    from hybridrec.core.runtime import rpc
    from hybridrec.app.run.ports import free_port

    shm = Path(tempfile.mkdtemp(prefix="hybridrec-plan-", dir="/dev/shm"))
    address = f"127.0.0.1:{free_port()}"
    config = tmp_path / "c.yaml"
    job["ps"]["shm_dir"] = str(shm)
    config.write_text(yaml.safe_dump({**job, "data": {"train": ["unused.tsv"]},
                                      "cluster": {"ps": [address], "bind_host": "127.0.0.1"}}))
    planned = json.loads(subprocess.run(HYBRIDREC + ["plan", "--config", str(config), "--json"], cwd=REPO,
                                        capture_output=True, text=True, check=True).stdout)
    ps = subprocess.Popen(HYBRIDREC + ["serve", "embedding_ps", "--config", str(config), "--replica", "0"], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(rpc.wait_until_serving([address], timeout_s=120))
        allocated = sum(p.stat().st_blocks * 512 for p in shm.rglob("*") if p.is_file())
    finally:
        ps.terminate()
        ps.wait(timeout=30)
        shutil.rmtree(shm, ignore_errors=True)
    return planned, allocated


@pytest.mark.parametrize("dim,most", [(16, 64), (128, 300)])
def test_compact_rows_take_the_planned_bytes_a_row_in_a_running_ps(tmp_path, dim, most):
    """fp16 weights with row-wise Adagrad: at most 64 bytes a row at width 16 and 300 at width 128 (float32
    Adagrad: about 152 and 1,048), as planned and as the PS's files take them."""
    capacity = 1_000_000
    planned, allocated = _planned_and_allocated(tmp_path, {
        "features": [{"name": "C1", "group": 0, "dim": dim}],
        "optimizer": {"embedding": {"name": "rowwise_adagrad"}},
        "ps": {"capacity": capacity, "storage": "fp16"}})
    assert planned["storage"] == "fp16" and planned["stores"][0]["row_bytes_in_checkpoints"] == 8 + 4 * (dim // 2 + 1)
    assert planned["per_shard_bytes"] / capacity <= most
    assert abs(planned["per_shard_bytes"] - allocated) <= 0.05 * allocated, (planned["per_shard_bytes"], allocated)


def test_plan_agrees_with_what_a_ps_allocates(tmp_path):
    planned, allocated = _planned_and_allocated(tmp_path, {
        "features": [{"name": "C1", "group": 0, "dim": 32}, {"name": "C2", "group": 1, "dim": 8}],
        "optimizer": {"embedding": {"name": "adam"}},
        # With the lifecycle on, so that its sketch, row stamps and counters are planned too
        "ps": {"capacity": 300_000, "lifecycle": {"ttl_steps": 100, "tables": {1: {"admit_after": 2}}}}})
    assert allocated > 0
    assert abs(planned["per_shard_bytes"] - allocated) <= 0.05 * allocated, (planned["per_shard_bytes"], allocated)
    parts = planned["per_shard_parts"]
    assert parts["sketch"] == (1 << 22) * 4 and parts["touched"] == 2 * 300_000 * 16 and parts["tables"] > 0
