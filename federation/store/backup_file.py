"""Backups of the embedded store as files: what one holds, and putting one in place.

A backup is a whole SQLite database, as ``SqliteStore.backup`` writes it. Restoring one puts
it where a stopped coordinator's store lives; the coordinator started next serves from it.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from federation.durable import sync_dir
from federation.store.base import StoreError
from federation.store.sqlite import SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class StoreFile:
    """What a store file holds."""

    revision: int
    keys: int
    jobs: int


def inspect(path: Path) -> StoreFile:
    """What the store file ``path`` holds, read without changing it.

    Raises:
        StoreError: It cannot be read, is damaged, is no store, or is newer than this code.
    """
    if not path.is_file():
        raise StoreError(f"{path}: no such file")
    try:
        # immutable: nothing else writes it, so SQLite needs no lock or -shm file beside it.
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error as err:
        raise StoreError(f"{path}: cannot open: {err}") from None
    try:
        (check,) = conn.execute("PRAGMA quick_check").fetchone()
        if check != "ok":
            raise StoreError(f"{path}: damaged ({check})")
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{path}: written by a newer version (schema {version}, this one reads up to "
                f"{SCHEMA_VERSION})"
            )
        (revision,) = conn.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()
        (keys,) = conn.execute("SELECT COUNT(*) FROM kv").fetchone()
        (jobs,) = conn.execute(
            "SELECT COUNT(*) FROM kv WHERE key >= '/jobs/' AND key < '/jobs0'"
        ).fetchone()
    except sqlite3.DatabaseError as err:  # not a database, or not one of ours
        raise StoreError(f"{path}: not a federation store ({err})") from None
    finally:
        conn.close()
    return StoreFile(revision=revision, keys=keys, jobs=jobs)


def check_not_in_use(path: Path) -> None:
    """Raise ``StoreError`` when a running coordinator has the store ``path`` open: it holds
    the file's lock for as long as it runs."""
    conn = sqlite3.connect(path, timeout=0)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        conn.execute("ROLLBACK")
    except sqlite3.OperationalError as err:
        raise StoreError(
            f"{path} is in use ({err}): a coordinator is running on it. To fix: stop it first"
        ) from None
    finally:
        conn.close()


def restore(backup: Path, target: Path, *, force: bool = False) -> StoreFile:
    """Put the backup ``backup`` in place as the store ``target``; returns what it holds.

    Nothing changes unless the backup reads whole, no coordinator has ``target`` open, and
    (without ``force``) ``target`` holds no store yet.
    """
    restored = inspect(backup)
    if target.exists():
        check_not_in_use(target)
        if not force:
            try:
                held = inspect(target)
                what = f"a store (revision {held.revision}, {held.jobs} job(s))"
            except StoreError as err:
                what = f"something else ({err})"
            raise StoreError(f"{target} holds {what}. To fix: --force replaces it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{secrets.token_hex(4)}.restoring")
    try:
        with backup.open("rb") as source, staged.open("xb") as copy:
            while chunk := source.read(1 << 20):
                copy.write(chunk)
            copy.flush()
            os.fsync(copy.fileno())
        os.chmod(staged, 0o600)
        # The replaced store's write-ahead log must go first: it belongs to the old file.
        for leftover in ("-wal", "-shm", "-journal"):
            target.with_name(target.name + leftover).unlink(missing_ok=True)
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)
    sync_dir(target.parent)  # the rename itself survives a power cut
    return restored
