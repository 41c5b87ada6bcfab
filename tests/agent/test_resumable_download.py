"""Downloads cut mid-way resume from the bytes already written (an HTTP Range), against a
real HTTP server on loopback that drops connections; nothing partial is ever left in place."""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.agent.object_store import DataError, download

pytestmark = pytest.mark.timeout(60)

DATA = os.urandom(5 * 1024 * 1024 + 3)
DIGEST = hashlib.sha256(DATA).hexdigest()


class Server(http.server.ThreadingHTTPServer):
    cut_after: list[int]
    """Per request in turn: close the connection after this many bytes of the body."""
    ranges: list[str]
    ignore_range: bool = False
    status: int = 200


class Handler(http.server.BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        server = self.server
        asked = self.headers.get("Range", "")
        server.ranges.append(asked)
        if server.status != 200:
            self.send_error(server.status)
            return
        start = 0
        if (m := re.fullmatch(r"bytes=(\d+)-", asked)) and not server.ignore_range:
            start = int(m.group(1))
        body = DATA[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(DATA) - 1}/{len(DATA)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = server.cut_after.pop(0) if server.cut_after else len(body)
        self.wfile.write(body[:cut])
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Server]:
    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.cut_after, httpd.ranges = [], []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def url(server: Server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/obj?X-Amz-Signature=s"


def test_a_cut_download_resumes_from_the_bytes_written(server: Server, tmp_path: Path) -> None:
    server.cut_after = [2 * 1024 * 1024 + 1, 1024 * 1024]
    seen: list[int] = []
    got = download(
        url(server),
        tmp_path / "in.bin",
        len(DATA),
        DIGEST,
        folder=False,
        backoff_s=0.01,
        progress=lambda held, _s: seen.append(held),
    )
    assert (tmp_path / "in.bin").read_bytes() == DATA
    assert server.ranges == ["", "bytes=2097153-", "bytes=3145729-"]
    assert got.resumes == 2
    assert got.bytes == len(DATA)  # no byte fetched twice
    assert seen == sorted(seen)
    assert seen[-1] == len(DATA)
    assert [p.name for p in tmp_path.iterdir()] == ["in.bin"]


def test_a_store_that_ignores_the_range_starts_over_without_doubling(
    server: Server, tmp_path: Path
) -> None:
    server.cut_after, server.ignore_range = [1024 * 1024], True
    got = download(url(server), tmp_path / "in.bin", len(DATA), DIGEST, folder=False, backoff_s=0)
    assert (tmp_path / "in.bin").read_bytes() == DATA
    assert got.resumes == 1
    assert got.bytes == len(DATA) + 1024 * 1024


def test_cuts_beyond_the_tries_fail_and_leave_nothing(server: Server, tmp_path: Path) -> None:
    server.cut_after = [1000] * 3
    with pytest.raises(
        DataError, match=r"cannot be reached: .*\(3000 of \d+ bytes after 3 tries\)"
    ):
        download(
            url(server),
            tmp_path / "in.bin",
            len(DATA),
            DIGEST,
            folder=False,
            attempts=3,
            backoff_s=0,
        )
    assert list(tmp_path.iterdir()) == []


def test_a_refusal_is_not_tried_again(server: Server, tmp_path: Path) -> None:
    server.status = 403
    with pytest.raises(DataError, match="answered HTTP 403") as caught:
        download(url(server), tmp_path / "in.bin", len(DATA), DIGEST, folder=False, backoff_s=0)
    assert server.ranges == [""]
    assert "Signature" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_resumed_bytes_that_do_not_match_are_refused(server: Server, tmp_path: Path) -> None:
    server.cut_after = [1024 * 1024]
    with pytest.raises(DataError, match="digest mismatch"):
        download(url(server), tmp_path / "in.bin", len(DATA), "0" * 64, folder=False, backoff_s=0)
    assert list(tmp_path.iterdir()) == []
