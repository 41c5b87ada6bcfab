"""The federation's certificate authorities: ECDSA P-256 keys, SHA-256 signatures.

A root CA, whose key is kept offline, signs an issuing (intermediate) CA; only the issuing
CA's key is online, on the coordinator. Peers trust the roots (the trust bundle, ``ca.pem``)
and every certificate the issuing CA hands out carries the issuing CA's certificate after
it, so a peer that trusts only the root verifies the chain. A pki made before the offline
root (one self-signed CA that signs everything) still loads: that CA is its own root.

The issuing CA issues three kinds of certificates:

* a server certificate for the coordinator (DNS/IP SANs only),
* client certificates for operators and tenants (``issue_client``),
* client certificates for joining sites, signed from their CSR (``sign_csr``).

Client certificates always carry the identity the CA decided on, never one the
requester asked for. Private keys are only ever written with 0600 permissions.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Defined where processes without cryptography (site agents) import them; part of this API.
from federation.durable import write_private_file as write_private_file
from federation.durable import write_public_file as write_public_file
from federation.security.cert_info import CLOCK_SKEW as CLOCK_SKEW
from federation.security.cert_info import CaCheckError as CaCheckError
from federation.security.identity import Identity, Role

DEFAULT_CLIENT_LIFETIME = timedelta(days=365)
"""Lifetime of a client certificate when the caller names none."""

MIN_RSA_BITS = 2048
"""Smallest RSA key that ``sign_csr`` accepts."""

_IssuablePublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey


class InvalidCsrError(ValueError):
    """A certificate signing request is malformed, forged, or uses a weak key."""


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_usage(*, digital_signature: bool = False, cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _check_valid_days(valid_days: int) -> None:
    if valid_days <= 0:
        raise ValueError(f"valid_days must be positive, got {valid_days}")


def _check_lifetime(lifetime: timedelta) -> None:
    if lifetime <= timedelta(0):
        raise ValueError(f"a certificate's lifetime must be positive, got {lifetime}")


def _days(valid_days: int) -> timedelta:
    _check_valid_days(valid_days)
    return timedelta(days=valid_days)


def _general_name(san: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(san))
    except ValueError:
        return x509.DNSName(san)


def _check_csr_key(key: object) -> _IssuablePublicKey:
    if isinstance(key, ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, ec.SECP256R1):
            raise InvalidCsrError(f"CSR uses EC curve {key.curve.name}; only P-256 is accepted")
        return key
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < MIN_RSA_BITS:
            raise InvalidCsrError(
                f"CSR uses a {key.key_size}-bit RSA key; at least {MIN_RSA_BITS} bits are required"
            )
        return key
    raise InvalidCsrError(
        f"CSR uses an unsupported {type(key).__name__}; use EC P-256 or RSA >= {MIN_RSA_BITS}"
    )


def is_self_signed(cert: x509.Certificate) -> bool:
    """Whether ``cert`` is a root: issued by itself, under its own key."""
    if cert.issuer != cert.subject:
        return False
    try:
        cert.verify_directly_issued_by(cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Whether ``issuer``'s key signed ``cert`` (names and signature both checked)."""
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def load_bundle(pem: bytes) -> list[x509.Certificate]:
    """Every certificate in a PEM bundle, in order.

    Raises:
        CaCheckError: The bundle holds no certificate or a malformed one.
    """
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise CaCheckError(f"not a PEM certificate bundle: {exc}") from None
    return certs


def bundle_pem(certs: Sequence[x509.Certificate]) -> bytes:
    """The certificates as one PEM bundle, each once, in order."""
    seen: set[bytes] = set()
    out = b""
    for cert in certs:
        der = cert.public_bytes(serialization.Encoding.DER)
        if der not in seen:
            seen.add(der)
            out += _cert_pem(cert)
    return out


def check_ca_certificate(cert: x509.Certificate, what: str) -> None:
    """Refuse a certificate that cannot sign certificates.

    Raises:
        CaCheckError: ``cert`` is no CA (basicConstraints) or may not sign (keyUsage).
    """
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise CaCheckError(f"{what} is not a CA certificate (basicConstraints CA:FALSE)")
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and not usage.key_cert_sign:
        raise CaCheckError(f"{what} may not sign certificates (keyUsage lacks keyCertSign)")
    if cert.not_valid_after_utc <= datetime.now(UTC):
        raise CaCheckError(f"{what} expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")


def _check_key_pair(cert: x509.Certificate, key: object, what: str) -> ec.EllipticCurvePrivateKey:
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CaCheckError(f"{what}'s key is not an EC private key")
    if key.public_key() != cert.public_key():
        raise CaCheckError(f"the key given is not the private key of {what}")
    return key


def load_private_key(pem: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    """An unencrypted EC private key.

    Raises:
        CaCheckError: Malformed, encrypted, or not an EC key.
    """
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise CaCheckError(f"{what} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CaCheckError(f"{what} is not an EC private key")
    return key


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    """A CA: its certificate and signing key; the issuing CA or a root."""

    cert: x509.Certificate
    """The CA certificate: self-signed for a root (or a pki from before the offline root),
    else signed by a root."""
    key: ec.EllipticCurvePrivateKey
    """CA signing key. Never log it."""

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, PEM-encoded."""
        return _cert_pem(self.cert)

    @property
    def chain_pem(self) -> bytes:
        """What follows each certificate this CA issues: its own certificate unless it is a
        root, so peers that trust only the root can build the path."""
        return b"" if is_self_signed(self.cert) else self.cert_pem

    def with_chain(self, cert: x509.Certificate) -> bytes:
        """``cert`` (issued by this CA), then the chain, PEM."""
        return _cert_pem(cert) + self.chain_pem

    @classmethod
    def create(
        cls,
        common_name: str = "federation CA",
        *,
        valid_days: int = 3650,
        signed_by: CertificateAuthority | None = None,
    ) -> CertificateAuthority:
        """Creates a new CA with a fresh P-256 key: a root, or an issuing CA under one.

        Args:
            common_name: Subject common name of the CA certificate.
            valid_days: Lifetime of the CA certificate (never past ``signed_by``'s).
            signed_by: The root that signs it; None makes a self-signed root.

        Returns:
            The new CA.
        """
        _check_valid_days(valid_days)
        key = _new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.now(UTC)
        not_after = now + timedelta(days=valid_days)
        issuer_name, signing_key, aki = name, key, key.public_key()
        # A root may sign one level of issuing CA; an issuing CA signs only leaves.
        path_length = 1
        if signed_by is not None:
            issuer_name, signing_key, aki = (
                signed_by.cert.subject,
                signed_by.key,
                signed_by.key.public_key(),
            )
            not_after = min(not_after, signed_by.cert.not_valid_after_utc)
            path_length = 0
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
            .add_extension(_key_usage(digital_signature=True, cert_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(aki), False)
            .sign(signing_key, hashes.SHA256())
        )
        return cls(cert=cert, key=key)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        """Loads a CA from PEM files.

        Args:
            cert_path: The CA certificate (the first in the file).
            key_path: The CA's unencrypted PKCS#8 EC private key.

        Returns:
            The CA.

        Raises:
            ValueError: If the files are malformed, the key is not an EC key, or
                the key does not belong to the certificate.
        """
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path} does not hold an EC private key")
        if key.public_key() != cert.public_key():
            raise ValueError(f"{key_path} is not the private key of {cert_path}")
        return cls(cert=cert, key=key)

    @classmethod
    def issuing(
        cls, cert_pem: bytes, key_pem: bytes, roots: Sequence[x509.Certificate]
    ) -> CertificateAuthority:
        """An issuing CA from PEM, checked before anything is issued with it.

        Args:
            cert_pem: The issuing CA's certificate (first in the PEM).
            key_pem: Its private key.
            roots: The trust bundle it must chain to (itself, for a pki from before the
                offline root).

        Raises:
            CaCheckError: Malformed; not a CA; expired; the key is not the certificate's;
                or no root in ``roots`` signed it.
        """
        certs = load_bundle(cert_pem)
        if not certs:
            raise CaCheckError("the issuing CA certificate is empty")
        cert = certs[0]
        what = f"issuing CA {cert.subject.rfc4514_string()!r}"
        check_ca_certificate(cert, what)
        key = _check_key_pair(cert, load_private_key(key_pem, what), what)
        if not any(issued_by(cert, root) for root in roots):
            raise CaCheckError(f"{what} is not signed by any root in the trust bundle")
        return cls(cert=cert, key=key)

    def save(self, cert_path: Path, key_path: Path) -> None:
        """Writes the CA certificate (0644) and key (0600) atomically."""
        write_public_file(cert_path, self.cert_pem)
        write_private_file(key_path, _key_pem(self.key))

    def issue_server(self, sans: Sequence[str], *, valid_days: int = 825) -> tuple[bytes, bytes]:
        """Issues a coordinator certificate with a fresh key.

        The certificate is good for both server and client authentication, so a
        coordinator can also dial other federation endpoints with it.

        Args:
            sans: DNS names and/or IP addresses the coordinator is reached by; the
                first one also becomes the subject common name.
            valid_days: Lifetime of the certificate.

        Returns:
            ``(cert_pem, key_pem)``.

        Raises:
            ValueError: If ``sans`` is empty.
        """
        if not sans:
            raise ValueError("a server certificate needs at least one DNS name or IP address")
        key = _new_key()
        cert = (
            self._leaf_builder(sans[0], key.public_key(), _days(valid_days))
            .add_extension(x509.SubjectAlternativeName([_general_name(s) for s in sans]), False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        return self.with_chain(cert), _key_pem(key)

    def issue_client(self, identity: Identity, *, valid_days: int = 365) -> tuple[bytes, bytes]:
        """Issues a client certificate for ``identity`` with a fresh key.

        Args:
            identity: Who the certificate is for.
            valid_days: Lifetime of the certificate.

        Returns:
            ``(cert_pem, key_pem)``.
        """
        key = _new_key()
        cert = self._sign_client(identity, key.public_key(), _days(valid_days))
        return self.with_chain(cert), _key_pem(key)

    def sign_csr(
        self,
        csr_pem: bytes,
        identity: Identity,
        *,
        lifetime: timedelta = DEFAULT_CLIENT_LIFETIME,
    ) -> x509.Certificate:
        """Signs a client certificate for ``identity`` from a CSR.

        Only the CSR's public key is used: the subject and any extensions the CSR
        asks for are ignored, and the certificate names ``identity`` instead.

        Args:
            csr_pem: PEM-encoded PKCS#10 request (see ``make_csr``).
            identity: The identity the CA decided the requester gets.
            lifetime: Lifetime of the certificate (from now; never past the CA's own expiry).

        Returns:
            The signed certificate.

        Raises:
            InvalidCsrError: If the PEM is malformed, the CSR's signature does not
                verify, or its key is not EC P-256 or RSA of at least 2048 bits.
        """
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise InvalidCsrError(f"not a valid PEM certificate signing request: {exc}") from exc
        try:
            public_key = csr.public_key()
            signature_ok = csr.is_signature_valid
        except (UnsupportedAlgorithm, ValueError) as exc:
            raise InvalidCsrError(f"CSR uses an unsupported key or signature: {exc}") from exc
        if not signature_ok:
            raise InvalidCsrError("CSR signature does not verify against its own public key")
        return self._sign_client(identity, _check_csr_key(public_key), lifetime)

    def _sign_client(
        self, identity: Identity, public_key: _IssuablePublicKey, lifetime: timedelta
    ) -> x509.Certificate:
        return (
            self._leaf_builder(str(identity), public_key, lifetime)
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity.uri)]),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
            .sign(self.key, hashes.SHA256())
        )

    def _leaf_builder(
        self, common_name: str, public_key: _IssuablePublicKey, lifetime: timedelta
    ) -> x509.CertificateBuilder:
        """A builder with everything but SANs and EKU; never outlives the CA."""
        _check_lifetime(lifetime)
        now = datetime.now(UTC)
        not_after = min(now + lifetime, self.cert.not_valid_after_utc)
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), False)
            .add_extension(self._authority_key_identifier(), False)
        )

    def _authority_key_identifier(self) -> x509.AuthorityKeyIdentifier:
        try:
            ski = self.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
        except x509.ExtensionNotFound:
            return x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key())
        return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski.value)


def make_csr(identity_hint: str) -> tuple[bytes, bytes]:
    """Makes a fresh P-256 key and a CSR for it, as an agent does before joining.

    Args:
        identity_hint: Subject common name to request (1 to 64 characters); the
            CA ignores it and decides the identity itself.

    Returns:
        ``(key_pem, csr_pem)``.
    """
    key = _new_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity_hint)]))
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def key_pair_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    """Whether ``key_pem`` is the private key of the certificate ``cert_pem``; False for
    either malformed (torn or foreign).

    Raises:
        TypeError: The key is encrypted.
    """
    try:
        certificate = x509.load_pem_x509_certificate(cert_pem)
        private_key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError:
        return False
    return bool(certificate.public_key() == private_key.public_key())


def load_certificate(path: Path) -> x509.Certificate:
    """The PEM certificate in ``path``."""
    return x509.load_pem_x509_certificate(path.read_bytes())


def fingerprint(cert_pem: bytes) -> str:
    """``"sha256:<hex>"`` of the certificate's DER encoding, for logs."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return "sha256:" + cert.fingerprint(hashes.SHA256()).hex()


def public_key_sha256(pem: bytes) -> str:
    """SHA-256 (hex) of the public key (DER) of a PEM certificate or CSR: whether a CSR asks
    for the key a certificate already has.

    Raises:
        ValueError: ``pem`` is neither.
    """
    item: x509.Certificate | x509.CertificateSigningRequest
    if b"CERTIFICATE REQUEST-----" in pem:
        item = x509.load_pem_x509_csr(pem)
    else:
        item = x509.load_pem_x509_certificate(pem)
    der = item.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest = hashes.Hash(hashes.SHA256())
    digest.update(der)
    return digest.finalize().hex()


def serial_hex(cert_pem: bytes) -> str:
    """The certificate's serial number in lowercase hex, for logs."""
    return format(x509.load_pem_x509_certificate(cert_pem).serial_number, "x")


@dataclass(frozen=True, slots=True)
class PkiLayout:
    """Where ``fedctl pki init`` keeps the CAs and the certificates it issues."""

    dir: Path
    """Directory holding every PEM file (0700)."""

    @property
    def ca_cert(self) -> Path:
        """The trust bundle: every root peers accept (the one CA, in a pki from before the
        offline root)."""
        return self.dir / "ca.pem"

    @property
    def ca_key(self) -> Path:
        """The issuing CA's signing key: the one the coordinator holds."""
        return self.dir / "ca-key.pem"

    @property
    def issuing_cert(self) -> Path:
        """The issuing CA's certificate; absent in a pki from before the offline root, where
        ``ca_cert`` is the issuer."""
        return self.dir / "issuing.pem"

    @property
    def root_key(self) -> Path:
        """The root's key: move it offline after ``init`` and bring it back to rotate."""
        return self.dir / "root-key.pem"

    @property
    def server_cert(self) -> Path:
        """The coordinator's server certificate."""
        return self.dir / "coordinator.pem"

    @property
    def server_key(self) -> Path:
        """The coordinator's private key."""
        return self.dir / "coordinator-key.pem"

    def client_cert(self, name: str) -> Path:
        """A client certificate, e.g. ``client_cert("operator-admin")``."""
        return self.dir / f"{name}.pem"

    def client_key(self, name: str) -> Path:
        """A client private key, e.g. ``client_key("operator-admin")``."""
        return self.dir / f"{name}-key.pem"

    def next(self, path: Path) -> Path:
        """Where a rotation puts the new version of ``path`` until the coordinator took it."""
        return path.with_name(f"next-{path.name}")


def _file_stem(identity: Identity) -> str:
    return f"{identity.role}-{identity.name}"


def load_issuer(ca_cert: Path, ca_key: Path, issuing_cert: Path | None) -> CertificateAuthority:
    """The issuing CA: ``issuing_cert`` (default: ``issuing.pem`` beside ``ca_key``) with
    ``ca_key``, or ``ca_cert`` itself when there is no issuing certificate (a pki from before
    the offline root).

    Raises:
        ValueError: The files are malformed or the key is not the certificate's.
    """
    if issuing_cert is None:
        issuing_cert = ca_key.with_name("issuing.pem")  # as 'fedctl pki init' lays them out
    if issuing_cert.exists():
        return CertificateAuthority.load(issuing_cert, ca_key)
    try:
        return CertificateAuthority.load(ca_cert, ca_key)
    except ValueError as err:
        raise ValueError(
            f"{err}, and there is no {issuing_cert}. "
            "To fix: put issuing.pem (from 'fedctl pki init') beside the CA key, or set "
            "issuing_cert"
        ) from None


def init_pki(
    directory: Path, *, server_sans: Sequence[str], operator: str = "admin", force: bool = False
) -> PkiLayout:
    """Creates a root CA, an issuing CA, a coordinator certificate and an operator's.

    Args:
        directory: Where to put the files; created if missing, made 0700 either way.
        server_sans: DNS names and/or IP addresses of the coordinator.
        operator: Name of the first operator; its files are ``operator-<name>.pem``
            and ``operator-<name>-key.pem``.
        force: Replace an existing CA (invalidating everything it issued).

    Returns:
        The layout of the new files.

    Raises:
        FileExistsError: If ``directory`` already holds a CA and ``force`` is false.
        ValueError: If ``server_sans`` is empty or ``operator`` is not a valid name.
    """
    layout = PkiLayout(directory)
    if not force and (layout.ca_cert.exists() or layout.ca_key.exists()):
        raise FileExistsError(
            f"a CA already exists in {directory}; refusing to overwrite it "
            "(use force to replace it, which invalidates every certificate it issued)"
        )
    # Build everything in memory first so bad arguments leave nothing behind.
    operator_identity = Identity(Role.OPERATOR, operator)
    root = CertificateAuthority.create("federation root CA", valid_days=7300)
    ca = CertificateAuthority.create(_issuing_name(), signed_by=root)
    server_cert, server_key = ca.issue_server(server_sans)
    operator_cert, operator_key = ca.issue_client(operator_identity)

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)  # also when it existed with a looser mode: it holds the CA keys
    write_private_file(layout.root_key, _key_pem(root.key))
    write_public_file(layout.ca_cert, root.cert_pem)
    ca.save(layout.issuing_cert, layout.ca_key)
    write_public_file(layout.server_cert, server_cert)
    write_private_file(layout.server_key, server_key)
    stem = _file_stem(operator_identity)
    write_public_file(layout.client_cert(stem), operator_cert)
    write_private_file(layout.client_key(stem), operator_key)
    return layout


def _issuing_name() -> str:
    # Dated, so the old and the new issuing CA read apart in logs and lists.
    return f"federation issuing CA {datetime.now(UTC):%Y-%m-%d %H:%M:%S}"


def issue_client_files(layout: PkiLayout, identity: Identity) -> tuple[Path, Path]:
    """Issues a client certificate from the layout's issuing CA and writes it beside it.

    Files are named ``<role>-<name>.pem`` (0644) and ``<role>-<name>-key.pem`` (0600);
    existing files for the same identity are replaced.

    Args:
        layout: A layout created by ``init_pki``.
        identity: Who the certificate is for.

    Returns:
        ``(cert_path, key_path)``.
    """
    ca = load_issuer(layout.ca_cert, layout.ca_key, layout.issuing_cert)
    cert_pem, key_pem = ca.issue_client(identity)
    stem = _file_stem(identity)
    cert_path, key_path = layout.client_cert(stem), layout.client_key(stem)
    write_public_file(cert_path, cert_pem)
    write_private_file(key_path, key_pem)
    return cert_path, key_path


@dataclass(frozen=True, slots=True)
class PreparedRotation:
    """A new issuing CA made offline, and the trust bundle that goes with it."""

    issuing: CertificateAuthority
    """The new issuing CA."""
    bundle_pem: bytes
    """The roots peers trust from now on: the old ones and, with a new root, that one."""
    new_root: CertificateAuthority | None
    """The new root when one was made; its key belongs offline."""


def prepare_rotation(
    layout: PkiLayout, *, root_key: Path | None = None, new_root: bool = False
) -> PreparedRotation:
    """Makes a new issuing CA signed by the root (or by a new root), in memory.

    Args:
        layout: The pki whose trust bundle the root must be in.
        root_key: The root's key, brought back from offline; default ``layout.root_key``, or
            for a pki from before the offline root, its one CA's key (``ca-key.pem``).
        new_root: Make a new root too and sign with it; the old root stays in the bundle
            until the old CA is retired. The root key then only proves the operator holds
            the current root.

    Raises:
        CaCheckError: The root key is no key of a root in the trust bundle.
    """
    roots = load_bundle(layout.ca_cert.read_bytes())
    key_path = root_key or (layout.root_key if layout.root_key.exists() else layout.ca_key)
    key = load_private_key(key_path.read_bytes(), f"root key {key_path}")
    root_cert = next((r for r in roots if r.public_key() == key.public_key()), None)
    if root_cert is None:
        raise CaCheckError(
            f"{key_path} is not the key of any root in {layout.ca_cert}. To fix: bring back "
            "the root key that 'fedctl pki init' wrote (root-key.pem)"
        )
    root = CertificateAuthority(cert=root_cert, key=key)
    constraints = root_cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    if not new_root and constraints.path_length == 0:
        # Peers would refuse every chain through an issuing CA under it.
        raise CaCheckError(
            f"the root in {layout.ca_cert} may not sign an issuing CA (pathLen 0: a pki made "
            "before the offline root). To fix: rotate with --new-root"
        )
    made = None
    if new_root:
        made = CertificateAuthority.create(
            f"federation root CA {datetime.now(UTC):%Y-%m-%d %H:%M:%S}", valid_days=7300
        )
        root = made
    issuing = CertificateAuthority.create(_issuing_name(), signed_by=root)
    return PreparedRotation(issuing, bundle_pem([*roots, root.cert]), made)


def write_prepared(layout: PkiLayout, rotation: PreparedRotation) -> None:
    """Writes a prepared rotation as ``next-*`` files, the current files left alone."""
    write_public_file(layout.next(layout.issuing_cert), rotation.issuing.cert_pem)
    write_private_file(layout.next(layout.ca_key), _key_pem(rotation.issuing.key))
    write_public_file(layout.next(layout.ca_cert), rotation.bundle_pem)
    if rotation.new_root is not None:
        write_private_file(layout.next(layout.root_key), _key_pem(rotation.new_root.key))


def discard_prepared(layout: PkiLayout) -> None:
    """Removes the ``next-*`` files of a rotation the coordinator refused."""
    for path in (layout.issuing_cert, layout.ca_key, layout.ca_cert, layout.root_key):
        layout.next(path).unlink(missing_ok=True)


def promote_prepared(layout: PkiLayout) -> None:
    """Moves the ``next-*`` files of a rotation the coordinator took into place.

    A pki from before the offline root keeps its one CA's key as the root key; a replaced
    root key is kept beside it as ``root-key.pem.old`` until the old root is retired.
    """
    if not layout.issuing_cert.exists() and not layout.root_key.exists():
        os.link(layout.ca_key, layout.root_key)  # the old CA is the root from now on
    next_root = layout.next(layout.root_key)
    if next_root.exists():
        os.replace(layout.root_key, layout.root_key.with_name("root-key.pem.old"))
        os.replace(next_root, layout.root_key)
    for path in (layout.issuing_cert, layout.ca_key, layout.ca_cert):
        os.replace(layout.next(path), path)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """A private key as unencrypted PKCS#8 PEM."""
    return _key_pem(key)
