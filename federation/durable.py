"""Making file-system changes survive a power cut."""

from __future__ import annotations

import os
from pathlib import Path


def sync_dir(folder: Path) -> None:
    """Make a rename, or a new file's name, in ``folder`` durable: names live in the
    directory, not in the file."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
