"""``fedctl pki renew|revoke|list|crl|rotate-ca|retire-ca|trust-bundle``: the coordinator's
certificates, revocations and CAs, online."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from rich.table import Table

from federation.api.v1 import certificate_service_pb2 as pb
from federation.api.v1 import certificate_service_pb2_grpc as pb_grpc
from federation.api.v1 import records_pb2
from federation.cli.connection import CliError
from federation.cli.output import message_data, output_of, show
from federation.cli.render import text, time_left, utc_time
from federation.connection import Connection
from federation.security.identity import InvalidIdentityError, identity_from_certificate
from federation.security.key_pair_files import finish_replacement, replace_key_pair
from federation.security.pki import (
    PkiLayout,
    discard_prepared,
    key_pem,
    make_csr,
    prepare_rotation,
    promote_prepared,
    write_prepared,
    write_public_file,
)


def add_parsers(pki_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    renew = pki_sub.add_parser(
        "renew",
        help="renew the certificate fedctl connects with (--cert, --key): a new key, a new "
        "expiry; both files are replaced (0600)",
    )
    renew.set_defaults(func=cmd_renew)
    revoke = pki_sub.add_parser(
        "revoke", help="revoke a certificate, or every certificate of an identity up to now"
    )
    target = revoke.add_mutually_exclusive_group(required=True)
    target.add_argument("--serial", help="one certificate, by its serial in hex")
    target.add_argument("--site", help="every certificate of this site issued up to now")
    target.add_argument("--tenant", help="every certificate of this tenant issued up to now")
    target.add_argument("--operator", help="every certificate of this operator issued up to now")
    revoke.add_argument("--reason", required=True, help="why, for the audit trail")
    revoke.set_defaults(func=cmd_revoke)
    listing = pki_sub.add_parser("list", help="issued certificates with their state, revocations")
    listing.add_argument("--identity", default="", help="only this identity's, e.g. site:edge-1")
    listing.add_argument("--limit", type=int, default=100, help="at most this many (max 1000)")
    listing.add_argument("--page-token", default="", help="go on from where a page ended")
    listing.set_defaults(func=cmd_list)
    crl = pki_sub.add_parser("crl", help="the revocations as an X.509 CRL (PEM) signed by the CA")
    crl.add_argument("--file", type=Path, help="write it here (default: print it)")
    crl.set_defaults(func=cmd_crl)
    rotate = pki_sub.add_parser(
        "rotate-ca",
        help="make a new issuing CA with the root key (offline) and hand it to the coordinator; "
        "the old CA's certificates stay accepted until 'fedctl pki retire-ca'",
    )
    rotate.add_argument(
        "--root-key",
        type=Path,
        help="the root's key, brought back from offline (default: root-key.pem in --pki-dir)",
    )
    rotate.add_argument(
        "--new-root", action="store_true", help="also make a new root; the bundle holds both"
    )
    rotate.set_defaults(func=cmd_rotate_ca)
    retire = pki_sub.add_parser(
        "retire-ca",
        help="retire every issuing CA but the newest: the coordinator serves a certificate of "
        "the newest, and certificates of the others are refused",
    )
    retire.set_defaults(func=cmd_retire_ca)
    bundle = pki_sub.add_parser(
        "trust-bundle", help="the roots the federation trusts now (PEM), for clients to keep"
    )
    bundle.add_argument(
        "--file", type=Path, help="write it here, e.g. the CA file fedctl uses (default: print)"
    )
    bundle.set_defaults(func=cmd_trust_bundle)


def _revoke_request(args: argparse.Namespace) -> pb.RevokeCertificatesRequest:
    if args.serial:
        return pb.RevokeCertificatesRequest(serial_hex=args.serial, reason=args.reason)
    role = next(r for r in ("site", "tenant", "operator") if getattr(args, r))
    identity = f"{role}:{getattr(args, role)}"
    return pb.RevokeCertificatesRequest(identity=identity, reason=args.reason)


async def cmd_revoke(args: argparse.Namespace, conn: Connection) -> int:
    request = _revoke_request(args)
    async with conn.channel() as channel:
        reply = await pb_grpc.CertificateServiceStub(channel).RevokeCertificates(request)
    out = output_of(args)
    if out.is_data:
        out.messages(reply)
        return 0
    target = reply.revocation.serial_hex or reply.revocation.identity
    serials = ", ".join(reply.serials) or "none"
    show(
        text(f"revoked {target} at {utc_time(reply.revocation.revoked_at)} UTC"),
        text(f"recorded certificates revoked: {serials}", "dim"),
    )
    return 0


def certificate_state(cert: records_pb2.IssuedCertificate, now: float) -> str:
    if cert.revoked:
        return "revoked"
    return "expired" if cert.not_after.seconds < now else "active"


async def cmd_list(args: argparse.Namespace, conn: Connection) -> int:
    request = pb.ListCertificatesRequest(
        limit=max(args.limit, 0), page_token=args.page_token, identity=args.identity
    )
    async with conn.channel() as channel:
        reply = await pb_grpc.CertificateServiceStub(channel).ListCertificates(request)
    now = time.time()
    out = output_of(args)
    if out.is_data:
        certs = message_data(list(reply.certificates))
        assert isinstance(certs, list)
        for data, cert in zip(certs, reply.certificates, strict=True):
            data["state"] = certificate_state(cert, now)
        out.data(
            {
                "certificates": certs,
                "revocations": message_data(list(reply.revocations)),
                "next_page_token": reply.next_page_token,
            }
        )
        return 0
    show(certificates_table(reply.certificates, now))
    if reply.revocations:
        show(revocations_table(reply.revocations))
    if reply.next_page_token:
        show(text(f"more: fedctl pki list --page-token {reply.next_page_token}"))
    return 0


def certificates_table(certs: Iterable[records_pb2.IssuedCertificate], now: float) -> Table:
    table = Table(title=text("Certificates the coordinator issued (newest first, UTC)"))
    for column in ("serial", "identity", "issued", "expires", "state"):
        table.add_column(column, overflow="fold")
    for cert in certs:
        cells = (
            cert.serial_hex,
            cert.identity,
            utc_time(cert.issued_at),
            utc_time(cert.not_after),
            certificate_state(cert, now),
        )
        table.add_row(*map(text, cells))
    return table


def revocations_table(revocations: Iterable[records_pb2.Revocation]) -> Table:
    table = Table(title=text("Revocations (newest first, UTC)"))
    for column in ("revoked", "certificates", "by", "reason"):
        table.add_column(column, overflow="fold")
    for r in revocations:
        what = f"serial {r.serial_hex}" if r.serial_hex else f"{r.identity}, issued up to then"
        table.add_row(*map(text, (utc_time(r.revoked_at), what, r.revoked_by, r.reason)))
    return table


async def cmd_crl(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = pb_grpc.CertificateServiceStub(channel)
        reply = await stub.GetRevocationList(pb.GetRevocationListRequest())
    return _print_or_write(args.file, reply.crl_pem, "CRL")


async def cmd_renew(args: argparse.Namespace, conn: Connection) -> int:
    cert, key = conn.tls.cert, conn.tls.key
    finish_replacement(cert, key)  # a renewal a crash interrupted: its pair is the one
    try:
        identity = identity_from_certificate(cert.read_bytes())
    except (OSError, InvalidIdentityError) as err:
        raise CliError(f"{cert}: {err}") from None
    key_pem, csr_pem = make_csr(str(identity))
    request = pb.RenewCertificateRequest(csr_pem=csr_pem)
    async with conn.channel() as channel:
        stub = pb_grpc.CertificateServiceStub(channel)
        reply = await stub.RenewCertificate(request)
    try:
        replace_key_pair(cert, key, reply.certificate_pem, key_pem)
        _keep_bundle(conn.tls.ca, reply.ca_bundle_pem)
    except OSError as err:
        raise CliError(
            f"renewed (serial {reply.serial_hex}) but the files could not be written: {err}. "
            f"To fix: make {cert.parent} writable and renew again"
        ) from None
    out = output_of(args)
    if out.is_data:
        out.data(
            {
                "identity": str(identity),
                "serial": reply.serial_hex,
                "not_after": reply.not_after.ToJsonString(),
                "cert": str(cert),
                "key": str(key),
            }
        )
        return 0
    show(
        text(
            f"renewed {identity}: serial {reply.serial_hex}, valid until "
            f"{utc_time(reply.not_after)} UTC ({time_left(reply.not_after)})"
        ),
        text(f"wrote {cert} and {key}", "dim"),
    )
    return 0


def _print_or_write(path: Path | None, pem: bytes, what: str) -> int:
    """``pem`` on stdout, or written to ``path`` (0644)."""
    if path is None:
        sys.stdout.write(pem.decode())
        return 0
    try:
        write_public_file(path, pem)
    except OSError as err:
        raise CliError(f"cannot write {path}: {err.strerror or err}") from None
    show(text(f"{what} written to {path}"))
    return 0


def _keep_bundle(path: Path, bundle_pem: bytes) -> bool:
    """Replace the CA bundle at ``path`` when the coordinator trusts other roots now."""
    if not bundle_pem or (path.exists() and path.read_bytes() == bundle_pem):
        return False
    write_public_file(path, bundle_pem)
    return True


def _layout(args: argparse.Namespace) -> PkiLayout:
    folder = args.pki_dir or (Path(d) if (d := os.environ.get("FEDCTL_PKI_DIR")) else None)
    if folder is None:
        raise CliError("rotate-ca works on the pki folder. To fix: pass --pki-dir")
    return PkiLayout(folder)


async def cmd_rotate_ca(args: argparse.Namespace, conn: Connection) -> int:
    layout = _layout(args)
    try:
        rotation = prepare_rotation(layout, root_key=args.root_key, new_root=args.new_root)
        # Written before the coordinator has it: a crash after its answer loses no key.
        write_prepared(layout, rotation)
    except (OSError, ValueError) as err:
        raise CliError(str(err)) from None
    new_roots = rotation.new_root.cert_pem if rotation.new_root is not None else b""
    request = pb.RotateCertificateAuthorityRequest(
        issuing_ca_pem=rotation.issuing.cert_pem,
        issuing_key_pem=key_pem(rotation.issuing.key),
        new_roots_pem=new_roots,
    )
    try:
        async with conn.channel() as channel:
            reply = await pb_grpc.CertificateServiceStub(channel).RotateCertificateAuthority(
                request
            )
    except BaseException:
        discard_prepared(layout)
        raise
    promote_prepared(layout)
    out = output_of(args)
    if out.is_data:
        out.data(
            {
                "issuing_fingerprint": reply.issuing_fingerprint,
                "sites_told": reply.sites_told,
                "trust_bundle": str(layout.ca_cert),
                "new_root": bool(new_roots),
            }
        )
        return 0
    show(
        text(f"new issuing CA {reply.issuing_fingerprint} in use; {reply.sites_told} site(s) told"),
        text(
            f"trust bundle ({reply.trust_bundle_pem.count(b'BEGIN CERTIFICATE')} roots): "
            f"{layout.ca_cert}"
        ),
        text(
            "next: let certificates renew (or 'fedctl pki renew'), then 'fedctl pki retire-ca'; "
            f"move {layout.root_key} offline again",
            "dim",
        ),
    )
    return 0


async def cmd_retire_ca(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = pb_grpc.CertificateServiceStub(channel)
        reply = await stub.RetireCertificateAuthorities(pb.RetireCertificateAuthoritiesRequest())
    try:
        _keep_bundle(conn.tls.ca, reply.trust_bundle_pem)
    except OSError as err:
        raise CliError(f"retired, but {conn.tls.ca} could not be written: {err}") from None
    out = output_of(args)
    if out.is_data:
        out.messages(reply)
        return 0
    show(
        text(f"retired {', '.join(reply.retired_fingerprints)}"),
        text(f"the coordinator serves {reply.server_fingerprint}; {reply.sites_told} site(s) told"),
    )
    return 0


async def cmd_trust_bundle(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        reply = await pb_grpc.CertificateServiceStub(channel).GetTrustBundle(
            pb.GetTrustBundleRequest()
        )
    return _print_or_write(args.file, reply.trust_bundle_pem, "trust bundle")
