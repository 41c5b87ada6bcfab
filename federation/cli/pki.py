"""``fedctl pki``: make the federation CA and certificates offline; renew one online."""

from __future__ import annotations

import argparse
from pathlib import Path

from federation.api.v1 import certificate_service_pb2, certificate_service_pb2_grpc
from federation.cli.connection import CliError, Connection
from federation.cli.output import output_of, show
from federation.cli.render import text, time_left, utc_time
from federation.security.identity import (
    Identity,
    InvalidIdentityError,
    Role,
    identity_from_certificate,
)
from federation.security.key_pair_files import finish_replacement, replace_key_pair
from federation.security.pki import (
    PkiLayout,
    fingerprint,
    init_pki,
    issue_client_files,
    make_csr,
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pki = sub.add_parser("pki", help="federation CA and certificates")
    pki_sub = pki.add_subparsers(dest="pki_command", required=True)
    init = pki_sub.add_parser("init", help="create a CA, a coordinator cert and an operator cert")
    init.add_argument("--dir", type=Path, required=True, help="folder to write (0700)")
    init.add_argument(
        "--san",
        action="append",
        default=[],
        help="coordinator DNS name or IP (repeatable; default localhost, 127.0.0.1)",
    )
    init.add_argument("--operator", default="admin", help="name of the first operator")
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(func=cmd_init)
    issue = pki_sub.add_parser("issue", help="issue a client certificate (tenant or operator)")
    issue.add_argument("--dir", type=Path, required=True)
    role = issue.add_mutually_exclusive_group(required=True)
    role.add_argument("--tenant")
    role.add_argument("--operator")
    issue.set_defaults(func=cmd_issue)
    renew = pki_sub.add_parser(
        "renew",
        help="renew the certificate fedctl connects with (--cert, --key): a new key, a new "
        "expiry; both files are replaced (0600)",
    )
    renew.set_defaults(func=cmd_renew)


def cmd_init(args: argparse.Namespace) -> int:
    sans = args.san or ["localhost", "127.0.0.1"]
    try:
        layout = init_pki(args.dir, server_sans=sans, operator=args.operator, force=args.force)
    except (FileExistsError, InvalidIdentityError, ValueError) as err:
        raise CliError(f"{err}") from None
    ca_fingerprint = fingerprint(layout.ca_cert.read_bytes())
    operator = layout.client_cert("operator-" + args.operator)
    out = output_of(args)
    if out.is_data:
        out.data(
            {
                "ca": str(layout.ca_cert),
                "ca_fingerprint": ca_fingerprint,
                "ca_key": str(layout.ca_key),
                "coordinator": str(layout.server_cert),
                "coordinator_sans": sans,
                "operator": str(operator),
            }
        )
        return 0
    # Paths and names are the operator's own, but a '[' in a folder name is not markup either.
    show(
        text(f"CA            {layout.ca_cert}  ({ca_fingerprint})"),
        text(f"coordinator   {layout.server_cert}  SANs: {', '.join(sans)}"),
        text(f"operator      {operator}"),
        text(f"keep {layout.ca_key} secret: it signs every site certificate", "dim"),
    )
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    try:
        identity = (
            Identity(Role.TENANT, args.tenant)
            if args.tenant
            else Identity(Role.OPERATOR, args.operator)
        )
        cert, key = issue_client_files(PkiLayout(args.dir), identity)
    except (InvalidIdentityError, OSError, ValueError) as err:
        raise CliError(str(err)) from None
    out = output_of(args)
    if out.is_data:
        out.data({"identity": str(identity), "cert": str(cert), "key": str(key)})
    else:
        show(text(f"{identity}: {cert} (key {key})"))
    return 0


async def cmd_renew(args: argparse.Namespace, conn: Connection) -> int:
    cert, key = conn.tls.cert, conn.tls.key
    finish_replacement(cert, key)  # a renewal a crash interrupted: its pair is the one
    try:
        identity = identity_from_certificate(cert.read_bytes())
    except (OSError, InvalidIdentityError) as err:
        raise CliError(f"{cert}: {err}") from None
    key_pem, csr_pem = make_csr(str(identity))
    request = certificate_service_pb2.RenewCertificateRequest(csr_pem=csr_pem)
    async with conn.channel() as channel:
        stub = certificate_service_pb2_grpc.CertificateServiceStub(channel)
        reply = await stub.RenewCertificate(request)
    try:
        replace_key_pair(cert, key, reply.certificate_pem, key_pem)
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
