"""Which certificates are revoked, kept in memory from the store, and the open streams of each.

A revocation names one certificate (by serial) or an identity: then every certificate of that
identity issued at or before ``revoked_at`` is revoked, those issued offline that the store
never saw included. A certificate's issue time is its notBefore plus the CA's ``CLOCK_SKEW``;
notBefore has whole seconds, so a certificate issued in the very second of the revocation
counts as revoked too (refusing is the safe side).

A renewed certificate is superseded (a ``Supersession``, kept beside the revocations): it is
accepted on until its successor is first used (as this coordinator sees it) or its overlap
ends, and after that only to repeat the renewal that superseded it.

Every coordinator keeps a ``RevocationBook``: loaded before it serves, then kept current by
``federation.store.revocations.follow`` from the store's watch, so each coordinator of an HA
group refuses a revoked peer as soon as the revocation is committed, leader or not.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import structlog
from cryptography import x509

from federation.api.v1 import records_pb2
from federation.errors import CertificateRevokedError, CertificateSupersededError
from federation.security.identity import Identity, identity_from_certificate
from federation.security.pki import CLOCK_SKEW

log = structlog.get_logger()

REVOCATIONS = "/revocations/"
BY_SERIAL = REVOCATIONS + "serial/"
BY_IDENTITY = REVOCATIONS + "identity/"
SUPERSEDED = REVOCATIONS + "superseded/"


def supersession_key(serial_hex: str) -> str:
    return SUPERSEDED + serial_hex


def revocation_key(revocation: records_pb2.Revocation) -> str:
    """Where a revocation is stored: one key per serial, one per identity."""
    if revocation.serial_hex:
        return BY_SERIAL + revocation.serial_hex
    return BY_IDENTITY + revocation.identity


@dataclass(frozen=True, slots=True)
class PeerCertificate:
    """What a revocation is checked against: a certificate's identity, serial and issue time."""

    identity: Identity
    serial_hex: str
    issued_s: int
    """Unix seconds: notBefore plus ``CLOCK_SKEW``."""


@functools.lru_cache(maxsize=4096)
def peer_certificate_of(pem: bytes) -> PeerCertificate:
    """The facts of a PEM certificate, parsed once per certificate (they never change).

    Raises:
        InvalidIdentityError: The certificate carries no valid federation identity.
    """
    identity = identity_from_certificate(pem)  # checks the PEM first
    cert = x509.load_pem_x509_certificate(pem)
    issued = cert.not_valid_before_utc + CLOCK_SKEW
    return PeerCertificate(identity, f"{cert.serial_number:x}", int(issued.timestamp()))


def covers(
    revocation: records_pb2.Revocation, serial_hex: str, identity: str, issued_s: int
) -> bool:
    """Whether ``revocation`` revokes the certificate ``serial_hex`` of ``identity``."""
    if revocation.serial_hex:
        return revocation.serial_hex == serial_hex
    return revocation.identity == identity and issued_s <= revocation.revoked_at.seconds


def refusal(cert: PeerCertificate, revocation: records_pb2.Revocation) -> CertificateRevokedError:
    """The error a revoked peer gets: its own serial, when and why, nothing else."""
    when = f"{revocation.revoked_at.ToDatetime():%Y-%m-%d %H:%M:%S}"
    return CertificateRevokedError(cert.serial_hex, when, revocation.reason)


@dataclass(eq=False, slots=True)
class OpenStream:
    """A stream being served, ended by ``RevocationBook`` when its certificate is revoked."""

    cert: PeerCertificate
    task: asyncio.Task[object] | None
    revoked: records_pb2.Revocation | None = None
    """Set once a revocation covers the certificate."""

    def refusal(self) -> CertificateRevokedError:
        assert self.revoked is not None
        return refusal(self.cert, self.revoked)


@dataclass
class RevocationBook:
    """Every revocation, by serial and by identity, and the streams open per certificate.

    A check is a set lookup by serial and a dict lookup by identity, cheap enough for every
    call and every stream message.
    """

    by_serial: dict[str, records_pb2.Revocation] = field(default_factory=dict)
    by_identity: dict[str, records_pb2.Revocation] = field(default_factory=dict)
    superseded: dict[str, records_pb2.Supersession] = field(default_factory=dict)
    """Renewed certificates by serial."""
    _streams: dict[str, set[OpenStream]] = field(default_factory=dict)
    """Open streams by identity (text): a revocation by serial or identity finds them alike."""
    _predecessors: dict[str, str] = field(default_factory=dict)
    """Serial of a renewed certificate by the serial of the one it was renewed into."""
    _successor_used: set[str] = field(default_factory=set)
    """Superseded serials whose successor was seen in use here: refused at once."""

    def revocations(self) -> list[records_pb2.Revocation]:
        """Every revocation, newest first."""
        every = [*self.by_serial.values(), *self.by_identity.values()]
        return sorted(every, key=lambda r: r.revoked_at.ToNanoseconds(), reverse=True)

    def revocation_of(self, cert: PeerCertificate) -> records_pb2.Revocation | None:
        """The revocation that covers ``cert``, or None."""
        if (by_serial := self.by_serial.get(cert.serial_hex)) is not None:
            return by_serial
        by_identity = self.by_identity.get(str(cert.identity))
        if by_identity is not None and cert.issued_s <= by_identity.revoked_at.seconds:
            return by_identity
        return None

    def check(self, cert: PeerCertificate, *, renewing: bool = False) -> None:
        """Raise ``CertificateRevokedError`` if ``cert`` is revoked, and
        ``CertificateSupersededError`` if it was renewed and its overlap is over (unless the
        call is ``renewing``: repeating a renewal whose reply was lost). A certificate whose
        predecessor is still in its overlap ends that overlap: it is in use."""
        if (revocation := self.revocation_of(cert)) is not None:
            raise refusal(cert, revocation)
        serial = cert.serial_hex
        supersession = self.superseded.get(serial)
        if supersession is not None and not renewing and self.retired(supersession):
            raise CertificateSupersededError(serial, supersession.superseded_by)
        predecessor = self._predecessors.get(serial)
        if predecessor is not None and predecessor not in self._successor_used:
            self._successor_used.add(predecessor)
            log.info("superseded_certificate_retired", serial=predecessor, successor=serial)

    def retired(self, supersession: records_pb2.Supersession) -> bool:
        """Whether a superseded certificate's overlap is over."""
        return (
            supersession.serial_hex in self._successor_used
            or supersession.overlap_until.seconds <= time.time()
        )

    def successor_fingerprint(self, serial_hex: str) -> str:
        """The fingerprint of the certificate ``serial_hex`` was renewed into, or ""."""
        supersession = self.superseded.get(serial_hex)
        return supersession.successor_fingerprint if supersession is not None else ""

    def renewals_of(self, serial_hex: str) -> list[str]:
        """The serials renewed from ``serial_hex``, directly or not, oldest first."""
        out: list[str] = []
        supersession = self.superseded.get(serial_hex)
        while supersession is not None and supersession.superseded_by not in out:
            out.append(supersession.superseded_by)
            supersession = self.superseded.get(supersession.superseded_by)
        return out

    def supersede(self, supersession: records_pb2.Supersession) -> None:
        """Take a supersession in (again: idempotent)."""
        self.superseded[supersession.serial_hex] = supersession
        self._predecessors[supersession.superseded_by] = supersession.serial_hex

    def apply(self, revocation: records_pb2.Revocation) -> None:
        """Take a revocation in (again: idempotent), and end the open streams it covers."""
        if revocation.serial_hex:
            self.by_serial[revocation.serial_hex] = revocation
        else:
            self.by_identity[revocation.identity] = revocation
        for stream in self._covered(revocation):
            if stream.revoked is None:
                stream.revoked = revocation
                if stream.task is not None:
                    stream.task.cancel()  # the interceptor answers UNAUTHENTICATED
                log.warning(
                    "revoked_stream_closed",
                    serial=stream.cert.serial_hex,
                    peer=str(stream.cert.identity),
                )

    def forget(self, key: str) -> None:
        """A revocation deleted from the store (by hand: the API never deletes one)."""
        if key.startswith(SUPERSEDED):
            supersession = self.superseded.pop(key.removeprefix(SUPERSEDED), None)
            if supersession is not None:
                self._predecessors.pop(supersession.superseded_by, None)
                self._successor_used.discard(supersession.serial_hex)
        elif key.startswith(BY_SERIAL):
            self.by_serial.pop(key.removeprefix(BY_SERIAL), None)
        elif key.startswith(BY_IDENTITY):
            self.by_identity.pop(key.removeprefix(BY_IDENTITY), None)

    def replace(
        self,
        revocations: Iterable[records_pb2.Revocation],
        supersessions: Iterable[records_pb2.Supersession] = (),
    ) -> None:
        """Take the store's whole list, as after a fresh read."""
        self.by_serial.clear()
        self.by_identity.clear()
        self.superseded.clear()
        self._predecessors.clear()
        for revocation in revocations:
            self.apply(revocation)
        for supersession in supersessions:
            self.supersede(supersession)
        self._successor_used.intersection_update(self.superseded)  # deleted ones go

    def open_stream(self, cert: PeerCertificate) -> OpenStream:
        """Register the stream the current task serves, for ``apply`` to end."""
        stream = OpenStream(cert, asyncio.current_task())
        self._streams.setdefault(str(cert.identity), set()).add(stream)
        return stream

    def close_stream(self, stream: OpenStream) -> None:
        key = str(stream.cert.identity)
        streams = self._streams.get(key)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._streams[key]

    def _covered(self, revocation: records_pb2.Revocation) -> list[OpenStream]:
        candidates: Collection[OpenStream]
        if revocation.identity:
            candidates = self._streams.get(revocation.identity, ())
        else:  # by serial: the identity is not in the revocation, so look at every stream
            candidates = [s for streams in self._streams.values() for s in streams]
        return [
            s
            for s in candidates
            if covers(revocation, s.cert.serial_hex, str(s.cert.identity), s.cert.issued_s)
        ]
