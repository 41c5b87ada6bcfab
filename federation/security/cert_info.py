"""Certificates read without cryptography, and what ``pki`` shares with processes that do
not load it.

A site agent reads its own certificate for two things all along: when it expires (renewal,
the expiry gauge, the "expired" message at start) and its fingerprint (logs). Both are read
here from the DER with the standard library, so that the agent does not hold cryptography's
library for them; whatever makes keys or checks signatures runs where cryptography is loaded
(``federation.security.pki``, in a child process for the agent: ``crypto_process``).

The reader walks only what leads to the validity (RFC 5280, 4.1): the certificate's SEQUENCE,
the tbsCertificate's, the optional version, the serial number, the signature algorithm, the
issuer, then notBefore and notAfter. It follows DER strictly (definite, minimal lengths, one
value that spans the whole encoding) and raises ``ValueError`` for anything else, as
cryptography does for a malformed certificate; it checks no signature and reads no extension.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

CLOCK_SKEW = timedelta(minutes=5)
"""How far in the past every certificate's validity starts, to tolerate clock skew."""


class CaCheckError(ValueError):
    """A CA certificate, key or trust bundle is not fit for its part; the message says why."""


_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.DOTALL)
_SEQUENCE, _INTEGER, _VERSION = 0x30, 0x02, 0xA0
_UTC_TIME, _GENERALIZED_TIME = 0x17, 0x18


@dataclass(frozen=True, slots=True)
class CertificateInfo:
    """What the agent reads of a certificate: its DER and its validity (UTC)."""

    der: bytes
    not_valid_before_utc: datetime
    not_valid_after_utc: datetime

    @property
    def fingerprint(self) -> str:
        """``"sha256:<hex>"`` of the DER, as ``pki.fingerprint`` gives it."""
        return "sha256:" + hashlib.sha256(self.der).hexdigest()


def first_der(pem: bytes) -> bytes:
    """The DER of the first certificate in ``pem`` (a bundle's first, a chain's leaf).

    Raises:
        ValueError: No PEM certificate, or its base64 is malformed.
    """
    found = _PEM.search(pem)
    if found is None:
        raise ValueError("no PEM certificate found")
    try:
        return base64.b64decode(b"".join(found.group(1).split()), validate=True)
    except binascii.Error as err:
        raise ValueError(f"the PEM certificate's base64 is malformed: {err}") from None


def read_certificate(pem: bytes) -> CertificateInfo:
    """The first certificate in ``pem``: its DER and validity.

    Raises:
        ValueError: Not a PEM certificate, or its DER is malformed up to the validity.
    """
    der = first_der(pem)
    tag, cert, end = _read(der, 0)
    if tag != _SEQUENCE or end != len(der):
        raise ValueError("a certificate is one DER SEQUENCE")
    tag, tbs, _ = _read(cert, 0)
    if tag != _SEQUENCE:
        raise ValueError("the tbsCertificate is no SEQUENCE")
    offset = 0
    tag, _, after = _read(tbs, offset)
    if tag == _VERSION:
        offset = after
    for expected, what in ((_INTEGER, "serial number"), (_SEQUENCE, "signature algorithm")):
        tag, _, offset = _read(tbs, offset)
        if tag != expected:
            raise ValueError(f"the certificate's {what} is malformed")
    tag, _, offset = _read(tbs, offset)  # the issuer
    if tag != _SEQUENCE:
        raise ValueError("the certificate's issuer is malformed")
    tag, validity, _ = _read(tbs, offset)
    if tag != _SEQUENCE:
        raise ValueError("the certificate's validity is malformed")
    tag, not_before, offset = _read(validity, 0)
    before = _time(tag, not_before)
    tag, not_after, offset = _read(validity, offset)
    after_ = _time(tag, not_after)
    if offset != len(validity):
        raise ValueError("the certificate's validity holds more than two times")
    return CertificateInfo(der, before, after_)


def load_certificate_info(path: Path) -> CertificateInfo:
    """The first certificate in the PEM file ``path`` (see ``read_certificate``)."""
    return read_certificate(path.read_bytes())


def fingerprint(cert_pem: bytes) -> str:
    """``"sha256:<hex>"`` of the first certificate's DER, for logs (``pki.fingerprint``)."""
    return read_certificate(cert_pem).fingerprint


def _read(data: bytes, offset: int) -> tuple[int, bytes, int]:
    """The DER value at ``offset``: its tag, its contents and where the next value starts."""
    if offset + 2 > len(data):
        raise ValueError("DER ends within a value's header")
    tag, first = data[offset], data[offset + 1]
    if tag & 0x1F == 0x1F:
        raise ValueError("DER tag in the high-tag-number form")
    offset += 2
    if first < 0x80:
        length = first
    else:
        count = first & 0x7F
        if count == 0 or count > 4 or offset + count > len(data):
            raise ValueError("DER length is indefinite or too long")
        length = int.from_bytes(data[offset : offset + count], "big")
        if length < 0x80 or data[offset] == 0:
            raise ValueError("DER length is not minimal")
        offset += count
    end = offset + length
    if end > len(data):
        raise ValueError("DER value runs past its container")
    return tag, data[offset:end], end


def _time(tag: int, value: bytes) -> datetime:
    """A UTCTime or GeneralizedTime, as RFC 5280 (4.1.2.5) has certificates write them:
    seconds always, no fraction, ``Z``."""
    if tag == _UTC_TIME and len(value) == 13:
        digits = value[:12]
    elif tag == _GENERALIZED_TIME and len(value) == 15:
        digits = value[:14]
    else:
        raise ValueError("the certificate's validity holds a malformed time")
    if value[-1:] != b"Z" or not digits.isdigit():
        raise ValueError("the certificate's validity holds a malformed time")
    text = digits.decode("ascii")
    if tag == _UTC_TIME:
        year, text = int(text[:2]), text[2:]
        year += 1900 if year >= 50 else 2000
    else:
        year, text = int(text[:4]), text[4:]
    month, day, hour, minute, second = (int(text[i : i + 2]) for i in range(0, 10, 2))
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)
