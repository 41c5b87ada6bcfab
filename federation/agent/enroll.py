"""Getting a site certificate: redeem a join token once, then keep the key and cert.

A join that fails for a reason that may pass (no coordinator listening yet, a TLS handshake
with one still starting, a timeout, a follower mid-election) is tried again with jittered
exponential backoff, for as long as it takes, whatever number of join addresses the agent
has. A join the coordinator refuses for good (a token unknown, used or expired, a bad
request) stops the agent with one line saying so: retrying it would only hide the mistake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc
import structlog

from federation.agent.config import AgentConfig
from federation.api.v1 import site_link_service_pb2, site_link_service_pb2_grpc
from federation.durable import write_private_file, write_public_file
from federation.endpoints import LEADER_JOIN, Endpoints, never_sent, parse_endpoints
from federation.envelopes import MAX_STREAM_MESSAGE_BYTES
from federation.security.cert_info import fingerprint, load_certificate_info
from federation.security.crypto_process import make_csr_async
from federation.security.key_pair_files import finish_replacement
from federation.security.tls import TlsFiles, server_only_channel_credentials

log = structlog.get_logger()

JOIN_TIMEOUT_S = 30.0
"""Deadline of one join call."""
JOIN_MAX_BACKOFF_S = 10.0
"""Longest wait between two joins (before jitter); the first waits are much shorter."""
PERMANENT_JOIN_ERRORS = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)
"""What a coordinator answers to a join that can never succeed: it is not tried again."""


class EnrollmentError(RuntimeError):
    """The agent has no certificate and cannot get one; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class SiteCredentials:
    cert: Path
    key: Path
    ca: Path

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(ca=self.ca, cert=self.cert, key=self.key)

    @property
    def joining_key(self) -> Path:
        """The key of a join under way, written before its CSR is sent."""
        return self.key.with_name("joining-key.pem")

    @property
    def joining_csr(self) -> Path:
        """The CSR of a join under way: sent again, after a restart too, until answered."""
        return self.cert.with_name("joining-csr.pem")

    @property
    def renewal_key(self) -> Path:
        """The key of a renewal under way, written before its CSR is sent."""
        return self.key.with_name("renewal-key.pem")

    @property
    def renewal_csr(self) -> Path:
        """The CSR of a renewal under way: sent again, unchanged, until it is answered."""
        return self.cert.with_name("renewal-csr.pem")


def expired_message(creds: SiteCredentials, site: str) -> str | None:
    """One line saying the site's certificate has expired and what to do; None while valid
    (or unreadable: then the TLS handshake says what is wrong)."""
    try:
        not_after = load_certificate_info(creds.cert).not_valid_after_utc
    except (OSError, ValueError):
        return None
    if not_after > datetime.now(UTC):
        return None
    return (
        f"the site certificate {creds.cert} expired at {not_after:%Y-%m-%d %H:%M:%S} UTC and "
        f"no coordinator accepts it. To fix: create a join token ('fedctl token create --site "
        f"{site} ...'), remove {creds.cert} and start the agent with --token-file"
    )


def credential_paths(state_dir: Path) -> SiteCredentials:
    return SiteCredentials(
        cert=state_dir / "site.pem", key=state_dir / "site-key.pem", ca=state_dir / "ca.pem"
    )


def channel_options(config: AgentConfig) -> list[tuple[str, str | int]]:
    options: list[tuple[str, str | int]] = [
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.max_receive_message_length", MAX_STREAM_MESSAGE_BYTES),
    ]
    if config.server_name:
        options.append(("grpc.ssl_target_name_override", config.server_name))
    return options


async def ensure_enrolled(config: AgentConfig) -> SiteCredentials:
    """Return the site's credentials, joining with the token first if there are none."""
    creds = credential_paths(config.state_dir)
    finish_replacement(creds.cert, creds.key)  # a renewal a crash interrupted
    if creds.cert.exists() and creds.key.exists() and creds.ca.exists():
        if (expired := expired_message(creds, config.site)) is not None:
            raise EnrollmentError(expired)
        return creds
    token = config.token
    if not token and config.token_file:
        try:
            token = config.token_file.read_text().strip()
        except OSError as err:
            raise EnrollmentError(f"cannot read token file {config.token_file}: {err}") from None
    if not token or not config.join_address:
        raise EnrollmentError(
            f"site {config.site} has no certificate in {config.state_dir}. To fix: give a join "
            "token (--token-file, from 'fedctl token create') and --join-address"
        )
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_pem, csr_pem = await pending_csr(creds.joining_key, creds.joining_csr, config.site)
    creds_in = server_only_channel_credentials(config.ca)
    request = site_link_service_pb2.JoinRequest(token=token, csr_pem=csr_pem)

    async def join(address: str) -> site_link_service_pb2.JoinResponse:
        async with grpc.aio.secure_channel(
            address, creds_in, options=channel_options(config)
        ) as channel:
            stub = site_link_service_pb2_grpc.SiteLinkServiceStub(channel)
            return await stub.Join(request, timeout=JOIN_TIMEOUT_S)

    reply = await join_until_answered(config.join_address, join)
    if reply.site != config.site:
        raise EnrollmentError(
            f"the join token was minted for site {reply.site!r}, not {config.site!r}"
        )
    write_private_file(creds.key, key_pem)
    write_private_file(creds.cert, reply.certificate_pem)
    write_public_file(creds.ca, reply.ca_bundle_pem)
    creds.joining_csr.unlink()
    creds.joining_key.unlink()
    log.info("site_enrolled", site=reply.site, fingerprint=fingerprint(reply.certificate_pem))
    return creds


async def pending_csr(key: Path, csr: Path, site: str) -> tuple[bytes, bytes]:
    """The key and CSR at ``key`` and ``csr``, made and written first if there are none: a
    join or renewal whose reply was lost is asked again with the same CSR, and answered with
    the same certificate. A new pair is made in a child process (``crypto_process``), so that
    the agent does not hold cryptography."""
    found = _read_pair(key, csr)
    if found is not None:
        return found
    key_pem, csr_pem = await make_csr_async(site)
    write_private_file(key, key_pem)
    write_public_file(csr, csr_pem)  # last: a CSR on disk has its key beside it
    return key_pem, csr_pem


def _read_pair(key: Path, csr: Path) -> tuple[bytes, bytes] | None:
    try:
        return key.read_bytes(), csr.read_bytes()
    except FileNotFoundError:
        return None


def one_line(text: str) -> str:
    return " ".join(text.split())


async def join_until_answered(
    join_address: str,
    join: Callable[[str], Awaitable[site_link_service_pb2.JoinResponse]],
    *,
    max_backoff_s: float = JOIN_MAX_BACKOFF_S,
) -> site_link_service_pb2.JoinResponse:
    """Call ``join`` until a coordinator (the leader, with several) answers it.

    Each failure is logged once (``join_failed``, with the error and the wait before the next
    try); ``Endpoints`` picks the next address (a follower's hint first) and the wait.

    Raises:
        EnrollmentError: The coordinator refused the join for good (``PERMANENT_JOIN_ERRORS``).
    """
    endpoints = Endpoints(
        parse_endpoints(join_address), hint_key=LEADER_JOIN, max_backoff_s=max_backoff_s
    )
    attempt, maybe_redeemed = 0, False
    while True:
        attempt += 1
        address = endpoints.current
        try:
            reply = await join(address)
        except grpc.aio.AioRpcError as err:
            code, details = err.code(), one_line(err.details() or "")
            if code in PERMANENT_JOIN_ERRORS:
                message = f"join refused by {address}: {code.name}: {details}"
                if maybe_redeemed:  # a join that timed out may have used the token
                    message += " (an earlier join went unanswered and may have used the token)"
                raise EnrollmentError(message) from None
            maybe_redeemed = maybe_redeemed or not never_sent(err)
            wait_s = endpoints.failed(err)
            log.warning(
                "join_failed",
                address=address,
                attempt=attempt,
                code=code.name,
                error=details,
                retry_in_s=round(wait_s, 2),
            )
            await asyncio.sleep(wait_s)
            continue
        endpoints.succeeded()
        return reply
