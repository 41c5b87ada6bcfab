"""Service jobs as clients see them: the endpoints of their replicas, now and as they change,
and changes to a running service (scale, rolling update), which its site makes in place.

Endpoints live in each task's status, written from its site's reports without a job event
(a readiness flap is not history): watchers follow the job's writes (``EventHub.follow``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterator

import structlog

from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common import job_state
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.manager import JobManager
from federation.coordinator.jobs.records import Change, find_spec, find_task, transition
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.jobs.spread import PART, part_number
from federation.coordinator.jobs.validation import MAX_REPLICAS, task_violations
from federation.coordinator.policy.reservations import Reservations
from federation.coordinator.policy.resources import at, demand
from federation.coordinator.policy.sharing import Sharing
from federation.coordinator.policy.usage import placed
from federation.coordinator.sites.registry import (
    SessionClosedError,
    SiteRegistry,
    cancel_request,
)
from federation.errors import (
    ConflictError,
    DeadlineExceededError,
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    JobNotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from federation.resources import add
from federation.security.identity import Identity
from federation.service_policy import fixed_fields

log = structlog.get_logger()

CHANGE_PROTOCOL = 3
"""The site-link protocol that brought ``ChangeTask`` (``federation.site_protocol``)."""
CHANGE_TIMEOUT_S = 10.0
"""How long a site has to answer a change."""


def endpoints_of(job: jobs_pb2.Job, ready_only: bool = False) -> list[jobs_pb2.Endpoint]:
    """Every replica of the job's service tasks that have not ended, task by task (an
    autoscaled service's overflow parts too, wherever they run), as their sites reported."""
    return [
        e
        for task in job.tasks
        if not job_state.is_terminal(task.state)
        for e in task.endpoints
        if e.ready or not ready_only
    ]


class Serving:
    """Endpoints of service jobs and changes to running services, for the callers that may
    see the jobs (one per term of leadership)."""

    def __init__(
        self,
        manager: JobManager,
        hub: EventHub,
        jobs: JobRepository,
        sites: SiteRegistry,
        sharing: Sharing,
        room_freed: Callable[[], None],
    ) -> None:
        """``room_freed``: told when room a change reserved in a queue is free again."""
        self._manager = manager
        self._hub = hub
        self._jobs = jobs
        self._sites = sites
        self._sharing = sharing
        self._room_freed = room_freed
        self._changing: dict[str, tuple[asyncio.Lock, int]] = {}
        """Per job with a change under way: its lock, and how many callers hold or await it."""
        self._growing = Reservations()
        """Running tasks whose change adds replicas, with what each will hold while it is
        made: counted against its queue in place of what it holds now."""
        jobs.counts(self._growing)

    async def endpoints(self, caller: Identity, job_id: str) -> tuple[str, list[jobs_pb2.Endpoint]]:
        """The job's full id and its endpoints; NOT_FOUND for a job the caller may not see."""
        job = await self._manager.get(caller, job_id)
        return job.id, endpoints_of(job)

    async def watch(
        self, caller: Identity, job_id: str, ready_only: bool
    ) -> AsyncIterator[list[jobs_pb2.Endpoint]]:
        """The endpoints now, then each time they change; ends once the job has ended (with
        an empty list), or raises as the hub closes (the coordinator stepped down)."""
        job = await self._manager.get(caller, job_id)
        changed = self._hub.follow(job.id)
        try:
            sent: list[jobs_pb2.Endpoint] | None = None
            while True:
                now = endpoints_of(job, ready_only)
                if now != sent:
                    yield now
                    sent = now
                if job_state.is_terminal(job.state):
                    return
                await changed.wait()
                changed.clear()
                if self._hub.closed is not None:
                    raise self._hub.closed
                job = await self._manager.get(caller, job.id)
        finally:
            self._hub.unfollow(job.id, changed)

    async def scale(self, caller: Identity, job_id: str, task: str, replicas: int) -> jobs_pb2.Job:
        """Sets how many replicas a service task keeps running (``task`` empty: the job's
        only service task); returns the job as written."""
        job = await self._manager.get(caller, job_id)
        old = _service_task(job, task, "task")
        if not 1 <= replicas <= MAX_REPLICAS:
            raise InvalidArgumentError(
                [
                    FieldViolation(
                        "replicas",
                        f"must be 1 to {MAX_REPLICAS}, got {replicas}; to stop a service, "
                        "cancel its job",
                    )
                ]
            )
        if old.service.HasField("autoscale"):
            bounds = old.service.autoscale
            if not bounds.min_replicas <= replicas <= bounds.max_replicas:
                raise InvalidArgumentError(
                    [
                        FieldViolation(
                            "replicas",
                            f"{old.name} is autoscaled within {bounds.min_replicas} to "
                            f"{bounds.max_replicas} replicas, got {replicas}; to change the "
                            "bounds, update its service.autoscale",
                        )
                    ]
                )
        new = jobs_pb2.TaskSpec()
        new.CopyFrom(old)
        new.replicas = replicas
        what = f"scaled from {old.replicas or 1} to {replicas} replicas"
        return await self._change(caller, job.id, new, what)

    async def autoscale(self, job_id: str, task: str, replicas: int, what: str) -> jobs_pb2.Job:
        """The coordinator's own scale of a service task (``jobs.autoscaler``),
        with ``what`` as the job's event."""
        job = await self._jobs.get(job_id)
        new = jobs_pb2.TaskSpec()
        new.CopyFrom(find_spec(job, task))
        new.replicas = replicas
        return await self._change(None, job.id, new, what)

    async def add_part(self, job_id: str, origin: str, replicas: int, what: str) -> str:
        """Another part of the autoscaled service task ``origin`` (``jobs.autoscaler``), with
        ``replicas`` replicas: a task ``origin/N`` (``spread.part_of`` names ``origin``) with
        ``origin``'s spec, PENDING, which the scheduling cycle places as any task, by the same
        placement and admitted against the job's queue. Returns its name."""
        name = ""

        def mutate(job: jobs_pb2.Job) -> list[Change]:
            nonlocal name
            numbers = [part_number(t.name) for t in job.tasks if t.part_of == origin]
            name = f"{origin}{PART}{max(numbers, default=0) + 1}"
            spec = job.spec.tasks.add()
            spec.CopyFrom(find_spec(job, origin))
            spec.name, spec.replicas = name, replicas
            spec.ClearField("spread")
            job.tasks.add(name=name, state=job_state.PENDING, reason=what, part_of=origin)
            return [Change(name, job_state.PENDING, what, "")]

        async with self._one_at_a_time(job_id):
            await self._jobs.update(job_id, mutate)
        self._room_freed()  # a new task in line: a cycle may place it now
        log.info("service_part_added", job=job_id, task=name, replicas=replicas)
        return name

    async def remove_part(self, job_id: str, part: str, what: str) -> None:
        """Stops part ``part`` of an autoscaled service: its site drains each replica (no new
        requests, those in flight finished) before it stops it, then reports it CANCELLED;
        one not placed yet ends at once."""
        to_stop: list[tuple[str, int]] = []

        def mutate(job: jobs_pb2.Job) -> list[Change]:
            task = find_task(job, part)
            to_stop.clear()
            if job_state.is_terminal(task.state):
                return []
            if task.state in job_state.AT_SITE and self._sites.session(task.site) is not None:
                to_stop.append((task.site, task.epoch))
                return [Change(part, task.state, what, task.site)]
            return [transition(job, part, job_state.CANCELLED, what)]

        async with self._one_at_a_time(job_id):
            await self._jobs.update(job_id, mutate)
        for site, epoch in to_stop:
            session = self._sites.session(site)
            if session is not None:
                with contextlib.suppress(SessionClosedError):
                    session.send(cancel_request(job_id, part, epoch, what))
        log.info("service_part_removed", job=job_id, task=part)

    async def update(self, caller: Identity, job_id: str, spec: jobs_pb2.TaskSpec) -> jobs_pb2.Job:
        """Replaces a service task's spec (the task ``spec.name``): its replicas are replaced
        in batches of service.max_unavailable; returns the job as written."""
        job = await self._manager.get(caller, job_id)
        old = _service_task(job, spec.name, "spec.name")
        violations = task_violations(spec, "spec")
        violations += [
            FieldViolation(
                f"spec.{name}",
                "cannot change in a rolling update (only replicas, command, env and service "
                "may); submit the new version as another job",
            )
            for name in fixed_fields(old, spec)
        ]
        if violations:
            raise InvalidArgumentError(violations)
        return await self._change(caller, job.id, spec, _described(old, spec))

    async def _change(
        self, caller: Identity | None, job_id: str, new: jobs_pb2.TaskSpec, what: str
    ) -> jobs_pb2.Job:
        """Takes the task ``new.name`` of the job to spec ``new``: through its site while it
        runs (the site holds room for added replicas, or declines), then in the store with a
        new revision and a job event. Changes of one job are made one at a time. ``caller``
        None: the coordinator's own change."""
        async with self._one_at_a_time(job_id):
            if caller is None:
                job = await self._jobs.get(job_id)
            else:
                job = await self._manager.get(caller, job_id)
            old = find_spec(job, new.name)
            status = find_task(job, new.name)
            if job_state.is_terminal(status.state):
                raise FailedPreconditionError(
                    f"task {new.name} of job {job.id} has ended "
                    f"({jobs_pb2.JobState.Name(status.state)}); nothing to change"
                )
            if new == old:
                return job
            if status.state not in (job_state.PENDING, job_state.RUNNING):
                raise ConflictError(
                    f"task {new.name} of job {job.id} is being placed at a site now "
                    f"({jobs_pb2.JobState.Name(status.state)}); try again in a few seconds"
                )
            # Above any revision sent before, even one a site took without the store hearing
            # (its answer lost, or the leader that sent it gone): a site declines a revision
            # it took with another spec, so a number is never sent twice.
            revision = max(status.revision, status.issued_revision) + 1
            state, epoch = status.state, status.epoch
            with self._reserved(job, status, old, new):
                if state == job_state.RUNNING:
                    issue = functools.partial(_issue_revision, new.name, revision, state, epoch)
                    await self._jobs.update(job.id, issue)
                    await self._tell_site(job, status, new, revision)
                written = await self._jobs.update(
                    job.id, functools.partial(_take_spec, new, revision, state, epoch, what)
                )
            log.info("service_changed", job=job.id, task=new.name, revision=revision, change=what)
            return written

    @contextlib.contextmanager
    def _reserved(
        self,
        job: jobs_pb2.Job,
        status: jobs_pb2.TaskStatus,
        old: jobs_pb2.TaskSpec,
        new: jobs_pb2.TaskSpec,
    ) -> Iterator[None]:
        """Added replicas of a running task count against the job's queue as a task that
        starts would, from the check until the change is written or given up: two scale-ups
        at once (or a task the scheduler admits meanwhile) cannot both take the last room."""
        extra = (new.replicas or 1) - (old.replicas or 1)
        if extra <= 0 or status.state != job_state.RUNNING:
            yield  # a pending task is admitted when it is placed, with its new spec
            return
        added = jobs_pb2.TaskSpec()
        added.CopyFrom(new)
        added.replicas = extra
        site, domain = status.site, self._sites.domain_of(status.site)
        need = at(demand(added), site, domain)
        if why := self._sharing.admit_change(job, need):
            raise ResourceExhaustedError(f"{extra} more replicas of {new.name}: {why}")
        # Held, the task counts as what it holds now and what it adds.
        reserved = at(placed(old, status), site, domain)
        add(reserved, need.items())
        key = (job.id, new.name)
        self._growing.keep([(key, reserved)])
        try:
            yield
        except BaseException:
            self._growing.let_go([key])
            self._room_freed()  # tasks turned away meanwhile may have it now
            raise
        self._growing.let_go([key])

    async def _tell_site(
        self,
        job: jobs_pb2.Job,
        status: jobs_pb2.TaskStatus,
        new: jobs_pb2.TaskSpec,
        revision: int,
    ) -> None:
        """Sends the change to the site that runs the task; raises unless it took it."""
        site = status.site
        session = self._sites.session(site)
        if session is None:
            raise UnavailableError(
                f"site {site}, which runs {new.name}, is not connected; try again once it is"
            )
        if session.protocol < CHANGE_PROTOCOL:
            raise FailedPreconditionError(
                f"the agent at site {site} speaks site-link protocol {session.protocol}; "
                f"changing a running service needs {CHANGE_PROTOCOL} or later. To fix: "
                f"upgrade the agent at {site}"
            )
        message = site_link_service_pb2.CoordinatorMessage(
            change=site_link_service_pb2.ChangeTask(
                job_id=job.id,
                task=status.name,
                epoch=status.epoch,
                spec=new,
                revision=revision,
                node_labels=job.spec.constraints.node_labels,
                cordoned_nodes=self._sites.get(site).record.cordoned_nodes,
            )
        )
        (reply,) = await session.request_many([message], CHANGE_TIMEOUT_S)
        if isinstance(reply, SessionClosedError):
            raise UnavailableError(f"site {site} disconnected before it answered; try again")
        if isinstance(reply, TimeoutError):
            raise DeadlineExceededError(
                f"site {site} did not answer within {CHANGE_TIMEOUT_S:g}s; it may still make "
                "the change: run the same command again to find out"
            )
        if not reply.change_answer.accepted:
            raise FailedPreconditionError(
                f"site {site} declined the change: {reply.change_answer.reason}"
            )

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, job_id: str) -> AsyncIterator[None]:
        lock, users = self._changing.get(job_id, (asyncio.Lock(), 0))
        self._changing[job_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._changing[job_id]
            if users == 1:
                del self._changing[job_id]
            else:
                self._changing[job_id] = (lock, users - 1)


def _take_spec(
    new: jobs_pb2.TaskSpec,
    revision: int,
    state: jobs_pb2.JobState.ValueType,
    epoch: int,
    what: str,
    job: jobs_pb2.Job,
) -> list[Change]:
    """The job's task ``new.name`` takes spec ``new`` as ``revision``, if it is still where
    the change was made (the same state and epoch)."""
    task = _numbered(job, new.name, revision, state, epoch)
    find_spec(job, new.name).CopyFrom(new)
    task.revision = revision
    return [Change(new.name, task.state, f"revision {revision}: {what}", task.site)]


def _issue_revision(
    name: str,
    revision: int,
    state: jobs_pb2.JobState.ValueType,
    epoch: int,
    job: jobs_pb2.Job,
) -> list[Change]:
    """Reserves ``revision`` for the job's task ``name`` before its site is told (no event:
    the change is not made yet), if the task is still where the change was made."""
    _numbered(job, name, revision, state, epoch)
    return []


def _numbered(
    job: jobs_pb2.Job, name: str, revision: int, state: jobs_pb2.JobState.ValueType, epoch: int
) -> jobs_pb2.TaskStatus:
    """The job's task ``name`` with ``revision`` used up (``issued_revision``); ConflictError
    if it left ``state`` or ``epoch`` meanwhile."""
    task = find_task(job, name)
    if (task.state, task.epoch) != (state, epoch):
        raise ConflictError(
            f"task {name} of job {job.id} changed while the change was made; try again"
        )
    task.issued_revision = max(task.issued_revision, revision)
    return task


def _service_task(job: jobs_pb2.Job, name: str, field: str) -> jobs_pb2.TaskSpec:
    """The job's service task ``name`` (empty: its only one); NOT_FOUND or INVALID_ARGUMENT
    on ``field`` otherwise."""
    services = [t for t in job.spec.tasks if t.kind == jobs_pb2.TASK_KIND_SERVICE]
    if not name:
        if len(services) == 1:
            return services[0]
        found = ", ".join(t.name for t in services) or "none"
        raise InvalidArgumentError(
            [
                FieldViolation(
                    field, f"job {job.id} has {len(services)} service tasks ({found}): name one"
                )
            ]
        )
    spec = next((t for t in job.spec.tasks if t.name == name), None)
    if spec is None:
        raise JobNotFoundError(f"{job.id}/{name}")
    if spec.kind != jobs_pb2.TASK_KIND_SERVICE:
        raise InvalidArgumentError(
            [
                FieldViolation(
                    field, f"task {name} is not a service: only services change while they run"
                )
            ]
        )
    return spec


def _described(old: jobs_pb2.TaskSpec, new: jobs_pb2.TaskSpec) -> str:
    """What an update changes, for the job's events."""
    parts = [
        name for name in ("command", "env", "service") if getattr(old, name) != getattr(new, name)
    ]
    out = f"updated {', '.join(parts)}" if parts else "updated"
    if (old.replicas or 1) != (new.replicas or 1):
        out += f"; {old.replicas or 1} to {new.replicas or 1} replicas"
    return out
