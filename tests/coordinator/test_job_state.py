"""The task state machine and how a job's state follows from its tasks'."""

from __future__ import annotations

import itertools

import pytest

from federation.common.job_state import (
    IllegalTransitionError,
    check_transition,
    is_terminal,
    job_state,
)
from federation.jobspec import state_name

P, SCH, DEL, RUN, OK, FAIL, CAN = range(1, 8)
STATES = (P, SCH, DEL, RUN, OK, FAIL, CAN)
NAMES = dict(zip(STATES, ("P", "SCH", "DEL", "RUN", "OK", "FAIL", "CAN"), strict=True))

# Written out by hand from the documented lifecycle, not copied from the module.
LEGAL = {
    (P, P), (P, SCH), (P, DEL), (P, CAN),
    (SCH, P), (SCH, SCH), (SCH, DEL), (SCH, CAN),
    (DEL, P), (DEL, RUN), (DEL, OK), (DEL, FAIL), (DEL, CAN),
    (RUN, P), (RUN, DEL), (RUN, OK), (RUN, FAIL), (RUN, CAN),  # RUN -> DEL: the site requeued it
}  # fmt: skip
ILLEGAL = set(itertools.product(STATES, STATES)) - LEGAL


def test_state_numbers_match_the_proto() -> None:
    """The shorthand used in these tables names the proto's JobState values."""
    assert [state_name(s) for s in STATES] == [
        "PENDING",
        "SCHEDULING",
        "DELEGATED",
        "RUNNING",
        "SUCCEEDED",
        "FAILED",
        "CANCELLED",
    ]


@pytest.mark.parametrize(
    ("current", "new"), sorted(LEGAL), ids=[f"{NAMES[a]}->{NAMES[b]}" for a, b in sorted(LEGAL)]
)
def test_legal_transitions_are_allowed(current: int, new: int) -> None:
    """Every transition of the lifecycle passes the check."""
    check_transition(current, new)


@pytest.mark.parametrize(
    ("current", "new"),
    sorted(ILLEGAL),
    ids=[f"{NAMES[a]}->{NAMES[b]}" for a, b in sorted(ILLEGAL)],
)
def test_illegal_transitions_raise(current: int, new: int) -> None:
    """Any other transition raises IllegalTransitionError naming both states."""
    with pytest.raises(IllegalTransitionError) as caught:
        check_transition(current, new)
    assert state_name(current) in str(caught.value)
    assert state_name(new) in str(caught.value)


@pytest.mark.parametrize("state", STATES)
def test_only_succeeded_failed_cancelled_are_terminal(state: int) -> None:
    """Exactly the three end states are terminal."""
    assert is_terminal(state) is (state in (OK, FAIL, CAN))


@pytest.mark.parametrize(
    ("tasks", "expected"),
    [
        pytest.param([], P, id="no-tasks"),
        pytest.param([P], P, id="one-pending"),
        pytest.param([OK, OK, OK], OK, id="all-succeeded"),
        pytest.param([OK, FAIL, OK], FAIL, id="terminal-with-failure"),
        pytest.param([CAN, FAIL], FAIL, id="failure-beats-cancel"),
        pytest.param([OK, CAN], CAN, id="cancel-beats-success"),
        pytest.param([FAIL, RUN], RUN, id="failure-waits-for-running"),
        pytest.param([FAIL, P], P, id="failure-waits-for-pending"),
        pytest.param([CAN, SCH], SCH, id="cancel-waits-for-scheduling"),
        pytest.param([OK, P], P, id="success-and-pending"),
        pytest.param([DEL, RUN, P], RUN, id="running-beats-delegated"),
        pytest.param([P, DEL, SCH], DEL, id="delegated-beats-scheduling"),
        pytest.param([P, SCH, P], SCH, id="scheduling-beats-pending"),
        pytest.param([OK, DEL], DEL, id="success-and-delegated"),
    ],
)
def test_job_state_aggregates_task_states(tasks: list[int], expected: int) -> None:
    """A job is terminal only once every task is; otherwise its most advanced task decides."""
    assert state_name(job_state(tasks)) == state_name(expected)


@pytest.mark.parametrize("tasks", list(itertools.permutations([P, DEL, RUN, FAIL])))
def test_job_state_ignores_task_order(tasks: tuple[int, ...]) -> None:
    """The order of the tasks does not affect the job's state."""
    assert job_state(tasks) == RUN


def test_job_state_accepts_a_generator() -> None:
    """job_state consumes any iterable, including a one-shot generator."""
    assert job_state(s for s in (OK, FAIL)) == FAIL


@pytest.mark.parametrize(("current", "new"), [(0, P), (P, 42)], ids=["from-unspecified", "to-42"])
def test_unknown_states_raise_illegal_transition(current: int, new: int) -> None:
    """A transition from or to a state outside the lifecycle is an IllegalTransitionError."""
    with pytest.raises(IllegalTransitionError):
        check_transition(current, new)


def test_taking_back_an_original_may_go_from_pending_to_running() -> None:
    """PENDING -> RUNNING is allowed only when taking back a kept original copy."""
    check_transition(P, RUN, taking_back=True)
    with pytest.raises(IllegalTransitionError):
        check_transition(P, RUN)
    with pytest.raises(IllegalTransitionError):
        check_transition(P, OK, taking_back=True)
