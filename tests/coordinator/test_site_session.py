"""SiteSession.request_many: answers matched by correlation id, timeouts and closed sessions."""

from __future__ import annotations

import asyncio

from federation.api.v1 import site_link_service_pb2 as pb
from federation.coordinator.sites.registry import SessionClosedError, SiteSession

Reply = pb.AgentMessage | SessionClosedError | TimeoutError


def offer(job_id: str) -> pb.CoordinatorMessage:
    """An offer of ``job_id``'s main task."""
    return pb.CoordinatorMessage(offer=pb.Offer(job_id=job_id, task="main", epoch=1))


def answer(request: pb.CoordinatorMessage, reservation_id: str) -> pb.AgentMessage:
    """The agent's acceptance of ``request``, echoing its correlation id."""
    return pb.AgentMessage(
        correlation_id=request.correlation_id,
        offer_answer=pb.OfferAnswer(accepted=True, reservation_id=reservation_id),
    )


async def sent(session: SiteSession, count: int) -> list[pb.CoordinatorMessage]:
    """The next ``count`` messages of the session's outbox, waiting for them to be queued."""
    out = []
    for _ in range(count):
        message = await asyncio.wait_for(session.outbox.get(), 5)
        assert message is not None
        out.append(message)
    return out


def answered(replies: list[Reply]) -> list[pb.AgentMessage]:
    """``replies``, checked to all be the agent's answers."""
    for reply in replies:
        assert isinstance(reply, pb.AgentMessage), reply
    return [r for r in replies if isinstance(r, pb.AgentMessage)]


def start(
    session: SiteSession, messages: list[pb.CoordinatorMessage], timeout_s: float
) -> asyncio.Task[list[Reply]]:
    return asyncio.create_task(session.request_many(messages, timeout_s))


async def test_answers_are_matched_by_correlation_id_out_of_order() -> None:
    """Replies resolved in reverse order still land in the slot of the request they answer."""
    session = SiteSession("s1")
    requests = [offer("j0"), offer("j1"), offer("j2")]
    waiting = start(session, requests, 5)
    outgoing = await sent(session, 3)
    assert [m.offer.job_id for m in outgoing] == ["j0", "j1", "j2"]
    ids = [m.correlation_id for m in outgoing]
    assert all(ids)
    assert len(set(ids)) == 3
    assert set(session.pending) == set(ids)
    for message in reversed(outgoing):
        assert session.resolve(answer(message, f"r-{message.offer.job_id}"))
    replies = answered(await waiting)
    assert [r.offer_answer.reservation_id for r in replies] == ["r-j0", "r-j1", "r-j2"]
    assert [r.correlation_id for r in replies] == ids
    assert session.pending == {}


async def test_unanswered_request_times_out_alone() -> None:
    """A request left unanswered gets a TimeoutError in its slot; answered ones get replies."""
    session = SiteSession("s1")
    waiting = start(session, [offer("j0"), offer("j1"), offer("j2")], 0.05)
    first, second, third = await sent(session, 3)
    assert session.resolve(answer(third, "r2"))
    assert session.resolve(answer(first, "r0"))
    replies = await waiting
    assert isinstance(replies[0], pb.AgentMessage)
    assert replies[0].offer_answer.reservation_id == "r0"
    assert isinstance(replies[1], TimeoutError)
    assert isinstance(replies[2], pb.AgentMessage)
    assert replies[2].offer_answer.reservation_id == "r2"
    assert session.pending == {}
    # A late answer finds nobody waiting.
    assert not session.resolve(answer(second, "late"))


async def test_closing_while_waiting_fails_the_unanswered_requests() -> None:
    """Closing the session gives SessionClosedError to requests still waiting, at once."""
    session = SiteSession("s1")
    waiting = start(session, [offer("j0"), offer("j1")], 30)
    first, _ = await sent(session, 2)
    assert session.resolve(answer(first, "r0"))
    session.close()
    replies = await asyncio.wait_for(waiting, 5)  # well before the 30 s timeout
    assert isinstance(replies[0], pb.AgentMessage)
    assert replies[0].offer_answer.reservation_id == "r0"
    assert isinstance(replies[1], SessionClosedError)
    assert session.pending == {}


async def test_closing_with_nothing_answered_fails_every_request() -> None:
    """Every request waiting when the session closes gets a SessionClosedError."""
    session = SiteSession("s1")
    waiting = start(session, [offer("j0"), offer("j1"), offer("j2")], 30)
    await sent(session, 3)
    session.close()
    replies = await asyncio.wait_for(waiting, 5)
    assert len(replies) == 3
    assert all(isinstance(r, SessionClosedError) for r in replies)
    assert session.pending == {}


async def test_requests_on_a_closed_session_all_fail() -> None:
    """Sending on an already closed session gives SessionClosedError in every slot."""
    session = SiteSession("s1")
    session.close()
    replies = await asyncio.wait_for(session.request_many([offer("j0"), offer("j1")], 5), 1)
    assert len(replies) == 2
    assert all(isinstance(r, SessionClosedError) for r in replies)
    assert session.pending == {}
    assert session.outbox.get_nowait() is None  # only the end marker close() queued
    assert session.outbox.empty()


async def test_empty_request_list_returns_nothing() -> None:
    """No messages give an empty list, send nothing and leave nothing pending."""
    session = SiteSession("s1")
    assert await session.request_many([], 5) == []
    assert session.outbox.empty()
    assert session.pending == {}


async def test_correlation_ids_are_unique_across_calls() -> None:
    """Requests of two concurrent calls never share a correlation id, so answers never cross."""
    session = SiteSession("s1")
    one = start(session, [offer("a0"), offer("a1")], 5)
    two = start(session, [offer("b0")], 5)
    outgoing = await sent(session, 3)
    assert len({m.correlation_id for m in outgoing}) == 3
    for message in outgoing:
        assert session.resolve(answer(message, message.offer.job_id))
    assert [r.offer_answer.reservation_id for r in answered(await one)] == ["a0", "a1"]
    assert [r.offer_answer.reservation_id for r in answered(await two)] == ["b0"]
    assert session.pending == {}
