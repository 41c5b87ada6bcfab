"""Finding the leader among several coordinators: order, hints, backoff and safe repeats."""

from __future__ import annotations

import grpc
import pytest

from federation.endpoints import (
    LEADER_JOIN,
    Endpoints,
    call_leader,
    leader_hint,
    never_sent,
    parse_endpoints,
)
from federation.errors import NotLeaderError
from federation.security.interceptors import to_status

FAST = {"min_backoff_s": 0.001, "max_backoff_s": 0.004}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A failed call as a client sees it, without details."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def not_leader(leader: str = "", join: str = "") -> grpc.aio.AioRpcError:
    """A follower's refusal as a client sees it, with its ErrorInfo."""
    status = to_status(NotLeaderError(leader, join))
    return grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        status.details,
    )


REFUSED = rpc_error(
    grpc.StatusCode.UNAVAILABLE,
    "failed to connect to all addresses; last error: Connection refused",
)


def test_parse_endpoints_splits_and_drops_blanks_and_repeats() -> None:
    """A comma-separated list keeps its order, without blanks or repeated addresses."""
    assert parse_endpoints(" a:1, b:2,,a:1 ") == ("a:1", "b:2")
    assert parse_endpoints(["c:3", "c:3", "d:4"]) == ("c:3", "d:4")
    with pytest.raises(ValueError, match="at least one"):
        parse_endpoints(" , ")


def test_hints_come_from_error_info() -> None:
    """The leader's addresses are read from a NOT_LEADER status, and from nothing else."""
    err = not_leader("b:1", "b:2")
    assert (leader_hint(err), leader_hint(err, LEADER_JOIN)) == ("b:1", "b:2")
    assert leader_hint(REFUSED) == ""
    assert leader_hint(None) == ""


def test_never_sent_tells_safe_repeats_from_unsafe_ones() -> None:
    """A refusal or a failed connect may be repeated elsewhere; a broken call may not."""
    assert never_sent(not_leader())
    assert never_sent(REFUSED)
    assert not never_sent(rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert not never_sent(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "failed to connect"))


def test_single_address_backs_off_exponentially_and_resets() -> None:
    """With one coordinator every failure doubles the (jittered) wait up to the cap."""
    endpoints = Endpoints(["a:1"], min_backoff_s=0.2, max_backoff_s=1.0)
    waits = [endpoints.failed(REFUSED) for _ in range(5)]
    for wait, base in zip(waits, [0.2, 0.4, 0.8, 1.0, 1.0], strict=True):
        assert base * 0.5 <= wait <= base * 1.5
    assert endpoints.current == "a:1"
    endpoints.succeeded()
    assert 0.1 <= endpoints.failed(REFUSED) <= 0.3


def test_addresses_are_tried_in_order_and_hints_followed() -> None:
    """After the first address fails the next is tried; a follower's hint goes first."""
    endpoints = Endpoints(["a:1", "b:1", "c:1"], **FAST)
    assert endpoints.current == "a:1"
    endpoints.failed(REFUSED)
    assert endpoints.current == "b:1"
    endpoints.failed(not_leader("c:1"))
    assert endpoints.current == "c:1"


def test_hint_to_an_address_that_just_failed_is_skipped() -> None:
    """A follower that still names a dead leader does not send the caller back to it."""
    endpoints = Endpoints(["a:1", "b:1", "c:1"], **FAST)
    endpoints.failed(REFUSED)  # a:1 died
    endpoints.failed(not_leader("a:1"))  # b:1 has not noticed yet
    assert endpoints.current == "c:1"


def test_join_endpoints_follow_the_join_hint() -> None:
    """Joins go to the leader's join address, not its mTLS address."""
    endpoints = Endpoints(["a:2", "b:2"], hint_key=LEADER_JOIN, **FAST)
    endpoints.failed(not_leader("b:1", "b:2"))
    assert endpoints.current == "b:2"


async def test_call_leader_follows_the_hint_to_the_leader() -> None:
    """A call refused by a follower runs again at the leader it names, and returns there."""
    calls: list[str] = []

    async def call(address: str) -> str:
        calls.append(address)
        if address != "c:1":
            raise not_leader("c:1")
        return "done"

    endpoints = Endpoints(["a:1", "b:1", "c:1"], **FAST)
    assert await call_leader(endpoints, call) == "done"
    assert calls == ["a:1", "c:1"]
    assert endpoints.current == "c:1"


async def test_call_leader_raises_a_call_that_may_have_been_applied() -> None:
    """A call broken mid-way is not repeated: it may have taken effect."""
    calls: list[str] = []
    broken = rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    async def call(address: str) -> str:
        calls.append(address)
        raise broken

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call_leader(Endpoints(["a:1", "b:1"], **FAST), call, patience_s=10)
    assert caught.value is broken
    assert calls == ["a:1"]


async def test_call_leader_gives_up_after_one_pass_without_patience() -> None:
    """Without patience, a federation with no leader is reported after one pass."""
    calls: list[str] = []

    async def call(address: str) -> str:
        calls.append(address)
        raise not_leader()

    with pytest.raises(grpc.aio.AioRpcError):
        await call_leader(Endpoints(["a:1", "b:1", "c:1"], **FAST), call)
    assert calls == ["a:1", "b:1", "c:1"]


async def test_call_leader_waits_for_an_election_with_patience() -> None:
    """With patience, the call keeps going round until a leader is elected."""
    calls: list[str] = []

    async def call(address: str) -> str:
        calls.append(address)
        if len(calls) < 7:
            raise not_leader() if address != "a:1" else REFUSED
        return address

    assert await call_leader(Endpoints(["a:1", "b:1", "c:1"], **FAST), call, patience_s=10)
    assert len(calls) == 7
