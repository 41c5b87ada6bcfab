"""One-time join tokens and the exchange of a token and a CSR for a site certificate.

A token is redeemed once, for one CSR: the same CSR again (a retry after a lost reply) gets
the same certificate until the token expires; any other CSR is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import time
from datetime import timedelta

import structlog

from federation.api.v1 import admin_service_pb2, records_pb2, resources_pb2, site_link_service_pb2
from federation.coordinator import audit
from federation.coordinator.jobs.records import now_timestamp
from federation.coordinator.security.authorities import Authorities
from federation.coordinator.sites.registry import SiteRegistry
from federation.errors import (
    FieldViolation,
    InvalidArgumentError,
    SiteNotFoundError,
    UnauthenticatedError,
)
from federation.security.identity import Identity, InvalidIdentityError, Role, validate_name
from federation.security.pki import InvalidCsrError, fingerprint, public_key_sha256
from federation.store import CasConflictError, Delete, Put, Store

log = structlog.get_logger()

JOINER = "join-token"
"""Who joins, in the audit trail: the bearer of a token, known by no certificate yet."""
TOKENS = "/tokens/"
CERTIFICATES = "/certificates/"
DEFAULT_TOKEN_TTL_S = 3600.0
MAX_TOKEN_TTL_S = 7 * 24 * 3600.0


def _token_key(token: str) -> str:
    return TOKENS + hashlib.sha256(token.encode()).hexdigest()


def csr_key(csr_pem: bytes) -> str:
    """The SHA-256 of a CSR's public key; INVALID_ARGUMENT for a CSR that cannot be read."""
    try:
        return public_key_sha256(csr_pem)
    except ValueError:
        raise InvalidArgumentError(
            [FieldViolation("csr_pem", "is not a PEM certificate signing request")]
        ) from None


class Enrollment:
    """Mints join tokens (kept only as hashes) and redeems each for one CSR."""

    def __init__(
        self,
        store: Store,
        sites: SiteRegistry,
        authorities: Authorities,
        *,
        site_lifetime: timedelta = timedelta(days=7),
    ) -> None:
        self._store = store
        self._sites = sites
        self._authorities = authorities
        self._site_lifetime = site_lifetime

    async def create_token(
        self, site: str, domain: int, ttl_s: float, created_by: str
    ) -> admin_service_pb2.CreateJoinTokenResponse:
        violations = []
        try:
            validate_name(site, "site")
        except InvalidIdentityError as err:
            violations.append(FieldViolation("site", str(err)))
        if domain not in set(resources_pb2.Domain.values()) - {0}:
            violations.append(FieldViolation("domain", "must be edge, datacenter or cloud"))
        ttl_s = ttl_s or DEFAULT_TOKEN_TTL_S
        if not 0 < ttl_s <= MAX_TOKEN_TTL_S:
            violations.append(FieldViolation("ttl_s", f"must be in (0, {MAX_TOKEN_TTL_S:g}]"))
        if violations:
            raise InvalidArgumentError(violations)
        token = "fedjoin." + secrets.token_urlsafe(32)
        record = records_pb2.JoinTokenRecord(
            token_sha256=_token_key(token).removeprefix(TOKENS),
            site=site,
            domain=domain,  # type: ignore[arg-type]
            created_at=now_timestamp(),
            created_by=created_by,
        )
        record.expires_at.FromSeconds(int(time.time() + ttl_s))
        expires = f"expires {record.expires_at.ToDatetime():%Y-%m-%d %H:%M:%S} UTC"
        await self._store.commit(
            [
                Put(_token_key(token), record.SerializeToString()),
                audit.entry(created_by, "token.create", site, expires),
            ]
        )
        log.info("join_token_created", site=site, by=created_by, ttl_s=ttl_s)
        return admin_service_pb2.CreateJoinTokenResponse(token=token, expires_at=record.expires_at)

    async def join(
        self, request: site_link_service_pb2.JoinRequest
    ) -> site_link_service_pb2.JoinResponse:
        """Redeem a token: sign the CSR, register the site, and mark the token used, atomically
        (or answer the certificate a redeemed token got again, to the same CSR)."""
        refused = UnauthenticatedError(
            "join token is unknown, already used or expired. "
            "To fix: create a new one with 'fedctl token create'"
        )
        kv = await self._store.get(_token_key(request.token)) if request.token else None
        if kv is None:
            raise refused
        record = records_pb2.JoinTokenRecord.FromString(kv.value)
        if record.expires_at.seconds < time.time():
            await self._store.commit([Delete(kv.key, expect_revision=kv.mod_revision)])
            raise refused
        if record.certificate_pem:
            if record.csr_key_sha256 != csr_key(request.csr_pem):
                raise refused
            log.info("site_join_repeated", site=record.site)
            return self._reply(record)
        identity = Identity(Role.SITE, record.site)
        ca = self._authorities.issuer
        try:
            cert = ca.sign_csr(request.csr_pem, identity, lifetime=self._site_lifetime)
        except InvalidCsrError as err:
            raise InvalidArgumentError([FieldViolation("csr_pem", str(err))]) from None
        cert_pem = ca.with_chain(cert)
        issued = records_pb2.IssuedCertificate(
            serial_hex=f"{cert.serial_number:x}",
            identity=str(identity),
            fingerprint=fingerprint(cert_pem),
            issued_at=now_timestamp(),
        )
        issued.not_after.FromDatetime(cert.not_valid_after_utc)
        site = admin_service_pb2.Site(
            name=record.site,
            domain=record.domain,
            joined_at=now_timestamp(),
            certificate_fingerprint=issued.fingerprint,
        )
        with contextlib.suppress(SiteNotFoundError):  # a first join has no record yet
            site.cordoned = self._sites.get(record.site).record.cordoned
        record.certificate_pem, record.csr_key_sha256 = cert_pem, public_key_sha256(cert_pem)
        try:
            await self._store.commit(
                [
                    Put(kv.key, record.SerializeToString(), expect_revision=kv.mod_revision),
                    self._sites.record_put(site),
                    Put(CERTIFICATES + issued.serial_hex, issued.SerializeToString()),
                    audit.entry(
                        JOINER, "token.redeem", record.site, f"created by {record.created_by}"
                    ),
                    audit.entry(
                        JOINER,
                        "certificate.issue",
                        issued.serial_hex,
                        f"{identity}, valid until {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC",
                    ),
                ]
            )
        except CasConflictError:
            raise refused from None
        self._sites.registered(site)
        log.info("site_joined", site=record.site, fingerprint=issued.fingerprint)
        return self._reply(record)

    def _reply(self, record: records_pb2.JoinTokenRecord) -> site_link_service_pb2.JoinResponse:
        return site_link_service_pb2.JoinResponse(
            site=record.site,
            domain=record.domain,
            certificate_pem=record.certificate_pem,
            ca_bundle_pem=self._authorities.bundle_pem,
        )
