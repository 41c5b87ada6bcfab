"""``fedctl pki``: make the federation CA and certificates offline (``init``, ``issue``); renew,
revoke and list them through the coordinator (``renew``, ``revoke``, ``list``, ``crl``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from federation.cli import certificates
from federation.cli.connection import CliError
from federation.cli.output import output_of, show
from federation.cli.render import text
from federation.security.identity import (
    Identity,
    InvalidIdentityError,
    Role,
)
from federation.security.pki import (
    PkiLayout,
    fingerprint,
    init_pki,
    issue_client_files,
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
    certificates.add_parsers(pki_sub)


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
                "issuing_ca": str(layout.issuing_cert),
                "root_key": str(layout.root_key),
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
        text(f"root key      {layout.root_key}: move it offline; bring it back to rotate"),
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
