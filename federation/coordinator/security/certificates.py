"""Operators' side of certificates: revoke them, list them, and the CRL for other tools.

A revocation is written in one commit with its audit entry and ``revoked`` set on the
certificate records it covers. Revoking a serial revokes the certificates renewed from it too
(each by its own serial, with the same reason): a stolen key's renewals go with it. Revoking
a serial already revoked (by serial, or by its identity's revocation) is refused with
ALREADY_EXISTS; revoking an identity again moves its cut-off to now, so certificates issued
since the last revocation are revoked too.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding

from federation.api.v1 import certificate_service_pb2 as pb
from federation.api.v1 import records_pb2
from federation.coordinator import audit
from federation.coordinator.jobs.records import now_timestamp
from federation.coordinator.security.authorities import Authorities
from federation.coordinator.sites.enrollment import CERTIFICATES
from federation.errors import (
    AlreadyExistsError,
    CertificateNotFoundError,
    FieldViolation,
    InvalidArgumentError,
)
from federation.security.identity import Identity, InvalidIdentityError, Role, validate_name
from federation.security.revocation import RevocationBook, covers, revocation_key
from federation.store import CasConflictError, KeyValue, Op, Put, Store

log = structlog.get_logger()

MAX_REASON_CHARS = 500
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_MARKED = 100
"""Certificate records one revocation marks in its commit (etcd allows 128 operations in a
transaction); older ones of the identity are revoked all the same: the check and the list
go by the revocation itself, the mark is for readers of the record."""
CRL_VALID = timedelta(days=1)
"""How long a CRL is current; tools fetch a new one before its nextUpdate."""


def parse_identity_text(text: str) -> Identity:
    """``site:edge-1``, ``tenant:NAME`` or ``operator:NAME``.

    Raises:
        InvalidIdentityError: Not of that form, or the name is invalid.
    """
    role, sep, name = text.partition(":")
    if not sep or role not in set(Role):
        raise InvalidIdentityError(
            f"expected ROLE:NAME with ROLE one of {', '.join(Role)}, got {text[:80]!r}"
        )
    validate_name(name, f"{role} name")
    return Identity(Role(role), name)


def normal_serial(text: str) -> str:
    """A serial in hex as the coordinator writes it (lowercase, no leading zeros or colons).

    Raises:
        ValueError: Not a positive hexadecimal number.
    """
    digits = text.strip().lower().removeprefix("0x").replace(":", "")
    if not digits or len(digits) > 40 or int(digits, 16) <= 0:  # int() refuses non-hex
        raise ValueError(text)
    return f"{int(digits, 16):x}"


def _violations(request: pb.RevokeCertificatesRequest) -> list[FieldViolation]:
    out = []
    target = request.WhichOneof("target")
    if target is None:
        out.append(FieldViolation("target", "give serial_hex or identity"))
    elif target == "serial_hex":
        try:
            normal_serial(request.serial_hex)
        except ValueError:
            out.append(FieldViolation("serial_hex", "must be a certificate serial in hex"))
    else:
        try:
            parse_identity_text(request.identity)
        except InvalidIdentityError as err:
            out.append(FieldViolation("identity", str(err)))
    if not request.reason.strip():
        out.append(FieldViolation("reason", "is required: why, for the audit trail"))
    elif len(request.reason) > MAX_REASON_CHARS:
        out.append(FieldViolation("reason", f"at most {MAX_REASON_CHARS} characters"))
    return out


def _issued_s(record: records_pb2.IssuedCertificate) -> int:
    return record.issued_at.seconds


class Certificates:
    """Revokes, lists and publishes revocations; ``book`` is the coordinator's own list.

    Args:
        store: Where this term writes (fenced when several coordinators share it).
        authorities: Whose issuing CA signs the CRL.
        book: Updated at once after a revocation's commit, so the revoking coordinator
            refuses the very next call; the others hear of it from the store's watch.
    """

    def __init__(self, store: Store, authorities: Authorities, book: RevocationBook) -> None:
        self._store = store
        self._authorities = authorities
        self._book = book

    async def revoke(
        self, revoked_by: str, request: pb.RevokeCertificatesRequest
    ) -> pb.RevokeCertificatesResponse:
        if violations := _violations(request):
            raise InvalidArgumentError(violations)
        revocation = records_pb2.Revocation(
            revoked_at=now_timestamp(), revoked_by=revoked_by, reason=request.reason.strip()
        )
        revocations = [revocation]
        if request.WhichOneof("target") == "serial_hex":
            revocation.serial_hex = normal_serial(request.serial_hex)
            marked = [kv for kv in [await self._one(revocation)] if kv is not None]
            target = revocation.serial_hex
            for serial in self._book.renewals_of(revocation.serial_hex):
                if serial in self._book.by_serial:
                    continue
                renewal = records_pb2.Revocation()
                renewal.CopyFrom(revocation)
                renewal.serial_hex = serial
                renewal.reason = f"renewed from {target}: {revocation.reason}"
                revocations.append(renewal)
                kv = await self._store.get(CERTIFICATES + serial)
                if kv is not None:
                    marked.append(kv)
        else:
            revocation.identity = str(parse_identity_text(request.identity))
            marked = await self._of_identity(revocation)
            target = revocation.identity
        serials = [f"{kv.key.removeprefix(CERTIFICATES)}" for kv in marked]
        ops: list[Op] = [
            *(
                Put(
                    revocation_key(r),
                    r.SerializeToString(),
                    expect_revision=0 if r.serial_hex else None,
                )
                for r in revocations
            ),
            *(self._marked(kv) for kv in marked),
            audit.entry(
                revoked_by,
                "certificate.revoke",
                target,
                f"{revocation.reason} ({len(serials)} recorded certificate(s))",
            ),
        ]
        try:
            await self._store.commit(ops)
        except CasConflictError:
            raise AlreadyExistsError(
                f"{target} was revoked meanwhile. To fix: nothing; 'fedctl pki list' shows it",
                target=target,
            ) from None
        for applied in revocations:
            self._book.apply(applied)
        log.warning("certificates_revoked", target=target, by=revoked_by, serials=len(serials))
        return pb.RevokeCertificatesResponse(revocation=revocation, serials=serials)

    async def _one(self, revocation: records_pb2.Revocation) -> KeyValue | None:
        """The record of the serial revoked, refused when unknown or revoked already; None
        for a renewed certificate whose record was compacted away."""
        kv = await self._store.get(CERTIFICATES + revocation.serial_hex)
        if kv is None:
            if revocation.serial_hex in self._book.superseded:
                if revocation.serial_hex in self._book.by_serial:
                    raise AlreadyExistsError(
                        f"certificate {revocation.serial_hex} is revoked already. To fix: "
                        "nothing; 'fedctl pki list' shows it",
                        serial=revocation.serial_hex,
                    )
                return None
            raise CertificateNotFoundError(revocation.serial_hex)
        record = records_pb2.IssuedCertificate.FromString(kv.value)
        earlier = self._revocation_of(record)
        if record.revoked or earlier is not None:
            how = (
                f"with every certificate of {earlier.identity}"
                if earlier and earlier.identity
                else ""
            )
            raise AlreadyExistsError(
                f"certificate {revocation.serial_hex} is revoked already {how}".strip()
                + ". To fix: nothing; 'fedctl pki list' shows it",
                serial=revocation.serial_hex,
            )
        return kv

    async def _of_identity(self, revocation: records_pb2.Revocation) -> list[KeyValue]:
        """The unrevoked records of the identity issued up to the revocation, newest first."""
        found = []
        for kv in await self._store.range(CERTIFICATES):
            record = records_pb2.IssuedCertificate.FromString(kv.value)
            if record.revoked or record.identity != revocation.identity:
                continue
            if _issued_s(record) <= revocation.revoked_at.seconds:
                found.append((record.issued_at.ToNanoseconds(), kv))
        found.sort(key=lambda pair: pair[0], reverse=True)
        return [kv for _, kv in found[:MAX_MARKED]]

    @staticmethod
    def _marked(kv: KeyValue) -> Put:
        record = records_pb2.IssuedCertificate.FromString(kv.value)
        record.revoked = True
        return Put(kv.key, record.SerializeToString(), expect_revision=kv.mod_revision)

    def _revocation_of(
        self, record: records_pb2.IssuedCertificate
    ) -> records_pb2.Revocation | None:
        by_serial = self._book.by_serial.get(record.serial_hex)
        if by_serial is not None:
            return by_serial
        by_identity = self._book.by_identity.get(record.identity)
        if by_identity is not None and covers(
            by_identity, record.serial_hex, record.identity, _issued_s(record)
        ):
            return by_identity
        return None

    async def _records(self) -> list[records_pb2.IssuedCertificate]:
        """Every issued certificate, newest first, ``revoked`` set from the revocations too."""
        records = []
        for kv in await self._store.range(CERTIFICATES):
            record = records_pb2.IssuedCertificate.FromString(kv.value)
            record.revoked = record.revoked or self._revocation_of(record) is not None
            record.ClearField("certificate_pem")  # kept to answer a lost renewal, not listed
            records.append(record)
        records.sort(key=lambda r: (r.issued_at.ToNanoseconds(), r.serial_hex), reverse=True)
        return records

    async def list(self, request: pb.ListCertificatesRequest) -> pb.ListCertificatesResponse:
        """One page of certificates, newest first; every revocation on the first page."""
        violations = []
        if request.limit > MAX_LIMIT:
            violations.append(FieldViolation("limit", f"at most {MAX_LIMIT}, got {request.limit}"))
        if request.identity:
            try:
                parse_identity_text(request.identity)
            except InvalidIdentityError as err:
                violations.append(FieldViolation("identity", str(err)))
        after = _cursor(request.page_token)
        if request.page_token and after is None:
            violations.append(FieldViolation("page_token", "is not one this service gave"))
        if violations:
            raise InvalidArgumentError(violations)
        limit = request.limit or DEFAULT_LIMIT
        out = pb.ListCertificatesResponse()
        if not request.page_token:
            out.revocations.extend(self._book.revocations())
        for record in await self._records():
            if request.identity and record.identity != request.identity:
                continue
            if after is not None and (record.issued_at.ToNanoseconds(), record.serial_hex) >= after:
                continue
            if len(out.certificates) == limit:
                last = out.certificates[-1]
                out.next_page_token = f"{last.issued_at.ToNanoseconds()}-{last.serial_hex}"
                break
            out.certificates.append(record)
        return out

    async def revocation_list(self) -> pb.GetRevocationListResponse:
        """An X.509 CRL, signed by the CA, of every revoked serial the coordinator knows.

        Certificates it never recorded (issued offline) and revoked with their identity are
        not in it: their serials are unknown here.
        """
        revoked: dict[str, datetime] = {
            serial: r.revoked_at.ToDatetime(UTC) for serial, r in self._book.by_serial.items()
        }
        for record in await self._records():
            revocation = self._revocation_of(record)
            if revocation is not None and record.serial_hex not in revoked:
                revoked[record.serial_hex] = revocation.revoked_at.ToDatetime(UTC)
        now = datetime.now(UTC)
        ca = self._authorities.issuer
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(ca.cert.subject)
            .last_update(now)
            .next_update(now + CRL_VALID)
            .add_extension(x509.CRLNumber(int(now.timestamp())), critical=False)
        )
        for serial, when in sorted(revoked.items()):
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(int(serial, 16))
                .revocation_date(when)
                .build()
            )
        crl = builder.sign(ca.key, hashes.SHA256())
        return pb.GetRevocationListResponse(crl_pem=crl.public_bytes(Encoding.PEM))


def _cursor(token: str) -> tuple[int, str] | None:
    """``NANOS-SERIAL`` from a page token, or None for one this service did not give."""
    nanos, sep, serial = token.partition("-")
    if not sep or not nanos.isdigit():
        return None
    try:
        return (int(nanos), normal_serial(serial)) if serial == normal_serial(serial) else None
    except ValueError:
        return None
