"""At most one copy: when a cut-off site stops a job's tasks, and when a replacement may start.

A job's ``disconnect.stop_after_s`` reaches the site in each offer. An agent that has heard
nothing from any coordinator for that long stops the job's tasks itself (coordinators answer
every heartbeat, so silence means a cut); the coordinator places a replacement only once
``gone_after_s`` has passed since it lost the site's session. Agent and coordinator read these
same numbers, so the cut-off copy is gone before its replacement starts.
"""

from __future__ import annotations

import math

import structlog

log = structlog.get_logger()

WATCHDOG_S = 1.0
"""How often an agent looks at how long it has been cut off."""
STOP_GRACE_S = 5.0
"""Longest wait between SIGTERM and SIGKILL when a cut-off agent stops a task (its own
``kill_grace_s`` when shorter): the coordinator must know how long a stop may take."""
IN_TOUCH_HEARTBEATS = 2
"""Silence shorter than this many heartbeat intervals says nothing of a cut: it is the gap
between two answers to heartbeats, one of them a little late."""
EXIT_S = 1.0
"""For killed processes to be reaped and the agent to see them gone."""
CLOCK_DRIFT = 1e-3
"""How far apart the agent's and the coordinator's clocks may run: NTP slews each by at most
500 ppm."""


def stops_after_s(stop_after_s: float, heartbeat_s: float) -> float:
    """How long an agent hears nothing before it stops a task that asks for ``stop_after_s``;
    never sooner than ``IN_TOUCH_HEARTBEATS`` heartbeats, so a task is not stopped while its
    agent is in touch."""
    return max(stop_after_s, IN_TOUCH_HEARTBEATS * heartbeat_s)


def gone_after_s(stop_after_s: float, heartbeat_s: float) -> float:
    """How long after it lost a site's session the coordinator knows the site's copy of a task
    that asks for ``stop_after_s`` has ended.

    The agent counts from the last coordinator message it handled, the coordinator from losing
    the session, which is never sooner than it sent that message (a new leader counts from the
    start of its term, which comes after the old leader stepped down and ended its sessions).
    The margin after the agent's own wait covers, in order: that message reaching the agent
    late (in flight, or behind a busy event loop), one heartbeat interval; the agent noticing
    the cut up to one watchdog tick late; the stop itself, SIGTERM then SIGKILL after at most
    ``STOP_GRACE_S``; the processes being gone; and the two clocks running apart over the wait.
    """
    waited_s = stops_after_s(stop_after_s, heartbeat_s)
    margin_s = heartbeat_s + WATCHDOG_S + STOP_GRACE_S + EXIT_S + CLOCK_DRIFT * waited_s
    return waited_s + margin_s


def announce_stop(
    key: tuple[str, str, int], cut_off_s: float, stop_after_s: float, **more: object
) -> str:
    """Logs that a core stops task ``key`` of a job with ``stop_after_s`` (cut off for
    ``cut_off_s``, or ``math.inf``: its agent is stopping and, once gone, could not stop it in
    time), and returns why, for the task's report."""
    job_id, task, epoch = key
    log.warning(
        "task_stopped_cut_off",
        job_id=job_id,
        task=task,
        epoch=epoch,
        cut_off_s=round(cut_off_s, 1),
        stop_after_s=stop_after_s,
        **more,
    )
    policy = f"disconnect.stop_after_s {stop_after_s:g}"
    if math.isinf(cut_off_s):
        return f"the agent is stopping and could not stop it later ({policy})"
    return f"cut off from every coordinator for {cut_off_s:.0f} s ({policy})"
