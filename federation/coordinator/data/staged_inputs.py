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

A registered dataset (``dataset:NAME``, ``federation.coordinator.data.datasets``) is staged the same
way: its holder signs a URL for its key, and the size and digest recorded at registration are
checked by the downloading site.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Mapping

from federation.api.v1 import data_service_pb2, jobs_pb2, site_link_service_pb2
from federation.common.keys import DATASET
from federation.coordinator.data.outputs import PROTOCOL, in_job_folder, source_of
from federation.coordinator.sites.registry import SessionClosedError, SiteRegistry
from federation.errors import SiteNotFoundError
from federation.placement.request import Input, Request
from federation.placement.snapshot import Snapshot

Registered = Mapping[tuple[str, str], data_service_pb2.Dataset]
"""The registered datasets by (tenant, name)."""

URL_TTL_S = 900
"""How long a signed URL may be used: the download starts at once, so 15 minutes is ample."""


def nearest_first(
    held: list[jobs_pb2.Artifact], size: int, to_site: str, snap: Snapshot
) -> list[jobs_pb2.Artifact]:
    """``held`` (copies of ``size`` bytes) in the order they would reach ``to_site`` soonest
    over the links the placement reads (measured, learnt from earlier transfers, or
    declared): the site itself first; a holder the snapshot does not know last; ties as
    ``held`` had them."""
    to = snap.site_index(to_site)
    if to is None:
        return held

    def seconds(copy: jobs_pb2.Artifact) -> float:
        if copy.site == to_site:
            return 0.0
        source = snap.site_index(copy.site)
        if source is None:
            return math.inf
        bits = size * 8.0
        link_s = bits / (float(snap.bandwidth_mbps[source, to]) * 1e6)
        return link_s + float(snap.rtt_ms[source, to]) / 1000

    return sorted(held, key=seconds)


def dataset_holders(
    tenant: str, item: jobs_pb2.DataInput | Input, datasets: Registered
) -> list[tuple[str, str]]:
    """(site, location) of every holder of a ``dataset:NAME`` input (as a spec or placement
    names it): where it was registered, then its copies; only the input's site when the
    dataset is not known."""
    record = datasets.get((tenant, item.dataset.removeprefix(DATASET)))
    if record is None:
        return [(item.site, "")]
    return [(record.site, record.location), *((c.site, c.location) for c in record.copies)]


def with_copies(
    request: Request | None,
    tenant: str,
    datasets: Registered | None,
    connected: Callable[[str], bool],
) -> Request | None:
    """``request`` with each registered dataset it reads counted at every ``connected`` site
    holding a copy (placement takes the one that reaches each site soonest; with none
    connected, where it was registered)."""
    if request is None or not datasets:
        return request
    inputs = []
    for item in request.inputs:
        held = [site for site, _ in dataset_holders(tenant, item, datasets)]
        if item.dataset.startswith(DATASET) and len(held) > 1:
            reachable = [site for site in held if connected(site)] or held[:1]
            item = dataclasses.replace(item, site=reachable[0], also=tuple(reachable[1:]))
        inputs.append(item)
    return dataclasses.replace(request, inputs=tuple(inputs))


def holders_away(
    job: jobs_pb2.Job, task_name: str, sites: SiteRegistry, datasets: Registered | None = None
) -> list[str]:
    """The sites holding the task's staged inputs that have no session now (most tasks have
    no staged input: nothing is looked at). A dataset is away only when every holder is."""
    specs = {t.name: t for t in job.spec.tasks}
    status = {t.name: t for t in job.tasks}
    away = set()
    for item in specs[task_name].inputs:
        if item.dataset.startswith(DATASET) and item.site:
            held = dataset_holders(job.spec.tenant, item, datasets or {})
            if all(sites.session(site) is None for site, _ in held):
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
    to_site: str = "",
    push: Callable[[str], None] | None = None,
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
            staged_input, key, holder = _dataset(
                job.spec.tenant, item, datasets or {}, sites, to_site
            )
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
        artifact = next(
            (a for a in status[producer].artifacts if a.name == output.name and not a.partial),
            None,
        )
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
            source = _reachable_copy(artifact, sites, to_site)
            if source is None:
                if push is not None:
                    push(producer)  # a push lost with a leader is asked for again
                return (
                    f"waiting for output {output.name} of task {producer} to be pushed out "
                    f"of site {artifact.site}, whose store other sites cannot reach"
                )
            staged_input.site = source.site
            asks.setdefault(source.site, []).append((staged_input, source.key))
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


def _reachable_copy(
    artifact: jobs_pb2.Artifact, sites: SiteRegistry, to_site: str
) -> jobs_pb2.Artifact | None:
    """Where ``to_site`` stages a task's output from: the holder whose store it can reach
    nearest it (copies pushed out of a store other sites cannot reach count, its copies
    being in the job's folder too); None while there is none yet."""
    held = [a for a in [artifact, *artifact.copies] if a.site == to_site or reached(sites, a.site)]
    if not held:
        return None
    return nearest_first(held, artifact.bytes, to_site, sites.snapshot())[0]


def reached(sites: SiteRegistry, site: str) -> bool:
    """Whether other sites reach ``site``'s store, as its view says (an unknown site: yes)."""
    try:
        view = sites.get(site).view
    except SiteNotFoundError:
        return True
    return view is None or not view.header.store_unreachable


def _dataset(
    tenant: str, item: jobs_pb2.DataInput, datasets: Registered, sites: SiteRegistry, to_site: str
) -> tuple[site_link_service_pb2.StagedInput, str, str]:
    """A registered dataset to stage: the input, its key and the site to sign it, the
    connected holder nearest ``to_site`` (the input's error says why when it is no longer
    registered)."""
    name = item.dataset.removeprefix(DATASET)
    staged_input = site_link_service_pb2.StagedInput(dataset=item.dataset, path=item.path or name)
    record = datasets.get((tenant, name))
    if record is None:
        staged_input.error = f"dataset {name} is no longer registered"
        return staged_input, "", ""
    staged_input.bytes, staged_input.sha256 = record.bytes, record.sha256
    held = [
        jobs_pb2.Artifact(site=site, key=location)
        for site, location in dataset_holders(tenant, item, datasets)
    ]
    if len(held) > 1:
        connected = [a for a in held if sites.session(a.site) is not None] or held
        held = nearest_first(connected, record.bytes, to_site, sites.snapshot())
    _, _, key = held[0].key.removeprefix("s3://").partition("/")
    staged_input.site = held[0].site  # the stage-in is measured on that link
    return staged_input, key, held[0].site
