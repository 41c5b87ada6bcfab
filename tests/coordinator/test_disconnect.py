"""The lost-site rules: policy defaults, when to move, partition suspicion, which copy wins."""

from __future__ import annotations

import pytest
from google.protobuf import timestamp_pb2

from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common import job_state
from federation.coordinator.sites.disconnect import (
    BEST,
    KEEP_ORIGINAL,
    KEEP_REPLACEMENT,
    Policy,
    is_displaced_original,
    is_due,
    is_newer_checkpoint,
    is_partitioned,
    original_wins,
    policy_of,
    replace_after_s,
)
from federation.jobspec import job_spec_from_dict


def spec_with(disconnect: dict[str, object] | None) -> jobs_pb2.JobSpec:
    doc: dict[str, object] = {"name": "j", "tasks": [{"name": "t", "command": ["x"]}]}
    if disconnect is not None:
        doc["disconnect"] = disconnect
    return job_spec_from_dict(doc)


@pytest.mark.parametrize(
    ("disconnect", "expected"),
    [
        pytest.param(None, Policy(60.0, True, KEEP_REPLACEMENT), id="unset"),
        pytest.param({}, Policy(60.0, True, KEEP_REPLACEMENT), id="empty"),
        pytest.param({"lost_after_s": 3}, Policy(3.0, True, KEEP_REPLACEMENT), id="grace"),
        pytest.param({"replace": False}, Policy(60.0, False, KEEP_REPLACEMENT), id="keep"),
        pytest.param({"replace": True}, Policy(60.0, True, KEEP_REPLACEMENT), id="replace"),
        pytest.param(
            {"reconcile": "keep_original"}, Policy(60.0, True, KEEP_ORIGINAL), id="original"
        ),
        pytest.param({"reconcile": "best"}, Policy(60.0, True, BEST), id="best"),
        pytest.param(
            {"lost_after_s": 8, "stop_after_s": 3},
            Policy(8.0, True, KEEP_REPLACEMENT, stop_after_s=3.0),
            id="stop",
        ),
    ],
)
def test_policy_defaults(disconnect: dict[str, object] | None, expected: Policy) -> None:
    """Unset fields take the defaults: 60 s, replace, keep the replacement, keep running."""
    assert policy_of(spec_with(disconnect)) == expected


def test_reconcile_names_read_as_specs_spell_them() -> None:
    """The rule's name in logs is the one a job spec uses."""
    assert Policy(reconcile=KEEP_ORIGINAL).reconcile_name == "keep_original"
    assert Policy().reconcile_name == "keep_replacement"


@pytest.mark.parametrize(
    ("policy", "away_s", "due"),
    [
        (Policy(lost_after_s=3), 2.9, False),
        (Policy(lost_after_s=3), 3.0, True),
        (Policy(lost_after_s=3, replace=False), 1000.0, False),
        (Policy(), 59.0, False),
        (Policy(), 61.0, True),
        # stop_after_s well within lost_after_s: the copy is gone by then.
        (Policy(stop_after_s=30), 59.9, False),
        (Policy(stop_after_s=30), 60.0, True),
        # stop_after_s = lost_after_s: 60 s, and the margin at a 3 s heartbeat (heartbeat 3,
        # watchdog 1, stop grace 5, exit 1, clock drift 0.06).
        (Policy(stop_after_s=60), 70.0, False),
        (Policy(stop_after_s=60), 70.1, True),
        # Shorter than two heartbeats: the agent waits those out (6 s), the coordinator too.
        (Policy(lost_after_s=5, stop_after_s=1), 15.9, False),
        (Policy(lost_after_s=5, stop_after_s=1), 16.1, True),
        (Policy(lost_after_s=5, stop_after_s=1, replace=False), 1000.0, False),
    ],
)
def test_a_task_moves_once_its_grace_is_over(policy: Policy, away_s: float, due: bool) -> None:
    """A task moves when its site has been away for lost_after_s, and with stop_after_s not
    before the cut-off site has surely stopped its copy; never without replace."""
    assert is_due(policy, away_s, heartbeat_s=3.0) is due


@pytest.mark.parametrize(
    ("policy", "heartbeat_s", "after_s"),
    [
        (Policy(lost_after_s=8), 0.5, 8.0),
        (Policy(lost_after_s=8, stop_after_s=3), 0.5, 10.503),
        (Policy(lost_after_s=8, stop_after_s=3), 3.0, 16.006),
        (Policy(lost_after_s=30, stop_after_s=3), 3.0, 30.0),
    ],
)
def test_replacement_waits_for_the_cut_off_copy(
    policy: Policy, heartbeat_s: float, after_s: float
) -> None:
    """The wait is lost_after_s, or stop_after_s plus the margin when that is longer; a slower
    heartbeat means a longer margin."""
    assert replace_after_s(policy, heartbeat_s) == pytest.approx(after_s)


@pytest.mark.parametrize(
    ("connected", "unreachable", "paused"),
    [
        (5, 0, False),
        (0, 0, False),
        (4, 1, False),
        (1, 1, False),  # half is not more than half
        (2, 2, False),
        (2, 3, True),
        (1, 2, True),
        (0, 1, True),
        (10, 11, True),
    ],
)
def test_partition_suspected_when_most_sites_are_unreachable(
    connected: int, unreachable: int, paused: bool
) -> None:
    """Moving pauses exactly while more than half of the reachable-or-not sites are unreachable."""
    assert is_partitioned(connected, unreachable) is paused


def checkpoint(progress_s: float, epoch: int = 1, seconds: int = 100) -> jobs_pb2.CheckpointRecord:
    return jobs_pb2.CheckpointRecord(
        path=f"/ck/{epoch}/{seconds}",
        epoch=epoch,
        progress_s=progress_s,
        time=timestamp_pb2.Timestamp(seconds=seconds),
    )


def original(
    state: jobs_pb2.JobState.ValueType, progress_s: float | None = None
) -> site_link_service_pb2.TaskReport:
    report = site_link_service_pb2.TaskReport(job_id="j", task="t", epoch=1, state=state)
    if progress_s is not None:
        report.checkpoint.CopyFrom(checkpoint(progress_s))
    return report


def replacement(
    state: jobs_pb2.JobState.ValueType = job_state.RUNNING, progress_s: float | None = None
) -> jobs_pb2.TaskStatus:
    task = jobs_pb2.TaskStatus(name="t", state=state, site="b", epoch=3)
    task.displaced.site, task.displaced.epoch = "a", 1
    if progress_s is not None:
        task.checkpoint.CopyFrom(checkpoint(progress_s, epoch=3))
    return task


R, OK, FAIL, CAN = job_state.RUNNING, job_state.SUCCEEDED, job_state.FAILED, job_state.CANCELLED


@pytest.mark.parametrize(
    ("rule", "theirs", "ours", "wins"),
    [
        pytest.param(KEEP_REPLACEMENT, original(R, 99), replacement(R, 1), False, id="repl-run"),
        pytest.param(KEEP_REPLACEMENT, original(OK), replacement(R), False, id="repl-succeeded"),
        pytest.param(KEEP_ORIGINAL, original(R), replacement(R, 50), True, id="orig-run"),
        pytest.param(KEEP_ORIGINAL, original(OK), replacement(job_state.PENDING), True, id="orig"),
        pytest.param(KEEP_ORIGINAL, original(FAIL), replacement(R), False, id="orig-failed"),
        pytest.param(KEEP_ORIGINAL, original(CAN), replacement(R), False, id="orig-cancelled"),
        pytest.param(KEEP_ORIGINAL, original(R), replacement(OK), False, id="orig-too-late"),
        pytest.param(BEST, original(R, 30), replacement(R, 20), True, id="best-further"),
        pytest.param(BEST, original(R, 20), replacement(R, 20), False, id="best-tie"),
        pytest.param(BEST, original(R, 10), replacement(R, 20), False, id="best-behind"),
        pytest.param(BEST, original(R), replacement(R, 5), False, id="best-no-checkpoint"),
        pytest.param(BEST, original(R, 5), replacement(R), True, id="best-none-here"),
        pytest.param(BEST, original(OK), replacement(R, 500), True, id="best-succeeded"),
        pytest.param(BEST, original(FAIL, 900), replacement(R, 5), False, id="best-failed"),
    ],
)
def test_which_copy_survives(
    rule: jobs_pb2.Reconcile.ValueType,
    theirs: site_link_service_pb2.TaskReport,
    ours: jobs_pb2.TaskStatus,
    wins: bool,
) -> None:
    """keep_replacement never keeps the original, keep_original keeps a live one, best compares."""
    assert original_wins(Policy(reconcile=rule), theirs, ours) is wins


def test_only_the_copy_left_behind_is_the_original() -> None:
    """A report is the displaced original only from the site and epoch the task left."""
    task = replacement()
    assert is_displaced_original(task, "a", original(R))
    assert not is_displaced_original(task, "b", original(R))
    older = original(R)
    older.epoch = 0
    assert not is_displaced_original(task, "a", older)
    assert not is_displaced_original(jobs_pb2.TaskStatus(name="t"), "a", original(R))


@pytest.mark.parametrize(
    ("recorded", "reported", "newer"),
    [
        pytest.param(None, checkpoint(1), True, id="first"),
        pytest.param(checkpoint(1), jobs_pb2.CheckpointRecord(), False, id="empty"),
        pytest.param(checkpoint(1, 1, 100), checkpoint(2, 1, 101), True, id="later"),
        pytest.param(checkpoint(1, 1, 100), checkpoint(1, 1, 100), False, id="same"),
        pytest.param(checkpoint(2, 1, 101), checkpoint(1, 1, 100), False, id="older"),
        pytest.param(checkpoint(9, 1, 500), checkpoint(1, 2, 100), True, id="new-copy"),
    ],
)
def test_newer_checkpoint(
    recorded: jobs_pb2.CheckpointRecord | None, reported: jobs_pb2.CheckpointRecord, newer: bool
) -> None:
    """A current copy's checkpoint replaces another copy's, or an older one of its own."""
    assert is_newer_checkpoint(recorded, reported) is newer
