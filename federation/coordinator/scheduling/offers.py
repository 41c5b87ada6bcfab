"""One task on its way through the rounds of offers, and the pure choices made about it: which
site's answer it takes, what each site is offered, how a site's own run time changes its
estimate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common.keys import TaskKey
from federation.coordinator.scheduling.task_requests import copy_estimate


@dataclass(slots=True)
class Negotiation:
    """One task on its way through the negotiation rounds of a batch."""

    job_id: str
    task: str
    candidates: tuple[str, ...]
    """Sites to try, best first."""
    verdicts: list[jobs_pb2.SiteVerdict]
    """Why sites did not take it: placement's, then each refusal."""
    estimates: dict[str, jobs_pb2.Estimate]
    """Placement's estimate per site; a site that accepts with its own run time replaces it
    there (``committed``)."""
    holds: dict[str, float] = field(default_factory=dict)
    """What it counts against its queue while offers are out (``Admitted.holds``)."""
    models: dict[str, list[str]] = field(default_factory=dict)
    """Per site, the only device models its queues' quotas let it be given there."""
    slower: set[str] = field(default_factory=set)
    """Sites that accepted with a longer run time than placement estimated there."""
    deferred: set[str] = field(default_factory=set)
    """Slower sites let go once for untried sites estimated sooner (tried again last)."""
    settled: bool = False
    """Delegated, or moot (cancelled meanwhile): not to be put back to PENDING."""
    epoch: int = 0
    """The epoch of its latest round's offers."""
    revision: int = 0
    """The revision of the spec its offers carried (a service changed meanwhile is not
    delegated with the spec it had before)."""
    chosen: tuple[str, str] | None = None
    """The site and reservation it is delegated to, once a round found one."""
    over: bool = False
    """Let go already (delegated before the rest of its batch ended): the batch must not
    touch it again, since a later negotiation may hold the task by then."""
    gang: list[Negotiation] | None = None
    """Its gang's negotiations, itself included, when it is a part of an all-or-nothing
    gang (``federation.coordinator.jobs.gangs``): committed only with all of them."""
    committing: bool = False
    """Its gang is being committed (every part held a reservation)."""
    chosen_at: float = 0.0
    """When ``chosen`` was set (monotonic): how long a gang part's reservation is held."""
    key: TaskKey = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.job_id, self.task)


def by_promise(
    n: Negotiation, rank: list[str], answers: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """A task's acceptances, the one to commit first: by placement's rank, except that a site
    that can run the task only slower than placement estimated (``n.slower``) goes last unless
    it still finishes soonest of all."""

    def total(answer: tuple[str, str]) -> float:
        estimated = n.estimates.get(answer[0])
        return estimated.total_s if estimated is not None else math.inf

    soonest = min(total(a) for a in answers)
    return sorted(
        answers,
        key=lambda a: (a[0] in n.slower and total(a) > soonest, rank.index(a[0])),
    )


def sooner_untried(n: Negotiation, site: str, offered: list[str]) -> str | None:
    """An untried site estimated to finish sooner than ``site`` answered it would, when
    ``site`` accepted only slower than placement estimated (and was not let go once already);
    else None. Placement ranked ``site`` first for an estimate its answer broke."""
    if site not in n.slower or site in n.deferred or not offered:
        return None
    answered = n.estimates[site].total_s
    untried = n.candidates[n.candidates.index(offered[-1]) + 1 :]
    sooner = [s for s in untried if s in n.estimates and n.estimates[s].total_s < answered]
    return min(sooner, key=lambda s: n.estimates[s].total_s) if sooner else None


def for_site(
    offer: site_link_service_pb2.Offer,
    estimated: jobs_pb2.Estimate | None,
    models: list[str] | None,
    cordoned: Sequence[str] = (),
) -> site_link_service_pb2.Offer:
    """The offer for one site: with what placement estimated there, so the site packs onto
    devices as fast as the estimate assumed (or answers its own run time); with only the
    device ``models`` its queues' quotas leave the task there, if they rule some out; and
    with the site's ``cordoned`` nodes, which no replica may take."""
    if estimated is None and not models and not cordoned:
        return offer
    own = site_link_service_pb2.Offer()
    own.CopyFrom(offer)
    own.cordoned_nodes.extend(cordoned)
    if estimated is not None:
        own.estimate.CopyFrom(estimated)
    if models:
        own.spec.resources.accelerator.models[:] = models
    return own


def commit_estimate(n: Negotiation, site: str, run_s: float, model: str = "") -> None:
    """Take a site's own run time into its estimate: what the task is ranked and shown by.

    Cost and energy scale with the run time; a run time the site does not give (0) or that
    is not a finite positive number leaves placement's estimate as it was. ``model`` is the
    device model the site reserved.
    """
    placed = n.estimates.get(site)
    if placed is not None and model and placed.device_model != model:
        placed = n.estimates[site] = copy_estimate(placed, device_model=model)
    if placed is None or not (math.isfinite(run_s) and run_s > 0) or run_s == placed.run_s:
        return
    if run_s > placed.run_s * (1 + 1e-9):
        n.slower.add(site)
    committed = jobs_pb2.Estimate()
    committed.CopyFrom(placed)
    ratio = run_s / placed.run_s if placed.run_s > 0 else 1.0
    committed.run_s = run_s
    committed.total_s = placed.queue_s + placed.provision_s + placed.transfer_s + run_s
    committed.cost_usd = placed.cost_usd * ratio
    committed.energy_kwh = placed.energy_kwh * ratio
    if placed.device_speed > 0:
        committed.device_speed = placed.device_speed / ratio
    n.estimates[site] = committed


def whole_gangs(chosen: list[Negotiation]) -> list[Negotiation]:
    """The gangs whose last part ``chosen`` gave a site: every part of each, to commit
    together (each marked, so that no other decision commits it again)."""
    out: list[Negotiation] = []
    for n in chosen:
        gang = n.gang
        if gang is None or n.committing:
            continue
        if all(m.chosen is not None and not m.settled and not m.over for m in gang):
            for m in gang:
                m.committing = True
            out.extend(gang)
    return out


def devices_of(spec: jobs_pb2.TaskSpec) -> float:
    """Device-equivalents a task holds: per replica its whole devices, its share of one, or
    one partition slot."""
    acc = spec.resources.accelerator
    each = acc.count or acc.fraction or (1.0 if acc.partition else 0.0)
    return float(each) * max(1, spec.replicas)
