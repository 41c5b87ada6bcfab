"""Getting a site certificate: redeem a join token once, then keep the key and cert."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from federation.agent.config import AgentConfig
from federation.api.v1 import site_link_service_pb2, site_link_service_pb2_grpc
from federation.endpoints import LEADER_JOIN, Endpoints, call_leader, parse_endpoints
from federation.envelopes import MAX_STREAM_MESSAGE_BYTES
from federation.security.pki import fingerprint, make_csr, write_private_file, write_public_file
from federation.security.tls import TlsFiles, server_only_channel_credentials

log = structlog.get_logger()

JOIN_PATIENCE_S = 30.0
"""With several coordinators: how long to keep looking for the leader (say, mid-election)."""


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
    if creds.cert.exists() and creds.key.exists() and creds.ca.exists():
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
    key_pem, csr_pem = make_csr(config.site)
    creds_in = server_only_channel_credentials(config.ca)
    request = site_link_service_pb2.JoinRequest(token=token, csr_pem=csr_pem)

    async def join(address: str) -> site_link_service_pb2.JoinResponse:
        async with grpc.aio.secure_channel(
            address, creds_in, options=channel_options(config)
        ) as channel:
            stub = site_link_service_pb2_grpc.SiteLinkServiceStub(channel)
            return await stub.Join(request, timeout=30)

    endpoints = Endpoints(parse_endpoints(config.join_address), hint_key=LEADER_JOIN)
    patience_s = JOIN_PATIENCE_S if len(endpoints.addresses) > 1 else 0.0
    try:
        reply = await call_leader(endpoints, join, patience_s=patience_s)
    except grpc.aio.AioRpcError as err:
        raise EnrollmentError(f"join refused: {err.code().name}: {err.details()}") from None
    if reply.site != config.site:
        raise EnrollmentError(
            f"the join token was minted for site {reply.site!r}, not {config.site!r}"
        )
    write_private_file(creds.key, key_pem)
    write_private_file(creds.cert, reply.certificate_pem)
    write_public_file(creds.ca, reply.ca_bundle_pem)
    log.info("site_enrolled", site=reply.site, fingerprint=fingerprint(reply.certificate_pem))
    return creds
