"""Ray's word on a node, awaited before a failed job on it is called a failure.

A launched node that dies ends its tasks' Ray jobs as well as itself, and Ray may end a job
FAILED (its replica's actor died) before its health checks have found the node dead. Such a
job's launcher exits ``REPLICA_LOST`` rather than a replica's exit code; on a launched node,
the task's end then waits up to ``NODE_VERDICT_S`` for Ray's word on the node: a node found
dead meanwhile is taken back (``RayCore._node_taken_back``), which marks the task interrupted,
so it ends CANCELLED and interrupted, placed again by the coordinator without counting a failed
attempt. A node still alive after the wait leaves the job FAILED, as Ray said.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from datacenter_agent.ray_cluster.launch import REPLICA_LOST
from datacenter_agent.ray_cluster.tasks import RayTask
from federation.api.v1 import jobs_pb2

NODE_VERDICT_S = 30.0
"""How long a failed job's end waits for Ray's word on its node: more than Ray's health
checks take to find a dead node (about 18 s with Ray's defaults)."""


def may_be_lost(task: RayTask, state: int, launched: Collection[str]) -> bool:
    """Whether ``task``, ended in ``state``, failed because a replica's actor died on one of
    the ``launched`` nodes that Ray has not yet found dead."""
    return (
        state == jobs_pb2.JOB_STATE_FAILED
        and task.exit_code == REPLICA_LOST
        and any(slot.node in launched for slot in task.slots)
    )


async def node_lost(task: RayTask, timeout_s: float = NODE_VERDICT_S) -> bool:
    """Waits until one of the task's nodes is taken back or ``timeout_s`` passes; whether it
    was."""
    try:
        async with asyncio.timeout(timeout_s):
            await task.taken_back.wait()
    except TimeoutError:
        return False
    return True
