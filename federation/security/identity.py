"""Who a peer is: roles, names and their SPIFFE-style URIs.

Every client certificate the federation issues carries exactly one URI SAN of
the form ``spiffe://federation/<role>/<name>``; that URI, not the subject
common name, is the authoritative identity of the peer.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

TRUST_DOMAIN = "federation"
"""Trust domain of every identity URI the federation issues or accepts."""

NAME_PATTERN = re.compile(r"\A[a-z0-9][a-z0-9-]{0,62}\Z")
"""Allowed names: a DNS-label-like string of 1 to 63 lowercase letters, digits and '-',
starting with a letter or digit."""

_NAME_RULE = (
    "1 to 63 lowercase letters, digits or '-', starting with a letter or digit "
    f"(pattern {NAME_PATTERN.pattern!r})"
)
_SPIFFE_SCHEME = "spiffe://"


class InvalidIdentityError(ValueError):
    """An identity, identity URI or certificate identity is malformed or not ours."""


class Role(enum.StrEnum):
    """What kind of principal an identity names."""

    SITE = "site"
    OPERATOR = "operator"
    TENANT = "tenant"


@dataclass(frozen=True, slots=True)
class Identity:
    """A principal of the federation, e.g. ``site:edge-7``.

    Raises:
        InvalidIdentityError: On construction, if the role is not a Role or the
            name does not match NAME_PATTERN.
    """

    role: Role
    """Kind of principal."""
    name: str
    """Name of the principal, unique within its role (see NAME_PATTERN)."""

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise InvalidIdentityError(
                f"role must be a Role ({', '.join(Role)}), got {self.role!r}"
            )
        validate_name(self.name)

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"

    @property
    def uri(self) -> str:
        """The SPIFFE-style URI SAN that certificates for this identity carry."""
        return f"{_SPIFFE_SCHEME}{TRUST_DOMAIN}/{self.role}/{self.name}"


def validate_name(name: str, field: str = "name") -> None:
    """Checks that ``name`` is an acceptable principal name.

    Args:
        name: The candidate name.
        field: What the name is called in the error message (e.g. "site name").

    Raises:
        InvalidIdentityError: If the name does not match NAME_PATTERN.
    """
    if not isinstance(name, str) or NAME_PATTERN.match(name) is None:
        raise InvalidIdentityError(f"invalid {field} {name!r}: must be {_NAME_RULE}")


def parse_identity(uri: str) -> Identity:
    """Parses an identity URI of the form ``spiffe://federation/<role>/<name>``.

    Args:
        uri: The URI, typically taken from a certificate's URI SAN.

    Returns:
        The identity the URI names.

    Raises:
        InvalidIdentityError: If the URI is not a SPIFFE URI, names another trust
            domain, or has an unknown role or an invalid name.
    """
    if not uri.startswith(_SPIFFE_SCHEME):
        raise InvalidIdentityError(
            f"invalid identity URI {uri!r}: expected {_SPIFFE_SCHEME}{TRUST_DOMAIN}/<role>/<name>"
        )
    parts = uri.removeprefix(_SPIFFE_SCHEME).split("/")
    if len(parts) != 3:
        raise InvalidIdentityError(
            f"invalid identity URI {uri!r}: expected {_SPIFFE_SCHEME}{TRUST_DOMAIN}/<role>/<name>"
        )
    domain, role, name = parts
    if domain != TRUST_DOMAIN:
        raise InvalidIdentityError(
            f"identity URI {uri!r} belongs to trust domain {domain!r}, not {TRUST_DOMAIN!r}"
        )
    try:
        parsed_role = Role(role)
    except ValueError:
        raise InvalidIdentityError(
            f"identity URI {uri!r} has unknown role {role!r} (expected one of {', '.join(Role)})"
        ) from None
    validate_name(name, f"{parsed_role} name")
    return Identity(parsed_role, name)


@functools.lru_cache(maxsize=4096)
def identity_from_certificate(pem: bytes) -> Identity:
    """Reads the identity from the URI SAN of a PEM certificate.

    The certificate must carry exactly one ``spiffe://`` URI SAN and it must belong
    to our trust domain. The certificate's chain is *not* checked here; the TLS
    handshake does that. Results are cached (certificates are immutable).

    Args:
        pem: The PEM-encoded certificate, e.g. from the gRPC auth context.

    Returns:
        The identity the certificate was issued to.

    Raises:
        InvalidIdentityError: If the PEM is malformed or the certificate does not
            carry exactly one valid identity URI.
    """
    from cryptography import x509  # here: a site agent, which reads no peer's, never loads it

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise InvalidIdentityError(f"not a valid PEM certificate: {exc}") from exc
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise InvalidIdentityError("certificate has no subjectAltName extension") from None
    uris = [
        uri
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier)
        if uri.startswith(_SPIFFE_SCHEME)
    ]
    if len(uris) != 1:
        raise InvalidIdentityError(
            f"certificate must carry exactly one {_SPIFFE_SCHEME} URI SAN, found {len(uris)}"
        )
    return parse_identity(uris[0])
