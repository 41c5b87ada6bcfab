"""Joining: transient failures are retried with backoff, a refused token stops the agent."""

from __future__ import annotations

import grpc
import pytest
from structlog.testing import capture_logs

from federation.agent.enroll import EnrollmentError, join_until_answered
from federation.api.v1 import site_link_service_pb2 as pb

REPLY = pb.JoinResponse(site="site-a")


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Coordinator:
    """Answers joins with the scripted errors, in turn, then with ``REPLY``."""

    def __init__(self, *errors: grpc.aio.AioRpcError) -> None:
        self.errors = list(errors)
        self.called: list[str] = []

    async def join(self, address: str) -> pb.JoinResponse:
        self.called.append(address)
        if self.errors:
            raise self.errors.pop(0)
        return REPLY


async def test_transient_failures_are_retried_with_growing_waits() -> None:
    """One join address: refused connections, a timeout, a handshake failure, then the join."""
    unreachable = "failed to connect to all addresses; last error: connection refused"
    coordinator = Coordinator(
        rpc_error(grpc.StatusCode.UNAVAILABLE, unreachable),
        rpc_error(grpc.StatusCode.UNAVAILABLE, unreachable),
        rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
        rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect: Ssl handshake failed"),
    )
    with capture_logs() as logs:
        reply = await join_until_answered("127.0.0.1:1", coordinator.join, max_backoff_s=0.4)
    assert reply is REPLY
    assert coordinator.called == ["127.0.0.1:1"] * 5
    failed = [e for e in logs if e["event"] == "join_failed"]
    assert [e["code"] for e in failed] == [
        "UNAVAILABLE",
        "UNAVAILABLE",
        "DEADLINE_EXCEEDED",
        "UNAVAILABLE",
    ]
    assert [e["attempt"] for e in failed] == [1, 2, 3, 4]
    assert all(e["log_level"] == "warning" and e["error"] for e in failed)
    waits = [e["retry_in_s"] for e in failed]
    assert 0.1 <= waits[0] <= 0.3  # 0.2 s, jittered by ±50 %
    assert all(0.1 <= w <= 0.6 for w in waits)  # doubled, up to max_backoff_s, jittered


async def test_several_addresses_are_tried_in_turn() -> None:
    """With two join addresses, a failure moves on to the other one."""
    down = rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    coordinator = Coordinator(down, down)
    await join_until_answered("a:1,b:2", coordinator.join, max_backoff_s=0.4)
    assert coordinator.called == ["a:1", "b:2", "a:1"]


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ],
)
async def test_a_refused_join_is_not_retried(code: grpc.StatusCode) -> None:
    """A token the coordinator refuses ends the join at once, with one line saying why."""
    coordinator = Coordinator(rpc_error(code, "join token is unknown,\nalready used or expired"))
    with pytest.raises(EnrollmentError) as raised:
        await join_until_answered("127.0.0.1:1", coordinator.join)
    assert coordinator.called == ["127.0.0.1:1"]
    message = str(raised.value)
    assert "\n" not in message
    assert message == (
        f"join refused by 127.0.0.1:1: {code.name}: join token is unknown, already used or expired"
    )


async def test_a_refusal_after_an_unanswered_join_says_the_token_may_be_used() -> None:
    """A join that timed out may have used the token: the refusal that follows says so."""
    coordinator = Coordinator(
        rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
        rpc_error(grpc.StatusCode.UNAUTHENTICATED, "join token is unknown, already used"),
    )
    with pytest.raises(EnrollmentError, match="may have used the token"):
        await join_until_answered("127.0.0.1:1", coordinator.join)
