"""``fedctl``: the operator and client command line."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import sys
from pathlib import Path

import grpc

from federation import __version__
from federation.cli import audit, data, demo, pki, queues, remote, sim, store, top
from federation.cli.connection import CliError, describe_rpc_error, resolve_connection
from federation.cli.output import add_to_every_command, output_of, quiet_on_closed_pipe
from federation.connection import on_leader


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedctl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fedctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    pki.add_parser(sub)
    remote.add_parsers(sub)
    queues.add_parser(sub)
    data.add_parser(sub)
    audit.add_parser(sub)
    store.add_parser(sub)
    demo.add_parser(sub)
    sim.add_parser(sub)
    top.add_parser(sub)
    # -o, --json and where to connect, before or after any subcommand
    add_to_every_command(parser, add_connection_options)
    return parser


def add_connection_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """Where the coordinator is and which certificate to show it. Only the top-level parser
    sets defaults (see ``add_output_options``), so ``fedctl --pki-dir D pki list`` and
    ``fedctl pki list --pki-dir D`` both work."""
    unset = None if top else argparse.SUPPRESS
    parser.add_argument(
        "--coordinator",
        default=unset,
        help="host:port, or several coordinators as a,b,c: the leader is found among them "
        "(env FEDCTL_COORDINATOR)",
    )
    parser.add_argument(
        "--pki-dir",
        type=Path,
        default=unset,
        help="folder from 'fedctl pki init' (env FEDCTL_PKI_DIR); uses its operator certificate",
    )
    parser.add_argument("--ca", type=Path, default=unset, help="CA certificate (env FEDCTL_CA)")
    parser.add_argument(
        "--cert", type=Path, default=unset, help="client certificate (env FEDCTL_CERT)"
    )
    parser.add_argument("--key", type=Path, default=unset, help="client key (env FEDCTL_KEY)")


def main(argv: list[str] | None = None) -> None:
    with quiet_on_closed_pipe():  # `--version` and `--help` print while parsing: inside too
        args = build_parser().parse_args(argv)
        try:
            output_of(args)  # refuse --json with another -o before any work
            sys.exit(run(args))
        except CliError as err:
            print(f"fedctl: {err}", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:
            sys.exit(130)


def run(args: argparse.Namespace) -> int:
    func = args.func
    params = inspect.signature(func).parameters
    if "conn" not in params:
        result = func(args)
        return int(asyncio.run(result) if inspect.iscoroutine(result) else result)
    conn = resolve_connection(args.coordinator, args.pki_dir, args.ca, args.cert, args.key)
    try:
        return int(asyncio.run(on_leader(conn, lambda pinned: func(args, pinned))))
    except grpc.aio.AioRpcError as err:
        raise CliError(describe_rpc_error(err)) from None
