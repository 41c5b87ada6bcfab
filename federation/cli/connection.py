"""How fedctl reaches the coordinator, and how it turns RPC errors into one clear line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from federation.security.pki import PkiLayout
from federation.security.tls import TlsFiles, channel_credentials


class CliError(Exception):
    """An error for people: printed as one line, exit status 1."""


@dataclass(frozen=True, slots=True)
class Connection:
    address: str
    tls: TlsFiles

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(self.address, channel_credentials(self.tls))


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


def describe_rpc_error(err: grpc.aio.AioRpcError) -> str:
    """One line: ``CODE: message``, or every bad field from the status details."""
    message = f"{err.code().name}: {err.details()}"
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields = "; ".join(f"{v.field}: {v.description}" for v in bad.field_violations)
            message = f"{err.code().name}: {fields}"
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        message += (
            " (the coordinator is unreachable, or refused this certificate in the TLS "
            "handshake. To fix: check --coordinator and that the certificate is from its CA)"
        )
    return message
