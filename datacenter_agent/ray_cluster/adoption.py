"""A restarted agent takes back its site's unfinished Ray jobs, with their data and nodes.

Ray's job carries the site and the task's group in its metadata; the task's folder holds its
launch file (the devices each replica was given) and its record (``record.py``): the agent
rebuilds the task's data from it (its checkpoints watched from the job's start, its outputs
stored once it succeeds) and its slots, so the view shows what it holds and a launched node
that is lost stops it. A job whose folder has no record (an agent that kept none submitted it)
is adopted as before records were kept: its end is reported, nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from datacenter_agent.ray_cluster.groups import parse_group
from datacenter_agent.ray_cluster.launch import launch_devices
from datacenter_agent.ray_cluster.record import TaskRecord, read_record
from datacenter_agent.ray_cluster.task_data import RayTaskData, task_folder
from datacenter_agent.ray_cluster.tasks import RayTask
from federation.agent.task_data import TaskData
from federation.common.keys import RunKey

log = structlog.get_logger()

FINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
"""Ray's states of a job that has ended."""


def status_of(job: Any) -> str:
    """Ray's state of a job (``JobInfo`` or ``JobDetails``) as a plain string."""
    return str(job.status.value if hasattr(job.status, "value") else job.status)


@dataclass(frozen=True, slots=True)
class Unfinished:
    """A job of this site Ray still runs (or has yet to start)."""

    key: RunKey
    submission_id: str
    group: str
    started_at: float
    """Wall-clock time its job started; 0 while it has not."""


def unfinished(job: Any, site: str) -> Unfinished | None:
    """``job`` (from Ray's job list) if it is one of ``site``'s and has not ended."""
    meta = job.metadata or {}
    if meta.get("federation_site") != site or status_of(job) in FINAL:
        return None
    group = meta.get("federation_group", "")
    key = parse_group(group, site)
    if key is None:
        return None
    started_ms = getattr(job, "start_time", None) or 0
    return Unfinished(key, job.submission_id, group, started_ms / 1000.0)


async def adopted_task(
    job: Unfinished,
    work_dir: Path,
    data: TaskData,
    names: Mapping[str, str],
    on_checkpoint: Callable[[RayTask], None],
) -> RayTask:
    """The task of an unfinished job, as far as its folder tells: its devices, and from its
    record its slots (on the nodes as ``names``, Ray node id → node, names them now), its
    stop-after-disconnect and its data."""
    folder = task_folder(work_dir, job.key)
    devices = await asyncio.to_thread(launch_devices, folder)
    record: TaskRecord | None = await asyncio.to_thread(read_record, folder)
    slots = record.slots_now(names) if record is not None else ()
    task = RayTask(job.key, job.submission_id, job.group, slots, devices)
    if record is not None:
        task.stop_after_s = record.stop_after_s
        spec = record.spec
        if spec.outputs or spec.HasField("checkpoint"):
            task.data = RayTaskData.adopted(
                data,
                job.key,
                record,
                folder=folder,
                started_at=job.started_at,
                on_checkpoint=lambda: on_checkpoint(task),
            )
    key = job.key
    log.info(
        "task_adopted",
        job_id=key[0],
        task=key[1],
        epoch=key[2],
        ray_job=job.submission_id,
        nodes=sorted({s.node for s in slots}),
        data=task.data is not None,
        started_at=job.started_at,
    )
    return task
