"""Why a task waits, as site verdicts and one line for people."""

from __future__ import annotations

from federation.api.v1 import jobs_pb2
from federation.coordinator.scheduling.config import NEGOTIATE, QUOTA, WAIT
from federation.coordinator.scheduling.waits import Wait


def refusal(site: str, reason: str) -> jobs_pb2.SiteVerdict:
    return jobs_pb2.SiteVerdict(site=site, stage=NEGOTIATE, reason=reason)


def stage_verdicts(stage: str, refused: list[tuple[str, str]]) -> list[jobs_pb2.SiteVerdict]:
    """Why ``stage`` keeps the task from each of these sites."""
    return [jobs_pb2.SiteVerdict(site=site, stage=stage, reason=why) for site, why in refused]


def summarize(verdicts: list[jobs_pb2.SiteVerdict]) -> str:
    """One line for people: why no site took the task."""
    if not verdicts:
        return "no sites are connected"
    if verdicts[0].stage == WAIT:
        return verdicts[0].reason
    if all(v.stage == QUOTA for v in verdicts):
        return verdicts[0].reason  # its queue holds it back, whatever the sites have
    parts = [f"{v.site}: {v.reason}" for v in verdicts[:3]]
    more = f" (+{len(verdicts) - 3} more)" if len(verdicts) > 3 else ""
    return "no site can take it now: " + "; ".join(parts) + more


def waiting_verdict(wait: Wait, now_site: str, now_s: float) -> jobs_pb2.SiteVerdict:
    """Why the task waits although ``now_site`` could take it; figures are rounded so that
    the record is written again only when they change notably."""
    sooner = 5 * round(20 * (1 - wait.finish_s / now_s)) if now_s > 0 else 0
    return jobs_pb2.SiteVerdict(
        site=wait.site,
        stage=WAIT,
        reason=f"waits for room at {wait.site}, expected in {about(wait.wait_s)}: it should"
        f" finish there about {sooner} % sooner than at {now_site}, which could take it now",
    )


def about(seconds: float) -> str:
    """A duration to two figures, for people."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"
