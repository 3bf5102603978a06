"""The whole hybridrec cluster as containers: health, training to an AUC, a PS killed mid-run.

Each test cluster is 2 PS shards, 1 embedding worker, 2 NN workers and 2 data
loaders on a private Docker network, in the image users run, trained on the
synthetic set of the `synthetic_data` fixture (100k rows). AUC is read from
the summary.json NN worker rank 0 writes into the results volume.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from tests.containers.cluster import DATALOADERS, EMBEDDING_WORKERS, NN_WORKERS, PS, SERVERS, Cluster
from tests.containers.conftest import AUC_THRESHOLD, SYNTH_ROWS

START_TIMEOUT_S = 300
"""Until every server reports SERVING (cold numba/torch start of 5 processes on 2 cores)."""
TRAIN_TIMEOUT_S = 600
"""From the data loader's start until NN worker rank 0 exits."""


@dataclass
class Run:
    cluster: Cluster
    health: dict[str, str] = field(default_factory=dict)
    """What `hybridrec health` answered for each node while the cluster ran."""
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    summary: dict | None = None
    wall_s: float = 0.0


def start_servers(cluster: Cluster, run: Run, *, ps_restart: str = "no", nn_restart: str = "no") -> None:
    for node in SERVERS:
        cluster.start(node, restart=ps_restart if node in PS else nn_restart if node in NN_WORKERS else "no")
    for node in SERVERS:
        run.health[node.name] = cluster.wait_serving(node.name, timeout_s=START_TIMEOUT_S)
    not_serving = {n: h for n, h in run.health.items() if h != "SERVING"}
    assert not not_serving, f"not SERVING after start: {not_serving}\n{cluster.all_logs()}"


def start_loaders(cluster: Cluster) -> None:
    for node in DATALOADERS:
        cluster.start(node)


def wait_for_steps(cluster: Cluster, steps: float) -> float:
    """Rank 0's step count (Stats RPC) once it reaches `steps`; fails if rank 0 stalls or exits first."""
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    done = 0.0
    while done < steps:
        assert time.monotonic() < deadline, f"rank 0 made no progress\n{cluster.all_logs()}"
        assert cluster.running("nn-worker-0"), f"rank 0 exited early\n{cluster.all_logs()}"
        done = cluster.nn_stats("nn-worker-0").get("steps_total", 0.0)
        time.sleep(0.5)
    return done


def finish(cluster: Cluster, run: Run, started: float) -> None:
    """Wait for rank 0 to exit, then collect exit codes and the summary."""
    code = cluster.wait_exit("nn-worker-0", timeout_s=TRAIN_TIMEOUT_S)
    run.wall_s = time.monotonic() - started
    assert code is not None, f"training did not finish within {TRAIN_TIMEOUT_S} s\n{cluster.all_logs()}"
    for node in NN_WORKERS + DATALOADERS:
        run.exit_codes[node.name] = cluster.wait_exit(node.name, timeout_s=60)
    try:
        run.summary = cluster.summary()
    except Exception as exc:  # no summary.json: say why, with the logs
        pytest.fail(f"no /results/summary.json ({exc}); exit codes {run.exit_codes}\n{cluster.all_logs()}")


def assert_trained(run: Run, *, epochs: int = 1, min_fraction: float = 1.0) -> None:
    """Every process exited 0, rank 0 saw (at least min_fraction of) the data, AUC above the threshold."""
    cluster, summary = run.cluster, run.summary
    assert all(code == 0 for code in run.exit_codes.values()), (
        f"exit codes {run.exit_codes}\n{cluster.all_logs()}")
    expected = epochs * SYNTH_ROWS
    assert expected * min_fraction <= summary["samples"] <= expected, (
        f"trained on {summary['samples']} samples, expected {expected}")
    assert summary["auc"] >= AUC_THRESHOLD, (
        f"eval AUC {summary['auc']:.4f} < {AUC_THRESHOLD} (logloss {summary['logloss']:.4f})")


@pytest.fixture(scope="module")
def trained(docker_client, image, synthetic_data, log_root):
    """One undisturbed cluster run; its health observations and summary."""
    cluster = Cluster(docker_client, image, synthetic_data, log_dir=log_root / "undisturbed")
    run = Run(cluster)
    try:
        start_servers(cluster, run)
        # A loader is SERVING from its start until it has sent the eval set, which can take less than a
        # `hybridrec health` exec'd in its container: asked while the embedding worker is paused, so that
        # the loaders wait for it (SERVING) instead of sending.
        cluster.docker(EMBEDDING_WORKERS[0].name).pause()
        try:
            started = time.monotonic()
            start_loaders(cluster)
            for node in DATALOADERS:
                run.health[node.name] = cluster.wait_serving(node.name, timeout_s=START_TIMEOUT_S)
        finally:
            cluster.docker(EMBEDDING_WORKERS[0].name).unpause()
        finish(cluster, run, started)
        yield run
    finally:
        cluster.close()


def test_every_service_answers_the_grpc_health_check_with_serving(trained):
    expected = [n.name for n in SERVERS + DATALOADERS]
    assert sorted(trained.health) == sorted(expected)
    assert all(answer == "SERVING" for answer in trained.health.values()), trained.health


def test_cluster_trains_the_synthetic_set_to_the_auc_threshold(trained):
    assert_trained(trained)
    print(f"containers: AUC {trained.summary['auc']:.4f}, {trained.summary['samples']} samples, "
          f"{trained.wall_s:.0f} s from the data loader's start")


def test_run_survives_sigkill_of_a_ps_process_mid_training(docker_client, image, synthetic_data, log_root):
    """ps-1's process is SIGKILLed inside its container while the NN workers train; the restart
    policy restarts the container, the PS re-attaches to its store (the shm volume lives as long as
    the container) and the run finishes above the AUC threshold."""
    epochs = 3  # long enough to kill in the middle
    cluster = Cluster(docker_client, image, synthetic_data, overrides=(f"training.epochs={epochs}",),
                      log_dir=log_root / "ps-killed")
    run = Run(cluster)
    victim = PS[1].name
    try:
        start_servers(cluster, run, ps_restart="unless-stopped")
        started = time.monotonic()
        start_loaders(cluster)
        # Kill once rank 0 has done some steps (Stats RPC), well before the end of training.
        steps_per_rank = epochs * SYNTH_ROWS // (1024 * len(NN_WORKERS))
        steps = wait_for_steps(cluster, steps_per_rank * 0.2)
        # docker kill would count as a manual stop and disable the restart policy, so the PS
        # process (the child of docker-init, PID 1) is killed from inside the container.
        code, out = cluster.exec(victim, ["sh", "-c", "kill -KILL $(cat /proc/1/task/1/children)"])
        assert code == 0, f"could not kill the PS process in {victim}: {out}"
        killed_at_step = steps
        finish(cluster, run, started)
        state = cluster.state(victim)
        assert state["RestartCount"] >= 1, f"{victim} was not restarted: {state}"
        assert cluster.health(victim) == "SERVING", f"{victim} is not serving after its restart"
        reopened = [line for line in cluster.logs(victim, tail=None).splitlines() if "stores_open" in line]
        assert len(reopened) >= 2, f"{victim} did not reopen its store after the restart:\n{cluster.logs(victim)}"
        assert killed_at_step < steps_per_rank * 0.8, "the kill came too late to be mid-training"
        # Updates in flight to the dead shard may be lost (Persia paper (Lian et al., KDD 2022) §4.2.4),
        # samples may not.
        assert_trained(run, epochs=epochs, min_fraction=0.95)
        print(f"PS killed at step {killed_at_step:.0f} of ~{steps_per_rank}; restarts {state['RestartCount']}; "
              f"AUC {run.summary['auc']:.4f}; lost updates {run.summary.get('lost_updates')}; "
              f"skipped batches {run.summary.get('skipped_batches')}; "
              f"store reopened: {reopened[-1][:200]}")
    finally:
        cluster.close()


def test_run_survives_docker_kill_of_an_nn_worker_container(docker_client, image, synthetic_data, log_root):
    """`docker kill` of nn-worker-1 while the ranks train, then `docker start` of the same container (what an
    orchestrator does; Docker's restart policy ignores a container stopped by `docker kill`). Rank 0 re-forms
    the process group with the restarted process and hands it the dense state; no checkpoint is read and the run
    finishes every sample, above the AUC threshold, with nothing skipped or lost."""
    epochs = 3  # long enough to kill in the middle
    cluster = Cluster(docker_client, image, synthetic_data, overrides=(f"training.epochs={epochs}",),
                      log_dir=log_root / "nn-killed")
    run = Run(cluster)
    victim = NN_WORKERS[1].name
    try:
        start_servers(cluster, run, nn_restart="on-failure")
        started = time.monotonic()
        start_loaders(cluster)
        steps_per_rank = epochs * SYNTH_ROWS // (1024 * len(NN_WORKERS))
        steps = wait_for_steps(cluster, steps_per_rank * 0.3)
        container = cluster.docker(victim)
        container.kill()
        killed_at_step = steps
        container.wait(timeout=60)
        container.start()
        finish(cluster, run, started)
        assert killed_at_step < steps_per_rank * 0.8, f"the kill came too late: step {killed_at_step}"
        assert_trained(run, epochs=epochs)
        rank0 = cluster.logs("nn-worker-0", tail=None)
        assert '"group_reformed"' in rank0 and '"checkpoint_restored"' not in rank0, rank0[-3000:]
        replaced = cluster.logs(victim, tail=None)
        assert '"replaced_a_lost_rank"' in replaced, replaced[-3000:]
        assert run.summary["skipped_batches"] == 0 and run.summary["lost_updates"] == 0, run.summary
        print(f"nn-worker-1 killed at step {killed_at_step:.0f} of ~{steps_per_rank}; "
              f"AUC {run.summary['auc']:.4f}; samples {run.summary['samples']}")
    finally:
        cluster.close()
