"""A real OCI registry (Debian's ``docker-registry``) and a small image built from a static
busybox, for the container tests and ``bench/containers.py``.

The registry serves plain HTTP at the address given (pull with ``--tls-verify=false``) and
logs every request; ``wrap`` runs it in a network namespace. Given ``logins`` (user: password)
it asks for them (htpasswd, bcrypt), as a tenant's private registry does. The image holds
busybox and its applets, and optionally a layer of incompressible bytes, so a pull moves
about that much.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from federation.testing.etcd import stop_process

TOOLS = ("sh", "id", "echo", "sleep", "cat", "pwd", "ls", "test", "[", "date", "true")
START_TIMEOUT_S = 30.0


def unavailable() -> str | None:
    """Why a registry and images cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root: rootful Podman"
    for tool, package in (
        ("podman", "podman runc catatonit"),
        ("docker-registry", "docker-registry"),
        ("busybox", "busybox-static"),
    ):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    return None


def podman(*args: str, timeout_s: float = 300.0) -> str:
    """Runs podman; its output, or RuntimeError with its error."""
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def busybox_rootfs(folder: Path, *, filler_mib: int = 0) -> Path:
    """A root file system as a tar: /bin/busybox, its applets, /tmp, and ``filler_mib`` MiB of
    random bytes in /filler (which no compression shrinks)."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("busybox is not installed (apt-get install busybox-static)")
    tree = folder / "rootfs"
    (tree / "bin").mkdir(parents=True)
    (tree / "tmp").mkdir(mode=0o1777)
    shutil.copy(busybox, tree / "bin" / "busybox")
    for tool in TOOLS:
        (tree / "bin" / tool).symlink_to("busybox")
    if filler_mib:
        with (tree / "filler").open("wb") as out:
            for _ in range(filler_mib):
                out.write(os.urandom(1 << 20))
    archive = folder / "rootfs.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(tree, arcname=".")
    shutil.rmtree(tree)
    return archive


def import_image(archive: Path, image: str, store: Sequence[str] = ()) -> None:
    """Makes ``archive`` the image ``image`` in a Podman store (the host's, or ``store``'s
    flags), with /bin on its PATH."""
    podman(*store, "import", "--change", "ENV=PATH=/bin", str(archive), image)


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash of ``password``, as the registry's htpasswd file takes it."""
    import bcrypt  # the dev extra's; imported here so the module loads without it

    return str(bcrypt.hashpw(password.encode(), bcrypt.gensalt()).decode())


@dataclass
class LocalRegistry:
    """A running registry; ``stop`` ends it."""

    address: str
    log: Path
    process: subprocess.Popen[bytes]

    @classmethod
    def start(
        cls,
        folder: Path,
        address: str,
        wrap: Callable[[list[str]], list[str]] = lambda argv: argv,
        logins: dict[str, str] | None = None,
    ) -> LocalRegistry:
        """Serves a registry at ``address`` (host:port) with its blobs in ``folder``; with
        ``logins``, to those users alone."""
        server = shutil.which("docker-registry")
        if server is None:
            raise RuntimeError("docker-registry is not installed (apt-get install docker-registry)")
        config = folder / "config.yml"
        config.write_text(
            "version: 0.1\nlog: {level: info, accesslog: {disabled: false}}\n"
            f"storage: {{filesystem: {{rootdirectory: {folder / 'data'}}}}}\n"
            f"http: {{addr: {address}}}\n"
        )
        if logins:
            users = folder / "htpasswd"
            users.write_text("".join(f"{u}:{bcrypt_hash(p)}\n" for u, p in logins.items()))
            with config.open("a") as out:
                out.write(f"auth: {{htpasswd: {{realm: fedtest, path: {users}}}}}\n")
        log = folder / "registry.log"
        with log.open("wb") as out:
            process = subprocess.Popen(wrap([server, "serve", str(config)]), stdout=out, stderr=out)
        registry = cls(address, log, process)
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return registry
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    registry.stop()
                    raise RuntimeError(
                        f"the registry did not answer at {address}: {log.read_text()[-2000:]}"
                    ) from None
                time.sleep(0.05)

    def push(
        self, image: str, store: Sequence[str] = (), login: tuple[str, str] | None = None
    ) -> None:
        """Pushes ``image`` (named for this registry) from a Podman store, as ``login``
        (user, password) where the registry asks for one."""
        creds = [f"--creds={login[0]}:{login[1]}"] if login else []
        podman(*store, "push", "--tls-verify=false", *creds, image)

    def manifest_gets(self, repository: str) -> int:
        """How often the registry was asked for a manifest of ``repository`` (pulls)."""
        text = self.log.read_text(errors="replace")
        return text.count(f"GET /v2/{repository}/manifests/")

    def stop(self) -> None:
        stop_process(self.process)
