"""The task and job state machine: which transitions are legal and what a job's state is.

A job's state is derived from its tasks', so it can never disagree with them.
"""

from __future__ import annotations

from collections.abc import Iterable

from federation.api.v1 import jobs_pb2

S = jobs_pb2.JobState
PENDING = jobs_pb2.JOB_STATE_PENDING
SCHEDULING = jobs_pb2.JOB_STATE_SCHEDULING
DELEGATED = jobs_pb2.JOB_STATE_DELEGATED
RUNNING = jobs_pb2.JOB_STATE_RUNNING
SUCCEEDED = jobs_pb2.JOB_STATE_SUCCEEDED
FAILED = jobs_pb2.JOB_STATE_FAILED
CANCELLED = jobs_pb2.JOB_STATE_CANCELLED

TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
AT_SITE = frozenset({DELEGATED, RUNNING})

# A task stays PENDING while its offers are out and becomes DELEGATED once a site accepted one.
# A RUNNING task goes back to DELEGATED when the site's own scheduler puts it back in its queue
# (Slurm requeues a job it preempted or whose node failed). It returns to PENDING when every
# site declined it, a commit failed, its site lost it, or it was moved away from a lost site.
# SCHEDULING (offers out) is no longer written, since offers need no write before they leave;
# a store written by an earlier version may still hold it.
TRANSITIONS: dict[int, frozenset[int]] = {
    PENDING: frozenset({PENDING, SCHEDULING, DELEGATED, CANCELLED}),
    SCHEDULING: frozenset({PENDING, SCHEDULING, DELEGATED, CANCELLED}),
    DELEGATED: frozenset({PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED}),
    RUNNING: frozenset({PENDING, DELEGATED, SUCCEEDED, FAILED, CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


# Only when taking back an original copy that came back from a lost site, running, and the
# job's reconcile rule keeps it: the task was PENDING (moved away), and runs again at once.
TAKE_BACK: frozenset[tuple[int, int]] = frozenset({(PENDING, RUNNING)})


class IllegalTransitionError(RuntimeError):
    """A bug: code tried a transition the state machine forbids."""


def check_transition(current: int, new: int, *, taking_back: bool = False) -> None:
    """Raise ``IllegalTransitionError`` unless ``current -> new`` is allowed.

    ``taking_back`` also allows the ``TAKE_BACK`` transitions (reconcile keeps an original).
    """
    if taking_back and (current, new) in TAKE_BACK:
        return
    if new not in TRANSITIONS.get(current, frozenset()):
        raise IllegalTransitionError(f"task cannot go from {_name(current)} to {_name(new)}")


def _name(state: int) -> str:
    return S.Name(state) if state in S.values() else f"unknown state {state}"  # type: ignore[arg-type]


def job_state(task_states: Iterable[int]) -> jobs_pb2.JobState.ValueType:
    """The job's state given its tasks' states.

    A job is terminal only when every task is; a failure wins over a cancellation, which wins
    over success. Otherwise the most advanced active task decides.
    """
    states = set(task_states)  # a hot path: one set, then only membership tests
    if not states:
        return PENDING
    if states <= TERMINAL:
        if FAILED in states:
            return FAILED
        return CANCELLED if CANCELLED in states else SUCCEEDED
    for candidate in (RUNNING, DELEGATED, SCHEDULING):
        if candidate in states:
            return candidate
    return PENDING


def is_terminal(state: int) -> bool:
    """Whether nothing more will happen to a task or job in ``state``."""
    return state in TERMINAL
