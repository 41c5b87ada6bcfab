"""A task stopped for another stays away from that site until the other has started there."""

from __future__ import annotations

import pytest

from federation.api.v1 import jobs_pb2
from federation.common.keys import TaskKey
from federation.coordinator.policy.stopped_for import StoppedFor

URGENT: TaskKey = ("urgent", "main")
VICTIM: TaskKey = ("victim", "main")
P, D, R = jobs_pb2.JOB_STATE_PENDING, jobs_pb2.JOB_STATE_DELEGATED, jobs_pb2.JOB_STATE_RUNNING


def gate(urgent: jobs_pb2.TaskStatus | None, waiting: bool) -> StoppedFor:
    stopped = StoppedFor(lambda key: urgent if key == URGENT else None, lambda key: waiting)
    stopped.stopped("dc", URGENT, [("victim", "main", 1)])
    return stopped


@pytest.mark.parametrize(
    ("state", "site", "waiting", "kept"),
    [
        pytest.param(P, "", True, ["edge"], id="urgent-waits-for-the-room"),
        pytest.param(D, "dc", False, ["edge"], id="urgent-delegated-there-not-started"),
        pytest.param(R, "dc", False, ["dc", "edge"], id="urgent-runs-there"),
        pytest.param(D, "edge", False, ["dc", "edge"], id="urgent-went-elsewhere"),
        pytest.param(P, "", False, ["dc", "edge"], id="urgent-no-longer-waits"),
    ],
)
def test_held_back_from_the_site_until_the_urgent_task_starts(
    state: int, site: str, waiting: bool, kept: list[str]
) -> None:
    """The victim may go anywhere but the site it was stopped at while the task it was stopped
    for waits for that site's room or is delegated there and not started; then anywhere."""
    status = jobs_pb2.TaskStatus(name="main", state=state, site=site)  # type: ignore[arg-type]
    stopped = gate(status, waiting)
    allowed, behind = stopped.room_kept(VICTIM, ["dc", "edge"])
    assert allowed == kept
    assert behind == [s for s in ["dc", "edge"] if s not in kept]


def test_an_ended_urgent_job_or_a_forgotten_victim_holds_nothing_back() -> None:
    """Once the urgent job is gone, or the victim is forgotten, every site is open to it."""
    assert gate(None, True).room_kept(VICTIM, ["dc"]) == (["dc"], [])
    status = jobs_pb2.TaskStatus(name="main", state=P)
    stopped = gate(status, True)
    stopped.forget(VICTIM)
    assert stopped.room_kept(VICTIM, ["dc"]) == (["dc"], [])
    assert gate(status, True).room_kept(("other", "main"), ["dc"]) == (["dc"], [])


def test_a_new_stop_drops_the_entries_whose_urgent_task_has_started() -> None:
    """Victims that never wait again are not kept once their urgent task runs."""
    urgent = jobs_pb2.TaskStatus(name="main", state=P)
    stopped = gate(urgent, True)
    urgent.state, urgent.site = R, "dc"
    stopped.stopped("dc", ("other", "main"), [("victim-2", "main", 1)])
    assert set(stopped._for) == {("victim-2", "main")}
