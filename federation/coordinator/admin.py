"""Operator views and actions over the whole federation."""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from google.protobuf import text_format

from federation import __version__
from federation.api.v1 import admin_service_pb2, queues_pb2
from federation.coordinator import audit
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.queues import QueueBook
from federation.coordinator.policy.sharing import Sharing
from federation.coordinator.security.expiry import Expiries
from federation.coordinator.sites.drains import with_progress
from federation.coordinator.sites.lost import LostSites
from federation.coordinator.sites.registry import SiteRegistry
from federation.errors import FieldViolation, InvalidArgumentError
from federation.security.identity import NAME_PATTERN, Identity, Role

MAX_DRAIN_DEADLINE_S = 30 * 86400.0
"""The longest a drain may let tasks that do not checkpoint run."""
DEFAULT_PAGE = 100
"""Sites in a ``ListSites`` page when the caller names no size."""
MAX_PAGE = 1000
"""Most sites a caller may ask for in one page. A site of 100 nodes of 8 GPUs each takes
about 50 KiB, so the byte bound below usually ends a page of such sites first."""
MAX_REPLY_BYTES = 3 << 20
"""Most a page of sites may take: gRPC clients refuse a reply over 4 MiB by default. One site
alone may take more (a view may hold 10,000 nodes); a page always holds one."""
_OVERHEAD_BYTES = 64
"""A bound on what a site adds to the reply beyond its own size: the tag and length in front
of it, and its forecast (filled in once the page is chosen)."""

Forecasts = Callable[[list[str]], dict[str, admin_service_pb2.SiteForecast]]


class Admin:
    """Answers the operator RPCs from the sites, the jobs and the list of coordinators.

    Args:
        sites: Every site with its record, view and session.
        jobs: The job repository, for counts by state.
        coordinators: Lists every running coordinator, the leader marked.
        lost_sites: The lost-site monitor, whose pause the status shows; None: never paused.
        forecasts: Per site, when room should free there (``Scheduler.forecasts``).
        expiries: When certificates expire; None: the status shows none.
    """

    def __init__(
        self,
        sites: SiteRegistry,
        jobs: JobRepository,
        coordinators: Callable[[], Awaitable[list[admin_service_pb2.Coordinator]]],
        lost_sites: LostSites | None = None,
        sharing: Sharing | None = None,
        forecasts: Forecasts | None = None,
        expiries: Expiries | None = None,
        queues: QueueBook | None = None,
    ) -> None:
        self._sites = sites
        self._jobs = jobs
        self._coordinators = coordinators
        self._lost_sites = lost_sites
        self._queues = queues or QueueBook(jobs.store)
        """Where queues are written; ``sharing`` reads the same ones."""
        self._sharing = sharing or Sharing(self._queues, jobs.usage)
        self._forecasts = forecasts
        self._expiries = expiries

    def list_sites(self, page_size: int, page_token: str) -> admin_service_pb2.ListSitesResponse:
        """One page of sites in name order: ``page_size`` of them (0: ``DEFAULT_PAGE``) after
        the site named ``page_token``, fewer where they would pass ``MAX_REPLY_BYTES``."""
        violations = []
        if page_size > MAX_PAGE:
            violations.append(FieldViolation("page_size", f"at most {MAX_PAGE}, got {page_size}"))
        if page_token and NAME_PATTERN.match(page_token) is None:
            violations.append(FieldViolation("page_token", "is not one this service gave"))
        if violations:
            raise InvalidArgumentError(violations)
        names = self._sites.names()
        start = bisect.bisect_right(names, page_token) if page_token else 0
        reply = admin_service_pb2.ListSitesResponse()
        size = 0
        for name in names[start : start + (page_size or DEFAULT_PAGE)]:
            site = with_progress(self._jobs, self._sites.describe(name))
            size += site.ByteSize() + _OVERHEAD_BYTES
            if reply.sites and size > MAX_REPLY_BYTES:
                break
            reply.sites.append(site)
        if start + len(reply.sites) < len(names):
            reply.next_page_token = reply.sites[-1].name
        if self._forecasts is not None:
            forecasts = self._forecasts([site.name for site in reply.sites])
            for site in reply.sites:
                site.forecast.CopyFrom(forecasts[site.name])
        return reply

    async def status(self) -> admin_service_pb2.GetFederationStatusResponse:
        coordinators = await self._coordinators()
        states, cordoned = self._sites.count_by_state()
        status = admin_service_pb2.GetFederationStatusResponse(
            coordinator_version=__version__,
            sites_by_state={
                admin_service_pb2.SiteState.Name(state): count for state, count in states.items()
            },
            sites_cordoned=cordoned,
            jobs_by_state=await self._jobs.count_by_state(),
            leader=next((c.address for c in coordinators if c.leader), ""),
            coordinators=coordinators,
            rescheduling_paused=self._lost_sites is not None and self._lost_sites.paused,
            rescheduling_note=self._lost_sites.note if self._lost_sites is not None else "",
        )
        if self._expiries is not None:
            soonest = await self._expiries.soonest()
            if soonest is not None:
                status.soonest_expiring_certificate.CopyFrom(soonest)
            status.server_certificate_not_after.CopyFrom(self._expiries.server_not_after)
            status.ca_not_after.CopyFrom(self._expiries.ca_not_after)
        return status

    async def cordon(
        self, caller: str, site: str, cordoned: bool, node: str = ""
    ) -> admin_service_pb2.Site:
        """Cordon or uncordon ``site``, or only its ``node``; an uncordon ends the drains it
        covers."""
        if not site:
            raise InvalidArgumentError([FieldViolation("site", "is required")])
        action = "site.cordon" if cordoned else "site.uncordon"
        entry = audit.entry(caller, action, site, f"node {node}" if node else "")
        described = await self._sites.set_cordoned(site, cordoned, [entry], node=node)
        return with_progress(self._jobs, described)

    async def drain(
        self, caller: str, site: str, node: str, deadline_s: float
    ) -> admin_service_pb2.Site:
        """Cordon ``site`` (or its ``node``) and record a drain there (``drains.Drains``
        stops what it holds); a drain of the same place replaces the one before."""
        violations = []
        if not site:
            violations.append(FieldViolation("site", "is required"))
        if not 0 <= deadline_s <= MAX_DRAIN_DEADLINE_S:  # NaN fails too
            violations.append(
                FieldViolation(
                    "deadline_s", f"must be in [0, {MAX_DRAIN_DEADLINE_S:g}], got {deadline_s}"
                )
            )
        if violations:
            raise InvalidArgumentError(violations)
        drain = admin_service_pb2.Drain(node=node, requested_by=caller)
        now = time.time()
        drain.started_at.FromNanoseconds(int(now * 1e9))
        if deadline_s:
            drain.deadline.FromNanoseconds(int((now + deadline_s) * 1e9))
        parts = [f"node {node}"] if node else []
        if deadline_s:
            parts.append(f"deadline {deadline_s:g}s")
        detail = ", ".join(parts)
        entry = audit.entry(caller, "site.drain", site, detail)
        described = await self._sites.set_cordoned(site, True, [entry], node=node, drain=drain)
        return with_progress(self._jobs, described)

    # Queues ------------------------------------------------------------------------------

    async def create_queue(self, caller: str, queue: queues_pb2.Queue) -> queues_pb2.Queue:
        recorded = audit.entry(caller, "queue.create", queue.name, _described(queue))
        return await self._queues.create(queue, [recorded])

    async def update_queue(self, caller: str, queue: queues_pb2.Queue) -> queues_pb2.Queue:
        recorded = audit.entry(caller, "queue.update", queue.name, _described(queue))
        return await self._queues.update(queue, [recorded])

    async def delete_queue(self, caller: str, name: str) -> None:
        if not name:
            raise InvalidArgumentError([FieldViolation("name", "is required")])
        used_by = [job.id for job in self._jobs.active() if job.spec.queue == name]
        recorded = audit.entry(caller, "queue.delete", name)
        await self._queues.delete(name, used_by, [recorded])

    def queues(self, caller: Identity) -> list[queues_pb2.QueueStatus]:
        """Every queue's status for an operator; a tenant's own queues for a tenant."""
        waiting = Counter(job.spec.queue for job in self._jobs.pending())
        statuses = self._sharing.status(self._sites.capacity(), waiting)
        if caller.role is Role.TENANT:
            return [s for s in statuses if s.queue.tenant == caller.name]
        return statuses


def _described(queue: queues_pb2.Queue) -> str:
    """A queue as one line of text, for its audit entry."""
    return text_format.MessageToString(queue, as_one_line=True)
