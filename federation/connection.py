"""How a program reaches the federation: where its coordinators are, which certificate to
show them, and finding the leader among several."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from federation.endpoints import Endpoints, call_leader, parse_endpoints
from federation.envelopes import MAX_STREAM_MESSAGE_BYTES
from federation.security.tls import TlsFiles, channel_credentials

T = TypeVar("T")

CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_STREAM_MESSAGE_BYTES),)
"""What channels to the coordinator accept: a page of sites ends before 3 MiB, but one site
alone can take more, up to the largest view an agent may send (gRPC's default limit is 4 MiB)."""

LEADER_PATIENCE_S = 15.0
"""With several coordinators: how long a command keeps looking for the leader (an election
takes the leader's lease time and a little more)."""


@dataclass(frozen=True, slots=True)
class Connection:
    """Where the coordinator is and which certificate to show it."""

    address: str
    """host:port, or several coordinators' addresses separated by commas."""
    tls: TlsFiles

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every coordinator address, in the order to try them."""
        return parse_endpoints(self.address)

    def at(self, address: str) -> Connection:
        """The same credentials for one coordinator."""
        return Connection(address, self.tls)

    def channel(self) -> grpc.aio.Channel:
        """A channel to the first coordinator (see ``on_leader`` to find the leader)."""
        return grpc.aio.secure_channel(
            self.addresses[0], channel_credentials(self.tls), options=CHANNEL_OPTIONS
        )


async def on_leader(
    conn: Connection,
    command: Callable[[Connection], Awaitable[T]],
    *,
    patience_s: float | None = None,
) -> T:
    """Run ``command`` on the leader among ``conn``'s coordinators.

    The command gets a connection to one coordinator; where a follower refuses it (or the
    coordinator cannot be reached at all) it runs again at the next one, following the
    leader's address the follower names (see ``federation.endpoints.call_leader``).

    Args:
        conn: Credentials and every coordinator's address.
        command: What to run; it must make its first call before any side effect.
        patience_s: How long to keep looking once every coordinator was tried; default
            ``LEADER_PATIENCE_S`` with several coordinators, none with one.
    """
    endpoints = Endpoints(conn.addresses)
    if patience_s is None:
        patience_s = LEADER_PATIENCE_S if len(endpoints.addresses) > 1 else 0.0
    return await call_leader(
        endpoints, lambda address: command(conn.at(address)), patience_s=patience_s
    )
