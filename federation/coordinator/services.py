"""What a leading coordinator runs: state loaded from the store, the scheduler, the RPC logic.

A coordinator builds these when it starts to lead (at once with the embedded store, on
winning the election with etcd) and drops them when it stops leading; a later term builds
them afresh from the store, so nothing cached by an earlier term survives into the next.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

import structlog

from federation.api.v1 import admin_service_pb2
from federation.common import job_state
from federation.coordinator.admin import Admin
from federation.coordinator.config import CoordinatorConfig
from federation.coordinator.data.datasets import DatasetBook
from federation.coordinator.data.task_logs import TaskLogs
from federation.coordinator.jobs.autoscaler import Autoscaler
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.gangs import GangKeeper
from federation.coordinator.jobs.manager import JobManager
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.jobs.retention import Retention
from federation.coordinator.jobs.serving import Serving
from federation.coordinator.layout import upgrade_layout
from federation.coordinator.policy.priority import parse_priority_classes
from federation.coordinator.policy.queues import QueueBook
from federation.coordinator.policy.sharing import Sharing
from federation.coordinator.scheduling.config import SchedulerConfig
from federation.coordinator.scheduling.cycle import Scheduler
from federation.coordinator.scheduling.learning import LearningSaver, SpeedLearner
from federation.coordinator.security.authorities import Authorities
from federation.coordinator.security.certificates import Certificates
from federation.coordinator.security.expiry import Expiries
from federation.coordinator.security.renewal import Renewal
from federation.coordinator.sites.drains import Drains
from federation.coordinator.sites.enrollment import Enrollment
from federation.coordinator.sites.link import SiteLink
from federation.coordinator.sites.lost import LostSites
from federation.coordinator.sites.registry import SiteRegistry
from federation.errors import NotLeaderError
from federation.metrics import PLACEMENT_PLUGINS_DISABLED
from federation.placement.framework import Framework
from federation.placement.registry import build_framework
from federation.security.pki import load_certificate
from federation.security.revocation import RevocationBook
from federation.store import Store

log = structlog.get_logger()

ListCoordinators = Callable[[], Awaitable[list[admin_service_pb2.Coordinator]]]
"""Every running coordinator, for the federation status."""


@dataclass
class Services:
    """One term of leadership: everything the RPCs call, and the scheduling loop."""

    jobs: JobRepository
    sites: SiteRegistry
    hub: EventHub
    scheduler: Scheduler
    manager: JobManager
    enrollment: Enrollment
    certificates: Certificates
    link: SiteLink
    admin: Admin
    renewal: Renewal
    serving: Serving
    logs: TaskLogs
    datasets: DatasetBook
    scheduler_task: asyncio.Task[None]
    lost_sites: LostSites
    lost_sites_task: asyncio.Task[None]
    learning_task: asyncio.Task[None]
    """Saves what the learner learned, in batches."""
    expiry_task: asyncio.Task[None]
    """Keeps the certificate expiry gauge current."""
    authorities: Authorities | None = None
    """The CAs in force (they outlive the term)."""
    store: Store | None = None
    """Where this term writes (fenced when several coordinators share the store)."""
    stop_telling_bundles: Callable[[], None] | None = None
    """Stops telling this term's sessions of trust bundle changes."""
    ended: NotLeaderError | None = None
    """Set when the term ended by stepping down: streams still open end with it."""
    retention_task: asyncio.Task[None] | None = None
    """Removes finished jobs and audit entries past their retention."""
    drains_task: asyncio.Task[None] | None = None
    autoscale_task: asyncio.Task[None] | None = None
    gangs_task: asyncio.Task[None] | None = None
    """Stops what operators' drains hold."""

    async def stop(self, step_down: NotLeaderError | None = None) -> None:
        """Stop scheduling; with ``step_down``, also end every agent session and watch.

        Args:
            step_down: Why the term ends early. Open ``Connect`` and ``WatchJobs`` streams end
                with it, so agents and clients move to the new leader. ``None`` (shutting
                down) leaves them to the server's own stop.
        """
        if self.stop_telling_bundles is not None:
            self.stop_telling_bundles()
            self.stop_telling_bundles = None
        if step_down is not None:
            self.ended = step_down
            self.sites.close_sessions()
            self.hub.close(step_down)
        for task in (
            self.lost_sites_task,
            self.scheduler_task,
            self.learning_task,
            self.expiry_task,
            self.retention_task,
            self.drains_task,
            self.autoscale_task,
            self.gangs_task,
        ):
            if task is None:
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.scheduler.close()


async def start_services(
    store: Store,
    config: CoordinatorConfig,
    authorities: Authorities,
    coordinators: ListCoordinators,
    probe_endpoint: str = "",
    *,
    revocations: RevocationBook,
) -> Services:
    """Load sites and jobs from ``store``, recover interrupted offers, start scheduling.

    Args:
        store: Where the term reads and writes (fenced when several coordinators share it).
        config: The coordinator's settings.
        authorities: The CAs in force; its issuing CA signs site certificates at Join.
        coordinators: Lists every running coordinator, for the federation status.
        probe_endpoint: Where agents measure their link to this coordinator.
        revocations: The coordinator's revocations (it outlives the term), which a
            revocation made in this term joins at once.
    """
    await upgrade_layout(store)  # before anything is read: this term's writes are fenced
    hub = EventHub()
    scheduler_ref: list[Scheduler] = []

    def wake() -> None:
        if scheduler_ref:
            scheduler_ref[0].wake()

    sites = SiteRegistry(store, wake)
    jobs = JobRepository(store, hub, domain_of=sites.domain_of)
    learner = SpeedLearner()
    await learner.load(store)  # what earlier terms learned
    book = QueueBook(store)
    await book.load()
    classes = parse_priority_classes(config.priority_classes, source="config")
    sharing = Sharing(book, jobs.usage, classes)
    await sites.load()
    datasets = DatasetBook(store, sites)
    await datasets.load()
    recovered = await jobs.load()
    scheduler = Scheduler(
        jobs,
        sites,
        placement_framework(config),
        SchedulerConfig(
            offer_timeout_s=config.offer_timeout_s,
            reservation_lease_s=config.reservation_lease_s,
            retry_interval_s=config.retry_interval_s,
            unfit_retry_interval_s=config.unfit_retry_interval_s,
            preemption_min_run_s=config.preemption_min_run_s,
            reclaim_min_run_s=config.reclaim_min_run_s,
            wait_gain=config.wait_gain,
            max_offers_per_round=config.max_offers_per_round,
            offers_at_once=config.offers_at_once,
        ),
        learner,
        sharing,
        datasets.datasets,
    )
    scheduler_ref.append(scheduler)
    manager = JobManager(
        jobs,
        sites,
        hub,
        wake,
        max_spec_bytes=config.max_spec_bytes,
        max_unfinished_jobs_per_tenant=config.max_unfinished_jobs_per_tenant,
        learner=learner,
        sharing=sharing,
        freed=scheduler.capacity_freed,
        datasets=datasets,
    )
    scheduler.push_outputs = manager.push_outputs
    await manager.recover()
    # Sites holding tasks are unknown until they say hello to this term: their grace (and the
    # partition rule) count from now.
    sites.presume_unreachable({job_site for job_site, *_ in _delegated(jobs)})
    lost_sites = LostSites(
        jobs,
        sites,
        wake,
        interval_s=config.heartbeat_interval_s,
        heartbeat_s=config.heartbeat_interval_s,
    )
    scheduler_task = asyncio.create_task(scheduler.run())
    lost_sites_task = asyncio.create_task(lost_sites.run())
    learning_task = asyncio.create_task(LearningSaver(learner, store).run())
    expiries = Expiries(store, load_certificate(config.cert), authorities.issuer.cert)
    expiry_task = asyncio.create_task(expiries.run())
    retention = Retention(
        jobs,
        store,
        finished_job_retention_s=config.finished_job_retention_s,
        audit_retention_s=config.audit_retention_s,
        archive_dir=config.archive_dir,
    )
    retention_task = asyncio.create_task(retention.run())
    drains_task = asyncio.create_task(Drains(sites, jobs, scheduler.stop).run())
    gangs_task = asyncio.create_task(GangKeeper(jobs, scheduler.stop).run())
    serving = Serving(manager, hub, jobs, sites, sharing, scheduler.room_freed)
    autoscaler = Autoscaler(
        jobs, serving.autoscale, add_part=serving.add_part, remove_part=serving.remove_part
    )
    autoscale_task = asyncio.create_task(autoscaler.run())
    site_lifetime = timedelta(seconds=config.site_certificate_lifetime_s)
    log.info("services_started", jobs_recovered=len(recovered), sites=len(sites.names()))
    return Services(
        jobs=jobs,
        sites=sites,
        hub=hub,
        scheduler=scheduler,
        manager=manager,
        enrollment=Enrollment(store, sites, authorities, site_lifetime=site_lifetime),
        certificates=Certificates(store, authorities, revocations),
        link=SiteLink(
            sites,
            manager,
            config.heartbeat_interval_s,
            config.missed_heartbeats,
            probe_endpoint=probe_endpoint,
            trust_bundle=lambda: authorities.bundle_pem,
            renewed_as=revocations.successor_fingerprint,
            datasets=datasets,
        ),
        admin=Admin(
            sites,
            jobs,
            coordinators,
            lost_sites,
            sharing,
            scheduler.forecasts,
            expiries,
            queues=book,
        ),
        serving=serving,
        logs=TaskLogs(manager, jobs, sites),
        datasets=datasets,
        renewal=Renewal(
            store,
            sites,
            authorities,
            site_lifetime=site_lifetime,
            client_lifetime=timedelta(seconds=config.client_certificate_lifetime_s),
            overlap=timedelta(seconds=config.renewal_overlap_s),
            book=revocations,
        ),
        scheduler_task=scheduler_task,
        lost_sites=lost_sites,
        lost_sites_task=lost_sites_task,
        learning_task=learning_task,
        expiry_task=expiry_task,
        retention_task=retention_task,
        drains_task=drains_task,
        autoscale_task=autoscale_task,
        gangs_task=gangs_task,
        authorities=authorities,
        store=store,
        stop_telling_bundles=authorities.on_bundle_change(sites.tell_trust_bundle),
    )


def _delegated(jobs: JobRepository) -> list[tuple[str, str, str]]:
    """(site, job, task) of every task delegated to or running at a site."""
    return [
        (task.site, job.id, task.name)
        for job in jobs.active()
        for task in job.tasks
        if task.site and task.state in job_state.AT_SITE
    ]


def placement_framework(config: CoordinatorConfig) -> Framework:
    """The placement profile the config names; plugins from outside the project are tried on
    a sample federation first (``UnknownPluginError``) and counted when disabled."""
    return build_framework(
        config.placement_filters,
        config.placement_scores,
        config.compat_table,
        plugin_budget_s=config.placement_plugin_budget_ms / 1000,
        on_disabled=lambda plugin, _why: PLACEMENT_PLUGINS_DISABLED.labels(plugin).inc(),
    )
