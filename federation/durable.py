"""Making file-system changes survive a power cut."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def sync_dir(folder: Path) -> None:
    """Make a rename, or a new file's name, in ``folder`` durable: names live in the
    directory, not in the file."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
