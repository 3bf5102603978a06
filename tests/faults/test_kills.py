"""kill -9 of a PS, an embedding-worker, an NN-worker or the data-loader process mid-run: `hybridrec run` finishes
normally.

With the README example's defaults: a lost NN worker is replaced and its peer hands it the dense state, and a
lost data loader reads on from where the NN workers are (no checkpoint involved, nothing skipped or lost).

Each disturbed run must end within 0.005 eval AUC of an undisturbed run of the
same config, having trained every sample, with the restart counted in the
summary. An embedding worker's buffer is on file, so its restart skips no
batch and loses no update: it re-attaches the batches it held (counted in the
summary), and pushes re-sent across the restart are applied once.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hybridrec.app.data.synth import synthesize
from hybridrec.app.run.launcher import rank_step
from tests.conftest import HYBRIDREC, REPO

pytestmark = pytest.mark.faults

ROWS = 1_000_000  # the synthetic example of the README: smaller sets are too noisy for a 0.005 AUC bound


@pytest.fixture(scope="module")
def fault_config(tmp_path_factory) -> Path:
    """examples/criteo_synth.yaml on its 1M-row data, with its default settings (recovery needs none)."""
    root = tmp_path_factory.mktemp("faults")
    synthesize(root / "data", rows=ROWS, seed=0)
    tree = yaml.safe_load((REPO / "examples" / "criteo_synth.yaml").read_text())
    tree["data"] = {"train": [str(root / "data" / "train.tsv")], "eval": [str(root / "data" / "eval.tsv")],
                    "oracle": str(root / "data" / "oracle.json")}
    (root / "config.yaml").write_text(yaml.safe_dump(tree))
    return root / "config.yaml"


def _run(config: Path, run_dir: Path, kill: str | None = None, args: tuple[str, ...] = (), **how) -> dict:
    summary = run_dir / "summary-out.json"
    proc = subprocess.Popen(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir), "--summary-json",
                                         str(summary), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    killed = None
    if kill:
        killed = _kill_mid_run(run_dir, kill, alive=lambda: proc.poll() is None, **how)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(summary.read_text())
    result["killed_pid"] = killed
    result["printed"] = out
    return result


def _kill_mid_run(run_dir: Path, service: str, fraction: float = 0.3, replicas: tuple[int, ...] = (0,),
                  alive=lambda: True, after_checkpoint: bool = False, during_checkpoint: bool = False,
                  before_kill=lambda: None) -> int:
    """SIGKILL `replicas` of `service` once NN rank 0 has trained `fraction` of its steps (and, with
    `after_checkpoint`, once the first interval checkpoint is complete; with `during_checkpoint`, at the next
    moment rank 0 is writing one: its directory still ends in .tmp). `before_kill` runs just before."""
    config_path = str(run_dir / "config.yaml")
    deadline = time.monotonic() + 600
    steps_total = ROWS // 4096 // 2
    while time.monotonic() < deadline:
        log = run_dir / "logs" / "nn_worker-0.log"
        status = rank_step(run_dir)
        checkpointed = not after_checkpoint or any(not m.parent.name.endswith(".tmp")  # renamed into place
                                                   for m in (run_dir / "checkpoints").glob("step-*/manifest.json"))
        if status is not None and status >= steps_total * fraction and checkpointed:
            assert status < steps_total, f"training ended (step {status}) before the kill"
            break
        assert alive(), f"the run ended before the kill; see {run_dir / 'logs'}"
        time.sleep(0.2)
    else:
        raise AssertionError(f"training did not get going; see {log}")
    rank_of = "nn_worker" if service == "receiver" else service
    targets = [p for p in psutil.process_iter(["cmdline"])
               if any(f"serve {rank_of} --config {config_path} --replica {r}" in " ".join(p.info["cmdline"] or [])
                      for r in replicas)]
    if service == "receiver":  # an NN worker's receiver process (training.receiver): a child of that rank
        targets = [child for p in targets for child in p.children()
                   if "services.nn_worker.receiver" in " ".join(child.cmdline())]
    assert len(targets) == len(replicas), f"{service} replicas {replicas}: found {len(targets)} processes"
    while during_checkpoint and not any(p.name.endswith(".tmp") for p in (run_dir / "checkpoints").glob("step-*")):
        assert alive() and time.monotonic() < deadline, "no interval checkpoint was seen being written"
        time.sleep(0.002)
    before_kill()
    for p in targets:  # back to back: as good as at once for the launcher, which looks every 0.1 s
        p.send_signal(signal.SIGKILL)
    return targets[0].pid


@pytest.fixture(scope="module")
def undisturbed(fault_config, tmp_path_factory) -> dict:
    return _run(fault_config, tmp_path_factory.mktemp("undisturbed"))


@pytest.mark.parametrize("service", ["embedding_ps", "embedding_worker", "nn_worker", "dataloader"])
def test_kill_minus_9_mid_run(fault_config, undisturbed, tmp_path, service):
    result = _run(fault_config, tmp_path / "run", kill=service)
    restarted = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert restarted[(service, 0)] == 1
    # The launcher timed the recovery: from the death it saw to the replacement's first piece of work.
    (recovery,) = result["recoveries"]
    assert (recovery["service"], recovery["replica"], recovery["exit_code"]) == (service, 0, -9), recovery
    assert recovery["action"] == ("restart" if service in ("embedding_ps", "embedding_worker") else "replace")
    assert 0 < recovery["seconds"] < 60 and recovery["what"], recovery
    assert "restarts, back at work in" in result["printed"]  # and the end table says so
    if service == "nn_worker":  # rank 1 handed its state to rank 0's replacement; nobody else restarted
        assert restarted[("nn_worker", 1)] == 0 and restarted[("dataloader", 0)] == 0
        logs = (tmp_path / "run" / "logs" / "nn_worker-1.log").read_text()
        assert '"group_reformed"' in logs and '"checkpoint_restored"' not in logs
        replacement = (tmp_path / "run" / "logs" / "nn_worker-0.log").read_text()
        assert '"replaced_a_lost_rank"' in replacement
        assert result["skipped_batches"] == 0 and result["lost_updates"] == 0
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.005, (result["auc"], undisturbed["auc"])
    assert result["samples"] == undisturbed["samples"]
    if service == "dataloader":  # the new loader read on from where the NN workers were; they were not restarted
        assert restarted[("nn_worker", 0)] == restarted[("nn_worker", 1)] == 0
        resumed = [json.loads(line) for line in (tmp_path / "run" / "logs" / "dataloader-0.log").read_text()
                   .splitlines() if '"resuming"' in line]
        assert len(resumed) == 1 and resumed[0]["source"] == "ranks" and resumed[0]["seq"] > 0, resumed
        assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
        assert result["data"]["train"]["first_seq"] == resumed[0]["seq"]
    if service == "embedding_worker":
        assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
        assert result["skipped_eval_batches"] == 0
        assert result["batches_recovered"] > 0  # it held batches when it died, and served them after
        assert result["updates_deduplicated"] is not None


def test_a_ps_over_a_disk_tier_killed_mid_run_reopens_both_tiers_and_loses_nothing(fault_config, undisturbed,
                                                                                  tmp_path):
    """ps.tier with a quarter of each shard's table in memory: a PS killed with SIGKILL re-attaches its memory,
    reopens its disk tier and serves again; nothing is skipped, lost or dropped, and the run learns as the
    all-in-memory one did (the tier forgets no row)."""
    quarter = undisturbed["ps_rows"] // 2 // 4  # two shards
    tree = yaml.safe_load(fault_config.read_text())
    tree["ps"] = {**tree.get("ps", {}), "capacity": quarter,
                  "tier": {"dir": str(tmp_path / "disk"), "capacity": 4_000_000}}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tree))
    result = _run(config, tmp_path / "run", kill="embedding_ps")
    (recovery,) = result["recoveries"]
    assert (recovery["service"], recovery["exit_code"], recovery["action"]) == ("embedding_ps", -9, "restart")
    assert 0 < recovery["seconds"] < 60, recovery
    assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    assert all(t["dropped_gradients"] == 0 for t in (result["lifecycle"] or {}).values()), result["lifecycle"]
    tier = result["disk_tier"]
    assert tier["overflows"] == 0 and tier["fills"] > 0 and tier["memory_rows"] <= 2 * quarter, tier
    assert result["samples"] == undisturbed["samples"]
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.005, (result["auc"], undisturbed["auc"])
    created = [line for line in (tmp_path / "run" / "logs" / "embedding_ps-0.log").read_text().splitlines()
               if "created disk tier" in line and str(tmp_path / "disk") in line]
    assert len(created) == 1, created  # created once (not a warm-up's scratch tier); the restart reopened it


def test_a_ps_of_compact_rows_killed_mid_run_reattaches_them_and_learns_as_float32_adagrad(fault_config,
                                                                                          undisturbed, tmp_path):
    """ps.storage fp16 with row-wise Adagrad (36 bytes a row of width 16): a PS killed with SIGKILL re-attaches
    its 16-bit store (header checked, dirty stripes rebuilt) and serves again; nothing skipped or lost, and the
    run learns as the undisturbed float32 Adagrad one did."""
    result = _run(fault_config, tmp_path / "run", kill="embedding_ps",
                  args=("--set", "ps.storage=fp16", "--set", "optimizer.embedding.name=rowwise_adagrad"))
    (recovery,) = result["recoveries"]
    assert (recovery["service"], recovery["exit_code"], recovery["action"]) == ("embedding_ps", -9, "restart")
    assert result["ps_storage"] == "fp16" and "fp16 weights" in result["printed"]
    assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    assert result["samples"] == undisturbed["samples"]
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.005, (result["auc"], undisturbed["auc"])


def test_a_receiver_killed_mid_run_is_replaced_and_loses_nothing(fault_config, undisturbed, tmp_path):
    """`training.receiver`: rank 0's receiver process SIGKILLed mid-run. The NN worker starts another and sends it
    every call the dead one had not answered (lookups and pushes are both safe to repeat): the NN worker itself
    is not restarted, no batch is skipped, no update lost, and the run trains every sample once."""
    run_dir = tmp_path / "run"
    result = _run(fault_config, run_dir, kill="receiver", args=("--set", "training.receiver=true"))
    restarted = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert set(restarted.values()) == {0}, restarted
    lost = [json.loads(line) for line in (run_dir / "logs" / "nn_worker-0.log").read_text().splitlines()
            if '"receiver_lost"' in line]
    assert len(lost) == 1 and lost[0]["exit_code"] == -9, lost
    assert result["samples"] == undisturbed["samples"]
    assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.005, (result["auc"], undisturbed["auc"])


def test_losing_every_nn_worker_at_once_goes_back_to_the_newest_default_checkpoint(fault_config, undisturbed,
                                                                                   tmp_path):
    """Both NN workers killed together right after the first time checkpoint: nobody holds the dense state, so
    the group and the data loader restart from that checkpoint and finish. The example trains in under 30 s
    (the default interval) on an idle machine, and in under 10 s on a fast one (a clean-clone CI run finished
    its 123 steps before a 10-s checkpoint), so the interval is 4 s here: the default's mechanism, sooner."""
    run_dir = tmp_path / "run"
    result = _run(fault_config, run_dir, kill="nn_worker", fraction=0.0, replicas=(0, 1), after_checkpoint=True,
                  args=("--set", "checkpoint.interval_s=4"))
    restarted = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert restarted[("nn_worker", 0)] == restarted[("nn_worker", 1)] == restarted[("dataloader", 0)] == 1
    logs = (run_dir / "logs" / "nn_worker-0.log").read_text()
    restored = [json.loads(line) for line in logs.splitlines() if '"checkpoint_restored"' in line]
    assert len(restored) == 1 and restored[0]["step"] > 0, restored
    assert result["samples"] == undisturbed["samples"]
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.005, (result["auc"], undisturbed["auc"])


def test_losing_an_nn_worker_during_a_checkpoint_replaces_it_alone(fault_config, undisturbed, tmp_path):
    """nn_worker 1 SIGKILLed while rank 0 writes an interval checkpoint (rank 1 waits at the checkpoint's last
    barrier): rank 0 re-forms the group around a replacement, as after a loss in a training step. Nobody goes
    back to a checkpoint, and every sample is counted once."""
    run_dir = tmp_path / "run"
    result = _run(fault_config, run_dir, kill="nn_worker", replicas=(1,), fraction=0.16,  # step 20 on (of 122)
                  during_checkpoint=True, args=("--set", "checkpoint.interval_steps=10"))
    restarted = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert restarted[("nn_worker", 1)] == 1, restarted
    assert restarted[("nn_worker", 0)] == 0 and restarted[("dataloader", 0)] == 0, restarted
    logs = (run_dir / "logs" / "nn_worker-0.log").read_text()
    assert '"group_reformed"' in logs and '"checkpoint_restored"' not in logs
    assert result["samples"] == undisturbed["samples"]
    assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.005, (result["auc"], undisturbed["auc"])


CHAOS_EPOCHS = ("--set", "training.epochs=2")
"""The chaos run reads the example's data twice (244 steps), room for five kills with recovery between them."""
CHAOS_KILL_STEPS = (30, 70, 110, 150, 190)
"""Rank 0's steps at which the chaos run kills a process: tied to training progress, not to wall time, so a fast
idle machine and a loaded one see the same number of kills (every 15 s of wall time gave only two on a fast one)."""


@pytest.fixture(scope="module")
def undisturbed_two_epochs(fault_config, tmp_path_factory) -> dict:
    return _run(fault_config, tmp_path_factory.mktemp("undisturbed2"), args=CHAOS_EPOCHS)


def test_chaos_a_random_process_killed_every_40_steps(fault_config, undisturbed_two_epochs, tmp_path):
    """At rank 0's steps 30, 70, ..., 190 (of 244), SIGKILL one process picked at random among every replica of
    the four kinds (seeded): the run finishes within 0.01 AUC of the undisturbed one, with no update lost."""
    import random

    undisturbed = undisturbed_two_epochs
    assert undisturbed["steps"] > CHAOS_KILL_STEPS[-1], undisturbed["steps"]
    run_dir = tmp_path / "run"
    summary = run_dir / "summary-out.json"
    proc = subprocess.Popen(HYBRIDREC + ["run", str(fault_config), "--run-dir", str(run_dir), "--summary-json",
                                         str(summary), *CHAOS_EPOCHS], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    rng = random.Random(14)
    kinds = {"embedding_ps": 2, "embedding_worker": 1, "nn_worker": 2, "dataloader": 1}
    killed: list[str] = []
    deadline = time.monotonic() + 900
    for at_step in CHAOS_KILL_STEPS:
        service = rng.choice(sorted(kinds))
        replica = rng.randrange(kinds[service])
        pattern = f"serve {service} --config {run_dir / 'config.yaml'} --replica {replica}"
        while proc.poll() is None and time.monotonic() < deadline:
            step = rank_step(run_dir)
            targets = [p for p in psutil.process_iter(["cmdline"]) if pattern in " ".join(p.info["cmdline"] or [])]
            if step is not None and step >= at_step and targets:  # a process being restarted is waited for
                for p in targets:
                    p.send_signal(signal.SIGKILL)
                killed.append(f"{service}-{replica}@{step}")
                break
            time.sleep(0.2)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(summary.read_text())
    print(f"chaos: killed {killed}; AUC {result['auc']:.4f} (undisturbed {undisturbed['auc']:.4f}); "
          f"lost updates {result['lost_updates']}; skipped batches {result['skipped_batches']}")
    assert len(killed) == len(CHAOS_KILL_STEPS), killed
    assert result["samples"] == undisturbed["samples"]
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.01, (result["auc"], undisturbed["auc"])
    assert result["lost_updates"] == 0, result


def _events(log: Path, event: str) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if f'"event": "{event}"' in line]


def test_a_ps_host_lost_after_a_checkpoint_restores_it_and_counts_what_was_lost(fault_config, undisturbed,
                                                                                  tmp_path):
    """PS shard 0's store removed and its process killed after the first checkpoint: what a rescheduled pod on
    a new node, or a rebooted machine, gives it. The restarted shard finds no store in a job that trained it, so
    it loads its part of the newest checkpoint before it serves, and the run counts the updates it had
    acknowledged since that checkpoint as lost, the same number the NN workers' own record gives."""
    import shutil

    run_dir = tmp_path / "run"
    shard_dir = {}

    def remove_store() -> None:  # removed first: the launcher restarts a killed PS within a tenth of a second
        shm_dir = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["ps"]["shm_dir"])
        shard_dir["path"] = shm_dir / "shard-00000"
        shutil.rmtree(shard_dir["path"])

    result = _run(fault_config, run_dir, kill="embedding_ps", fraction=0.0, after_checkpoint=True,
                  before_kill=remove_store, args=("--set", "checkpoint.interval_s=5"))
    assert result["shards_restored"] == 1 and len(result["store_losses"]) == 1, result
    loss = result["store_losses"][0]
    assert loss["shard"] == 0 and loss["restored_step"] > 0, loss
    ps_log = run_dir / "logs" / "embedding_ps-0.log"
    restored = _events(ps_log, "ps_shard_restored")
    assert len(restored) == 1 and restored[0]["step"] == loss["restored_step"], restored
    # Never an empty table served: the restarted shard opened with the checkpoint's rows, before it listened.
    opened = _events(ps_log, "stores_open")
    assert len(opened) == 2 and opened[1]["lives_lost"] == 1 and sum(opened[1]["rows"].values()) > 0, opened
    assert sum(restored[0]["rows"].values()) == sum(opened[1]["rows"].values())
    # The NN workers' own record: every update of theirs that the lost life acknowledged.
    acked = sum(n for rank in (0, 1)
                for shard, life, n in _events(run_dir / "logs" / f"nn_worker-{rank}.log", "train_done")[-1]["ps_acks"]
                if shard == 0 and life == loss["life"])
    assert acked == loss["acknowledged"] >= loss["applied_at_checkpoint"] > 0, (acked, loss)
    assert loss["lost"] == acked - loss["applied_at_checkpoint"]
    assert result["lost_updates"] == loss["lost"] and result["skipped_batches"] == 0, result
    assert result["samples"] == undisturbed["samples"]
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.01, (result["auc"], undisturbed["auc"])


def test_a_ps_host_lost_with_a_replica_copies_the_shard_back_and_loses_nothing(fault_config, undisturbed,
                                                                                tmp_path):
    """The same fault with `ps.replicas: 2`: shard 0's backup (kept by PS 1) held every update shard 0 had
    acknowledged, so the restarted shard copies it back before it serves, inherits the update ids it
    remembers (a re-sent update is still applied once), and nothing is lost; PS 0's own backup of shard 1,
    gone with its store, catches up again from shard 1."""
    import shutil

    run_dir = tmp_path / "run"

    def remove_store() -> None:
        shm_dir = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["ps"]["shm_dir"])
        shutil.rmtree(shm_dir / "shard-00000")
        shutil.rmtree(shm_dir / "backup-00001")

    result = _run(fault_config, run_dir, kill="embedding_ps", fraction=0.0, after_checkpoint=True,
                  before_kill=remove_store, args=("--set", "checkpoint.interval_s=5", "--set", "ps.replicas=2"))
    assert result["shards_restored"] == 1 and len(result["store_losses"]) == 1, result
    loss = result["store_losses"][0]
    assert loss["shard"] == 0 and loss["from_replica"] and loss["lost"] == 0, loss
    ps_log = run_dir / "logs" / "embedding_ps-0.log"
    assert not _events(ps_log, "ps_shard_restored")  # not from the checkpoint
    copied = _events(ps_log, "ps_shard_restored_from_backup")
    assert len(copied) == 1 and copied[0]["rows"] > 0, copied
    opened = _events(ps_log, "stores_open")  # never an empty table served: copied before it listened
    assert len(opened) == 2 and opened[1]["lives_lost"] == 1 and sum(opened[1]["rows"].values()) == copied[0]["rows"]
    acked = sum(n for rank in (0, 1)
                for shard, life, n in _events(run_dir / "logs" / f"nn_worker-{rank}.log", "train_done")[-1]["ps_acks"]
                if shard == 0 and life == loss["life"])
    assert acked == loss["acknowledged"] > 0 and loss["applied_at_checkpoint"] >= acked, (acked, loss)
    in_sync = _events(ps_log, "backup_in_sync")  # PS 0's backup of shard 1, at start and after the loss
    assert len(in_sync) >= 2 and in_sync[-1]["shard"] == 1, in_sync
    assert result["lost_updates"] == 0 and result["skipped_batches"] == 0, result
    assert result["samples"] == undisturbed["samples"]
    assert abs(result["auc"] - undisturbed["auc"]) <= 0.005, (result["auc"], undisturbed["auc"])


# -- one of three data loaders killed ------------------------------------------------------------------------

LOADERS = ["127.0.0.1:0"] * 3
SMALL_BATCH = 500  # 60,000 rows: 40 batches a loader, 20 steps of each per rank: room for a kill mid-stream


def _three_loader_config(tmp_path: Path, small_data: Path, train: list[str], stream: dict | None = None) -> Path:
    """The small test job with three data loaders, trained on `train` (or, with `stream`, on data.stream)."""
    from tests.conftest import write_config

    path = write_config(tmp_path / "config.yaml", small_data, training={"batch_size": SMALL_BATCH},
                        cluster={"dataloader": LOADERS})
    tree = yaml.safe_load(path.read_text())
    tree["data"]["train"] = train
    if stream is not None:
        tree["data"]["stream"] = stream
    path.write_text(yaml.safe_dump(tree))
    return path


def _run_killing_a_loader(config: Path, run_dir: Path, *, at_step: int, loader: int = 1,
                          while_running=lambda: None, service: str = "dataloader", also=lambda: True) -> dict:
    """`hybridrec run` with each NN worker's trace of the batches it trained (`batch_trained`, a debug line),
    data loader `loader` (or replica `loader` of `service`) SIGKILLed once rank 0 is at `at_step` and `also()`
    holds (the launcher replaces it alone)."""
    import os

    summary = run_dir / "summary-out.json"
    proc = subprocess.Popen(HYBRIDREC + ["run", str(config), "--run-dir", str(run_dir), "--summary-json",
                                         str(summary)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "HYBRIDREC_LOG_LEVEL": "DEBUG"})
    while_running()
    pattern = f"serve {service} --config {run_dir / 'config.yaml'} --replica {loader}"
    deadline = time.monotonic() + 300
    while (step := rank_step(run_dir)) is None or step < at_step or not also():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
        time.sleep(0.02)
    (target,) = [p for p in psutil.process_iter(["cmdline"]) if pattern in " ".join(p.info["cmdline"] or [])]
    target.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(summary.read_text())


def _trained(run_dir: Path) -> dict[tuple[int, int], tuple[int, tuple[int, ...]]]:
    """(loader, seq) -> (rows, position after it) of every batch an NN worker trained; each batch once."""
    out: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
    logs = sorted((run_dir / "logs").glob("nn_worker-*.log"))
    for log in logs:
        for entry in _events(log, "batch_trained"):
            key = (entry["loader"], entry["seq"])
            assert key not in out, f"batch {key} trained twice"
            assert not entry["lost"], entry
            out[key] = (entry["rows"], tuple(entry["position"]))
    for log in logs:  # trained by a rank killed before its batch_trained line: its replacement says so
        for entry in _events(log, "batch_settled"):
            out.setdefault((entry["loader"], entry["seq"]), (entry["rows"], tuple(entry["position"])))
    return out


def _assert_each_sample_trained_once(run_dir: Path, bounds: list[tuple[int, int]]) -> None:
    """Every loader's stream was trained in order, once, and its batches hold every line of the loader's split
    exactly once. `bounds`: per loader, the `line` of the positions at its split's start and end (a TSV line
    number; prepared data: the row + 1). A batch holds the lines between the position before it and its own
    (the final round is one piece of data split among the ranks: its batches share one position)."""
    trained = _trained(run_dir)
    for loader, (start, end) in enumerate(bounds):
        batches = sorted((seq, rows, position) for (l, seq), (rows, position) in trained.items() if l == loader)
        assert [seq for seq, _, _ in batches] == list(range(len(batches))), (loader, [s for s, _, _ in batches])
        line, i = start, 0
        while i < len(batches):
            position, rows = batches[i][2], 0
            while i < len(batches) and batches[i][2] == position:
                rows += batches[i][1]
                i += 1
            assert rows == position[3] - line, (loader, position, rows, line)
            line = position[3]
        assert line == end, (loader, line, end)


def _split_lines(config_path: Path, count_lines) -> list[tuple[int, int]]:
    """Per data loader, the `line` at its split's start and end (of the one training file or shard it has a
    part of; `count_lines(file, offset)`)."""
    from hybridrec.core.config import load_config
    from services.dataloader.sources import split

    config = load_config(config_path, [])
    out = []
    for loader in range(len(config.cluster.dataloader)):
        ((file, part),) = [(f, p) for f, p in enumerate(split(config, "data.train", loader)) if p is not None]
        out.append((count_lines(file, part.start), count_lines(file, part.stop)))
    return out


def _check_loader_replaced(result: dict, run_dir: Path, loader: int = 1) -> None:
    restarts = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert restarts == {**{k: 0 for k in restarts}, ("dataloader", loader): 1}, restarts  # it alone
    resumed = [json.loads(line) for line in (run_dir / "logs" / f"dataloader-{loader}.log").read_text().splitlines()
               if '"resuming"' in line]
    assert len(resumed) == 1 and resumed[0]["source"] == "ranks" and resumed[0]["seq"] > 0, resumed
    assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    assert result["data"]["train"]["loaders"][loader]["first_seq"] == resumed[0]["seq"]


def test_one_of_three_loaders_killed_mid_run_on_tsv_trains_every_sample_once(small_data, tmp_path):
    """Three loaders, each on its byte range of the one training file; loader 1 SIGKILLed mid-stream. It is
    replaced alone, reads on from where the NN workers are, and every line of every split is trained once."""
    config = _three_loader_config(tmp_path, small_data, [str(small_data / "train.tsv")])
    run_dir = tmp_path / "run"
    result = _run_killing_a_loader(config, run_dir, at_step=8)
    _check_loader_replaced(result, run_dir)
    assert result["samples"] == 60_000 and result["data"]["eval"]["rows"] == 20_000, result["data"]
    data = (small_data / "train.tsv").read_bytes()
    _assert_each_sample_trained_once(run_dir, _split_lines(
        run_dir / "config.yaml", lambda _, offset: 1 + data.count(b"\n", 0, len(data) if offset is None else offset)))
    assert result["auc"] > 0.6


def test_one_of_three_loaders_killed_mid_run_on_prepared_data_trains_every_sample_once(small_data, tmp_path):
    prepared = tmp_path / "train.prep"
    out = subprocess.run(HYBRIDREC + ["data", "prepare", str(small_data / "train.tsv"), "--out", str(prepared)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    config = _three_loader_config(tmp_path, small_data, [str(prepared)])
    run_dir = tmp_path / "run"
    result = _run_killing_a_loader(config, run_dir, at_step=8)
    _check_loader_replaced(result, run_dir)
    assert result["samples"] == 60_000, result["data"]
    _assert_each_sample_trained_once(run_dir, _split_lines(run_dir / "config.yaml",
                                                           lambda _, row: (60_000 if row is None else row) + 1))


def test_an_nn_worker_replaced_after_a_loader_finished_gets_that_loaders_frames_again(small_data, tmp_path):
    """Three gzip files of 40,000, 15,000 and 5,000 lines, one per loader: loader 2 sends all it has (its end of
    training and its eval data) early, and waits. NN worker 1 SIGKILLed after that: its replacement takes the
    steps per loader from its peer, and loader 2 sends it again what it had not confirmed, its end included,
    without which the replacement would wait for loader 2 for ever. Every sample is trained once."""
    import gzip

    lines = (small_data / "train.tsv").read_bytes().splitlines(keepends=True)
    files = []
    for name, (a, b) in zip("abc", [(0, 40_000), (40_000, 55_000), (55_000, 60_000)]):
        files.append(tmp_path / f"{name}.tsv.gz")
        with gzip.open(files[-1], "wb") as f:
            f.write(b"".join(lines[a:b]))
    config = _three_loader_config(tmp_path, small_data, [str(f) for f in files])
    run_dir = tmp_path / "run"
    finished = run_dir / "logs" / "dataloader-2.log"
    result = _run_killing_a_loader(config, run_dir, at_step=25, loader=1, service="nn_worker",
                                   also=lambda: finished.is_file() and '"eval_data_sent"' in finished.read_text())
    restarts = {(s["name"], s["replica"]): s["restarts"] for s in result["services"]}
    assert restarts == {**{k: 0 for k in restarts}, ("nn_worker", 1): 1}, restarts
    assert '"group_reformed"' in (run_dir / "logs" / "nn_worker-0.log").read_text()
    again = _events(finished, "frames_sent_again")
    assert again and again[0]["rank"] == 1 and again[0]["ended"] == "eval", again
    assert result["samples"] == 60_000 and result["eval_samples"] == 20_000, result
    assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    _assert_each_sample_trained_once(run_dir, [(1, 40_001), (1, 15_001), (1, 5_001)])
    for rank in (0, 1):  # each rank, done, stayed up until every loader had heard so (else loaders wait 300 s)
        assert [e["loaders"] for e in _events(run_dir / "logs" / f"nn_worker-{rank}.log", "loaders_told")] == [3]


def test_one_of_three_loaders_killed_mid_stream_trains_every_event_once(small_data, tmp_path):
    """The stream in three partitions (`hybridrec data replay --partitions 3`), one per loader, each through its
    own durable consumer; loader 1 SIGKILLed in the middle of the replay. Every event is trained once and every
    message of every partition (its end marker included) is acknowledged."""
    import asyncio

    from hybridrec.app.run.broker import create_stream
    from hybridrec.core.config import StreamConfig
    from tests.integration.test_stream import SUBJECT, Broker, _assert_each_event_once

    broker = Broker(tmp_path)
    try:
        asyncio.run(create_stream(broker.url, StreamConfig(), partitions=3))
        config = _three_loader_config(tmp_path, small_data, [], stream={"url": broker.url, "until_event": 60_000})
        run_dir = tmp_path / "run"
        replaying = []

        def replay() -> None:  # from the moment every loader reads its partition: the kill comes mid-replay
            logs = [run_dir / "logs" / f"dataloader-{loader}.log" for loader in range(3)]
            deadline = time.monotonic() + 120
            while not all(log.is_file() and '"stream_reading"' in log.read_text() for log in logs):
                assert time.monotonic() < deadline, "the loaders did not start reading the stream"
                time.sleep(0.05)
            replaying.append(subprocess.Popen(HYBRIDREC + [
                "data", "replay", str(small_data / "train.tsv"), "--to", f"{broker.url}/{SUBJECT}", "--rate", "10000",
                "--limit", "60000", "--partitions", "3"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))

        result = _run_killing_a_loader(config, run_dir, at_step=8, while_running=replay)
        out, err = replaying[0].communicate(timeout=300)
        assert replaying[0].returncode == 0, err
        assert "published 60,000 events (0..59999) in 600 messages" in out, out
        _check_loader_replaced(result, run_dir)
        assert result["samples"] == 60_000 and result["data"]["train"]["rows"] <= 60_000, result["data"]
        _assert_each_event_once(run_dir, 60_000, loaders=3)
        stream = result["stream"]  # the loaders' accounts, merged; the restarted one went on with its predecessor's
        assert [p["partition"] for p in stream["partitions"]] == [0, 1, 2], stream
        assert [p["events"] for p in stream["partitions"]] == [20_000, 20_000, 20_000], stream
        assert [p["loader_restarts"] for p in stream["partitions"]] == [0, 1, 0], stream
        assert stream["events"] == 60_000 and stream["loader_restarts"] == 1, stream
        # 600 messages (partition p: p + 1, p + 4, ...), then each partition's end marker (601, 602, 603).
        # Partitions 0 and 1 end at their markers, acknowledged; partition 2 ends with the message holding event
        # 59,999 (sequence 600) without waiting for its marker, which a next job passes over.
        for partition, expected in enumerate([(601, 0), (602, 0), (600, 1)]):
            floor, pending, delivered = _partition_consumer(broker.url, partition)
            assert (floor, pending) == expected, (partition, floor, pending, delivered)
    finally:
        broker.stop()


def _partition_consumer(url: str, partition: int) -> tuple[int, int, tuple[int, int]]:
    """A partition's consumer: (ack floor's stream sequence, messages not delivered or not acknowledged, (its
    own sequence of the last acknowledged and of the last delivered message))."""
    import asyncio

    async def ask():
        import nats

        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().consumer_info("HYBRIDREC_EVENTS", f"hybridrec-trainer-{partition}")
            return (info.ack_floor.stream_seq, info.num_ack_pending + info.num_pending,
                    (info.ack_floor.consumer_seq, info.delivered.consumer_seq))
        finally:
            await nc.close()

    return asyncio.run(ask())
