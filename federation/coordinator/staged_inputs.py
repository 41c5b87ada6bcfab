"""Outputs of one task staged into a dependant at another site, never through the coordinator.

A task declares ``outputs`` (name and path); a dependant reads one as an input
``task:NAME.OUTPUT`` (or ``task:NAME`` when NAME declares exactly one). When NAME succeeds its
site reports each output as stored (``Artifact``: size, SHA-256, the key in its own store).
When the dependant is committed, the coordinator asks the holding site, over its own session,
to sign a short-lived read-only URL for that one key, and hands the URL to the dependant's site
in the commit; that site downloads and checks the bytes itself. The coordinator sees keys and
digests, never bytes nor any site's credentials.

A key must lie in the job's own folder (``.../TENANT/JOB/TASK/EPOCH/OUTPUT``) before a URL is
asked for, so a job names only objects of its own tenant; the holding site checks the tenant's
folder again before it signs.

A registered dataset (``dataset:NAME``, ``federation.coordinator.datasets``) is staged the same
way: its holder signs a URL for its key, and the size and digest recorded at registration are
checked by the downloading site.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from federation.api.v1 import data_service_pb2, jobs_pb2, site_link_service_pb2
from federation.coordinator.outputs import DATASET, PROTOCOL, in_job_folder, source_of
from federation.coordinator.sites import SessionClosedError, SiteRegistry

Registered = Mapping[tuple[str, str], data_service_pb2.Dataset]
"""The registered datasets by (tenant, name)."""

URL_TTL_S = 900
"""How long a signed URL may be used: the download starts at once, so 15 minutes is ample."""


def holders_away(job: jobs_pb2.Job, task_name: str, sites: SiteRegistry) -> list[str]:
    """The sites holding the task's staged inputs that have no session now (most tasks have
    no staged input: nothing is looked at)."""
    specs = {t.name: t for t in job.spec.tasks}
    status = {t.name: t for t in job.tasks}
    away = set()
    for item in specs[task_name].inputs:
        if item.dataset.startswith(DATASET) and item.site and sites.session(item.site) is None:
            away.add(item.site)
            continue
        found = source_of(item.dataset, specs)
        if found is None or (output := found[1]) is None:
            continue
        for artifact in status[found[0]].artifacts:
            if (
                artifact.name == output.name
                and artifact.key
                and sites.session(artifact.site) is None
            ):
                away.add(artifact.site)
    return sorted(away)


async def resolve(
    job: jobs_pb2.Job,
    task_name: str,
    sites: SiteRegistry,
    timeout_s: float,
    datasets: Registered | None = None,
) -> list[site_link_service_pb2.StagedInput] | str:
    """The staged inputs of a task about to be committed, each with a URL its holder signed
    (or, for one that cannot be had, the reason); a string instead while a holder is not
    connected or did not answer: the task waits and is placed again."""
    specs = {t.name: t for t in job.spec.tasks}
    spec = specs[task_name]
    status = {t.name: t for t in job.tasks}
    out: list[site_link_service_pb2.StagedInput] = []
    asks: dict[str, list[tuple[site_link_service_pb2.StagedInput, str]]] = {}
    for item in spec.inputs:
        if item.dataset.startswith(DATASET):
            staged_input, key, holder = _dataset(job.spec.tenant, item, datasets or {})
            out.append(staged_input)
            if not staged_input.error:
                asks.setdefault(holder, []).append((staged_input, key))
            continue
        found = source_of(item.dataset, specs)
        if found is None or (output := found[1]) is None:
            continue
        producer = found[0]
        staged_input = site_link_service_pb2.StagedInput(
            dataset=item.dataset, path=item.path or output.name
        )
        out.append(staged_input)
        artifact = next((a for a in status[producer].artifacts if a.name == output.name), None)
        if artifact is None:
            staged_input.error = f"task {producer} reported no output {output.name}"
            continue
        staged_input.bytes, staged_input.sha256 = artifact.bytes, artifact.sha256
        staged_input.folder, staged_input.site = artifact.folder, artifact.site
        if not artifact.key:
            staged_input.error = (
                f"output {output.name} of task {producer} stayed at site {artifact.site}, "
                "which has no object store"
            )
        elif not in_job_folder(artifact.key, job.spec.tenant, job.id, producer):
            staged_input.error = (
                f"site {artifact.site} stored output {output.name} outside this job's folder"
            )
        else:
            asks.setdefault(artifact.site, []).append((staged_input, artifact.key))
    for site, wanted in asks.items():
        session = sites.session(site)
        if session is None:
            return f"waiting for site {site}, which holds its inputs, to connect"
        if session.protocol < PROTOCOL:
            for staged_input, _ in wanted:
                staged_input.error = f"site {site}'s agent is too old to sign URLs"
            continue
        requests = [
            site_link_service_pb2.CoordinatorMessage(
                presign=site_link_service_pb2.PresignRequest(
                    key=key, method="GET", ttl_s=URL_TTL_S, tenant=job.spec.tenant or "_"
                )
            )
            for _, key in wanted
        ]
        answers = await session.request_many(requests, timeout_s)
        for (staged_input, _), answer in zip(wanted, answers, strict=True):
            if isinstance(answer, SessionClosedError | TimeoutError | asyncio.CancelledError):
                return f"site {site}, which holds input {staged_input.dataset}, did not sign it"
            if answer.presign_answer.error:
                staged_input.error = f"site {site} would not sign it: {answer.presign_answer.error}"
            else:
                staged_input.url = answer.presign_answer.url
    return out


def _dataset(
    tenant: str, item: jobs_pb2.DataInput, datasets: Registered
) -> tuple[site_link_service_pb2.StagedInput, str, str]:
    """A registered dataset to stage: the input, its key and the site holding it (the input's
    error says why when it is no longer registered)."""
    name = item.dataset.removeprefix(DATASET)
    staged_input = site_link_service_pb2.StagedInput(dataset=item.dataset, path=item.path or name)
    record = datasets.get((tenant, name))
    if record is None:
        staged_input.error = f"dataset {name} is no longer registered"
        return staged_input, "", ""
    staged_input.bytes, staged_input.sha256 = record.bytes, record.sha256
    _, _, key = record.location.removeprefix("s3://").partition("/")
    return staged_input, key, record.site
