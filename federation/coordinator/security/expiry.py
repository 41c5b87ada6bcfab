"""When certificates expire: the soonest of those the coordinator issued, its own, the CA's.

The federation status reads them on each call, and ``Expiries.run`` keeps the Prometheus
gauge current, so an alert on it sees a certificate expire (or get revoked) within a minute.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from cryptography import x509
from google.protobuf import timestamp_pb2

from federation.api.v1 import records_pb2
from federation.coordinator.sites.enrollment import CERTIFICATES
from federation.metrics import CERTIFICATE_EXPIRY
from federation.store import Store

log = structlog.get_logger()

REFRESH_S = 60.0
"""How often the gauge is refreshed from the store."""
_CHUNK = 500


class Expiries:
    """Reads certificate expiries; the issued ones from the store, as revocations mark them.

    Args:
        store: Holds every certificate issued at a join or a renewal.
        server_cert: The coordinator's own certificate, as it serves it.
        ca_cert: The issuing CA's certificate.
    """

    def __init__(self, store: Store, server_cert: x509.Certificate, ca_cert: x509.Certificate):
        self._store = store
        self.server_not_after = _timestamp(server_cert)
        self.ca_not_after = _timestamp(ca_cert)

    async def soonest(self) -> records_pb2.IssuedCertificate | None:
        """The issued certificate, not revoked, not renewed and not yet expired, that expires
        first (a renewed one is replaced already: its expiry needs nobody)."""
        now_s = int(time.time())
        best: records_pb2.IssuedCertificate | None = None
        after = ""
        while True:
            chunk = await self._store.range(CERTIFICATES, start_after=after, limit=_CHUNK)
            issued = [records_pb2.IssuedCertificate.FromString(kv.value) for kv in chunk]
            live = [
                c
                for c in issued
                if not c.revoked and not c.superseded_by and c.not_after.seconds > now_s
            ]
            best = min([*live, *([best] if best else [])], key=_expiry_ns, default=None)
            if len(chunk) < _CHUNK:
                break
            after = chunk[-1].key
        self._export(best)
        return best

    async def run(self, interval_s: float = REFRESH_S) -> None:
        """Refresh the gauge every ``interval_s`` until cancelled."""
        while True:
            try:
                await self.soonest()
            except Exception as err:  # a store hiccup: the next round tries again
                log.warning("certificate_expiry_unread", error=str(err))
            await asyncio.sleep(interval_s)

    def _export(self, soonest: records_pb2.IssuedCertificate | None) -> None:
        CERTIFICATE_EXPIRY.labels("issued").set(
            soonest.not_after.seconds if soonest is not None else 0
        )
        CERTIFICATE_EXPIRY.labels("server").set(self.server_not_after.seconds)
        CERTIFICATE_EXPIRY.labels("ca").set(self.ca_not_after.seconds)


def _expiry_ns(issued: records_pb2.IssuedCertificate) -> int:
    return issued.not_after.ToNanoseconds()


def _timestamp(cert: x509.Certificate) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(cert.not_valid_after_utc)
    return stamp
