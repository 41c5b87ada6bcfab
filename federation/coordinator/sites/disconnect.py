"""The rules for lost sites: when a task is moved, which copy survives, when to hold back.

Pure functions of API messages and numbers, so each rule has its own table test. The lost-site
monitor (``lost_sites``) and the reconciliation of returning copies (``reconcile``) apply them.
"""

from __future__ import annotations

from dataclasses import dataclass

from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common import job_state
from federation.stop_after import gone_after_s

DEFAULT_LOST_AFTER_S = 60.0
"""Grace a job's tasks get when its policy sets no ``lost_after_s``."""
KEEP_REPLACEMENT = jobs_pb2.RECONCILE_KEEP_REPLACEMENT
KEEP_ORIGINAL = jobs_pb2.RECONCILE_KEEP_ORIGINAL
BEST = jobs_pb2.RECONCILE_BEST


@dataclass(frozen=True, slots=True)
class Policy:
    """A job's disconnect policy with the defaults filled in."""

    lost_after_s: float = DEFAULT_LOST_AFTER_S
    """Seconds a site may stay away before its tasks are placed elsewhere."""
    replace: bool = True
    """Whether the tasks of a lost site are placed elsewhere at all."""
    reconcile: jobs_pb2.Reconcile.ValueType = KEEP_REPLACEMENT
    """Which copy survives when the original comes back."""
    stop_after_s: float = 0.0
    """Seconds a cut-off site keeps the tasks running before it stops them; 0: it does not."""

    @property
    def reconcile_name(self) -> str:
        """``keep_replacement``, ``keep_original`` or ``best``, as job specs spell it."""
        return jobs_pb2.Reconcile.Name(self.reconcile).removeprefix("RECONCILE_").lower()


def policy_of(spec: jobs_pb2.JobSpec) -> Policy:
    """The job's disconnect policy, defaults filled in."""
    given = spec.disconnect
    return Policy(
        lost_after_s=given.lost_after_s if given.lost_after_s > 0 else DEFAULT_LOST_AFTER_S,
        replace=given.replace if given.HasField("replace") else True,
        reconcile=given.reconcile or KEEP_REPLACEMENT,
        stop_after_s=given.stop_after_s,
    )


def replace_after_s(policy: Policy, heartbeat_s: float) -> float:
    """How long a task's site must have been away before the task is placed elsewhere:
    ``lost_after_s``, and with ``stop_after_s`` no sooner than the cut-off copy is surely gone
    (``heartbeat_s``: the interval at which agents hear from the coordinator)."""
    if policy.stop_after_s <= 0:
        return policy.lost_after_s
    return max(policy.lost_after_s, gone_after_s(policy.stop_after_s, heartbeat_s))


def is_due(policy: Policy, lost_for_s: float, heartbeat_s: float) -> bool:
    """Whether a task whose site has been away ``lost_for_s`` seconds should move now."""
    return policy.replace and lost_for_s >= replace_after_s(policy, heartbeat_s)


def is_partitioned(connected: int, unreachable: int) -> bool:
    """Whether the coordinator should suspect that it is the one cut off.

    True while more than half of the sites it should reach are unreachable: moving all their
    work onto the few it still sees would be worse than waiting. Sites that said goodbye and
    cordoned sites are counted by neither argument.
    """
    return unreachable > 0 and 2 * unreachable > connected + unreachable


def progress_s(checkpoint: jobs_pb2.CheckpointRecord | None) -> float:
    """The work a checkpoint holds, 0 for none."""
    return checkpoint.progress_s if checkpoint is not None else 0.0


def original_wins(
    policy: Policy, original: site_link_service_pb2.TaskReport, current: jobs_pb2.TaskStatus
) -> bool:
    """Whether a returning original copy should be kept over the task's replacement.

    ``original`` is what the site that was lost reports of its copy; ``current`` is the task
    as recorded now (moved on, not finished). Only an original that runs or succeeded can win:

    - keep_replacement: never.
    - keep_original: always.
    - best: a succeeded original; else the one whose newest checkpoint holds more progress,
      the replacement on a tie (its newest is the task's recorded checkpoint, or the one it
      restarted from).
    """
    if job_state.is_terminal(current.state):
        return False
    if original.state not in (job_state.RUNNING, job_state.SUCCEEDED):
        return False
    if policy.reconcile == KEEP_ORIGINAL:
        return True
    if policy.reconcile != BEST:
        return False
    if original.state == job_state.SUCCEEDED:
        return True
    theirs = original.checkpoint if original.HasField("checkpoint") else None
    ours = current.checkpoint if current.HasField("checkpoint") else None
    return progress_s(theirs) > progress_s(ours)


def is_displaced_original(
    task: jobs_pb2.TaskStatus, site: str, report: site_link_service_pb2.TaskReport
) -> bool:
    """Whether ``report`` comes from the copy the task was last moved away from."""
    return (
        task.HasField("displaced")
        and task.displaced.site == site
        and task.displaced.epoch == report.epoch
    )


def is_newer_checkpoint(
    recorded: jobs_pb2.CheckpointRecord | None, reported: jobs_pb2.CheckpointRecord
) -> bool:
    """Whether the current copy's ``reported`` checkpoint should replace the recorded one.

    Only the copy holding the task's current epoch gets here. Its first checkpoint replaces one
    of another epoch (the one it restored from, or an earlier copy's); after that a checkpoint
    replaces the recorded one when it is a different one and not older.
    """
    if not reported.path:
        return False
    if recorded is None or not recorded.path or reported.epoch != recorded.epoch:
        return True
    if reported.path == recorded.path and reported.time == recorded.time:
        return False
    reported_at = (reported.time.seconds, reported.time.nanos)
    return reported_at >= (recorded.time.seconds, recorded.time.nanos)
