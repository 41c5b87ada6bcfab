"""How fedctl reaches the coordinator, and how it turns RPC errors into one clear line."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from federation.cli.render import text
from federation.client import CallError, call_error
from federation.endpoints import Endpoints, call_leader, is_not_leader, parse_endpoints
from federation.envelopes import MAX_STREAM_MESSAGE_BYTES
from federation.security.pki import PkiLayout
from federation.security.tls import TlsFiles, channel_credentials

T = TypeVar("T")


class CliError(Exception):
    """An error for people: printed as one line, exit status 1."""


CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_STREAM_MESSAGE_BYTES),)
"""What fedctl's channels accept: a page of sites ends before 3 MiB, but one site alone can
take more, up to the largest view an agent may send (gRPC's default limit is 4 MiB)."""

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


def resolve_connection(
    address: str | None,
    pki_dir: Path | None,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    identity: str = "operator-admin",
) -> Connection:
    """Flags first, then FEDCTL_* environment variables, then the PKI folder's operator."""
    address = address or os.environ.get("FEDCTL_COORDINATOR", "127.0.0.1:7070")
    try:
        parse_endpoints(address)
    except ValueError:
        raise CliError(
            "--coordinator is empty. To fix: give host:port (or several, a,b,c)"
        ) from None
    pki = pki_dir or _env_path("FEDCTL_PKI_DIR")
    layout = PkiLayout(pki) if pki else None
    ca = ca or _env_path("FEDCTL_CA") or (layout.ca_cert if layout else None)
    cert = cert or _env_path("FEDCTL_CERT") or (layout.client_cert(identity) if layout else None)
    key = key or _env_path("FEDCTL_KEY") or (layout.client_key(identity) if layout else None)
    if not (ca and cert and key):
        raise CliError(
            "no credentials. To fix: pass --pki-dir (from 'fedctl pki init') or --ca, --cert "
            "and --key, or set FEDCTL_PKI_DIR"
        )
    for path in (ca, cert, key):
        if not path.exists():
            raise CliError(f"{path} does not exist. To fix: run 'fedctl pki init' or check paths")
    return Connection(address, TlsFiles(ca=ca, cert=cert, key=key))


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def cli_error(err: CallError) -> CliError:
    """The client's refusal as one line for people (``describe_call_error``)."""
    return CliError(describe_call_error(err))


def describe_call_error(err: CallError) -> str:
    """One line: ``CODE: message``, or every bad field from the status details."""
    message = err.message
    if err.violations:
        fields = "; ".join(f"{field}: {why}" for field, why in err.violations.items())
        message = f"{err.code.name}: {fields}"
    # The details can echo what a tenant or a site sent: control characters come out escaped.
    return text(message).plain


def describe_rpc_error(err: grpc.aio.AioRpcError) -> str:
    """``describe_call_error``'s line, and what to check when no coordinator answered."""
    message = describe_call_error(call_error(err))
    if err.code() == grpc.StatusCode.UNAVAILABLE and not is_not_leader(err):
        message += (
            " (the coordinator is unreachable, or refused this certificate in the TLS "
            "handshake. To fix: check --coordinator and that the certificate is from its CA)"
        )
    return message
