"""A disk that fills: staging into a small real filesystem (a 4 MiB tmpfs, mounted as root)
from a real HTTP server. A download that cannot fit is refused before a byte moves; one that
the disk runs out under mid-way ends at once with the reason (no retries: they cannot help),
and leaves no partial file behind. Skipped where a tmpfs cannot be mounted."""

from __future__ import annotations

import hashlib
import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.agent.object_store import DataError, download

SIZE = 3 * 1024 * 1024
BODY = os.urandom(SIZE)
DIGEST = hashlib.sha256(BODY).hexdigest()


class _Serve(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(SIZE))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Serve)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/object"
    server.shutdown()
    server.server_close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs at tmp_path/disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file() and p.name != "filler")


def test_an_input_larger_than_the_free_space_is_refused_before_it_moves(
    small_disk: Path, url: str
) -> None:
    """3 MiB fits the 4 MiB disk as a file, not as a folder (its tar, then the files)."""
    with pytest.raises(DataError, match="not enough disk space at this site: it needs") as caught:
        download(url, small_disk / "in" / "data", SIZE, DIGEST, folder=True)
    assert f"needs {2 * SIZE} bytes" in str(caught.value)
    assert leftovers(small_disk) == []


def test_a_disk_that_fills_mid_way_ends_the_download_with_its_reason(
    small_disk: Path, url: str
) -> None:
    """Once the first bytes are in, another writer fills the disk: the download stops at once
    with the disk's reason, not as a store it cannot reach, and removes its partial file."""
    filled: list[int] = []

    def fill(held: int, _seconds: float) -> None:
        if not filled:
            free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
            with (small_disk / "filler").open("wb") as out:
                out.write(b"\0" * max(0, free - 4096))
            filled.append(held)

    with pytest.raises(DataError) as caught:
        download(url, small_disk / "in" / "data.bin", SIZE, DIGEST, folder=False, progress=fill)
    assert str(caught.value) == "cannot write it at this site: No space left on device"
    assert filled, "the download never began"
    assert leftovers(small_disk) == []
    (small_disk / "filler").unlink()
    download(url, small_disk / "in" / "data.bin", SIZE, DIGEST, folder=False)
    assert hashlib.sha256((small_disk / "in" / "data.bin").read_bytes()).hexdigest() == DIGEST
