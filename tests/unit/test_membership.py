"""Forming and re-forming the NN workers' group (services/nn_worker/group/membership.py) and handing the dense state
to a replacement (handover.py), with real processes and real Gloo groups."""
from __future__ import annotations

import json
import multiprocessing as mp
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hybridrec.app.run.ports import free_port
from services.nn_worker.group import membership
from services.nn_worker.group.membership import Fingerprint, Membership, is_group_failure
from tests.unit.membership_ranks import handover_rank, refusal_rank


_port = free_port  # below the ephemeral range: no outgoing connection can take it first


def _errors(out: Path) -> dict[str, str]:
    """The ranks' tracebacks (a rank that fails writes rank<N>.err, then exits 3)."""
    return {e.name: e.read_text() for e in out.glob("*.err")}


def _a_correct_rank_joins(ctx, rank0, port: int, tmp_path) -> None:
    """Rank 1 of the right config joins the waiting rank 0; both end with a group of two."""
    correct = ctx.Process(target=refusal_rank, args=(1, port, str(tmp_path), "good", 60))
    correct.start()
    for p in (rank0, correct):
        p.join(300)
    assert rank0.exitcode == 0 and correct.exitcode == 0, (rank0.exitcode, correct.exitcode, _errors(tmp_path))
    assert json.loads((tmp_path / "rank0-good.json").read_text()) == {"joined": 1}
    assert json.loads((tmp_path / "rank1-good.json").read_text()) == {"joined": 1}


def _run(procs: list, out: Path, timeout: float = 120) -> None:
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    assert all(p.exitcode == 0 for p in procs), ([p.exitcode for p in procs], _errors(out))


def _wait_ready(proc, ready: Path, out: Path) -> None:
    """Until `proc` has imported torch and is about to join (`refusal_rank` touches `ready`)."""
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.is_alive() and time.monotonic() < deadline, _errors(out)
        time.sleep(0.05)


def test_a_fresh_rank_takes_model_optimizer_and_counters_from_the_source(tmp_path):
    ctx = mp.get_context("spawn")
    port = _port()
    _run([ctx.Process(target=handover_rank, args=(r, port, str(tmp_path))) for r in range(2)], tmp_path)
    assert not _errors(tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["first"] == [1, None] and r1["first"] == [1, None]  # nobody had state: a cold start
    assert r0["second"] == [2, 0, [1]] == r1["second"]  # the next generation, rank 0 the source, rank 1 fresh
    np.testing.assert_array_equal(r0["params"], r1["params"])
    assert r0["moments"] == r1["moments"] and all(m != 0 for m in r0["moments"])  # Adam's moments came along
    assert r1["steps"] == [5.0] * len(r1["steps"])
    assert r1["handed"] == {"steps": 5.0} and r1["wall"] == 12.5


def test_a_replacement_with_another_config_is_refused_and_the_group_waits_for_a_correct_one(tmp_path):
    ctx = mp.get_context("spawn")
    port = _port()
    # Rank 0 waits out two spawns in a row (each imports torch): 300 s, which costs nothing when all goes well
    rank0 = ctx.Process(target=refusal_rank, args=(0, port, str(tmp_path), "good", 300))
    stranger = ctx.Process(target=refusal_rank, args=(1, port, str(tmp_path), "other", 60))
    rank0.start()
    stranger.start()
    stranger.join(60)
    assert json.loads((tmp_path / "rank1-other.json").read_text()) == {
        "error": "rank 0 refused this NN worker (rank 1): its config (features, model, optimizer, training, data) "
                 "differs"}
    time.sleep(0.5)
    assert rank0.is_alive()  # still waiting for a correct rank 1
    _a_correct_rank_joins(ctx, rank0, port, tmp_path)


def test_the_group_stops_naming_missing_ranks_and_refusals_after_the_timeout(tmp_path):
    ctx = mp.get_context("spawn")
    port = _port()
    rank0 = ctx.Process(target=refusal_rank, args=(0, port, str(tmp_path), "good", 4))
    stranger = ctx.Process(target=refusal_rank, args=(1, port, str(tmp_path), "other", 30))
    # The stranger first, and rank 0 once it has imported torch: on a loaded machine its imports alone could
    # outlast rank 0's 4 s, and rank 0 would time out without having heard it (the stranger retries the store).
    stranger.start()
    _wait_ready(stranger, tmp_path / "rank1-other.ready", tmp_path)
    _run([rank0], tmp_path, timeout=60)
    stranger.join(60)
    assert stranger.exitcode == 0, (stranger.exitcode, _errors(tmp_path))
    error = json.loads((tmp_path / "rank0-good.json").read_text())["error"]
    assert "rank(s) [1] did not join the group within cluster.rejoin_timeout_s=4s" in error
    assert "refused: rank 1: its config" in error


def test_fingerprints_name_what_differs():
    a = Fingerprint("c1", 2, "m1")
    assert a.differences(Fingerprint("c1", 2, "m1")) == []
    assert a.differences(Fingerprint("c1", 3, "m2")) == [
        "its world size is 3, the group's 2", "its dense model has other parameter names, shapes or dtypes"]


@pytest.mark.parametrize("exc, lost", [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("gloo"), False),
])
def test_only_a_lost_peer_counts_as_a_group_failure(exc, lost):
    assert is_group_failure(exc) is lost


def test_a_malformed_lobby_entry_is_ignored_and_the_group_still_forms(tmp_path):
    """Anything that reaches rank 0's store can write a lobby entry: one that is not a join request (not JSON,
    fields missing, of the wrong type or out of range) is dropped and logged, and rank 0 goes on waiting for
    the rank (on 3b8ae06 it raised inside the coordinator and ended the group)."""
    import datetime

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    port = _port()
    rank0 = ctx.Process(target=refusal_rank, args=(0, port, str(tmp_path), "good", 300))
    rank0.start()
    _wait_ready(rank0, tmp_path / "rank0-good.ready", tmp_path)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    good = {"nonce": "ab12", "rank": 1, "generation": 0, "step": None,
            "fingerprint": {"config": "good", "world_size": 2, "model": "model"}}
    for entry in (b"not json", b"[1, 2]", json.dumps({**good, "fingerprint": None}).encode(),
                  json.dumps({**good, "rank": -1}).encode(), json.dumps({**good, "nonce": "x" * 500}).encode(),
                  json.dumps({**good, "step": "7"}).encode(), b"\xff" * 100):
        client.set("lobby/1", entry)
        while client.check(["lobby/1"]):  # rank 0 took it
            assert rank0.is_alive(), _errors(tmp_path)
            time.sleep(0.02)
    time.sleep(0.3)
    assert rank0.is_alive(), _errors(tmp_path)
    _a_correct_rank_joins(ctx, rank0, port, tmp_path)


def test_a_rank_up_before_rank_0_connects_as_soon_as_its_store_listens(monkeypatch):
    """A rank that comes up before rank 0's store (forked together at a run's start) tries again every
    CONNECT_POLL_S rather than by the TCPStore client's own back-off (up to 0.75 s late): it keeps waiting while
    nothing listens, and returns once something does. Asserts the order of events, not a duration."""
    port = _port()
    rank1 = Membership(rank=1, world_size=2, rendezvous=f"127.0.0.1:{port}", fingerprint=Fingerprint("a", 2, "b"),
                       backend="gloo", join_timeout_s=60)
    pauses: list[float] = []
    real_sleep = time.sleep
    refused_twice, returned = threading.Event(), threading.Event()

    def counting_sleep(seconds: float) -> None:  # called after each refused try
        pauses.append(seconds)
        if len(pauses) >= 2:
            refused_twice.set()
        real_sleep(seconds)

    monkeypatch.setattr(membership.time, "sleep", counting_sleep)
    waiter = threading.Thread(target=lambda: (rank1._await_listener(), returned.set()))
    waiter.start()
    assert refused_twice.wait(30) and not returned.is_set()  # refused twice, still waiting: nothing listens
    with socket.create_server(("127.0.0.1", port)):
        assert returned.wait(30)  # the store listens: it connects
    waiter.join(30)
    assert set(pauses) == {membership.CONNECT_POLL_S}
