"""Job operations for clients and agents: submit, read, cancel, watch, and task reports."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence

import structlog

from federation import tracing
from federation.api.v1 import job_service_pb2, jobs_pb2, site_link_service_pb2
from federation.common import job_state
from federation.coordinator import audit
from federation.coordinator.data import transfers
from federation.coordinator.data.checkpoint_copies import replicates
from federation.coordinator.data.copies import Copies
from federation.coordinator.data.datasets import DatasetBook
from federation.coordinator.data.outputs import names_dataset
from federation.coordinator.data.staged_inputs import reached
from federation.coordinator.jobs import spread
from federation.coordinator.jobs.events import WATCH_BATCH, EventHub
from federation.coordinator.jobs.listing import MAX_REPLY_BYTES, ListFilter
from federation.coordinator.jobs.reconcile import Reconciler, record_checkpoint
from federation.coordinator.jobs.records import (
    MADE_ID,
    Change,
    Mutation,
    find_spec,
    find_task,
    new_job_id,
    now_timestamp,
    transition,
    unplace,
)
from federation.coordinator.jobs.reports import (
    MAX_OUTPUT_TAIL,
    MAX_REPORT_REASON,
    ReportEffects,
    ack,
    back_from_preemption,
    crash_loop_changes,
    default_reason,
    failed_attempt,
    placed_again,
    ran_s,
    reports_on,
    stages_on,
    waiting_again,
)
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.jobs.validation import MAX_SPEC_BYTES, TASK_OUTPUT, spec_violations
from federation.coordinator.policy.queues import QueueBook
from federation.coordinator.policy.sharing import Sharing
from federation.coordinator.scheduling.learning import SpeedLearner
from federation.coordinator.sites.registry import SessionClosedError, SiteRegistry, cancel_request
from federation.errors import (
    FederationError,
    FieldViolation,
    InvalidArgumentError,
    JobNotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from federation.metrics import JOBS_SUBMITTED
from federation.placement.selectors import try_selectors
from federation.security.identity import Identity, Role
from federation.store import CommitTooLargeError
from federation.timeslice import TimeSlice

log = structlog.get_logger()

"""How long a site may take to sign the URL for a checkpoint's copy."""

DEFAULT_TENANT = "default"
MAX_BATCH = 10_000
MAX_PAGE = 1000


def job_id_for(tenant: str, chosen: str) -> str:
    """The id of a job whose submitter chose ``chosen``: ids a tenant chooses are that tenant's
    own namespace (``TENANT:ID``), so no tenant can learn which ids another uses; the default
    tenant's (operators' own jobs) stay bare. Chosen ids never hold a colon."""
    return chosen if tenant == DEFAULT_TENANT else f"{tenant}:{chosen}"


def ids_to_look_up(caller: Identity, job_id: str) -> tuple[str, ...]:
    """The id ``job_id`` means to ``caller``: a tenant names its own jobs by the id it chose,
    by their full id, or by the id the coordinator made (``j-…``, which no one may choose)."""
    if caller.role is Role.TENANT and ":" not in job_id and not job_id.startswith(MADE_ID):
        return (job_id_for(caller.name, job_id),)
    return (job_id,)


def tenant_of(caller: Identity, spec: jobs_pb2.JobSpec) -> str:
    """A tenant's own certificate decides its jobs' tenant; operators may name one."""
    if caller.role is Role.TENANT:
        return caller.name
    return spec.tenant or DEFAULT_TENANT


def visible_to(caller: Identity) -> Callable[[jobs_pb2.Job], bool]:
    """Operators see every job; a tenant sees only its own."""
    if caller.role is Role.OPERATOR:
        return lambda job: True
    return lambda job: job.spec.tenant == caller.name


class JobManager:
    def __init__(
        self,
        jobs: JobRepository,
        sites: SiteRegistry,
        hub: EventHub,
        wake: Callable[[], None],
        *,
        max_spec_bytes: int = MAX_SPEC_BYTES,
        max_unfinished_jobs_per_tenant: int = 0,
        learner: SpeedLearner | None = None,
        freed: Callable[[str, float], None] | None = None,
        sharing: Sharing | None = None,
        datasets: DatasetBook | None = None,
    ) -> None:
        self._jobs = jobs
        self._datasets = datasets
        """The registered datasets that inputs may name (``dataset:NAME``)."""
        self._sharing = sharing or Sharing(QueueBook(jobs.store), jobs.usage)
        """Which queues a tenant may submit to, and the priority classes."""
        self._learner = learner
        """Told how long each task that succeeded on devices ran."""
        self._freed = freed or (lambda site, ran_s: wake())
        """Called when a task ends at a site, with how long it ran (NaN: unknown): the
        capacity it held is for the first in line."""
        self._max_spec_bytes = max_spec_bytes
        self._max_unfinished = max_unfinished_jobs_per_tenant
        self._sites = sites
        self._hub = hub
        self._wake = wake
        self._reconciler = Reconciler(jobs, self.tell_site)
        self._copies = Copies(jobs, sites)

    # Clients -----------------------------------------------------------------------------

    def _check_unfinished(self, jobs: list[jobs_pb2.Job]) -> None:
        """Refuse jobs that would take a tenant past its unfinished jobs."""
        if not self._max_unfinished:
            return
        for tenant, count in Counter(job.spec.tenant for job in jobs).items():
            unfinished = self._jobs.unfinished(tenant)
            if unfinished + count > self._max_unfinished:
                raise ResourceExhaustedError(
                    f"tenant {tenant} has {unfinished} unfinished jobs and may have at most "
                    f"{self._max_unfinished}. To fix: wait for some to finish, or cancel some"
                )

    async def submit(
        self,
        caller: Identity,
        specs: Sequence[jobs_pb2.JobSpec],
        *,
        batch: bool,
        validate_only: bool = False,
    ) -> list[jobs_pb2.Job]:
        """Validate every spec, then store all jobs in one commit (all or nothing); a single
        job (``batch`` False) may share its commit with other callers' (``create_one``).
        ``validate_only``: the jobs as they would be stored, and nothing stored."""
        started_ns = tracing.now_ns()
        if len(specs) > MAX_BATCH:
            raise InvalidArgumentError(
                [FieldViolation("specs", f"at most {MAX_BATCH} jobs per batch, got {len(specs)}")]
            )
        if batch and not specs:
            raise InvalidArgumentError([FieldViolation("specs", "the batch is empty")])
        # Selectors are tried in the sandbox off the event loop; validation then reads the
        # verdicts from memory.
        await try_selectors(t.resources.accelerator.selector for s in specs for t in s.tasks)
        violations: list[FieldViolation] = []
        ids: set[str] = set()
        timeslice = TimeSlice()  # a batch of thousands must not stall other callers
        for i, spec in enumerate(specs):
            await timeslice.share()
            path = f"specs[{i}]" if batch else "spec"
            violations += spec_violations(spec, path, self._max_spec_bytes)
            if caller.role is Role.TENANT and spec.tenant not in ("", caller.name):
                raise PermissionDeniedError(
                    f"{caller} may not submit jobs for tenant {spec.tenant!r}"
                )
            violations += self._sharing.spec_violations(
                spec, tenant_of(caller, spec), path, by_tenant=caller.role is Role.TENANT
            )
            if spec.id.startswith(MADE_ID):
                violations.append(
                    FieldViolation(
                        f"{path}.id",
                        f"ids starting with {MADE_ID!r} are the coordinator's; choose another",
                    )
                )
            if spec.id:
                job_id = job_id_for(tenant_of(caller, spec), spec.id)
                if job_id in ids:
                    violations.append(
                        FieldViolation(f"{path}.id", f"duplicate id {spec.id!r} in this batch")
                    )
                ids.add(job_id)
        if self._datasets is not None:
            violations += self._datasets.resolve_inputs(
                (f"specs[{i}]" if batch else "spec", tenant_of(caller, spec), spec)
                for i, spec in enumerate(specs)
            )
        violations += self._unknown_datasets(specs, batch)
        if violations:
            raise InvalidArgumentError(violations)
        submitted_by = str(caller)
        jobs = []
        for spec in specs:
            await timeslice.share()
            jobs.append(self._new_job(caller, submitted_by, spec))
        reply_bytes = sum(job.ByteSize() + 8 for job in jobs)
        if reply_bytes > MAX_REPLY_BYTES:
            raise InvalidArgumentError(
                [
                    FieldViolation(
                        "specs" if batch else "spec",
                        f"the jobs would take {reply_bytes} bytes in the reply; at most "
                        f"{MAX_REPLY_BYTES}. To fix: split the batch",
                    )
                ]
            )
        self._check_unfinished(jobs)
        if validate_only:
            return jobs
        try:
            if batch or len(jobs) != 1:
                await self._jobs.create(jobs, batch=batch)
            else:
                # Validated on its own above; stored with the other single jobs that arrive
                # while a commit of them is under way (group commit).
                await self._jobs.create_one(jobs[0])
        except CommitTooLargeError as err:
            raise ResourceExhaustedError(
                f"the store cannot take these {len(jobs)} jobs in one commit ({err}). To fix: "
                "submit fewer jobs per batch",
                jobs=str(len(jobs)),
            ) from None
        JOBS_SUBMITTED.inc(len(jobs))
        await self._audit_on_behalf(caller, jobs)
        if tracing.on():
            _trace_submitted(jobs, started_ns)
        log.debug("jobs_submitted", count=len(jobs), by=submitted_by)  # each has its event
        self._wake()
        return jobs

    async def _audit_on_behalf(self, caller: Identity, jobs: list[jobs_pb2.Job]) -> None:
        """An operator's job for a tenant goes in the audit trail (a tenant's own do not: it
        may only submit for itself). Written after the jobs, in a commit of its own."""
        if caller.role is Role.TENANT:
            return
        entries = [
            audit.entry(str(caller), "job.submit", job.id, f"for tenant {job.spec.tenant}")
            for job in jobs
            if job.spec.tenant
        ]
        if entries:
            await self._jobs.store.commit(entries)

    def _unknown_datasets(
        self, specs: Sequence[jobs_pb2.JobSpec], batch: bool
    ) -> list[FieldViolation]:
        """Inputs that name no site and that no site reports holding."""
        known: set[str] | None = None  # gathered from every site's view only when needed
        out = []
        for i, spec in enumerate(specs):
            path = f"specs[{i}]" if batch else "spec"
            for t, task in enumerate(spec.tasks):
                for n, item in enumerate(task.inputs):
                    dataset = item.dataset
                    if (
                        not dataset
                        or item.site
                        or dataset.startswith(TASK_OUTPUT)
                        or names_dataset(dataset)  # the registry's (resolve_inputs)
                    ):
                        continue
                    if known is None:
                        known = self._sites.known_datasets()
                    if dataset not in known:
                        out.append(
                            FieldViolation(
                                f"{path}.tasks[{t}].inputs[{n}].dataset",
                                f"unknown dataset {dataset!r}: no site reports holding it. To fix: "
                                "name the site that has it in inputs[].site",
                            )
                        )
        return out

    def _new_job(self, caller: Identity, submitted_by: str, spec: jobs_pb2.JobSpec) -> jobs_pb2.Job:
        tenant = tenant_of(caller, spec)
        job_id = job_id_for(tenant, spec.id) if spec.id else new_job_id()
        job = jobs_pb2.Job(id=job_id, submitted_by=submitted_by)
        job.spec.CopyFrom(spread.divide(spec))
        job.spec.id = job.id
        job.spec.tenant = tenant
        job.spec.priority = self._sharing.priority_of(spec)
        job.state = job_state.PENDING
        job.reason = "submitted"
        job.created_at.CopyFrom(now_timestamp())
        job.updated_at.CopyFrom(job.created_at)
        for task in job.spec.tasks:
            job.tasks.add(
                name=task.name,
                state=job_state.PENDING,
                reason="submitted",
                part_of=spread.part_of(task.name),
            )
        return job

    async def get(self, caller: Identity, job_id: str) -> jobs_pb2.Job:
        visible = visible_to(caller)
        candidates = ids_to_look_up(caller, job_id)
        for candidate in candidates:
            with contextlib.suppress(JobNotFoundError):
                job = await self._jobs.get(candidate)
                if visible(job):
                    return job
        raise JobNotFoundError(job_id)  # do not reveal other tenants' jobs

    async def events(self, job_id: str) -> list[jobs_pb2.JobEvent]:
        """A job's recorded events (call ``get`` first: it checks visibility)."""
        return await self._jobs.events(job_id)

    async def list_jobs(
        self, caller: Identity, request: job_service_pb2.ListJobsRequest
    ) -> job_service_pb2.ListJobsResponse:
        if request.page_size > MAX_PAGE:
            raise InvalidArgumentError(
                [FieldViolation("page_size", f"at most {MAX_PAGE}, got {request.page_size}")]
            )
        known = jobs_pb2.JobState.values()
        for i, state in enumerate(request.states):
            if state not in known:
                names = ", ".join(jobs_pb2.JobState.keys()[1:])
                raise InvalidArgumentError(
                    [FieldViolation(f"states[{i}]", f"unknown job state {state}; one of {names}")]
                )
        visible = visible_to(caller)
        states = set(request.states)

        def accepts(job: jobs_pb2.Job) -> bool:
            return (
                visible(job)
                and (not states or job.state in states)
                and (not request.tenant or job.spec.tenant == request.tenant)
                and (not request.site or any(t.site == request.site for t in job.tasks))
                and (not request.queue or job.spec.queue == request.queue)
            )

        # A tenant sees only its own jobs: its listing walks its own index.
        tenant = request.tenant or (caller.name if caller.role is Role.TENANT else "")
        where = ListFilter.of(states, tenant, request.site, request.queue)
        reply = job_service_pb2.ListJobsResponse()
        reply.next_page_token = await self._jobs.list_page(
            accepts, reply.jobs, request.page_size or 100, request.page_token, where=where
        )
        return reply

    async def cancel(self, caller: Identity, job_id: str, reason: str) -> jobs_pb2.Job:
        job_id = (await self.get(caller, job_id)).id  # visibility check, and the full id
        why = reason or f"cancelled by {caller}"
        to_stop: list[tuple[str, str, int]] = []

        def mutate(job: jobs_pb2.Job) -> list[Change]:
            if job_state.is_terminal(job.state):
                return []
            job.cancel_requested = True
            to_stop.clear()
            return self._stop_tasks(job, why, to_stop)

        job = await self._jobs.update(job_id, mutate)
        self._send_cancels(job_id, to_stop, why)
        if caller.role is not Role.TENANT and job.spec.tenant:
            # Someone else's job stopped: the trail says who (a commit of its own, after it).
            detail = f"of tenant {job.spec.tenant}: {why}"
            await self._jobs.store.commit([audit.entry(str(caller), "job.cancel", job.id, detail)])
        return job

    def _stop_tasks(
        self, job: jobs_pb2.Job, reason: str, to_stop: list[tuple[str, str, int]]
    ) -> list[Change]:
        """Cancel every unfinished task: at once if no site runs it, else through its site."""
        changes = []
        for task in job.tasks:
            if job_state.is_terminal(task.state):
                continue
            if task.state in job_state.AT_SITE and self._sites.session(task.site) is not None:
                to_stop.append((task.site, task.name, task.epoch))
                continue
            # Not at a connected site: fencing stops any stale copy when its site returns.
            changes.append(transition(job, task.name, job_state.CANCELLED, reason))
        return changes

    def _send_cancels(self, job_id: str, to_stop: list[tuple[str, str, int]], reason: str) -> None:
        for site, task, epoch in to_stop:
            self.tell_site(site, cancel_request(job_id, task, epoch, reason))

    def tell_site(self, site: str, message: site_link_service_pb2.CoordinatorMessage) -> None:
        session = self._sites.session(site)
        if session is not None:
            with contextlib.suppress(SessionClosedError):
                session.send(message)

    async def watch(
        self, caller: Identity, request: job_service_pb2.WatchJobsRequest
    ) -> AsyncIterator[list[jobs_pb2.JobEvent]]:
        """Events of the jobs the caller may see (and asked for), in batches of those ready."""
        wanted = {full for job_id in request.job_ids for full in ids_to_look_up(caller, job_id)}
        visible = visible_to(caller)

        def accepts(job: jobs_pb2.Job) -> bool:
            return visible(job) and (not wanted or job.id in wanted)

        subscription = self._hub.subscribe(accepts)
        try:
            if request.include_current:
                current = []
                for job_id in sorted(set(request.job_ids)):
                    with contextlib.suppress(JobNotFoundError):
                        current.append(current_event(await self.get(caller, job_id)))
                if not wanted:
                    current += [current_event(j) for j in self._jobs.active() if accepts(j)]
                for first in range(0, len(current), WATCH_BATCH):
                    yield current[first : first + WATCH_BATCH]
            while True:
                yield await subscription.next_batch()
        finally:
            self._hub.unsubscribe(subscription)

    # Agents ------------------------------------------------------------------------------

    async def recover(self) -> None:
        """After a restart: offers that were never committed are void; place those again (a
        store written by an earlier version may hold tasks in SCHEDULING)."""
        for job in self._jobs.active():
            for task in job.tasks:
                if task.state == job_state.SCHEDULING:
                    await self._requeue(job.id, task.name, task.epoch, task.site)

    async def apply_reports(
        self, site: str, reports: Sequence[site_link_service_pb2.TaskReport]
    ) -> None:
        """Apply reports that arrived together, each job's in the order they came.

        Reports for the delegation the coordinator holds as current (the usual case) are
        written together in one ``update_many``; the rest (stale, foreign, for jobs no longer
        cached) take ``apply_report`` one by one, after them.
        """
        for i, report in enumerate(reports):
            if not report.job_id or not report.task:
                raise InvalidArgumentError(
                    [FieldViolation(f"task_status[{i}]", "job_id and task are required")]
                )
        current: list[tuple[site_link_service_pb2.TaskReport, ReportEffects]] = []
        others: list[site_link_service_pb2.TaskReport] = []
        others_jobs: set[str] = set()
        for report in reports:
            if report.job_id in others_jobs or not self._is_current(site, report):
                others.append(report)
                others_jobs.add(report.job_id)
            else:
                current.append((report, ReportEffects()))
        if current:
            written = await self._jobs.update_many(
                [(r.job_id, self._report_mutation(site, r, effects)) for r, effects in current]
            )
            for report, effects in current:
                job = written[report.job_id]
                if isinstance(job, FederationError):
                    # Unacknowledged: the agent's journal offers it again at its next hello.
                    log.warning("task_report_failed", job=report.job_id, error=str(job))
                    continue
                self._after_report(site, report, job, effects)
        for report in others:
            await self.apply_report(site, report)

    def _is_current(self, site: str, report: site_link_service_pb2.TaskReport) -> bool:
        """Whether the report is for the delegation of the task the coordinator holds now."""
        job = self._jobs.cached(report.job_id)
        if job is None:
            return False
        task = next((t for t in job.tasks if t.name == report.task), None)
        return task is not None and reports_on(task, site, report)

    async def note_staging(self, site: str, progress: site_link_service_pb2.StageProgress) -> None:
        """A stage-in's progress from ``site``: an event on the task, and, once the input is in
        place, its bytes counted per link and tenant and its throughput learnt for the link
        from the holder. Progress of a delegation the task no longer holds is dropped."""
        job = self._jobs.cached(progress.job_id)
        if job is None:
            return
        task = next((t for t in job.tasks if t.name == progress.task), None)
        if task is None or not stages_on(task, site, progress.epoch):
            return
        if progress.done:
            transfers.count(progress, site, job.spec.tenant)
            self._sites.observe_transfer(
                progress.source_site, site, progress.bytes_moved, progress.active_s
            )
        reason = transfers.line(progress)

        def mutate(job: jobs_pb2.Job) -> list[Change]:
            task = find_task(job, progress.task)
            if not stages_on(task, site, progress.epoch):
                return []
            return [Change(task.name, task.state, reason, site)]

        # The job went meanwhile, or its record is full: the progress is not kept.
        with contextlib.suppress(JobNotFoundError, CommitTooLargeError):
            await self._jobs.update(progress.job_id, mutate)

    async def apply_report(self, site: str, report: site_link_service_pb2.TaskReport) -> None:
        """Record a task status from ``site``; stale or foreign reports are fenced off."""
        try:
            job = await self._jobs.get(report.job_id)
            task = find_task(job, report.task)
        except JobNotFoundError:
            job, task = None, None
        if task is None or not reports_on(task, site, report):
            if (
                task is not None
                and job is not None
                and await self._reconciler.take_back(site, report, job, task)
            ):
                await self.apply_report(site, report)  # current again: apply it as usual
                return
            self._fence(site, report, job_state.is_terminal(report.state))
            return
        effects = ReportEffects()
        updated = await self._jobs.update(
            report.job_id, self._report_mutation(site, report, effects)
        )
        self._after_report(site, report, updated, effects)

    def _report_mutation(
        self, site: str, report: site_link_service_pb2.TaskReport, effects: ReportEffects
    ) -> Mutation:
        final = job_state.is_terminal(report.state)

        def mutate(job: jobs_pb2.Job) -> list[Change]:
            effects.superseded = False
            effects.siblings.clear()
            effects.uploaded = None
            current = find_task(job, report.task)
            if current.epoch != report.epoch or current.state not in job_state.AT_SITE:
                effects.superseded = True  # moved on since it was checked
                return []
            if report.devices:
                del current.devices[:]
                current.devices.extend(report.devices)
                del current.models[:]
                current.models.extend(self._sites.device_models(site, report.devices))
            if report.nodes:
                del current.nodes[:]
                current.nodes.extend(report.nodes)
            if report.HasField("checkpoint") and record_checkpoint(current, site, report):
                log.info(
                    "checkpoint_recorded",
                    job=job.id,
                    task=report.task,
                    site=site,
                    path=report.checkpoint.path,
                    bytes=report.checkpoint.bytes,
                    key=current.checkpoint.stored.key,
                )
                if current.checkpoint.HasField("stored") and replicates(
                    find_spec(job, report.task).checkpoint
                ):
                    effects.uploaded = jobs_pb2.CheckpointRecord()
                    effects.uploaded.CopyFrom(current.checkpoint)
            if report.state == job_state.RUNNING:
                changes = []
                if current.state != job_state.RUNNING:
                    # A site's word on the start (it started fresh, say) is kept with it.
                    said = f"; {report.reason}" if report.reason else ""
                    changes.append(
                        transition(job, report.task, job_state.RUNNING, f"running at {site}{said}")
                    )
                # Endpoints change without an event (readiness flaps are not history); a
                # crash loop's start and end are events, in the commit of their report.
                changes += crash_loop_changes(job, current, report.endpoints)
                if list(current.endpoints) != list(report.endpoints):
                    del current.endpoints[:]
                    current.endpoints.extend(report.endpoints)
                return changes
            if report.state == job_state.DELEGATED:
                return waiting_again(job, current, site, report.reason)
            if not final:
                return []
            del current.endpoints[:]
            succeeded = report.state == job_state.SUCCEEDED
            if report.artifacts and (succeeded or all(a.partial for a in report.artifacts)):
                del current.artifacts[:]
                current.artifacts.extend(report.artifacts)
                for artifact in current.artifacts:
                    artifact.site = site  # a site speaks only for its own store
            current.exit_code = report.exit_code
            current.output_tail = report.output_tail[-MAX_OUTPUT_TAIL:]
            if current.preempted_by:
                if report.state != job_state.SUCCEEDED and not job.cancel_requested:
                    return [back_from_preemption(job, current)]
                current.preempted_by = ""  # it ended by itself first
            reason = (report.reason or default_reason(report))[:MAX_REPORT_REASON]
            interrupted = report.interrupted and report.state != job_state.SUCCEEDED
            if interrupted and not job.cancel_requested:
                return [placed_again(job, current, f"stopped by {site}: {reason}")]
            if report.state == job_state.FAILED and not job.cancel_requested:
                changes = [failed_attempt(job, current, reason)]
            else:
                changes = [transition(job, report.task, report.state, reason)]
            if current.state == job_state.FAILED:
                changes += self._stop_tasks(job, f"task {report.task} failed", effects.siblings)
            return changes

        return mutate

    def _learn(self, job: jobs_pb2.Job, task_name: str) -> None:
        """A task that succeeded on devices: how fast its device model ran its workload."""
        assert self._learner is not None
        task = find_task(job, task_name)
        spec = find_spec(job, task_name)
        run_s = ran_s(task)
        if not task.estimate.device_model or math.isnan(run_s):
            return
        self._learner.observe(
            spec.workload_class,
            task.estimate.device_model,
            spec.estimated_duration_s,
            task.estimate.run_s,
            run_s,
            site=task.site,
        )

    def _after_report(
        self,
        site: str,
        report: site_link_service_pb2.TaskReport,
        updated: jobs_pb2.Job,
        effects: ReportEffects,
    ) -> None:
        """Tell the sites what a written report implies: ack, cancels, and wake the scheduler."""
        final = job_state.is_terminal(report.state)
        if effects.superseded:
            self._fence(site, report, final)
            return
        if final:
            self.tell_site(site, ack(report))
        if report.state == job_state.SUCCEEDED and self._learner is not None:
            self._learn(updated, report.task)
        if updated.cancel_requested and report.state == job_state.RUNNING:
            self._send_cancels(report.job_id, [(site, report.task, report.epoch)], "cancelled")
        self._send_cancels(report.job_id, effects.siblings, f"task {report.task} failed")
        if final:
            self._freed(site, ran_s(find_task(updated, report.task)))
        if effects.uploaded is not None:
            self._copies.copy_checkpoint(updated, report.task, effects.uploaded)
        pushed = report.state == job_state.SUCCEEDED and report.artifacts
        if pushed and not reached(self._sites, site):
            self.push_outputs(updated.id, report.task)

    def push_outputs(self, job_id: str, task_name: str) -> None:
        """Push the outputs of a task that succeeded at a site whose store other sites cannot
        reach to a reachable store (``Copies.push_outputs``)."""
        self._copies.push_outputs(job_id, task_name)

    def _fence(self, site: str, report: site_link_service_pb2.TaskReport, final: bool) -> None:
        """A report for a delegation that is no longer current: stop it, never accept it."""
        log.warning(
            "stale_task_report_fenced",
            site=site,
            job=report.job_id,
            task=report.task,
            epoch=report.epoch,
        )
        if final:
            self.tell_site(site, ack(report))
        else:
            self.tell_site(
                site,
                cancel_request(
                    report.job_id,
                    report.task,
                    report.epoch,
                    "superseded: this delegation is no longer current",
                ),
            )

    def delegated_to(self, site: str) -> set[tuple[str, str, int]]:
        """(job, task, epoch) of every task the coordinator believes ``site`` holds."""
        return {
            (job.id, task.name, task.epoch)
            for job in self._jobs.active()
            for task in job.tasks
            if task.site == site and task.state in job_state.AT_SITE
        }

    async def reconcile(
        self,
        site: str,
        reports: Sequence[site_link_service_pb2.TaskReport],
        delegated: set[tuple[str, str, int]],
    ) -> None:
        """After a (re)connect: apply what the site has, requeue what it lost.

        ``delegated`` is ``delegated_to(site)`` taken when the site said hello.
        """
        named = [r for r in reports if r.job_id and r.task]
        if len(named) < len(reports):
            # Refusing the hello would only bring the same journal back: drop just these.
            log.warning(
                "hello_reports_without_ids_dropped", site=site, count=len(reports) - len(named)
            )
        held = {(r.job_id, r.task, r.epoch) for r in named}
        await self.apply_reports(site, named)
        for job_id, task, epoch in sorted(delegated - held):
            await self._requeue(job_id, task, epoch, site)
        for job_id, task, epoch in sorted(delegated & held):
            self._preempt_again(site, job_id, task, epoch)
        self._wake()

    def _preempt_again(self, site: str, job_id: str, task_name: str, epoch: int) -> None:
        """A task marked for preemption whose stop may never have reached its site (the
        leader changed, or the site reconnected, before it left): tell the site again."""
        job = self._jobs.cached(job_id)
        task = find_task(job, task_name) if job is not None else None
        if task is not None and task.preempted_by and task.epoch == epoch:
            reason = f"preempted by {task.preempted_by}"
            self.tell_site(site, cancel_request(job_id, task_name, epoch, reason))

    async def _requeue(self, job_id: str, task_name: str, epoch: int, site: str) -> None:
        def mutate(job: jobs_pb2.Job) -> list[Change]:
            task = find_task(job, task_name)
            if task.epoch != epoch or task.state not in (*job_state.AT_SITE, job_state.SCHEDULING):
                return []
            unplace(task)
            task.preempted_by = ""  # what it was stopped for is placed anew too
            reason = f"{site} no longer has the task; placing it again"
            if job.cancel_requested:
                return [transition(job, task_name, job_state.CANCELLED, "cancelled")]
            return [transition(job, task_name, job_state.PENDING, reason)]

        await self._jobs.update(job_id, mutate)


def _trace_submitted(jobs: list[jobs_pb2.Job], started_ns: int) -> None:
    """Each job's ``job.submit``, the root of its trace: from the call to the commit."""
    ended_ns = tracing.now_ns()
    for job in jobs:
        attributes: dict[str, tracing.Value] = {
            "federation.tenant": job.spec.tenant,
            "federation.tasks": [t.name for t in job.tasks],
            "federation.batch_size": len(jobs),
        }
        if job.spec.queue:
            attributes["federation.queue"] = job.spec.queue
        tracing.record(tracing.ROOT, job.id, started_ns, ended_ns, attributes=attributes)


def current_event(job: jobs_pb2.Job) -> jobs_pb2.JobEvent:
    """A synthetic event carrying a job's present state (sequence 0)."""
    return jobs_pb2.JobEvent(
        job_id=job.id,
        sequence=0,
        time=job.updated_at,
        state=job.state,
        reason=job.reason,
        job_state=job.state,
    )
