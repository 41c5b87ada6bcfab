"""How fedctl reaches the coordinator, and how it turns RPC errors into one clear line."""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from federation.cli.render import text
from federation.client import CallError, call_error
from federation.connection import Connection
from federation.endpoints import is_not_leader, parse_endpoints
from federation.security.pki import PkiLayout
from federation.security.tls import TlsFiles


class CliError(Exception):
    """An error for people: printed as one line, exit status 1."""


def resolve_connection(
    address: str | None,
    pki_dir: Path | None,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
    identity: str = "operator-admin",
) -> Connection:
    """Flags first, then FEDCTL_* environment variables, then the PKI folder's operator."""
    address = address or os.environ.get("FEDCTL_COORDINATOR", "127.0.0.1:7070")
    try:
        parse_endpoints(address)
    except ValueError:
        raise CliError(
            "--coordinator is empty. To fix: give host:port (or several, a,b,c)"
        ) from None
    pki = pki_dir or _env_path("FEDCTL_PKI_DIR")
    layout = PkiLayout(pki) if pki else None
    ca = ca or _env_path("FEDCTL_CA") or (layout.ca_cert if layout else None)
    cert = cert or _env_path("FEDCTL_CERT") or (layout.client_cert(identity) if layout else None)
    key = key or _env_path("FEDCTL_KEY") or (layout.client_key(identity) if layout else None)
    if not (ca and cert and key):
        raise CliError(
            "no credentials. To fix: pass --pki-dir (from 'fedctl pki init') or --ca, --cert "
            "and --key, or set FEDCTL_PKI_DIR"
        )
    for path in (ca, cert, key):
        if not path.exists():
            raise CliError(f"{path} does not exist. To fix: run 'fedctl pki init' or check paths")
    return Connection(address, TlsFiles(ca=ca, cert=cert, key=key))


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def cli_error(err: CallError) -> CliError:
    """The client's refusal as one line for people (``describe_call_error``)."""
    return CliError(describe_call_error(err))


def describe_call_error(err: CallError) -> str:
    """One line: ``CODE: message``, or every bad field from the status details."""
    message = err.message
    if err.violations:
        fields = "; ".join(f"{field}: {why}" for field, why in err.violations.items())
        message = f"{err.code.name}: {fields}"
    # The details can echo what a tenant or a site sent: control characters come out escaped.
    return text(message).plain


def describe_rpc_error(err: grpc.aio.AioRpcError) -> str:
    """``describe_call_error``'s line, and what to check when no coordinator answered."""
    message = describe_call_error(call_error(err))
    if err.code() == grpc.StatusCode.UNAVAILABLE and not is_not_leader(err):
        message += (
            " (the coordinator is unreachable, or refused this certificate in the TLS "
            "handshake. To fix: check --coordinator and that the certificate is from its CA)"
        )
    return message
