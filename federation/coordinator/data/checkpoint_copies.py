"""Checkpoints that follow their task across sites, through the sites' object stores.

A site with a store uploads each checkpoint its tasks complete and reports it with where it is
stored (``CheckpointRecord.stored``). So that it outlives its site, the coordinator has one
other connected site with a store keep a copy (unless the policy says ``replicate: false``): it
asks that site for a PUT URL for the key, and the holder writes the copy through it
(``copy_checkpoint``). When the task is placed again, anywhere, the coordinator asks a connected
site holding the newest uploaded checkpoint (its own site first, then the copies) for a GET URL
and puts it in the commit (``restore_input``); the new site stages it and points
``FEDERATION_RESTORE_FROM`` at it. When no holder can sign one, the task starts fresh rather
than wait for a site that may never return; the commit says why, and so does the task's
reason once it runs.

As for staged inputs, keys are checked against the job's own folder before any URL is asked
for, every site checks the tenant's folder again before it signs, and the coordinator sees
keys and digests, never bytes nor credentials.
"""

from __future__ import annotations

import asyncio

from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.coordinator.data.staged_inputs import URL_TTL_S, nearest_first, reached
from federation.coordinator.sites.registry import SessionClosedError, SiteRegistry

PROTOCOL = 5
"""The site-link protocol that carries uploaded checkpoints, PUT URLs and copies."""
FOLDER = "_checkpoints"
"""The folder of a task's checkpoints in a store (``TENANT/JOB/TASK/_checkpoints/FILE``)."""
COPY_RATE_BPS = 10 * 1024 * 1024
"""The slowest copy waited for: a copy gets a minute plus this long per byte."""


def replicates(policy: jobs_pb2.Checkpoint) -> bool:
    """Whether uploaded checkpoints are copied to another site: unless the policy says not."""
    return not policy.HasField("replicate") or policy.replicate


def in_checkpoint_folder(key: str, tenant: str, job_id: str, task: str) -> bool:
    """Whether ``key`` ends ``TENANT/JOB/TASK/_checkpoints/FILE``: a checkpoint of this task."""
    parts = key.split("/")
    tail = [tenant or "_", job_id, *task.split("/"), FOLDER]
    if ".." in parts or len(parts) < len(tail) + 1:
        return False
    return parts[-(len(tail) + 1) : -1] == tail and bool(parts[-1])


def holders(record: jobs_pb2.CheckpointRecord) -> list[jobs_pb2.Artifact]:
    """Where an uploaded checkpoint is stored: its own site's store first, then the copies."""
    if not record.HasField("stored") or not record.stored.key:
        return []
    return [record.stored, *record.replicas]


def _speaks(sites: SiteRegistry, site: str) -> bool:
    session = sites.session(site)
    return session is not None and session.protocol >= PROTOCOL


def copy_site(sites: SiteRegistry, held: set[str]) -> str | None:
    """A connected site with a store that other sites reach, other than the ``held`` ones, to
    keep a copy (the first by name: the same one each time, so copies do not spread); None if
    none."""
    for name in sorted(sites.names()):
        if name in held or not _speaks(sites, name):
            continue
        view = sites.get(name).view
        if view is not None and view.header.object_store and reached(sites, name):
            return name
    return None


async def copy_checkpoint(
    job: jobs_pb2.Job,
    task_name: str,
    record: jobs_pb2.CheckpointRecord,
    sites: SiteRegistry,
    timeout_s: float,
) -> jobs_pb2.Artifact | str:
    """Have one other site's store keep a copy of the task's uploaded checkpoint ``record``;
    returns the copy, or why none was made."""
    stored = record.stored
    tenant = job.spec.tenant or "_"
    if not in_checkpoint_folder(stored.key, job.spec.tenant, job.id, task_name):
        return f"site {stored.site} stored it outside this task's folder"
    below = "/".join((tenant, job.id, task_name, FOLDER, stored.key.rsplit("/", 1)[-1]))
    keep = find_spec_checkpoint(job, task_name).keep or 2
    held = {a.site for a in holders(record)}
    return await copy_object(stored, tenant, below, keep, held, sites, timeout_s)


async def copy_object(
    stored: jobs_pb2.Artifact,
    tenant: str,
    below: str,
    keep: int,
    held: set[str],
    sites: SiteRegistry,
    timeout_s: float,
) -> jobs_pb2.Artifact | str:
    """Have a site not in ``held`` keep a copy of ``stored`` (an object of its site's store)
    at ``below`` in the tenant's folder of its own store: that site signs a PUT URL, and the
    holder writes the copy through it. Returns the copy, or why none was made."""
    target = copy_site(sites, held)
    holder = sites.session(stored.site)
    if target is None or (session := sites.session(target)) is None:
        return "no other connected site has an object store other sites reach"
    if holder is None or holder.protocol < PROTOCOL:
        return f"site {stored.site}, which holds it, cannot copy it now"
    signing = site_link_service_pb2.PresignRequest(
        key=below, method="PUT", ttl_s=URL_TTL_S, tenant=tenant, keep=keep
    )
    signed = (
        await session.request_many(
            [site_link_service_pb2.CoordinatorMessage(presign=signing)], timeout_s
        )
    )[0]
    if isinstance(signed, SessionClosedError | TimeoutError):
        return f"site {target} did not sign a URL for the copy"
    if signed.presign_answer.error:
        return f"site {target} would not sign a URL: {signed.presign_answer.error}"
    copy = site_link_service_pb2.ReplicateCheckpoint(
        key=stored.key,
        tenant=tenant,
        bytes=stored.bytes,
        sha256=stored.sha256,
        url=signed.presign_answer.url,
    )
    wait_s = timeout_s + 60 + stored.bytes / COPY_RATE_BPS
    done = (
        await holder.request_many(
            [site_link_service_pb2.CoordinatorMessage(replicate=copy)], wait_s
        )
    )[0]
    if isinstance(done, SessionClosedError | TimeoutError):
        return f"site {stored.site} did not say it copied it"
    if done.replicate_answer.error:
        return f"site {stored.site} could not copy it: {done.replicate_answer.error}"
    replica = jobs_pb2.Artifact()
    replica.CopyFrom(stored)
    del replica.copies[:]
    replica.site, replica.key = target, signed.presign_answer.key
    return replica


def find_spec_checkpoint(job: jobs_pb2.Job, task_name: str) -> jobs_pb2.Checkpoint:
    return next(t.checkpoint for t in job.spec.tasks if t.name == task_name)


async def restore_input(
    job: jobs_pb2.Job,
    task_name: str,
    record: jobs_pb2.CheckpointRecord,
    sites: SiteRegistry,
    timeout_s: float,
    to_site: str = "",
) -> site_link_service_pb2.StagedInput:
    """The task's uploaded checkpoint ``record`` as a commit's ``restore``: with a URL that a
    connected holder signed (the one nearest ``to_site`` first), else with the error saying
    why the task starts fresh."""
    stored = record.stored
    staged = site_link_service_pb2.StagedInput(
        dataset=stored.name, bytes=stored.bytes, sha256=stored.sha256, folder=stored.folder
    )
    tried = []
    copies = holders(record)
    if to_site:
        copies = nearest_first(copies, stored.bytes, to_site, sites.snapshot())
    for held in copies:
        if not in_checkpoint_folder(held.key, job.spec.tenant, job.id, task_name):
            tried.append(f"site {held.site} holds it outside this task's folder")
            continue
        if held.site != to_site and not reached(sites, held.site):
            tried.append(f"site {held.site}'s store cannot be reached from other sites")
            continue
        session = sites.session(held.site)
        if session is None or session.protocol < PROTOCOL:
            tried.append(f"site {held.site} is not connected")
            continue
        request = site_link_service_pb2.PresignRequest(
            key=held.key, method="GET", ttl_s=URL_TTL_S, tenant=job.spec.tenant or "_"
        )
        answer = (
            await session.request_many(
                [site_link_service_pb2.CoordinatorMessage(presign=request)], timeout_s
            )
        )[0]
        if isinstance(answer, SessionClosedError | TimeoutError | asyncio.CancelledError):
            tried.append(f"site {held.site} did not sign it")
        elif answer.presign_answer.error:
            tried.append(f"site {held.site} would not sign it: {answer.presign_answer.error}")
        else:
            staged.url = answer.presign_answer.url
            return staged
    staged.error = "no copy can be reached (" + "; ".join(tried or ["none stored"]) + ")"
    return staged
