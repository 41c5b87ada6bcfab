"""Which coordinator to call next: several endpoints, the leader's hint, jittered backoff.

With several coordinators (one leader, the others standing by) a client or an agent is given
every coordinator's address. It tries them in order; a follower answers ``UNAVAILABLE`` with
reason ``NOT_LEADER`` and the leader's address in the status's ``ErrorInfo``, which is tried
next. This module is the one place that decides where to go next and how long to wait first;
the agent's session loop, its join and ``fedctl`` all use it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from federation.errors import NotLeaderError

T = TypeVar("T")

MIN_BACKOFF_S = 0.2
MAX_BACKOFF_S = 10.0
LEADER = "leader"
"""ErrorInfo metadata key: the leader's advertised mTLS address."""
LEADER_JOIN = "leader_join"
"""ErrorInfo metadata key: the leader's join address."""


def parse_endpoints(value: str | Sequence[str]) -> tuple[str, ...]:
    """Addresses from ``"a:1,b:2"`` or ``["a:1", "b:2"]``, blanks and duplicates dropped.

    Raises:
        ValueError: No address is left.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        address = str(item).strip()
        if address and address not in out:
            out.append(address)
    if not out:
        raise ValueError("give at least one coordinator address")
    return tuple(out)


def error_info(err: BaseException | None) -> error_details_pb2.ErrorInfo | None:
    """The ``ErrorInfo`` detail of a failed RPC, if it carries one."""
    if not isinstance(err, grpc.aio.AioRpcError):
        return None
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


def is_not_leader(err: BaseException | None) -> bool:
    """Whether ``err`` is a follower's answer: ``UNAVAILABLE`` with reason ``NOT_LEADER``."""
    info = error_info(err)
    return info is not None and info.reason == NotLeaderError.reason


def leader_hint(err: BaseException | None, key: str = LEADER) -> str:
    """The leader's address a follower named in ``err`` (``key``: which one), or ``""``."""
    info = error_info(err)
    if info is None or info.reason != NotLeaderError.reason:
        return ""
    return str(info.metadata.get(key, ""))


def never_sent(err: BaseException | None) -> bool:
    """Whether ``err`` means the RPC never reached a coordinator, so repeating it is safe.

    A follower's refusal qualifies, and so does a channel that could not connect at all; a
    connection that broke mid-call does not (the call may have been applied).
    """
    if is_not_leader(err):
        return True
    return (
        isinstance(err, grpc.aio.AioRpcError)
        and err.code() == grpc.StatusCode.UNAVAILABLE
        and "failed to connect" in (err.details() or "").lower()
    )


class Endpoints:
    """Where to reach the leader among several coordinators, and when to try again.

    Args:
        addresses: Every coordinator, in the order to try them.
        hint_key: Which ``ErrorInfo`` metadata names the leader's address for this kind of
            call (``LEADER``, or ``LEADER_JOIN`` for joins).
        min_backoff_s: Wait before the next try within one pass over the addresses, and the
            first wait between passes.
        max_backoff_s: Longest wait between two passes.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        hint_key: str = LEADER,
        min_backoff_s: float = MIN_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.addresses = parse_endpoints(addresses)
        self._hint_key = hint_key
        self._min_s = min_backoff_s
        self._max_s = max_backoff_s
        self._position = 0  # index in ``addresses`` of the last one taken from the list
        self._current = self.addresses[0]
        self._tried = 0  # addresses tried since the last success or the last full pass
        self._dead: set[str] = set()  # addresses that did not answer during this pass
        self._backoff_s = min_backoff_s

    @property
    def current(self) -> str:
        """The address to call now."""
        return self._current

    def hint(self, err: BaseException | None) -> str:
        """The leader's address for this kind of call that ``err`` names, or ``""``."""
        return leader_hint(err, self._hint_key)

    def succeeded(self) -> None:
        """The current address answered as the leader: stay, and come back quickly next time."""
        self._tried = 0
        self._dead.clear()
        self._backoff_s = self._min_s

    def failed(self, err: BaseException | None = None) -> float:
        """Move on after a failed call (or a session that ended); returns seconds to wait.

        A follower's hint is tried next, after a short wait, unless that address did not
        answer during this pass (a leader that died before its lease ran out). Otherwise the
        next address in order is; each full pass over the addresses without reaching the
        leader doubles the wait, up to ``max_backoff_s``. Every wait is jittered by ±50 %.
        """
        self._tried += 1
        hint = self.hint(err)
        if not is_not_leader(err):
            self._dead.add(self._current)
        follow = hint and hint != self._current and hint not in self._dead
        if follow and self._tried <= len(self.addresses):
            self._current = hint
            return self._jitter(self._min_s)
        self._position = (self._position + 1) % len(self.addresses)
        self._current = self.addresses[self._position]
        if self._tried < len(self.addresses):
            return self._jitter(self._min_s)
        self._tried = 0
        self._dead.clear()
        wait_s = self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self._max_s)
        return self._jitter(wait_s)

    @staticmethod
    def _jitter(seconds: float) -> float:
        return seconds * random.uniform(0.5, 1.5)


async def call_leader(
    endpoints: Endpoints, call: Callable[[str], Awaitable[T]], *, patience_s: float = 0.0
) -> T:
    """Run ``call(address)`` against the leader, moving on where it is safe to repeat.

    A call that a follower refused or that never reached a coordinator (see ``never_sent``)
    is repeated at the next address: through the first pass over the addresses, wherever a
    follower names the leader, and after that until ``patience_s`` has passed (for example
    while a new leader is being elected). Any other error, or the last one, is raised.

    Args:
        endpoints: Where to call, and when; ``current`` is tried first.
        call: Makes the call at one address.
        patience_s: How long to keep trying once every address has been tried.
    """
    deadline = time.monotonic() + patience_s
    attempts = 0
    while True:
        attempts += 1
        try:
            result = await call(endpoints.current)
        except grpc.aio.AioRpcError as err:
            if not never_sent(err):
                raise
            wait_s = endpoints.failed(err)
            first_pass = attempts < len(endpoints.addresses)
            if not (first_pass or endpoints.hint(err) or time.monotonic() + wait_s < deadline):
                raise
            if attempts > 4 * len(endpoints.addresses) and time.monotonic() >= deadline:
                raise  # followers that keep naming each other: give up in the end
            await asyncio.sleep(wait_s)
            continue
        endpoints.succeeded()
        return result
