"""Which of the sites placement ranked a task may go to beside placement: its queues' quotas
(``Sharing.where``), the sites' owner shares, its spread's rule for the parts of a divided
task, and the whole devices this cycle has not offered yet."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.common import job_state
from federation.coordinator.jobs import spread
from federation.coordinator.jobs.records import find_spec
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.preemption import free_room
from federation.coordinator.policy.resources import Demand, demand, kind_of
from federation.coordinator.policy.sharing import Admitted, Sharing, Tentative
from federation.coordinator.scheduling.config import DEVICE_KINDS
from federation.coordinator.scheduling.cycle_state import Cycle
from federation.coordinator.sites.registry import SiteRegistry
from federation.jobspec import domain_name
from federation.placement.snapshot import Snapshot
from federation.resources import add, owner_share_refusal


class Admission:
    """The rules beside placement that keep a task from some of its ranked sites."""

    def __init__(self, jobs: JobRepository, sites: SiteRegistry, sharing: Sharing) -> None:
        self._jobs = jobs
        self._sites = sites
        self._sharing = sharing
        self._offered_parts: dict[str, dict[str, str]] = {}
        """Per job, its parts of divided tasks under negotiation, with the site each is offered
        to: a later part's skew counts them (``spread.placed_parts``)."""

    def part_offered(self, job_id: str, task: str, site: str) -> None:
        """Part ``task`` of a divided task is offered, to ``site`` first."""
        self._offered_parts.setdefault(job_id, {})[task] = site

    def part_let_go(self, job_id: str, task: str) -> None:
        """Part ``task`` is offered no more (delegated, or back in line)."""
        if (offered := self._offered_parts.get(job_id)) is not None:
            offered.pop(task, None)
            if not offered:
                del self._offered_parts[job_id]

    def within_spread(
        self,
        job: jobs_pb2.Job,
        task: str,
        feasible: Sequence[str],
        ranked: Sequence[str],
        snapshot: Snapshot,
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """Of ``ranked``, the sites where part ``task`` of a divided task may go by its spread
        (``spread``): the one its static weights give it, or those within its skew; and
        (site, why) for the others. ``feasible`` are the sites placement found for it."""
        rule = find_spec(job, task).spread
        what = spread.part_of(task)
        if rule.site_weights:
            parts = sum(1 for t in job.tasks if t.part_of == what)
            division = spread.static_division(parts, rule.site_weights)
            number = spread.part_number(task)
            site = division[number] if number < len(division) else ""
            why = f"part {number} of {what} goes to {site} by its site weights"
            if site not in ranked:
                return [], [(site, f"{why}, which cannot take it now")]
            return [site], [(s, why) for s in ranked if s != site]
        if not rule.max_skew:
            return list(ranked), []  # division by available capacity: soonest finish wins
        topology = spread.TOPOLOGY.get(rule.topology, "site")

        def value_of(site: str) -> str:
            index = snapshot.site_index(site)
            if topology == "site" or index is None:
                return site
            if topology == "domain":
                return domain_name(int(snapshot.domain[index]))
            return str(snapshot.region[index])

        counts = spread.placed_parts(job, task, value_of, self._offered_parts.get(job.id, {}))
        return spread.within_skew(ranked, feasible, value_of, counts, rule.max_skew, what, topology)

    def where(
        self,
        job: jobs_pb2.Job,
        task: str,
        need: dict[str, float],
        ranked: Sequence[str],
        snapshot: Snapshot,
        tentative: Tentative,
    ) -> Admitted:
        """The sites of ``ranked`` (and models there) the quotas of the job's queues let the
        task run at, with what it then counts against them (``Sharing.where``)."""
        spec = find_spec(job, task)
        acc = spec.resources.accelerator
        accepted = set(acc.models)

        def models_at(site: str) -> set[str]:
            models = snapshot.device_models(acc.kind, site)
            return models & accepted if accepted else models

        return self._sharing.where(
            job, spec, need, ranked, models_at, self._sites.domain_of, tentative
        )

    def counted(
        self, job: jobs_pb2.Job, task: str, need: Demand, site: str, snapshot: Snapshot
    ) -> list[Demand]:
        """What the job's task may count against its queues' quotas at ``site`` (before
        ``at`` it): ``need``, or for a task that names not one model, ``need`` with each model
        it may be given there (as ``Sharing.where`` counts it)."""
        spec = find_spec(job, task)
        acc = spec.resources.accelerator
        kind = kind_of(spec)
        if kind is None or len(acc.models) == 1:
            return [need]
        models = snapshot.device_models(acc.kind, site)
        base = {r: amount for r, amount in need.items() if "/" not in r}
        return [need] + [
            {**base, f"{kind}/{model}": base[kind]}
            for model in sorted(models & set(acc.models) if acc.models else models)
        ]

    def within_owner_shares(
        self, job: jobs_pb2.Job, need: Demand, sites: Sequence[str], cycle: Cycle
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """Of ``sites``, those whose owner share leaves the job's tenant room for a task that
        needs ``need``; and (site, why) for the others. The site checks it again when offered
        the task."""
        shares = self._sites.owner_shares()
        tenant = job.spec.tenant
        if not shares or all(tenant in shares[s].tenants for s in sites if s in shares):
            return list(sites), []
        if cycle.guests is None:
            cycle.guests = self._guests(shares)
        kept, refused = [], []
        for site in sites:
            share = shares.get(site)
            why = share and owner_share_refusal(
                share, tenant, need, cycle.guests[site], self._sites.site_capacity(site)
            )
            if why:
                refused.append((site, why))
            else:
                kept.append(site)
        return kept, refused

    def guest_sent(
        self, job: jobs_pb2.Job, need: Demand, ranked: Sequence[str], cycle: Cycle
    ) -> None:
        """The task goes to one of ``ranked``: wherever it may go, it counts as a guest of
        the owner shares, so that no second guest in this cycle over-asks."""
        if cycle.guests is None:
            return
        shares = self._sites.owner_shares()
        for site in ranked:
            if site in cycle.guests and job.spec.tenant not in shares[site].tenants:
                add(cycle.guests[site], need.items())

    def _guests(
        self, shares: Mapping[str, resources_pb2.OwnerShare]
    ) -> dict[str, dict[str, float]]:
        """Per site that keeps an owner share, what other tenants' tasks hold there."""
        out: dict[str, dict[str, float]] = {site: {} for site in shares}
        for job in self._jobs.at_site():
            for spec, status in zip(job.spec.tasks, job.tasks, strict=False):
                share = shares.get(status.site)
                if (
                    share is not None
                    and status.state in job_state.AT_SITE
                    and job.spec.tenant not in share.tenants
                ):
                    add(out[status.site], demand(spec, status.models).items())
        return out


def with_devices_left(ranked: tuple[str, ...], need: Demand, cycle: Cycle) -> tuple[str, ...]:
    """The sites of ``ranked`` whose free whole devices, less those this cycle already offered,
    still hold ``need``'s; the first of them is counted as taking them (the site the task
    most likely gets). Tasks of shares or of no device are not counted (a share may fit on a
    device in use, which the free count does not show)."""
    wanted = {kind: n for kind, n in need.items() if kind in DEVICE_KINDS and n >= 1}
    if not wanted or any(n != int(n) for n in wanted.values()):
        return ranked
    if cycle.devices_left is None:
        assert cycle.snapshot is not None
        cycle.devices_left = free_room(cycle.snapshot, cycle.snapshot.site_ids)
    left = cycle.devices_left
    kept = tuple(s for s in ranked if all(left[s].get(k, 0.0) >= n for k, n in wanted.items()))
    if kept:
        for kind, n in wanted.items():
            left[kept[0]][kind] -= n
    return kept
