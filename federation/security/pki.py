"""The federation's certificate authority: ECDSA P-256 keys, SHA-256 signatures.

The CA issues three kinds of certificates:

* a server certificate for the coordinator (DNS/IP SANs only),
* client certificates for operators and tenants (``issue_client``),
* client certificates for joining sites, signed from their CSR (``sign_csr``).

Client certificates always carry the identity the CA decided on, never one the
requester asked for. Private keys are only ever written with 0600 permissions.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from federation.security.identity import Identity, Role

CLOCK_SKEW = timedelta(minutes=5)
"""How far in the past every certificate's validity starts, to tolerate clock skew."""

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


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    """The federation's root CA: its certificate and signing key."""

    cert: x509.Certificate
    """Self-signed CA certificate; the trust bundle every peer is given."""
    key: ec.EllipticCurvePrivateKey
    """CA signing key. Never log or transmit it."""

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate, PEM-encoded."""
        return _cert_pem(self.cert)

    @classmethod
    def create(
        cls, common_name: str = "federation CA", *, valid_days: int = 3650
    ) -> CertificateAuthority:
        """Creates a new self-signed CA with a fresh P-256 key.

        Args:
            common_name: Subject common name of the CA certificate.
            valid_days: Lifetime of the CA certificate.

        Returns:
            The new CA.
        """
        _check_valid_days(valid_days)
        key = _new_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.now(UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(digital_signature=True, cert_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), False
            )
            .sign(key, hashes.SHA256())
        )
        return cls(cert=cert, key=key)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> CertificateAuthority:
        """Loads a CA from PEM files.

        Args:
            cert_path: The CA certificate.
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
        return _cert_pem(cert), _key_pem(key)

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
        return _cert_pem(cert), _key_pem(key)

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


def load_certificate(path: Path) -> x509.Certificate:
    """The PEM certificate in ``path``."""
    return x509.load_pem_x509_certificate(path.read_bytes())


def fingerprint(cert_pem: bytes) -> str:
    """``"sha256:<hex>"`` of the certificate's DER encoding, for logs."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return "sha256:" + cert.fingerprint(hashes.SHA256()).hex()


def serial_hex(cert_pem: bytes) -> str:
    """The certificate's serial number in lowercase hex, for logs."""
    return format(x509.load_pem_x509_certificate(cert_pem).serial_number, "x")


def write_private_file(path: Path, data: bytes) -> None:
    """Atomically writes ``data`` to ``path`` with 0600 permissions (keys, agent certs)."""
    _atomic_write(path, data, 0o600)


def write_public_file(path: Path, data: bytes) -> None:
    """Atomically writes ``data`` to ``path`` with 0644 permissions (certificates)."""
    _atomic_write(path, data, 0o644)


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    """Writes a temp file in the same directory (never readable by others), then renames it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True, slots=True)
class PkiLayout:
    """Where ``fedctl pki init`` keeps the CA and the certificates it issues."""

    dir: Path
    """Directory holding every PEM file (0700)."""

    @property
    def ca_cert(self) -> Path:
        """The CA certificate (the trust bundle)."""
        return self.dir / "ca.pem"

    @property
    def ca_key(self) -> Path:
        """The CA signing key."""
        return self.dir / "ca-key.pem"

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


def _file_stem(identity: Identity) -> str:
    return f"{identity.role}-{identity.name}"


def init_pki(
    directory: Path, *, server_sans: Sequence[str], operator: str = "admin", force: bool = False
) -> PkiLayout:
    """Creates a CA, a coordinator certificate and a first operator certificate.

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
    ca = CertificateAuthority.create()
    server_cert, server_key = ca.issue_server(server_sans)
    operator_cert, operator_key = ca.issue_client(operator_identity)

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)  # also when it existed with a looser mode: it holds the CA key
    ca.save(layout.ca_cert, layout.ca_key)
    write_public_file(layout.server_cert, server_cert)
    write_private_file(layout.server_key, server_key)
    stem = _file_stem(operator_identity)
    write_public_file(layout.client_cert(stem), operator_cert)
    write_private_file(layout.client_key(stem), operator_key)
    return layout


def issue_client_files(layout: PkiLayout, identity: Identity) -> tuple[Path, Path]:
    """Issues a client certificate from the layout's CA and writes it next to the CA.

    Files are named ``<role>-<name>.pem`` (0644) and ``<role>-<name>-key.pem`` (0600);
    existing files for the same identity are replaced.

    Args:
        layout: A layout created by ``init_pki``.
        identity: Who the certificate is for.

    Returns:
        ``(cert_path, key_path)``.
    """
    ca = CertificateAuthority.load(layout.ca_cert, layout.ca_key)
    cert_pem, key_pem = ca.issue_client(identity)
    stem = _file_stem(identity)
    cert_path, key_path = layout.client_cert(stem), layout.client_key(stem)
    write_public_file(cert_path, cert_pem)
    write_private_file(key_path, key_pem)
    return cert_path, key_path
