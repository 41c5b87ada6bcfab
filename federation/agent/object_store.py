"""A site's object store (``[object_store]`` of the agent's config): any S3-compatible endpoint.

The site uploads its tasks' declared outputs there, under
``{prefix}/{tenant}/{job}/{task}/{epoch}/{output}``, reads the size and digest of a tenant's
object under ``{prefix}/{tenant}/`` for a dataset being registered, and signs short-lived,
read-only URLs for one object at a time when the coordinator asks on behalf of a dependant at
another site. The credentials are read here, from files or the environment, and never leave
the site: other sites download through the URLs, and the coordinator never touches the bytes.

A folder is stored as one tar file (its links kept as links, unpacked with tarfile's ``data``
filter); a file as itself. The SHA-256 is computed while the bytes are read for the upload and
checked by the downloader against every byte it received.

Every function here blocks: call them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import re
import shutil
import stat
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

import structlog

from federation.config import ConfigError, within

CHUNK = 1024 * 1024
MAX_TTL_S = 3600
DOWNLOAD_ATTEMPTS = 8
DOWNLOAD_STALL_S = 30.0
"""A connection that brings no byte for this long is given up and opened again."""
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0

log = structlog.get_logger()


def _obstore() -> ModuleType:
    """The S3 client, imported by the first site store: an agent without one never loads it."""
    import obstore

    return obstore


class DataError(Exception):
    """An upload, a download or a signature failed; the message is safe to show (no secret)."""


class _StoreFailure(Exception):
    """A request to this site's store failed; ``refused``: the store said no (a 4xx, such as
    wrong keys), which trying again cannot mend."""

    def __init__(self, err: Exception) -> None:
        super().__init__(type(err).__name__)
        self.err = err
        status = re.search(r"status code: (\d{3})|status: (\d{3})", str(err))
        self.refused = status is not None and (status.group(1) or status.group(2))[0] == "4"


@dataclass(frozen=True, slots=True)
class ObjectStoreSettings:
    """The ``[object_store]`` table of an agent config; no bucket: the site has no store (its
    tasks' outputs stay at the site, and tasks elsewhere cannot read them)."""

    bucket: str = ""
    endpoint: str = ""
    """``http(s)://host:port`` of an S3-compatible store (SeaweedFS, MinIO, Ceph); empty: AWS
    S3 in ``region``."""
    region: str = "us-east-1"
    prefix: str = "federation"
    """Where in the bucket this site's objects go; each tenant gets a folder under it."""
    access_key_id_file: Path | None = None
    secret_access_key_file: Path | None = None
    """Files holding the keys (one line each); unset: the variables below."""
    access_key_id_env: str = "AWS_ACCESS_KEY_ID"
    secret_access_key_env: str = "AWS_SECRET_ACCESS_KEY"
    virtual_hosted_style: bool = False
    """Address buckets as ``bucket.host`` (AWS's default) rather than ``host/bucket``."""
    max_retries: int = field(default=3, metadata=within(0, 20))
    """Retries of a request that failed for the network or a 5xx, before the upload fails."""
    upload_attempts: int = field(default=3, metadata=within(1, 20))
    """Tries of a whole upload (each after its requests' own retries), from its first byte:
    a cut multipart upload is never completed, so no partial object is ever seen."""
    download_attempts: int = field(default=DOWNLOAD_ATTEMPTS, metadata=within(1, 50))
    """Tries of an input's download; each after the first resumes from the bytes already
    written (an HTTP Range), after a backoff doubling from 1 s."""
    download_stall_s: float = field(default=DOWNLOAD_STALL_S, metadata=within(1, 600))
    """Seconds without a byte before a download's connection is given up and opened again."""
    reachable: bool = True
    """Whether other sites can reach this store. False (a store behind NAT that this site
    reaches and others do not): the outputs others need are pushed from it to a reachable
    site's store, through a URL that site signs, and staged from there."""
    replica_bytes: int = field(default=0, metadata=within(0, 2**62))
    """Bytes of registered datasets this site keeps in its store as copies after staging them
    for a task (``federation.agent.dataset_replicas``), the least recently used deleted first
    when a new one needs room; 0 keeps none."""


@dataclass(frozen=True, slots=True)
class Stored:
    """An object as uploaded."""

    key: str
    bytes: int
    sha256: str
    folder: bool


class SiteStore:
    """This site's bucket, with its own credentials."""

    def __init__(self, settings: ObjectStoreSettings, *, source: str = "object_store") -> None:
        self.settings = settings
        self.prefix = settings.prefix.strip("/")
        key_id = _secret(settings.access_key_id_file, settings.access_key_id_env, source, "id")
        secret = _secret(
            settings.secret_access_key_file, settings.secret_access_key_env, source, "secret"
        )
        self._redact = [value for value in (key_id, secret) if value]
        from obstore.store import S3Store  # loaded by sites with a store only (7 MiB)

        self._store = S3Store(
            settings.bucket,
            endpoint=settings.endpoint or None,
            region=settings.region,
            access_key_id=key_id,
            secret_access_key=secret,
            virtual_hosted_style_request=settings.virtual_hosted_style,
            client_options={"allow_http": settings.endpoint.startswith("http://")},
            retry_config={
                "max_retries": settings.max_retries,
                "retry_timeout": timedelta(seconds=60),
            },
        )

    @property
    def where(self) -> str:
        """The store as people name it: ``bucket at endpoint``."""
        return f"bucket {self.settings.bucket} at {self.settings.endpoint or 'AWS S3'}"

    def key(self, tenant: str, job_id: str, task: str, epoch: int, output: str) -> str:
        parts = (self.prefix, tenant or "_", job_id, task, str(epoch), output)
        return "/".join(part for part in parts if part)

    def upload(self, source: Path, key: str, scratch: Path) -> Stored:
        """Store the file or folder at ``source`` (never following a link there) as ``key``.

        ``scratch`` is an agent-only folder for a folder's tar. Raises DataError.
        """
        try:
            mode = source.lstat().st_mode
        except FileNotFoundError:
            raise DataError("the task did not write it") from None
        if stat.S_ISLNK(mode):
            raise DataError("it is a link; outputs must be real files or folders")
        if stat.S_ISDIR(mode):
            with tempfile.TemporaryDirectory(dir=scratch) as work:
                packed = Path(work) / "output.tar"
                try:
                    with tarfile.open(packed, "w") as tar:
                        tar.add(source, arcname=".", recursive=True)
                except (OSError, tarfile.TarError) as err:
                    raise DataError(f"cannot pack the folder: {err}") from None
                return self._put(packed, key, folder=True)
        if not stat.S_ISREG(mode):
            raise DataError("it is neither a file nor a folder")
        return self._put(source, key, folder=False)

    def _put(self, path: Path, key: str, *, folder: bool) -> Stored:
        """Upload ``path`` whole, again from its first byte after a failure the store did not
        refuse (a cut connection, a 5xx), up to ``upload_attempts`` tries with a backoff. A
        multipart upload that was cut is never completed, so the key holds no partial object;
        the size stored is checked against the size sent before the output counts as stored."""
        attempts = self.settings.upload_attempts
        for attempt in range(1, attempts + 1):
            try:
                return self._put_once(path, key, folder=folder)
            except _StoreFailure as failure:
                reason = self.describe(failure.err)
                if failure.refused or attempt == attempts:
                    raise DataError(f"upload to {self.where} failed: {reason}") from None
                wait = min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S)
                log.info("upload_retries", key=key, error=reason, wait_s=wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _put_once(self, path: Path, key: str, *, folder: bool) -> Stored:
        digest = hashlib.sha256()
        size = 0

        def chunks(handle: int) -> Iterator[bytes]:
            nonlocal size
            while block := os.read(handle, CHUNK):
                digest.update(block)
                size += len(block)
                yield block

        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            _obstore().put(self._store, key, chunks(handle))  # multipart, parts retried
            stored = _obstore().head(self._store, key)["size"]
        except Exception as err:
            raise _StoreFailure(err) from None
        finally:
            os.close(handle)
        if stored != size:
            raise DataError(f"the store holds {stored} bytes of {key}, not the {size} sent")
        return Stored(key, size, digest.hexdigest(), folder)

    def sign_get(self, key: str, tenant: str, ttl_s: int) -> str:
        """A read-only URL for ``key`` alone, valid ``ttl_s`` seconds; only keys of ``tenant``'s
        folder under this site's prefix are signed. Raises DataError."""
        self.check_tenant_key(key, tenant)
        ttl = timedelta(seconds=max(1, min(ttl_s, MAX_TTL_S)))
        try:
            return str(_obstore().sign(self._store, "GET", key, ttl))
        except Exception as err:
            raise DataError(f"cannot sign a URL: {self.describe(err)}") from None

    def sign_put(self, below_prefix: str, tenant: str, ttl_s: int) -> tuple[str, str]:
        """A write-only URL for one object of ``tenant``'s folder, given its key below this
        site's prefix (``TENANT/...``); returns the URL and the object's full key. Raises
        DataError."""
        key = "/".join(part for part in (self.prefix, below_prefix) if part)
        if not below_prefix.startswith(f"{tenant}/"):
            raise DataError(f"key {below_prefix!r} is not in tenant {tenant!r}'s folder")
        ttl = timedelta(seconds=max(1, min(ttl_s, MAX_TTL_S)))
        self.check_tenant_key(key, tenant)
        try:
            return _obstore().sign(self._store, "PUT", key, ttl), key
        except Exception as err:
            raise DataError(f"cannot sign a URL: {self.describe(err)}") from None

    def keys(self, folder: str) -> list[str]:
        """The keys of the objects in ``folder`` (a key prefix ending in '/'). Raises
        DataError."""
        try:
            return [
                meta["path"]
                for batch in _obstore().list(self._store, folder, chunk_size=1000)
                for meta in batch
            ]
        except Exception as err:
            raise DataError(f"cannot list {self.where}: {self.describe(err)}") from None

    def delete(self, keys: list[str]) -> None:
        """Delete the objects at ``keys``. Raises DataError."""
        if not keys:
            return
        try:
            _obstore().delete(self._store, keys)
        except Exception as err:
            raise DataError(f"cannot delete from {self.where}: {self.describe(err)}") from None

    def fetch(self, key: str, dest: Path) -> None:
        """Copy the object at ``key`` into the file ``dest``. Raises DataError."""
        try:
            with dest.open("wb") as out:
                for block in _obstore().get(self._store, key).stream(min_chunk_size=CHUNK):
                    out.write(block)
        except Exception as err:
            raise DataError(f"cannot read {key} from {self.where}: {self.describe(err)}") from None

    def stat(self, key: str, tenant: str, size: int = 0, sha256: str = "") -> tuple[int, str]:
        """The size and SHA-256 of ``key``, an object of ``tenant``'s folder under this site's
        prefix, for a dataset being registered. Given ``sha256``, only the size is read (and
        the digest is checked by every download); else the object is read and hashed. A given
        size or digest must match. Raises DataError."""
        self.check_tenant_key(key, tenant)
        try:
            stored = int(_obstore().head(self._store, key)["size"])
        except FileNotFoundError:
            raise DataError(f"no object {key!r} in {self.where}") from None
        except Exception as err:
            raise DataError(f"cannot read {key!r}: {self.describe(err)}") from None
        if size and stored != size:
            raise DataError(f"the store holds {stored} bytes of {key!r}, not the {size} given")
        if sha256:
            return stored, sha256
        digest = hashlib.sha256()
        got = 0
        try:
            for block in _obstore().get(self._store, key).stream(min_chunk_size=CHUNK):
                digest.update(block)
                got += len(block)
        except Exception as err:
            raise DataError(f"cannot read {key!r}: {self.describe(err)}") from None
        if got != stored:
            raise DataError(f"read {got} bytes of {key!r}, the store reported {stored}")
        return got, digest.hexdigest()

    def check_tenant_key(self, key: str, tenant: str) -> None:
        """Raises DataError unless ``key`` is in ``tenant``'s folder under this site's prefix."""
        folder = "/".join(part for part in (self.prefix, tenant) if part) + "/"
        if not tenant or not key.startswith(folder) or ".." in key.split("/"):
            raise DataError(f"key {key!r} is not in tenant {tenant!r}'s folder of this store")

    def describe(self, err: Exception) -> str:
        """What went wrong with a request, for a task's reason and the log: the S3 error
        code and status, never the keys (nor the response's details)."""
        return describe_error(err, self._redact)


def describe_error(err: Exception, redact: list[str] | None = None) -> str:
    text = str(err)
    code = re.search(r"<Code>([A-Za-z0-9.]+)</Code>", text)
    status = re.search(r"status code: (\d{3})|status: (\d{3})", text)
    parts = [type(err).__name__]
    if status:
        parts.append(f"HTTP {status.group(1) or status.group(2)}")
    if code:
        parts.append(code.group(1))
    elif "error sending request" in text or "Connection refused" in text:
        parts.append("the store cannot be reached")
    if code and code.group(1) in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"):
        parts.append("(check the site's object_store credentials)")
    out = " ".join(parts)
    for secret in redact or []:
        out = out.replace(secret, "<redacted>")
    return out


@dataclass(frozen=True, slots=True)
class Transfer:
    """What one download moved: its bytes over the network (a resumed one counts the bytes
    fetched again, none twice), the seconds from first request to the last byte, the seconds a
    connection was open and reading (what the link's throughput is measured over), and how
    many times it resumed after a cut."""

    bytes: int
    seconds: float
    active_s: float
    resumes: int


Progress = Callable[[int, float], None]
"""Told the bytes in place so far and the seconds since the download began."""


class _Cut(Exception):
    """The connection broke or stalled mid-way: the download resumes from what it holds."""


def download(
    url: str,
    dest: Path,
    size: int,
    sha256: str,
    *,
    folder: bool,
    attempts: int = DOWNLOAD_ATTEMPTS,
    stall_s: float = DOWNLOAD_STALL_S,
    backoff_s: float = BACKOFF_S,
    progress: Progress | None = None,
) -> Transfer:
    """Fetch ``url`` into a temporary file beside ``dest``, check its size and SHA-256, and
    only then put it at ``dest`` (a folder's tar unpacked there). Raises DataError.

    A connection that breaks, or stalls ``stall_s`` seconds, is opened again after a backoff
    and asks only for the bytes still missing (an HTTP Range), up to ``attempts`` tries in
    all; a refusal (4xx: an expired or wrong signature) is not tried again.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    need = 2 * size if folder else size  # a folder's tar, then what it unpacks to
    if (free := shutil.disk_usage(dest.parent).free) < need:
        raise DataError(
            f"not enough disk space at this site: it needs {need} bytes, {free} are free"
        )
    handle, temporary = tempfile.mkstemp(dir=dest.parent, prefix=".staging-")
    began = time.monotonic()
    active, resumes = 0.0, 0
    try:
        with os.fdopen(handle, "wb") as out:
            part = _Partial(out, began, progress)
            for attempt in range(1, attempts + 1):
                opened = time.monotonic()
                try:
                    _fetch(url, part, size, stall_s)
                    active += time.monotonic() - opened
                    break
                except _Cut as cut:
                    active += time.monotonic() - opened
                    got = part.held
                    if attempt == attempts:
                        raise DataError(
                            f"its site's store cannot be reached: {cut.args[0]} "
                            f"({got} of {size} bytes after {attempts} tries)"
                        ) from None
                    resumes += 1
                    wait = min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
                    log.info("download_resumes", after=str(cut.args[0]), held=got, wait_s=wait)
                    time.sleep(wait)
        if part.held != size:
            raise DataError(f"got {part.held} bytes, its site reported {size}")
        if (found := part.digest.hexdigest()) != sha256:
            raise DataError(f"digest mismatch: sha256 {found[:16]}…, expected {sha256[:16]}…")
        if folder:
            try:
                dest.mkdir(exist_ok=True)
                with tarfile.open(temporary) as tar:
                    tar.extractall(dest, filter="data")
            except (OSError, tarfile.TarError) as err:
                raise DataError(f"cannot unpack the folder: {err}") from None
        else:
            os.replace(temporary, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return Transfer(part.moved, time.monotonic() - began, active, resumes)


@dataclass
class _Partial:
    """A download's temporary file so far: the bytes in it and their digest."""

    out: BinaryIO
    began: float
    progress: Progress | None
    held: int = 0
    moved: int = 0
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)

    def restart(self) -> None:
        self.out.seek(0)
        self.out.truncate()
        self.held, self.digest = 0, hashlib.sha256()

    def add(self, block: bytes) -> None:
        self.digest.update(block)
        self.write(block)
        self.held += len(block)
        self.moved += len(block)
        if self.progress is not None:
            self.progress(self.held, time.monotonic() - self.began)

    def write(self, block: bytes = b"") -> None:
        """Writes ``block`` (nothing: flushes). A local failure (the disk filled) is no
        cut connection: retrying cannot help, so it ends the download with its reason."""
        try:
            if block:
                self.out.write(block)
            else:
                self.out.flush()
        except OSError as err:
            raise DataError(f"cannot write it at this site: {err.strerror or err}") from None


def _fetch(url: str, part: _Partial, size: int, stall_s: float) -> None:
    """One request for the bytes from ``part.held`` on, appended to ``part``. Raises _Cut to
    resume, DataError to give up."""
    request = urllib.request.Request(url)
    if part.held:
        request.add_header("Range", f"bytes={part.held}-")
    try:
        with urllib.request.urlopen(request, timeout=stall_s) as answer:
            if part.held and answer.status != 206:
                part.restart()  # the whole object came again: never append it twice
            length = answer.headers.get("Content-Length")
            end = part.held + int(length) if length is not None else None
            while block := answer.read(CHUNK):
                if part.held + len(block) > size:
                    raise DataError(f"more than the {size} bytes its site reported")
                part.add(block)
            if end is not None and part.held < end:
                raise _Cut("the connection closed early")
    except urllib.error.HTTPError as err:
        if err.code >= 500:
            raise _Cut(f"HTTP {err.code} {err.reason}") from None
        raise DataError(f"its site's store answered HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        raise _Cut(str(getattr(err, "reason", None) or err or type(err).__name__)) from None
    part.write()


def _secret(path: Path | None, variable: str, source: str, what: str) -> str:
    if path is not None:
        try:
            return path.read_text().strip()
        except OSError as err:
            raise ConfigError(
                f"{source}: cannot read the access key {what} from {path}: {err.strerror}"
            ) from None
    value = os.environ.get(variable, "")
    if not value:
        raise ConfigError(
            f"{source}: no access key {what}: set {variable} or the object_store's "
            f"{'access_key_id_file' if what == 'id' else 'secret_access_key_file'}"
        )
    return value
