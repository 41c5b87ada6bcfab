"""Renewing a certificate: a new one for the caller's own identity, for a fresh key.

Any identity renews itself over its current mTLS connection; the TLS handshake has already
refused an expired certificate or one from another CA. The certificate names the caller's
identity, whatever subject the CSR asks for, as at a join. A site's record then names the
new certificate, so its agent's next session must present it and the old one is refused.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import structlog
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from federation.api.v1 import admin_service_pb2, certificate_service_pb2, records_pb2
from federation.coordinator import audit
from federation.coordinator.enrollment import CERTIFICATES
from federation.coordinator.jobs import now_timestamp
from federation.coordinator.security.authorities import Authorities
from federation.coordinator.sites import SiteRegistry
from federation.errors import FieldViolation, InvalidArgumentError, PermissionDeniedError
from federation.metrics import CERTIFICATES_RENEWED
from federation.security.identity import Identity, Role
from federation.security.pki import InvalidCsrError, fingerprint
from federation.store import Op, Put, Store

log = structlog.get_logger()

RENEW = "certificate.renew"
"""The audit action of a renewal."""


class Renewal:
    """Signs renewals and records each, with the site's new fingerprint, in one commit.

    Args:
        store: Where issued certificates and the audit trail are kept.
        sites: The site records, whose fingerprint a site's renewal moves on.
        authorities: Whose issuing CA signs the new certificates.
        site_lifetime: How long a site's new certificate is valid.
        client_lifetime: How long an operator's or tenant's new certificate is valid.
    """

    def __init__(
        self,
        store: Store,
        sites: SiteRegistry,
        authorities: Authorities,
        *,
        site_lifetime: timedelta,
        client_lifetime: timedelta,
    ) -> None:
        self._store = store
        self._sites = sites
        self._authorities = authorities
        self._site_lifetime = site_lifetime
        self._client_lifetime = client_lifetime
        # One renewal at a time: two of one site at once would both pass the check that the
        # caller's certificate is the site's newest, and one new certificate would be orphaned.
        self._lock = asyncio.Lock()

    async def renew(
        self, caller: Identity, current_pem: bytes, csr_pem: bytes
    ) -> certificate_service_pb2.RenewCertificateResponse:
        """A certificate for ``caller`` and the CSR's key, in place of ``current_pem``.

        Raises:
            InvalidArgumentError: ``csr_pem`` is malformed, weak, or for the current key.
            PermissionDeniedError: The current certificate is revoked, or a site's is no
                longer its newest.
        """
        current = x509.load_pem_x509_certificate(current_pem)
        serial = f"{current.serial_number:x}"
        async with self._lock:
            await self._check_not_revoked(serial)
            cert = self._sign(caller, current, csr_pem)
            cert_pem = self._authorities.issuer.with_chain(cert)
            issued = records_pb2.IssuedCertificate(
                serial_hex=f"{cert.serial_number:x}",
                identity=str(caller),
                fingerprint=fingerprint(cert_pem),
                issued_at=now_timestamp(),
                renewed_from=serial,
            )
            issued.not_after.FromDatetime(cert.not_valid_after_utc)
            site = self._site_record(caller, current_pem, issued.fingerprint)
            ops: list[Op] = [
                Put(CERTIFICATES + issued.serial_hex, issued.SerializeToString()),
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
        return certificate_service_pb2.RenewCertificateResponse(
            certificate_pem=cert_pem,
            ca_bundle_pem=self._authorities.bundle_pem,
            not_after=issued.not_after,
            serial_hex=issued.serial_hex,
        )

    async def _check_not_revoked(self, serial: str) -> None:
        """Refuse a certificate the store marks revoked (one issued offline has no record)."""
        kv = await self._store.get(CERTIFICATES + serial)
        if kv is not None and records_pb2.IssuedCertificate.FromString(kv.value).revoked:
            raise PermissionDeniedError(
                f"certificate {serial} is revoked and cannot be renewed. "
                "To fix: ask an operator for a new certificate"
            )

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
