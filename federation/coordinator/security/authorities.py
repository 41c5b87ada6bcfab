"""The CAs in force, and rolling them over with no restart and no session lost.

The roots peers trust (the trust bundle), the issuing CA every new certificate comes from, and
the earlier issuing CAs whose certificates are still accepted. A rollover goes:

1. ``rotate``: a new issuing CA (made offline under a root, maybe a new one) takes over
   issuing; a new root joins the bundle; every connected agent is told the bundle. The old
   CA's certificates are still accepted, and renewals move everyone onto the new one.
2. ``retire``: the coordinator serves a server certificate of the new CA (new TLS handshakes
   get it at once: the server credentials are dynamic), roots no longer needed leave the
   bundle, and every call with a certificate of a retired CA is refused.

Streams already open when a CA is retired run on: their peer was verified when they began,
and cutting them would lose the very sessions a rollover must keep (revoke a certificate to
end its streams). Once a rollover began, the state lives in the store, written in one commit
with its audit entry. Every coordinator of an HA group reads it before it serves and then
follows it from the store's watch (``follow``), leader or not, as it follows revocations: its
bundle, its issuing CA (for when it leads) and the retired-CA check are current within a
moment, and a coordinator whose own server certificate is of a retired CA issues itself one of
the current CA (same names) and serves it at once, with no restart.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from google.protobuf.message import DecodeError

from federation.api.v1 import certificate_service_pb2 as pb
from federation.api.v1 import records_pb2
from federation.coordinator import audit
from federation.errors import (
    CertificateAuthorityRetiredError,
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
)
from federation.security.key_pair_files import replace_key_pair
from federation.security.pki import (
    CaCheckError,
    CertificateAuthority,
    bundle_pem,
    check_ca_certificate,
    fingerprint,
    issued_by,
    key_pem,
    load_bundle,
    load_issuer,
)
from federation.store import Put, Store, WatchEvent, WatchEventType
from federation.store.follow import follow as follow_prefix

log = structlog.get_logger()

AUTHORITIES = "/pki/authorities"
"""Where the CAs in force are kept once a rollover began."""
ROTATE = "pki.rotate-ca"
"""The audit action of introducing a new issuing CA."""
RETIRE = "pki.retire-ca"
"""The audit action of retiring the older issuing CAs."""
SERVER_CERTIFICATE_DAYS = 825


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass
class _State:
    """One consistent version of everything a TLS handshake or a signature needs."""

    roots: list[x509.Certificate]
    issuer: CertificateAuthority
    previous: list[x509.Certificate] = field(default_factory=list)
    retired_roots: list[x509.Certificate] = field(default_factory=list)

    @property
    def bundle_pem(self) -> bytes:
        return bundle_pem(self.roots)

    @property
    def handshake_roots_pem(self) -> bytes:
        """Roots asked of clients: the bundle and the retired ones (refused by the check)."""
        return bundle_pem([*self.roots, *self.retired_roots])

    def record(self) -> records_pb2.CertificateAuthorities:
        return records_pb2.CertificateAuthorities(
            trust_bundle_pem=self.bundle_pem,
            issuing_ca_pem=self.issuer.cert_pem,
            issuing_key_pem=key_pem(self.issuer.key),
            previous_issuers_pem=[_pem(c) for c in self.previous],
            retired_roots_pem=[_pem(c) for c in self.retired_roots],
        )

    @classmethod
    def of(cls, record: records_pb2.CertificateAuthorities) -> _State:
        roots = load_bundle(record.trust_bundle_pem)
        issuer = CertificateAuthority.issuing(record.issuing_ca_pem, record.issuing_key_pem, roots)
        return cls(
            roots,
            issuer,
            [x509.load_pem_x509_certificate(p) for p in record.previous_issuers_pem],
            [x509.load_pem_x509_certificate(p) for p in record.retired_roots_pem],
        )


class Authorities:
    """The CAs in force; outlives leadership terms, like the revocation book.

    Args:
        roots: The trust bundle.
        issuer: The issuing CA.
        server_cert: The coordinator's server certificate file (rewritten by a retirement).
        server_key: Its key file.
    """

    def __init__(
        self,
        roots: Sequence[x509.Certificate],
        issuer: CertificateAuthority,
        server_cert: Path,
        server_key: Path,
    ) -> None:
        self._state = _State(list(roots), issuer)
        self._server_files = (server_cert, server_key)
        self._server_pair = (server_key.read_bytes(), server_cert.read_bytes())
        self._generation = 0
        self._revision = 0
        """The store revision of the state in force (or the one it was read at)."""
        self._changing = asyncio.Lock()
        """Held while a rollover commits and takes its state in, so the watch never does first."""
        self._bundle_listeners: list[Callable[[bytes], int]] = []

    @classmethod
    async def load(
        cls,
        store: Store,
        *,
        ca_cert: Path,
        ca_key: Path,
        issuing_cert: Path | None,
        server_cert: Path,
        server_key: Path,
    ) -> Authorities:
        """The CAs of the stored rollover, else those of the files."""
        authorities = cls.from_files(ca_cert, ca_key, issuing_cert, server_cert, server_key)
        await authorities._read(store)
        return authorities

    @classmethod
    def from_files(
        cls,
        ca_cert: Path,
        ca_key: Path,
        issuing_cert: Path | None,
        server_cert: Path,
        server_key: Path,
    ) -> Authorities:
        """The CAs of the coordinator's files (as ``fedctl pki init`` wrote them)."""
        roots = load_bundle(ca_cert.read_bytes())
        return cls(roots, load_issuer(ca_cert, ca_key, issuing_cert), server_cert, server_key)

    @property
    def issuer(self) -> CertificateAuthority:
        """The CA that signs every certificate issued now."""
        return self._state.issuer

    @property
    def bundle_pem(self) -> bytes:
        """Every root peers should trust now."""
        return self._state.bundle_pem

    @property
    def accepted_issuers(self) -> list[x509.Certificate]:
        """Issuing CAs whose certificates are accepted, the newest first."""
        return [self._state.issuer.cert, *self._state.previous]

    def on_bundle_change(self, tell: Callable[[bytes], int]) -> Callable[[], None]:
        """Call ``tell(bundle)`` after each change (it answers how many it told); returns
        the function that stops it (a term ends)."""
        self._bundle_listeners.append(tell)
        return lambda: self._bundle_listeners.remove(tell)

    def server_credentials(self, *, require_client_auth: bool = True) -> grpc.ServerCredentials:
        """TLS credentials that follow the rollover: each new handshake gets the server
        certificate and the client roots in force, with no restart."""
        seen = [self._generation]

        def configuration() -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration(
                [self._server_pair], root_certificates=self._state.handshake_roots_pem
            )

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # Called by gRPC before every handshake: answer None unless something changed.
            if seen[0] == self._generation:
                return None
            seen[0] = self._generation
            return configuration()

        # gRPC's stub says the fetcher must return a configuration; None (no change) is the
        # documented answer.
        fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], fetch)
        return grpc.dynamic_ssl_server_credentials(
            configuration(), fetcher, require_client_authentication=require_client_auth
        )

    def check(self, cert_pem: bytes) -> None:
        """Refuse a peer certificate that no accepted issuing CA issued.

        Raises:
            CertificateAuthorityRetiredError: Its CA was retired.
        """
        if not _issued_by_any(cert_pem, self._generation, tuple(self.accepted_issuers)):
            cert = x509.load_pem_x509_certificate(cert_pem)
            raise CertificateAuthorityRetiredError(
                f"{cert.serial_number:x}", cert.issuer.rfc4514_string()
            )

    async def follow(self, store: Store) -> None:
        """Keep the CAs current from the store's watch, until cancelled (every coordinator).

        A broken watch (the store restarting, history compacted) reads the CAs again.
        """

        async def apply(event: WatchEvent) -> None:
            if event.kv.key == AUTHORITIES and event.type is WatchEventType.PUT:
                async with self._changing:
                    self._follow(event.kv.value, event.kv.mod_revision)

        await follow_prefix(
            store,
            AUTHORITIES,
            self._revision,
            apply,
            lambda: self._read(store),
            "certificate_authorities",
        )

    async def _read(self, store: Store) -> int:
        """Take the stored CAs in, if a rollover began; returns the revision read at or after."""
        revision = await store.revision()
        kv = await store.get(AUTHORITIES)
        async with self._changing:
            if kv is not None:
                self._follow(kv.value, kv.mod_revision)
            self._revision = max(self._revision, revision)
        return revision

    def _follow(self, value: bytes, revision: int) -> None:
        """Take in a state a coordinator committed (this one or another), unless older than
        or the same as the one in force."""
        if revision <= self._revision:
            return  # this coordinator's own commit, or one it read already
        self._revision = revision
        try:
            record = records_pb2.CertificateAuthorities.FromString(value)
            if record == self._state.record():
                return
            state = _State.of(record)
        except (DecodeError, CaCheckError, ValueError) as err:
            log.error("certificate_authorities_unreadable", revision=revision, error=str(err))
            return
        accepted = [state.issuer.cert, *state.previous]
        served = x509.load_pem_x509_certificate(self._server_pair[1])
        if not any(issued_by(served, issuer) for issuer in accepted):
            cert, key = self._issue_server_certificate(state.issuer)
            try:
                self._write_server_certificate(cert, key)
            except OSError as err:  # served all the same; the next start issues one again
                log.error("server_certificate_not_written", error=str(err))
            self._server_pair = (key, cert)
            log.warning("server_certificate_replaced", server=fingerprint(cert))
        self._changed(state)
        log.info(
            "certificate_authorities_followed",
            issuing=_fingerprint(state.issuer.cert),
            revision=revision,
        )

    def _issue_server_certificate(self, issuer: CertificateAuthority) -> tuple[bytes, bytes]:
        """A server certificate of ``issuer`` with the names of the one served now."""
        current = x509.load_pem_x509_certificate(self._server_pair[1])
        sans = current.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(n.value) for n in sans]
        return issuer.issue_server(names, valid_days=SERVER_CERTIFICATE_DAYS)

    def _write_server_certificate(self, cert: bytes, key: bytes) -> None:
        """The files too, so a restarted coordinator serves a certificate peers still trust."""
        replace_key_pair(*self._server_files, cert, key)

    def _changed(self, state: _State) -> int:
        self._state = state
        self._generation += 1
        told = 0
        for tell in list(self._bundle_listeners):
            told += tell(state.bundle_pem)
        return told

    async def rotate(
        self, store: Store, by: str, request: pb.RotateCertificateAuthorityRequest
    ) -> pb.RotateCertificateAuthorityResponse:
        """Introduce a new issuing CA; the old ones stay accepted until retired.

        Raises:
            InvalidArgumentError: Not a CA, its key is not the certificate's, it chains to no
                root of the bundle (or of ``new_roots_pem``), or it is in use already.
        """
        async with self._changing:
            return await self._rotate(store, by, request)

    async def _rotate(
        self, store: Store, by: str, request: pb.RotateCertificateAuthorityRequest
    ) -> pb.RotateCertificateAuthorityResponse:
        state = self._state
        try:
            new_roots = load_bundle(request.new_roots_pem) if request.new_roots_pem else []
            for root in new_roots:
                check_ca_certificate(root, f"new root {root.subject.rfc4514_string()!r}")
            roots = [*state.roots, *(r for r in new_roots if r not in state.roots)]
            issuer = CertificateAuthority.issuing(
                request.issuing_ca_pem, request.issuing_key_pem, roots
            )
        except CaCheckError as err:
            raise InvalidArgumentError([FieldViolation("issuing_ca_pem", str(err))]) from None
        if issuer.cert in self.accepted_issuers:
            raise InvalidArgumentError(
                [FieldViolation("issuing_ca_pem", "this issuing CA is in use already")]
            )
        new = _State(roots, issuer, [state.issuer.cert, *state.previous], state.retired_roots)
        fp = _fingerprint(issuer.cert)
        detail = f"issuing CA {issuer.cert.subject.rfc4514_string()}"
        if new_roots:
            detail += f", new root(s) {', '.join(_fingerprint(r) for r in new_roots)}"
        self._revision = await store.commit(
            [
                Put(AUTHORITIES, new.record().SerializeToString()),
                audit.entry(by, ROTATE, fp, detail),
            ]
        )
        told = self._changed(new)
        log.warning("certificate_authority_rotated", issuing=fp, by=by, sites_told=told)
        return pb.RotateCertificateAuthorityResponse(
            trust_bundle_pem=new.bundle_pem, issuing_fingerprint=fp, sites_told=told
        )

    async def retire(self, store: Store, by: str) -> pb.RetireCertificateAuthoritiesResponse:
        """Serve a server certificate of the newest CA, retire the others and the roots only
        they needed.

        Raises:
            FailedPreconditionError: There is only one issuing CA: nothing to retire.
        """
        async with self._changing:
            return await self._retire(store, by)

    async def _retire(self, store: Store, by: str) -> pb.RetireCertificateAuthoritiesResponse:
        state = self._state
        if not state.previous:
            raise FailedPreconditionError(
                "there is only one issuing CA, the one in use; nothing to retire. To fix: "
                "introduce a new one first ('fedctl pki rotate-ca')"
            )
        needed = [r for r in state.roots if issued_by(state.issuer.cert, r)]
        dropped = [r for r in state.roots if r not in needed]
        new = _State(needed, state.issuer, [], [*state.retired_roots, *dropped])
        server_cert, server_key = self._issue_server_certificate(state.issuer)
        retired = [_fingerprint(c) for c in state.previous]
        self._revision = await store.commit(
            [
                Put(AUTHORITIES, new.record().SerializeToString()),
                audit.entry(
                    by,
                    RETIRE,
                    ",".join(retired),
                    f"{len(retired)} issuing CA(s) and {len(dropped)} root(s) retired; "
                    f"server certificate {fingerprint(server_cert)}",
                ),
            ]
        )
        self._write_server_certificate(server_cert, server_key)
        self._server_pair = (server_key, server_cert)
        told = self._changed(new)
        log.warning("certificate_authorities_retired", retired=retired, by=by, sites_told=told)
        return pb.RetireCertificateAuthoritiesResponse(
            trust_bundle_pem=new.bundle_pem,
            retired_fingerprints=retired,
            server_fingerprint=fingerprint(server_cert),
            sites_told=told,
        )

    def trust_bundle(self) -> pb.GetTrustBundleResponse:
        state = self._state
        return pb.GetTrustBundleResponse(
            trust_bundle_pem=state.bundle_pem,
            issuing_ca_pem=state.issuer.cert_pem,
            accepted_issuers_pem=[_pem(c) for c in self.accepted_issuers],
        )


def _fingerprint(cert: x509.Certificate) -> str:
    return fingerprint(_pem(cert))


@functools.lru_cache(maxsize=4096)
def _issued_by_any(cert_pem: bytes, generation: int, issuers: tuple[x509.Certificate, ...]) -> bool:
    """Checked once per certificate and version of the CAs: a signature check per call would
    cost more than the call."""
    del generation  # part of the cache key only
    cert = x509.load_pem_x509_certificate(cert_pem)
    return any(issued_by(cert, issuer) for issuer in issuers)
