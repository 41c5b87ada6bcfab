"""The two requests a negotiation sends over a site's session and waits for: its offers and
its commits, each a batch answered in the site's own time."""

from __future__ import annotations

from typing import TypeAlias

import structlog

from federation.api.v1 import site_link_service_pb2
from federation.coordinator.sites.registry import SessionClosedError, SiteRegistry
from federation.errors import UnavailableError

log = structlog.get_logger()

OfferReply: TypeAlias = tuple[str, str, site_link_service_pb2.OfferAnswer | None]
"""A site's reply to one offer: (reservation id, "", the answer) when it accepts, else ("",
why not, None)."""


async def offer(
    sites: SiteRegistry, site: str, offers: list[site_link_service_pb2.Offer], timeout_s: float
) -> list[OfferReply]:
    """For each offer: (reservation id, "", the answer) when the site accepts, else ("",
    why not, None). The site's session is the one it has as the call starts."""
    session = sites.session(site)
    if session is None:
        return [("", "site disconnected before the offer", None)] * len(offers)
    replies = await session.request_many(
        [site_link_service_pb2.CoordinatorMessage(offer=offer) for offer in offers], timeout_s
    )
    out: list[OfferReply] = []
    for reply in replies:
        if isinstance(reply, TimeoutError):
            out.append(("", f"no answer to the offer within {timeout_s:g}s", None))
        elif isinstance(reply, SessionClosedError):
            out.append(("", "site disconnected during the offer", None))
        elif not reply.HasField("offer_answer"):
            out.append(("", "site answered the offer with the wrong message", None))
        elif not (answer := reply.offer_answer).accepted:
            out.append(("", f"declined: {answer.reason}", None))
        else:
            out.append((answer.reservation_id, "", answer))
    return out


async def commit(
    sites: SiteRegistry, site: str, commits: list[site_link_service_pb2.Commit], timeout_s: float
) -> list[site_link_service_pb2.AgentMessage | None]:
    """Send the commits; those without an answer (None) go once more over the same session.
    A site answers a repeated commit of a task it took at once, as a no-op.

    Never over a newer session: the site's hello there settles every task delegated to it
    before (``JobManager.reconcile``), and a commit sent meanwhile could start a task its
    hello did not list, which goes back to PENDING. A session that answers neither time is
    ended, so that its site says hello again with the tasks it holds."""
    answers: list[site_link_service_pb2.AgentMessage | None] = [None] * len(commits)
    session = sites.session(site)
    if session is None:
        return answers
    unanswered = list(range(len(commits)))
    for _ in range(2):
        if session.closed or not unanswered:
            break
        replies = await session.request_many(
            [site_link_service_pb2.CoordinatorMessage(commit=commits[i]) for i in unanswered],
            timeout_s,
        )
        still = []
        for i, reply in zip(unanswered, replies, strict=True):
            if isinstance(reply, TimeoutError | SessionClosedError):
                still.append(i)
            else:
                answers[i] = reply
        unanswered = still
    if unanswered and not session.closed:
        why = f"no answer to a commit within {2 * timeout_s:g}s"
        log.warning("site_session_ended", site=session.site, reason=why, unanswered=len(unanswered))
        session.end(UnavailableError(why))
    return answers
