"""`hybridrec run`'s restart policy (hybridrec.app.run.launcher.after_death): what happens to a process that exited."""
from __future__ import annotations

import signal

import pytest

from hybridrec.app.run.launcher import Action, after_death
from hybridrec.core.runtime.service import EXIT_PEER_LOST, SERVICES

KILLED = -signal.SIGKILL


def _decide(service: str, rc: int, *, serving=True, budget_left=True, state_held=True, checkpoints=True,
            group_budget_left=True) -> Action:
    return after_death(SERVICES[service], rc, serving=serving, budget_left=budget_left, state_held=state_held,
                       checkpoints=checkpoints, group_budget_left=group_budget_left)


@pytest.mark.parametrize("service", ["nn_worker", "dataloader"])
def test_killed_while_others_hold_the_state_is_replaced_alone(service):
    assert _decide(service, KILLED) is Action.REPLACE
    assert _decide(service, EXIT_PEER_LOST) is Action.REPLACE


@pytest.mark.parametrize("service", ["nn_worker", "dataloader"])
def test_without_the_state_the_group_goes_back_to_a_checkpoint(service):
    assert _decide(service, KILLED, state_held=False) is Action.GROUP
    assert _decide(service, KILLED, state_held=False, checkpoints=False) is Action.FAIL


@pytest.mark.parametrize("service", ["embedding_ps", "embedding_worker"])
def test_ps_and_embedding_workers_restart_in_place(service):
    assert _decide(service, KILLED) is Action.RESTART
    assert _decide(service, 1) is Action.RESTART  # even their own failure, while the budget lasts
    assert _decide(service, 1, budget_left=False) is Action.FAIL


def test_a_process_killed_after_it_served_is_restarted_however_often():
    """Chaos, an OOM killer or an operator: not a crash loop, so the budget does not apply."""
    assert _decide("embedding_worker", KILLED, budget_left=False) is Action.RESTART
    assert _decide("nn_worker", KILLED, budget_left=False) is Action.REPLACE
    assert _decide("nn_worker", KILLED, state_held=False, budget_left=False, group_budget_left=False) is Action.GROUP


def test_a_crash_loop_stops_when_the_budget_is_spent():
    """Deaths before the process ever served count, signals included."""
    assert _decide("embedding_ps", KILLED, serving=False, budget_left=False) is Action.FAIL
    assert _decide("nn_worker", KILLED, serving=False, budget_left=False, group_budget_left=False) is Action.FAIL
    assert _decide("dataloader", KILLED, serving=False, state_held=False, group_budget_left=False) is Action.FAIL


@pytest.mark.parametrize("service", ["nn_worker", "dataloader"])
def test_an_own_failure_of_a_group_member_stops_the_run(service):
    """Exit 1 is a bug or bad input: restarting would only repeat it."""
    assert _decide(service, 1) is Action.FAIL
