"""``fedctl store backup|restore``: a copy of the embedded store, and putting one back."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from federation.api.v1 import store_service_pb2, store_service_pb2_grpc
from federation.cli.connection import CliError
from federation.cli.output import output_of, show
from federation.cli.render import text
from federation.connection import Connection
from federation.coordinator.config import STORE_FILE
from federation.store import StoreError
from federation.store.backup_file import StoreFile, inspect, restore

_Advance = Callable[[int, int], None]
"""Told (bytes arrived, total size when first known)."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    store = sub.add_parser("store", help="back up and restore the coordinator's embedded store")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    backup = store_sub.add_parser(
        "backup", help="copy the running coordinator's store into FILE (a new file)"
    )
    backup.add_argument("file", type=Path)
    backup.set_defaults(func=cmd_backup)
    put_back = store_sub.add_parser(
        "restore", help="put a backup in place as a stopped coordinator's store"
    )
    put_back.add_argument("file", type=Path, help="a file from 'fedctl store backup'")
    put_back.add_argument(
        "--data-dir", type=Path, required=True, help="the coordinator's --data-dir"
    )
    put_back.add_argument("--force", action="store_true", help="replace the store it holds")
    put_back.set_defaults(func=cmd_restore)


def _summary(what: str, path: Path, held: StoreFile) -> dict[str, object]:
    return {what: str(path), "revision": held.revision, "jobs": held.jobs, "keys": held.keys}


async def cmd_backup(args: argparse.Namespace, conn: Connection) -> int:
    path: Path = args.file
    if await asyncio.to_thread(path.exists):
        raise CliError(f"{path} exists: a backup goes to a new file")
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    digest = hashlib.sha256()
    sha256 = ""
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # state is private
        with os.fdopen(fd, "wb") as out, _progress(sys.stderr.isatty()) as advance:
            async with conn.channel() as channel:
                stub = store_service_pb2_grpc.StoreServiceStub(channel)
                request = store_service_pb2.BackupStoreRequest()
                async for chunk in stub.BackupStore(request):
                    if chunk.size_bytes:
                        advance(0, chunk.size_bytes)
                    out.write(chunk.data)
                    digest.update(chunk.data)
                    advance(len(chunk.data), 0)
                    sha256 = chunk.sha256 or sha256
            out.flush()
            os.fsync(out.fileno())
        if sha256 != digest.hexdigest():
            raise CliError("the backup arrived damaged (its SHA-256 differs). To fix: run again")
        try:
            held = inspect(partial)
        except StoreError as err:
            raise CliError(f"the backup does not read whole: {err}") from None
        os.replace(partial, path)
    except OSError as err:
        raise CliError(f"cannot write {path}: {err}") from None
    finally:
        partial.unlink(missing_ok=True)
    out_ = output_of(args)
    if out_.is_data:
        out_.data({**_summary("backup", path, held), "sha256": sha256})
    else:
        show(text(f"backup {path}: revision {held.revision}, {held.jobs} job(s), {held.keys} keys"))
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    target = args.data_dir / STORE_FILE
    try:
        held = restore(args.file, target, force=args.force)
    except (StoreError, OSError) as err:
        raise CliError(str(err)) from None
    out = output_of(args)
    if out.is_data:
        out.data(_summary("store", target, held))
    else:
        show(
            text(f"restored {target}: revision {held.revision}, {held.jobs} job(s)"),
            text("start the coordinator on it; its agents reconnect with their tasks", "dim"),
        )
    return 0


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[_Advance]:
    """A progress bar on stderr while the copy arrives (when stderr is a terminal)."""
    if not enabled:
        yield lambda done, total: None
        return
    columns = (
        TextColumn("backup"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("backup", total=None)

        def advance(done: int, total: int) -> None:
            if total:
                bar.update(task, total=total)
            bar.advance(task, done)

        yield advance
