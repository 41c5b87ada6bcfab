"""Renewing the site's certificate before it expires, over the agent's own session.

Once two thirds of the certificate's lifetime have passed, the agent makes a new key and a
CSR and writes both (``renewal-key.pem``, ``renewal-csr.pem``) before it asks the coordinator
for a certificate over the established mTLS session; then it writes the pair
(``replace_key_pair``: no crash leaves a mismatched pair in use), drops the pending files, and
moves its session onto it. A failed renewal is logged and tried again with jittered backoff,
with the same CSR: a renewal whose reply was lost is answered again with the same
certificate. Meanwhile the agent works on with the current certificate, which the coordinator
accepts until the new one is used or a short overlap ends; a session refused after that is
recovered by repeating the pending renewal over a channel of its own (``recover``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta

import grpc
import structlog

from federation.agent.enroll import SiteCredentials, one_line, pending_csr
from federation.api.v1 import certificate_service_pb2, certificate_service_pb2_grpc
from federation.durable import write_public_file
from federation.metrics import AGENT_CERTIFICATE_EXPIRY
from federation.security.cert_info import (
    CLOCK_SKEW,
    CertificateInfo,
    fingerprint,
    load_certificate_info,
)
from federation.security.key_pair_files import replace_key_pair
from federation.security.tls import channel_credentials

log = structlog.get_logger()

RENEW_AT = 2 / 3
"""Share of a certificate's lifetime after which it is renewed: a third of it is left to
retry in, days for the default week."""
RENEW_TIMEOUT_S = 30.0
RETRY_MIN_S = 1.0
RETRY_MAX_S = 300.0


def renewal_due(cert: CertificateInfo) -> datetime:
    """When ``cert`` is due for renewal: ``RENEW_AT`` of its lifetime after it was issued.

    The CA starts every certificate ``CLOCK_SKEW`` before it issues it, so the lifetime
    counts from notBefore plus that margin (a certificate shorter than the margin counts
    from notBefore).
    """
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if end - start > CLOCK_SKEW:
        start += CLOCK_SKEW
    return start + (end - start) * RENEW_AT


class CertificateRenewer:
    """Keeps the site's certificate renewed.

    Args:
        creds: The site's certificate, key and CA bundle files.
        site: The site's name, as the CSR's subject (the coordinator decides the identity).
        channel: The established session's channel, waiting for one.
        renewed: Called once the new pair is on disk, to move the session onto it.
        options: Channel options of a channel of its own (``recover``).
    """

    def __init__(
        self,
        creds: SiteCredentials,
        site: str,
        channel: Callable[[], Awaitable[grpc.aio.Channel]],
        renewed: Callable[[], None],
        options: Sequence[tuple[str, str | int]] = (),
    ) -> None:
        self._creds = creds
        self._site = site
        self._channel = channel
        self._renewed = renewed
        self._options = list(options)

    async def run(self) -> None:
        """Renew each certificate when due, until cancelled."""
        while True:
            cert = load_certificate_info(self._creds.cert)
            AGENT_CERTIFICATE_EXPIRY.set(cert.not_valid_after_utc.timestamp())
            wait_s = (renewal_due(cert) - datetime.now(UTC)).total_seconds()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            await self._renew_until_done(cert)

    async def _renew_until_done(self, cert: CertificateInfo) -> None:
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.renew_once()
                return
            except grpc.aio.AioRpcError as err:
                error = f"{err.code().name}: {one_line(err.details() or '')}"
            except (OSError, ValueError) as err:  # the files could not be written
                error = str(err)
            left = cert.not_valid_after_utc - datetime.now(UTC)
            wait_s = _retry_wait(attempt, left)
            log.warning(
                "certificate_renewal_failed",
                attempt=attempt,
                error=error,
                retry_in_s=round(wait_s, 2),
                expires_in_s=round(left.total_seconds()),
            )
            await asyncio.sleep(wait_s)

    async def renew_once(self, channel: grpc.aio.Channel | None = None) -> None:
        """One renewal: the pending key and CSR (new ones if none), the coordinator's
        signature, the files, the session; over ``channel``, or the session's."""
        if channel is None:
            channel = await self._channel()
        key_pem, csr_pem = await self._pending()
        stub = certificate_service_pb2_grpc.CertificateServiceStub(channel)
        try:
            reply = await stub.RenewCertificate(
                certificate_service_pb2.RenewCertificateRequest(csr_pem=csr_pem),
                timeout=RENEW_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.INVALID_ARGUMENT:
                self._drop_pending()  # a CSR the coordinator refuses: the next try makes one
            raise
        replace_key_pair(self._creds.cert, self._creds.key, reply.certificate_pem, key_pem)
        self._drop_pending()
        if reply.ca_bundle_pem and reply.ca_bundle_pem != self._creds.ca.read_bytes():
            write_public_file(self._creds.ca, reply.ca_bundle_pem)
        AGENT_CERTIFICATE_EXPIRY.set(reply.not_after.seconds)
        log.info(
            "certificate_renewed",
            serial=reply.serial_hex,
            not_after=reply.not_after.ToJsonString(),
            fingerprint=fingerprint(reply.certificate_pem),
        )
        self._renewed()

    async def recover(self, address: str) -> bool:
        """Repeat a pending renewal over a channel of its own to ``address``, for a session
        the coordinator refused because the certificate was renewed (the reply lost, the
        overlap over); True if that got the new certificate onto disk."""
        if not self._creds.renewal_csr.exists():
            return False
        credentials = channel_credentials(self._creds.tls)
        try:
            async with grpc.aio.secure_channel(address, credentials, self._options) as channel:
                await self.renew_once(channel)
        except grpc.aio.AioRpcError as err:
            log.warning(
                "certificate_recovery_failed",
                code=err.code().name,
                error=one_line(err.details() or ""),
            )
            return False
        log.info("certificate_recovered", coordinator=address)
        return True

    async def _pending(self) -> tuple[bytes, bytes]:
        """The key and CSR of the renewal under way, written first if there is none."""
        return await pending_csr(self._creds.renewal_key, self._creds.renewal_csr, self._site)

    def _drop_pending(self) -> None:
        self._creds.renewal_csr.unlink(missing_ok=True)
        self._creds.renewal_key.unlink(missing_ok=True)


def _retry_wait(attempt: int, left: timedelta) -> float:
    """Doubling from ``RETRY_MIN_S``, jittered, and never more than a quarter of the time
    left, so a short certificate gets several tries before it expires."""
    wait_s = min(RETRY_MAX_S, RETRY_MIN_S * 2.0 ** (attempt - 1))
    wait_s = min(wait_s, max(RETRY_MIN_S, left.total_seconds() / 4))
    return wait_s * random.uniform(0.5, 1.5)
