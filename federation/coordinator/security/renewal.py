"""Renewing a certificate: a new one for the caller's own identity, for a fresh key.

Any identity renews itself over its current mTLS connection; the TLS handshake has already
refused an expired certificate or one from another CA. The certificate names the caller's
identity, whatever subject the CSR asks for, as at a join. A site's record then names the
new certificate.

A renewal supersedes the certificate renewed (``Supersession``): that one is still accepted
until the new one is first used or ``overlap`` passes, so a lost reply locks no one out; and
it can be renewed only again with the same CSR (a retry after a lost reply), which is answered
with the same certificate. So a certificate has at most one successor, and at most two of a
line of renewals are valid at a time. Records are compacted as the line grows: the
predecessor's record drops its certificate, the one before it is deleted (its supersession
still refuses it), and supersessions of the identity past their certificate's expiry go. An
identity has at most ``MAX_LIVE_RENEWALS`` supersessions of certificates not yet expired
(and so as many renewals within a certificate lifetime), plus two certificate records per line
of renewals: a renewal past that is refused with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import structlog
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from federation.api.v1 import admin_service_pb2, certificate_service_pb2, records_pb2
from federation.coordinator import audit
from federation.coordinator.jobs.records import now_timestamp
from federation.coordinator.security.authorities import Authorities
from federation.coordinator.sites.enrollment import CERTIFICATES, csr_key
from federation.coordinator.sites.registry import SiteRegistry
from federation.errors import (
    FieldViolation,
    InvalidArgumentError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from federation.metrics import CERTIFICATES_RENEWED
from federation.security.identity import Identity, Role
from federation.security.pki import InvalidCsrError, fingerprint, public_key_sha256
from federation.security.revocation import RevocationBook, supersession_key
from federation.store import Delete, KeyValue, Op, Put, Store

log = structlog.get_logger()

RENEW = "certificate.renew"
"""The audit action of a renewal."""
MAX_COMPACTED = 50
"""Expired supersessions one renewal deletes (etcd allows 128 operations in a transaction)."""
MAX_LIVE_RENEWALS = 100
"""Renewals of one identity whose renewed certificates have not expired yet: a site renews a
few times per lifetime, a person by hand; past this, renewing is an attack or a bug."""


class Renewal:
    """Signs renewals and records each, with the site's new fingerprint, in one commit.

    Args:
        store: Where issued certificates and the audit trail are kept.
        sites: The site records, whose fingerprint a site's renewal moves on.
        authorities: Whose issuing CA signs the new certificates.
        site_lifetime: How long a site's new certificate is valid.
        client_lifetime: How long an operator's or tenant's new certificate is valid.
        overlap: How long a renewed certificate is still accepted if the new one is not used.
        book: The coordinator's revocations and supersessions, told of each renewal at once.
    """

    def __init__(
        self,
        store: Store,
        sites: SiteRegistry,
        authorities: Authorities,
        *,
        site_lifetime: timedelta,
        client_lifetime: timedelta,
        overlap: timedelta = timedelta(minutes=10),
        book: RevocationBook | None = None,
    ) -> None:
        self._store = store
        self._sites = sites
        self._authorities = authorities
        self._site_lifetime = site_lifetime
        self._client_lifetime = client_lifetime
        self._overlap = overlap
        self._book = book if book is not None else RevocationBook()
        # One renewal at a time: two of one site at once would both pass the check that the
        # caller's certificate is the site's newest, and one new certificate would be orphaned.
        self._lock = asyncio.Lock()

    async def renew(
        self, caller: Identity, current_pem: bytes, csr_pem: bytes
    ) -> certificate_service_pb2.RenewCertificateResponse:
        """A certificate for ``caller`` and the CSR's key, in place of ``current_pem``; the
        one it got already if ``current_pem`` was renewed for this CSR's key before.

        Raises:
            InvalidArgumentError: ``csr_pem`` is malformed, weak, or for the current key.
            PermissionDeniedError: The current certificate is revoked, was renewed for another
                key, or a site's is no longer its newest.
            ResourceExhaustedError: ``caller`` renewed ``MAX_LIVE_RENEWALS`` certificates that
                have not expired.
        """
        current = x509.load_pem_x509_certificate(current_pem)
        serial = f"{current.serial_number:x}"
        async with self._lock:
            kv = await self._store.get(CERTIFICATES + serial)
            record = records_pb2.IssuedCertificate.FromString(kv.value) if kv else None
            if record is not None and record.revoked:
                raise PermissionDeniedError(
                    f"certificate {serial} is revoked and cannot be renewed. "
                    "To fix: ask an operator for a new certificate"
                )
            superseded = await self._store.get(supersession_key(serial))
            if superseded is not None:
                supersession = records_pb2.Supersession.FromString(superseded.value)
                return await self._again(supersession, csr_pem)
            expired = self._expired_supersessions(str(caller))
            cert = self._sign(caller, current, csr_pem)
            cert_pem = self._authorities.issuer.with_chain(cert)
            issued = records_pb2.IssuedCertificate(
                serial_hex=f"{cert.serial_number:x}",
                identity=str(caller),
                fingerprint=fingerprint(cert_pem),
                issued_at=now_timestamp(),
                renewed_from=serial,
                certificate_pem=cert_pem,
            )
            issued.not_after.FromDatetime(cert.not_valid_after_utc)
            supersession = records_pb2.Supersession(
                serial_hex=serial,
                identity=str(caller),
                superseded_by=issued.serial_hex,
                successor_fingerprint=issued.fingerprint,
                superseded_at=issued.issued_at,
            )
            supersession.overlap_until.FromDatetime(datetime.now(UTC) + self._overlap)
            supersession.not_after.FromDatetime(current.not_valid_after_utc)
            site = self._site_record(caller, current_pem, issued.fingerprint)
            ops: list[Op] = [
                Put(CERTIFICATES + issued.serial_hex, issued.SerializeToString()),
                Put(
                    supersession_key(serial),
                    supersession.SerializeToString(),
                    expect_revision=0,
                ),
                *self._compacted(kv, record, issued.serial_hex),
                *(Delete(supersession_key(old)) for old in expired),
                audit.entry(
                    str(caller),
                    RENEW,
                    issued.serial_hex,
                    f"renewed from {serial}, valid until "
                    f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC",
                ),
            ]
            if site is not None:
                ops.append(self._sites.record_put(site))
            await self._store.commit(ops)
            self._book.supersede(supersession)  # the watch brings it too, later
            if site is not None:
                self._sites.registered(site)
        CERTIFICATES_RENEWED.labels(caller.role).inc()
        log.info(
            "certificate_renewed",
            identity=str(caller),
            serial=issued.serial_hex,
            renewed_from=serial,
            fingerprint=issued.fingerprint,
        )
        return self._reply(issued)

    def _reply(
        self, issued: records_pb2.IssuedCertificate
    ) -> certificate_service_pb2.RenewCertificateResponse:
        return certificate_service_pb2.RenewCertificateResponse(
            certificate_pem=issued.certificate_pem,
            ca_bundle_pem=self._authorities.bundle_pem,
            not_after=issued.not_after,
            serial_hex=issued.serial_hex,
        )

    async def _again(
        self, supersession: records_pb2.Supersession, csr_pem: bytes
    ) -> certificate_service_pb2.RenewCertificateResponse:
        """A renewed certificate's renewal repeated: the same certificate for the same CSR
        (its reply was lost), a refusal for any other."""
        serial, newer = supersession.serial_hex, supersession.superseded_by
        kv = await self._store.get(CERTIFICATES + newer)
        successor = records_pb2.IssuedCertificate.FromString(kv.value) if kv else None
        if (
            successor is not None
            and successor.certificate_pem
            and not successor.revoked
            and csr_key(csr_pem) == public_key_sha256(successor.certificate_pem)
        ):
            log.info("certificate_renewal_repeated", serial=newer, renewed_from=serial)
            return self._reply(successor)
        raise PermissionDeniedError(
            f"certificate {serial} was renewed already, as {newer}, for another key; only the "
            f"newer certificate can be renewed. To fix: use certificate {newer} (the agent's "
            "state_dir), or ask an operator for a new certificate",
            serial=serial,
            superseded_by=newer,
        )

    @staticmethod
    def _compacted(
        kv: KeyValue | None, record: records_pb2.IssuedCertificate | None, newer: str
    ) -> list[Op]:
        """The renewed ``record`` naming ``newer``, without its certificate (asked again only
        while it is the newest), and the record of the one it was renewed from deleted."""
        ops: list[Op] = []
        if kv is not None and record is not None:
            record.certificate_pem = b""
            record.superseded_by = newer
            ops.append(Put(kv.key, record.SerializeToString(), expect_revision=kv.mod_revision))
            if record.renewed_from:
                ops.append(Delete(CERTIFICATES + record.renewed_from))
        return ops

    def _expired_supersessions(self, identity: str) -> list[str]:
        """Serials of ``identity``'s supersessions whose certificates expired (to delete, up to
        ``MAX_COMPACTED``).

        Raises:
            ResourceExhaustedError: ``identity`` has ``MAX_LIVE_RENEWALS`` others.
        """
        now = datetime.now(UTC).timestamp()
        expired, live = [], 0
        for supersession in self._book.superseded.values():
            if supersession.identity != identity:
                continue
            if supersession.not_after.seconds < now:
                expired.append(supersession.serial_hex)
            else:
                live += 1
        if live >= MAX_LIVE_RENEWALS:
            raise ResourceExhaustedError(
                f"{identity} renewed {live} certificates that have not expired yet; at most "
                f"{MAX_LIVE_RENEWALS}. To fix: renew once the oldest expire, or ask an operator "
                "for a new certificate",
                identity=identity,
            )
        return expired[:MAX_COMPACTED]

    def _sign(
        self, caller: Identity, current: x509.Certificate, csr_pem: bytes
    ) -> x509.Certificate:
        is_site = caller.role is Role.SITE
        lifetime = self._site_lifetime if is_site else self._client_lifetime
        try:
            cert = self._authorities.issuer.sign_csr(csr_pem, caller, lifetime=lifetime)
        except InvalidCsrError as err:
            raise InvalidArgumentError([FieldViolation("csr_pem", str(err))]) from None
        if _public_der(cert) == _public_der(current):
            # Renewing also rotates the key: a key that may have leaked must not live on
            # under a new expiry.
            raise InvalidArgumentError(
                [
                    FieldViolation(
                        "csr_pem",
                        "the CSR is for the key of the certificate being renewed. "
                        "To fix: make a new key and a CSR for it",
                    )
                ]
            )
        return cert

    def _site_record(
        self, caller: Identity, current_pem: bytes, new_fingerprint: str
    ) -> admin_service_pb2.Site | None:
        """A site's record naming the new certificate; None for operators and tenants."""
        if caller.role is not Role.SITE:
            return None
        entry = self._sites.get(caller.name)
        if entry.record.certificate_fingerprint not in ("", fingerprint(current_pem)):
            raise PermissionDeniedError(
                f"site {caller.name} has a newer certificate than this one; only the newest "
                "can be renewed. To fix: use the newest certificate (the agent's state_dir)"
            )
        record = admin_service_pb2.Site()
        record.CopyFrom(entry.record)
        record.certificate_fingerprint = new_fingerprint
        return record


def _public_der(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
